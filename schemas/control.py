"""The control loop: recommendations, signed commands and their results."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from perfloop.schemas.base import Event

__all__ = [
    "AUTOMATION_TIERS",
    "DECISION_OUTCOMES",
    "ActuationResult",
    "Approval",
    "Command",
    "Decision",
    "KnobValue",
    "Recommendation",
]

KnobValue = int | float | str | bool
AUTOMATION_TIERS = ("observe", "recommend", "approve", "auto")
"""How far the actuator goes for a job: ``observe`` records, ``recommend`` shows, ``approve``
waits for a person's approval, ``auto`` issues the command itself."""
DECISION_OUTCOMES = (
    "observed",
    "recommended",
    "pending",
    "issued",
    "dry_run",
    "refused",
    "rejected",
)
"""What became of a recommendation or an approval (`Decision.outcome`)."""
Tier = Literal["observe", "recommend", "approve", "auto"]


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
    """What a job did with a command: applied at a step, or rejected with the reason; then,
    once the steps after it were compared with those before (`perfloop.actuators.verification`),
    ``kept`` or ``rolled_back`` (``value`` then is the value restored) with the evidence.

    v2 adds the ``kept`` and ``rolled_back`` statuses and ``evidence``.
    """

    KIND: ClassVar[str] = "actuation"
    SCHEMA_VERSION: ClassVar[int] = 2

    schema_version: int = Field(2, ge=1)
    command_id: str = Field(min_length=1, max_length=64)
    status: Literal["applied", "rejected", "kept", "rolled_back"]
    reason: str = Field("", max_length=1000)
    knob: str = Field("", max_length=128)
    value: KnobValue | None = None
    step: int = Field(0, ge=0)
    evidence: dict[str, float] = Field(default_factory=dict)


class Approval(Event):
    """A person's verdict on a recommendation: ``perfloop approve`` / ``perfloop reject``.

    It carries the change it approves (``knob``, ``from_value`` → ``to_value``, ``loop`` and
    when the recommendation was made), so the actuator needs no memory of what is pending, and
    it is signed like a command (HMAC-SHA256 under ``key_id``): the actuator acts only on
    approvals signed with its key, and on none older than its approval horizon.
    """

    KIND: ClassVar[str] = "approval"

    rec_id: str = Field(min_length=1, max_length=64)
    verdict: Literal["approve", "reject"]
    author: str = Field("", max_length=256)
    reason: str = Field("", max_length=1000)
    knob: str = Field(min_length=1, max_length=128)
    from_value: KnobValue | None = None
    to_value: KnobValue
    loop: Literal["fast", "slow"] = "fast"
    rec_ts_ns: int = Field(ge=0)
    key_id: str = Field("default", max_length=64)
    signature: str = Field("", max_length=128)


class Decision(Event):
    """What the actuator decided about a recommendation or an approval, and why.

    One per recommendation it reads (``observed``, ``recommended``, ``pending`` approval,
    ``issued``, ``dry_run`` or ``refused`` with the reason) and one per approval (``issued`` or
    ``refused``, or ``rejected`` by its author). ``actor`` is who decided: ``actuator``, or the
    approval's author. The warehouse keeps them in ``audit``.
    """

    KIND: ClassVar[str] = "decision"

    rec_id: str = Field("", max_length=64)
    command_id: str = Field("", max_length=64)
    knob: str = Field("", max_length=128)
    from_value: KnobValue | None = None
    to_value: KnobValue | None = None
    loop: Literal["fast", "slow"] = "fast"
    tier: Tier
    outcome: Literal[
        "observed", "recommended", "pending", "issued", "dry_run", "refused", "rejected"
    ]
    reason: str = Field("", max_length=1000)
    actor: str = Field("actuator", max_length=256)
