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
    """A proposed change to one knob of one job, with its evidence and expected gain.

    The stream tier signs it (Ed25519, `perfloop.actuators.signing`: ``key_id`` names the key)
    and says until when it may be acted on (``expires_ts_ns``); an actuator given a keyring of
    recommender keys acts on nothing else (`perfloop.actuators.trust`).

    v2 adds ``expires_ts_ns``, ``key_id`` and ``signature`` (empty: unsigned, as v1 was).
    """

    KIND: ClassVar[str] = "recommendation"
    SCHEMA_VERSION: ClassVar[int] = 2

    schema_version: int = Field(2, ge=1)

    knob: str = Field(min_length=1, max_length=128)
    from_value: KnobValue
    to_value: KnobValue
    loop: Literal["fast", "slow"]
    expected_gain_pct: float = Field(allow_inf_nan=False)
    confidence: float = Field(ge=0, le=1)
    rationale: str = Field(max_length=2000)
    evidence: dict[str, float] = Field(default_factory=dict)
    expires_ts_ns: int = Field(0, ge=0)
    """When it stops being good to act on (Unix ns); 0: not said (unsigned, v1)."""
    key_id: str = Field("", max_length=64)
    signature: str = Field("", max_length=128)


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
    it is signed like a command: with a person's own Ed25519 key, checked against the
    actuator's roster of principals and roles (`perfloop.actuators.trust`), or, on an actuator
    without a roster, with HMAC-SHA256 under its shared key. The actuator acts on none older
    than its approval horizon, and none past its own ``expires_ts_ns`` (0: not said).

    v2 adds ``expires_ts_ns``.
    """

    KIND: ClassVar[str] = "approval"
    SCHEMA_VERSION: ClassVar[int] = 2

    schema_version: int = Field(2, ge=1)

    rec_id: str = Field(min_length=1, max_length=64)
    verdict: Literal["approve", "reject"]
    author: str = Field("", max_length=256)
    reason: str = Field("", max_length=1000)
    knob: str = Field(min_length=1, max_length=128)
    from_value: KnobValue | None = None
    to_value: KnobValue
    loop: Literal["fast", "slow"] = "fast"
    rec_ts_ns: int = Field(ge=0)
    expires_ts_ns: int = Field(0, ge=0)
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
