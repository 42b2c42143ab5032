"""Telemetry samples published by producers on training nodes, batched per node and kind.

Every sample family here travels in columnar batches (`perfloop.schemas.codec`): one Kafka
message carries many samples of one node. Fields are numbers or short strings, units are in
the names, and optional per-step figures (loss, grad norm, learning rate) are ``None`` when the
job did not report them.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from perfloop.schemas.base import Event

__all__ = [
    "COLLECTIVE_OPS",
    "KERNEL_CLASSES",
    "P2P_OPS",
    "STANDARD_PHASES",
    "CollectiveOp",
    "GpuSample",
    "HostSample",
    "KernelSummary",
    "PhaseSpan",
    "StepEvent",
]

# A short identifier: phase, op, kernel class and group names.
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f]+$")]

STANDARD_PHASES = (
    "data_wait",
    "forward",
    "backward",
    "comm",
    "optimizer",
    "checkpoint",
    "eval",
)
"""Phases every integration names the same way; anything else is a user-named span."""

COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "other",
)

P2P_OPS = ("send", "recv")
"""Point-to-point ops; a ``comm`` span of one is named after it (a pipeline's sends and
receives), the spans of every other collective are named ``comm``."""

KERNEL_CLASSES = (
    "gemm",
    "conv",
    "attention",
    "elementwise",
    "reduction",
    "norm",
    "comm",
    "memcpy",
    "memset",
    "other",
    "all",
)


class GpuSample(Event):
    """One reading of one GPU (NVML). Counters are cumulative since the driver loaded.

    ``throttle_reasons`` is NVML's clocks-event bitmask (0 = not throttled); ``xid_events``
    counts XID errors seen since the previous sample and ``last_xid`` is the latest code.
    ``process_mem_bytes`` is device memory held by this job's processes.

    >>> GpuSample(ts_ns=1, job_id="j", node="n", rank=0, device=0, sm_util_pct=97.0).power_w
    0.0
    """

    KIND: ClassVar[str] = "gpu"
    SCHEMA_VERSION: ClassVar[int] = 2
    MIN_SCHEMA_VERSION: ClassVar[int] = 1
    schema_version: int = Field(2, ge=1)

    rank: int = Field(ge=-1, le=1 << 20)
    device: int = Field(ge=0, le=1023)
    sm_util_pct: float = Field(0.0, ge=0, le=100)
    mem_util_pct: float = Field(0.0, ge=0, le=100)
    mem_used_bytes: int = Field(0, ge=0)
    mem_total_bytes: int = Field(0, ge=0)
    power_w: float = Field(0.0, ge=0, allow_inf_nan=False)
    temp_c: float = Field(0.0, ge=-50, le=200)
    sm_clock_mhz: float = Field(0.0, ge=0, allow_inf_nan=False)
    # schema_version 2
    power_limit_w: float = Field(0.0, ge=0, allow_inf_nan=False)
    energy_mj: int = Field(0, ge=0)
    mem_clock_mhz: float = Field(0.0, ge=0, allow_inf_nan=False)
    throttle_reasons: int = Field(0, ge=0)
    pcie_rx_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    pcie_tx_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    nvlink_rx_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    nvlink_tx_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    ecc_sbe_total: int = Field(0, ge=0)
    ecc_dbe_total: int = Field(0, ge=0)
    xid_events: int = Field(0, ge=0)
    last_xid: int = Field(0, ge=0)
    process_mem_bytes: int = Field(0, ge=0)


class HostSample(Event):
    """One reading of the host and of one training process (``pid``) with its loader workers.

    CPU percentages are of one core (a process using 4 cores reads 400); system CPU is of the
    whole machine (0–100). IO figures are rates over the interval since the previous sample.

    >>> HostSample(ts_ns=1, job_id="j", node="n", rank=0, pid=42, loader_workers=4).sys_cpu_pct
    0.0
    """

    KIND: ClassVar[str] = "host"
    SCHEMA_VERSION: ClassVar[int] = 3
    MIN_SCHEMA_VERSION: ClassVar[int] = 1
    schema_version: int = Field(3, ge=1)

    pid: int = Field(0, ge=0)
    proc_cpu_pct: float = Field(0.0, ge=0, allow_inf_nan=False)
    proc_rss_bytes: int = Field(0, ge=0)
    proc_threads: int = Field(0, ge=0)
    sys_cpu_pct: float = Field(0.0, ge=0, le=100)
    sys_iowait_pct: float = Field(0.0, ge=0, le=100)
    load_avg_1m: float = Field(0.0, ge=0, allow_inf_nan=False)
    sys_mem_used_bytes: int = Field(0, ge=0)
    sys_mem_total_bytes: int = Field(0, ge=0)
    disk_read_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    disk_write_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    net_rx_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    net_tx_bytes_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    loader_workers: int = Field(0, ge=0)
    loader_cpu_pct: float = Field(0.0, ge=0, allow_inf_nan=False)
    loader_rss_bytes: int = Field(0, ge=0)
    mem_room_bytes: int = Field(0, ge=0)
    """(v2) How much more memory the process may take before a limit of its own stops it: its
    address-space limit less its peak virtual size, or its cgroup's memory limit less the
    cgroup's usage (less its inactive page cache), whichever is less (``mem_room_limit``
    says which)."""
    mem_room_limit: str = Field("", max_length=32)
    """(v2) ``address_space``, ``cgroup``, or empty: no such limit (the host's memory is the
    bound)."""
    proc_run_delay_pct: float = Field(0.0, ge=0, allow_inf_nan=False)
    """(v3) How long the process's threads were runnable but waited for a CPU, summed over its
    threads, in percent of one core (the kernel's scheduler statistics): another process on
    its CPUs shows here before anywhere else."""


class StepEvent(Event):
    """One finished training step of one rank; ``ts_ns`` is the step's end.

    Version 2 adds what the training integration reports: samples and tokens, loss, gradient
    norm, learning rate (``None`` when not reported), and memory (CUDA allocator on GPU, RSS on
    CPU).

    >>> s = StepEvent(ts_ns=1, job_id="j", node="n", rank=0, step=3, step_time_ms=120.0,
    ...               data_wait_ms=30.0)
    >>> s.data_wait_share, s.loss
    (0.25, None)
    """

    KIND: ClassVar[str] = "step"
    SCHEMA_VERSION: ClassVar[int] = 2
    MIN_SCHEMA_VERSION: ClassVar[int] = 1
    schema_version: int = Field(2, ge=1)

    rank: int = Field(ge=0, le=1 << 20)
    step: int = Field(ge=0)
    step_time_ms: float = Field(gt=0, allow_inf_nan=False)
    data_wait_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    batch_size: int = Field(0, ge=0)
    num_workers: int = Field(0, ge=0, le=1024)
    # schema_version 2
    epoch: int = Field(0, ge=0)
    samples: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0)
    grad_accum_steps: int = Field(1, ge=1, le=1 << 16)
    loss: float | None = None
    grad_norm: float | None = Field(None, ge=0)
    lr: float | None = Field(None, ge=0)
    mem_allocated_bytes: int = Field(0, ge=0)
    mem_reserved_bytes: int = Field(0, ge=0)
    mem_peak_bytes: int = Field(0, ge=0)
    rss_bytes: int = Field(0, ge=0)

    @property
    def data_wait_share(self) -> float:
        """Fraction of the step spent waiting for the input pipeline (0..1)."""
        return min(1.0, self.data_wait_ms / self.step_time_ms)


class PhaseSpan(Event):
    """A timed part of one step: ``ts_ns`` is its start.

    ``phase`` is one of `STANDARD_PHASES` or ``"user"`` for a span the job named itself;
    ``name`` is the span's own name (equal to ``phase`` for standard ones). ``depth`` 0 spans
    of one step do not overlap; nested spans have depth ≥ 1.

    >>> PhaseSpan(ts_ns=1, job_id="j", node="n", rank=0, step=2, phase="forward",
    ...           name="forward", duration_ms=31.5).depth
    0
    """

    KIND: ClassVar[str] = "span"

    rank: int = Field(ge=0, le=1 << 20)
    step: int = Field(ge=0)
    phase: Name
    name: Name
    duration_ms: float = Field(ge=0, allow_inf_nan=False)
    depth: int = Field(0, ge=0, le=255)


class CollectiveOp(Event):
    """One collective or point-to-point communication of one rank; ``ts_ns`` is its start.

    ``op`` is one of `COLLECTIVE_OPS`; ``group`` names the process group (its ranks or id).

    >>> CollectiveOp(ts_ns=1, job_id="j", node="n", rank=0, step=1, op="all_reduce",
    ...              size_bytes=1 << 20, group="0", group_size=8, duration_ms=2.0).dtype
    ''
    """

    KIND: ClassVar[str] = "collective"

    rank: int = Field(ge=0, le=1 << 20)
    step: int = Field(ge=0)
    op: Name
    size_bytes: int = Field(0, ge=0)
    group: str = Field("", max_length=128)
    group_size: int = Field(0, ge=0)
    duration_ms: float = Field(ge=0, allow_inf_nan=False)
    dtype: str = Field("", max_length=32)


class KernelSummary(Event):
    """GPU kernels of one step on one stream, grouped by class; ``ts_ns`` is the step start.

    ``busy_ms`` is the union of the kernels' intervals (overlaps counted once). The row with
    ``stream=-1`` and ``kernel_class="all"`` is the step's GPU busy time over all streams.

    >>> KernelSummary(ts_ns=1, job_id="j", node="n", rank=0, step=5, stream=7,
    ...               kernel_class="gemm", count=12, busy_ms=4.5).count
    12
    """

    KIND: ClassVar[str] = "kernel"

    rank: int = Field(ge=0, le=1 << 20)
    step: int = Field(ge=0)
    stream: int = Field(ge=-1)
    kernel_class: Name
    count: int = Field(ge=0)
    busy_ms: float = Field(ge=0, allow_inf_nan=False)
