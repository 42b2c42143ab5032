"""The control loop: recommendations, signed commands and their results."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from perfloop.schemas.base import Event

__all__ = ["ActuationResult", "Command", "KnobValue", "Recommendation"]

KnobValue = int | float | str | bool


class Recommendation(Event):
    """A proposed change to one knob of one job, with its evidence and expected gain."""

    KIND: ClassVar[str] = "recommendation"

    knob: str = Field(min_length=1, max_length=128)
    from_value: KnobValue
    to_value: KnobValue
    loop: Literal["fast", "slow"]
    expected_gain_pct: float = Field(allow_inf_nan=False)
    confidence: float = Field(ge=0, le=1)
    rationale: str = Field(max_length=2000)
    evidence: dict[str, float] = Field(default_factory=dict)


class Command(Event):
    """A signed instruction to a job: set ``knob`` to ``value`` at the next step boundary.

    ``seq`` increases monotonically per job; a job agent rejects a command whose sequence it
    has already seen, whose ``expires_ts_ns`` has passed or whose signature does not verify.
    """

    KIND: ClassVar[str] = "command"

    rec_id: str = Field("", max_length=64)
    seq: int = Field(ge=1)
    knob: str = Field(min_length=1, max_length=128)
    from_value: KnobValue | None = None
    value: KnobValue
    loop: Literal["fast", "slow"] = "fast"
    expires_ts_ns: int = Field(ge=0)
    key_id: str = Field("default", max_length=64)
    signature: str = Field("", max_length=128)


class ActuationResult(Event):
    """What a job did with a command: applied at a step, or rejected with the reason."""

    KIND: ClassVar[str] = "actuation"

    command_id: str = Field(min_length=1, max_length=64)
    status: Literal["applied", "rejected"]
    reason: str = Field("", max_length=1000)
    knob: str = Field("", max_length=128)
    value: KnobValue | None = None
    step: int = Field(0, ge=0)
