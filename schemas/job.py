"""Job-level events: what the job is, where it is in its life, what each producer can see,
how each producer is doing, and (for simulated jobs) the ground truth of injected faults.

These are rare (one per job start, per state change, per producer every few seconds), so
they travel one JSON object per message on ``perfloop.telemetry.job``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

from pydantic import Field

from perfloop.schemas.base import Event

__all__ = [
    "FAULT_KINDS",
    "CapabilityReport",
    "FaultKind",
    "GroundTruth",
    "JobInfo",
    "JobLifecycle",
    "ProducerStats",
    "RankProgress",
]

Short = Annotated[str, Field(max_length=256)]

FaultKind = Literal[
    "dataloader_starvation",
    "straggler",
    "thermal_throttle",
    "memory_leak",
    "oom",
    "comm_degradation",
    "hang",
]
"""The kinds of fault a ground truth names (a memory leak may end in an ``oom``)."""

FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class JobInfo(Event):
    """What the job is: model, optimizer, parallelism, precision, world size and hardware.

    Published once per rank at start (and again if it changes); unknown fields stay empty.
    v2 adds the job's identity in its scheduler: ``scheduler`` with the Slurm job (id, name,
    node list, step) or the Kubernetes pod (pod, namespace, node).

    >>> JobInfo(ts_ns=1, job_id="j", node="n", rank=0, world_size=8, precision="bf16").nodes
    1
    """

    KIND: ClassVar[str] = "job_info"
    SCHEMA_VERSION: ClassVar[int] = 2

    schema_version: int = Field(2, ge=1)
    model_name: Short = ""
    model_params: int = Field(0, ge=0)
    optimizer: Short = ""
    parallelism: Short = Field("", description="ddp, fsdp, zero1, zero2, zero3, tp, pp, none")
    dp_size: int = Field(1, ge=1)
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    precision: Short = Field("", description="fp32, tf32, bf16, fp16, amp_bf16, amp_fp16")
    world_size: int = Field(1, ge=1)
    local_world_size: int = Field(1, ge=1)
    nodes: int = Field(1, ge=1)
    batch_size: int = Field(0, ge=0)
    grad_accum_steps: int = Field(1, ge=1)
    gpu_name: Short = ""
    gpu_count: int = Field(0, ge=0)
    gpu_mem_bytes: int = Field(0, ge=0)
    cpu_count: int = Field(0, ge=0)
    host_mem_bytes: int = Field(0, ge=0)
    framework: Short = ""
    framework_version: Short = ""
    cuda_version: Short = ""
    backend: Short = Field("", description="torch.distributed backend: nccl, gloo, …")
    command: str = Field("", max_length=4096)
    extra: dict[str, str] = Field(default_factory=dict)
    scheduler: Short = Field("", description="slurm, kubernetes, or empty (none seen)")
    slurm_job_id: Short = ""
    slurm_job_name: Short = ""
    slurm_nodelist: str = Field("", max_length=4096)
    slurm_step_id: Short = ""
    k8s_pod: Short = ""
    k8s_namespace: Short = ""
    k8s_node: Short = ""


class JobLifecycle(Event):
    """A change in the life of one rank (or of the whole job when ``rank`` is -1).

    >>> JobLifecycle(ts_ns=1, job_id="j", node="n", rank=0, state="finished", exit_code=0).state
    'finished'
    """

    KIND: ClassVar[str] = "lifecycle"

    state: Literal["started", "running", "finished", "failed", "killed"]
    exit_code: int | None = None
    message: str = Field("", max_length=2000)


class CapabilityReport(Event):
    """What one producer component can observe on this node, and what is missing and why.

    >>> r = CapabilityReport(ts_ns=1, job_id="j", node="n", rank=-1, component="nvml",
    ...                      available=False, missing=["gpu"], reason="no NVIDIA driver")
    >>> r.available, r.missing
    (False, ['gpu'])
    """

    KIND: ClassVar[str] = "capability"

    component: Annotated[str, Field(min_length=1, max_length=64)]
    available: bool
    devices: int = Field(0, ge=0)
    signals: list[Short] = Field(default_factory=list)
    missing: list[Short] = Field(default_factory=list)
    reason: str = Field("", max_length=2000)
    details: dict[str, str] = Field(default_factory=dict)


PROGRESS_PHASES = (
    "data_wait",
    "forward",
    "backward",
    "comm",
    "optimizer",
    "checkpoint",
    "eval",
    "other",
)
"""Where a rank can be inside a step (`RankProgress.phase`)."""


class RankProgress(Event):
    """Where one rank is inside a step that has gone on longer than its recent steps.

    The training hooks publish it while such a step lasts (every few seconds), so the stream
    tier can tell the rank blocked in a collective (``phase`` ``comm``: waiting for the others)
    from the rank that stopped before it, and a long checkpoint save or evaluation from a hang.
    ``since_ns`` is when the rank entered ``phase``; ``step_start_ns`` when the step began;
    ``op`` names the collective (``phase`` ``comm``) or the checkpoint call.

    >>> p = RankProgress(ts_ns=9, job_id="j", node="n", rank=1, step=40, phase="comm",
    ...                  op="all_reduce", since_ns=5, step_start_ns=4)
    >>> p.phase, p.ts_ns - p.since_ns
    ('comm', 4)
    """

    KIND: ClassVar[str] = "progress"

    rank: int = Field(ge=0, le=1 << 20)
    step: int = Field(ge=0)
    phase: Literal[
        "data_wait", "forward", "backward", "comm", "optimizer", "checkpoint", "eval", "other"
    ]
    op: str = Field("", max_length=64)
    since_ns: int = Field(ge=0)
    step_start_ns: int = Field(ge=0)


class ProducerStats(Event):
    """A producer's self-metrics, cumulative since it started.

    ``published`` messages were acknowledged by the broker, ``spooled`` went to the on-disk
    spool while the broker was unreachable, ``replayed`` came back out of it, ``resent`` were
    sent again after a broker lost them, ``refused`` were turned away by ``publish`` (it
    returned False: over the memory bound or not sendable), ``dropped`` were lost on purpose
    (spool full: oldest first) and ``failed`` could not be delivered or spooled.
    ``overhead_pct`` is the producer's own CPU time as a share of the job's wall time over
    the last interval.

    >>> ProducerStats(ts_ns=1, job_id="j", node="n", rank=0, producer_id="p").dropped
    0
    """

    KIND: ClassVar[str] = "producer"

    producer_id: Annotated[str, Field(min_length=1, max_length=128)]
    samples: int = Field(0, ge=0)
    messages: int = Field(0, ge=0)
    published: int = Field(0, ge=0)
    spooled: int = Field(0, ge=0)
    replayed: int = Field(0, ge=0)
    dropped: int = Field(0, ge=0)
    dropped_samples: int = Field(0, ge=0)
    failed: int = Field(0, ge=0)
    resent: int = Field(0, ge=0)
    refused: int = Field(0, ge=0)
    in_flight: int = Field(0, ge=0)
    spool_bytes: int = Field(0, ge=0)
    cpu_time_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    overhead_pct: float = Field(0.0, ge=0, allow_inf_nan=False)
    rates_hz: dict[str, float] = Field(default_factory=dict)


class GroundTruth(Event):
    """A fault injected into a simulated job: its kind, when it started and ended, where.

    ``end_ns`` is 0 while the fault is still active (or when it ends the job).

    >>> GroundTruth(ts_ns=5, job_id="j", node="n", rank=-1, scenario="straggler",
    ...             fault="straggler", onset_ns=5, ranks=[3]).end_ns
    0
    """

    KIND: ClassVar[str] = "ground_truth"

    scenario: Annotated[str, Field(min_length=1, max_length=64)]
    fault: FaultKind
    onset_ns: int = Field(ge=0)
    end_ns: int = Field(0, ge=0)
    ranks: list[int] = Field(default_factory=list)
    nodes: list[Short] = Field(default_factory=list)
    detail: str = Field("", max_length=2000)
