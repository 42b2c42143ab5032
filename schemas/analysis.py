"""What the stream tier concludes: phases, diagnoses, and the live changes made to it.

These are events, one JSON object per message (`encode_event` / `decode_event`):
`PhaseChange` on ``perfloop.phases``, `Diagnosis` on ``perfloop.diagnoses``, `Prediction` on
``perfloop.predictions`` and `ConfigChange` on ``perfloop.control`` (job agents ignore it;
stream workers and producers apply it).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from perfloop.schemas.base import Event
from perfloop.schemas.control import KnobValue

__all__ = [
    "BOTTLENECKS",
    "FUNNEL_LEVELS",
    "RUN_PHASES",
    "ConfigChange",
    "Diagnosis",
    "PhaseChange",
    "Prediction",
]

Short = Annotated[str, Field(max_length=256)]

RUN_PHASES = ("warmup", "steady", "eval", "checkpoint", "stalled", "finished")
"""Run-level states of the phase machine (``stalled``: no progress; ``finished``: ended)."""

FUNNEL_LEVELS = ("cluster_health", "network", "host", "memory", "kernel")
"""The top-down funnel, first level first (DESIGN.md): a higher level explains a lower one."""

BOTTLENECKS: dict[str, str] = {
    # cluster health
    "hang": "cluster_health",
    "thermal_throttle": "cluster_health",
    "power_throttle": "cluster_health",
    "gpu_error": "cluster_health",
    # network
    "straggler": "network",
    "comm_degradation": "network",
    "exposed_comm": "network",
    "load_imbalance": "network",
    # host
    "dataloader_starvation": "host",
    "cpu_saturation": "host",
    "launch_overhead": "host",
    "thread_oversubscription": "host",
    # memory
    "memory_leak": "memory",
    "oom": "memory",
    "low_memory_headroom": "memory",
    # kernel (roofline)
    "memory_bound": "kernel",
    "compute_bound": "kernel",
    "overhead_bound": "kernel",
}
"""Every bottleneck a diagnosis can name, and its funnel level."""


class PhaseChange(Event):
    """The phase machine moved: a run-level or step-level state changed for a rank.

    ``rank`` -1 is the job as a whole. ``source`` says what the state was read from: phase
    spans when the job publishes them, otherwise the GPU signal signature learned online;
    ``progress`` for a checkpoint or evaluation a rank reported while its step went on
    (`perfloop.schemas.RankProgress`).
    ``next_phase`` / ``next_ts_ns`` predict the next transition (0 and "" when unknown).
    ``ts_ns`` is the job's event time when the change was decided.

    >>> PhaseChange(ts_ns=1, job_id="j", node="n", rank=-1, level="run", phase="steady",
    ...             previous="warmup", since_ns=1, source="spans", step=40).phase
    'steady'
    """

    KIND: ClassVar[str] = "phase"

    level: Literal["run", "step"]
    phase: Annotated[str, Field(min_length=1, max_length=128)]
    previous: Short = ""
    since_ns: int = Field(ge=0, description="When the new phase began (event time).")
    step: int = Field(0, ge=0)
    source: Literal["spans", "gpu", "steps", "lifecycle", "progress"]
    confidence: float = Field(1.0, ge=0, le=1)
    duration_ms: float = Field(0.0, ge=0, allow_inf_nan=False, description="Of the previous.")
    next_phase: Short = ""
    next_ts_ns: int = Field(0, ge=0, description="Predicted time of the next transition.")


class Diagnosis(Event):
    """One bottleneck found by the top-down funnel, for a job (``rank`` -1) or one rank.

    A diagnosis opens when the bottleneck is found (``state`` "open", ``ts_ns`` the moment it
    was decided on the job's event-time clock — so ``ts_ns - onset_ns`` is the detection
    latency, whatever the read speed — ``onset_ns`` the estimated start), is updated while it
    persists ("update", at most every few seconds) and is closed when it clears ("resolved").
    ``diagnosis_id`` is the same across the three. ``explained_by`` names the higher-level
    bottleneck that explains this one (a rank slowed by its throttled GPU straggles): only an
    unexplained bottleneck on the critical path may lead to a recommendation.

    >>> d = Diagnosis(ts_ns=2, job_id="j", node="n", rank=3, diagnosis_id="d1",
    ...               bottleneck="straggler", level="network", loop="training",
    ...               state="open", onset_ns=1, step_share=0.3, confidence=0.9,
    ...               critical_path=True, ranks=[3], evidence={"score": 0.8})
    >>> d.level, d.explained_by
    ('network', '')
    """

    KIND: ClassVar[str] = "diagnosis"

    diagnosis_id: Annotated[str, Field(min_length=1, max_length=64)]
    bottleneck: Annotated[str, Field(min_length=1, max_length=64)]
    level: Literal["cluster_health", "network", "host", "memory", "kernel"]
    loop: Literal["inner", "training", "product"]
    state: Literal["open", "update", "resolved"]
    onset_ns: int = Field(ge=0)
    step_share: float = Field(ge=0, le=1, description="Share of step time it costs.")
    confidence: float = Field(ge=0, le=1)
    critical_path: bool
    explained_by: Short = ""
    ranks: list[int] = Field(default_factory=list)
    nodes: list[Short] = Field(default_factory=list)
    step: int = Field(0, ge=0)
    evidence: dict[str, float] = Field(default_factory=dict)
    summary: str = Field("", max_length=2000)


class ConfigChange(Event):
    """A live change to the stream tier or to producers, applied without a restart.

    ``target`` "streams" changes a stream worker setting (thresholds, windows); "producers"
    changes sampling on the job's nodes; "actuator" changes how the actuator treats the job
    (``actuator.tier``, ``actuator.dry_run``, its limits). ``applies_to`` is a job id, or "*"
    for every job (``job_id`` then names who issued it). Every change is recorded in the warehouse
    (``config_changes``) with who asked and why.

    A change for the actuator is signed by the person who makes it (Ed25519, ``key_id`` their
    key's) and expires (``expires_ts_ns``): an actuator given a roster of principals applies it
    only when a principal signed it within their role (`perfloop.actuators.trust`).

    v2 adds ``expires_ts_ns``, ``key_id`` and ``signature`` (empty: unsigned, as v1 was).

    >>> ConfigChange(ts_ns=1, job_id="ops", node="cli", rank=-1, target="streams",
    ...              key="thresholds.straggler_score", value=0.7).applies_to
    '*'

    """

    KIND: ClassVar[str] = "config"
    SCHEMA_VERSION: ClassVar[int] = 2

    schema_version: int = Field(2, ge=1)
    target: Literal["streams", "producers", "actuator"]
    applies_to: Annotated[str, Field(min_length=1, max_length=128)] = "*"
    key: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-z0-9_.]+$")]
    value: KnobValue | list[list[float]]
    author: Short = ""
    reason: str = Field("", max_length=1000)
    expires_ts_ns: int = Field(0, ge=0)
    """When it stops being good to apply (Unix ns); 0: not said (unsigned, v1)."""
    key_id: str = Field("", max_length=64)
    signature: str = Field("", max_length=128)


class Prediction(Event):
    """What an online model forecast for a job (``rank`` -1) or a rank, and later what came.

    A prediction is published twice with the same ``prediction_id``: ``state`` "predicted"
    when it is made (``ts_ns``, the job's event time then), and "realised" once the value it
    forecast is known, with ``realised`` set — so its accuracy is a join away (the warehouse
    view ``prediction_accuracy``). ``target`` names what is forecast, unit in the name
    (``step_time_ms``, ``forward_ms``, ``time_to_oom_s``, ``next_phase_s``, ``anomaly_score``,
    ``regime_change``); ``model`` the model class. ``step`` is the step it is for (0: not
    step-based) and ``for_ts_ns`` the event time it is expected at (0: not time-based).
    ``baseline`` is the moving-average baseline's forecast of the same value, when there is
    one, so a model's gain over it can be queried too.

    >>> p = Prediction(ts_ns=5, job_id="j", node="n", rank=-1, prediction_id="j:st:8",
    ...                model="StepTimeForecaster", target="step_time_ms", value=101.5, step=8)
    >>> p.state, p.realised
    ('predicted', None)
    """

    KIND: ClassVar[str] = "prediction"

    prediction_id: Annotated[str, Field(min_length=1, max_length=128)]
    model: Annotated[str, Field(min_length=1, max_length=128)]
    target: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[a-z0-9_.:]+$")]
    state: Literal["predicted", "realised"] = "predicted"
    value: float = Field(allow_inf_nan=False, description="The forecast, in the target's unit.")
    realised: float | None = Field(None, allow_inf_nan=False)
    baseline: float | None = Field(None, allow_inf_nan=False)
    step: int = Field(0, ge=0)
    for_ts_ns: int = Field(0, ge=0)
    evidence: dict[str, float] = Field(default_factory=dict)
    summary: str = Field("", max_length=2000)
