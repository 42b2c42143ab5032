"""The shape of a simulated job (private to `perfloop.producers.simulator`, which re-exports
the public names): its `SimConfig` (workload, hardware, faults, cadence and pace, and the step
time, memory and sample rate that follow from them), the `StepReport` a live display gets,
the phases of a step and the constants of the simulated hardware."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from perfloop.exceptions import ConfigError
from perfloop.producers.faults import Fault

__all__ = [
    "CONTEXT_BYTES",
    "GIB",
    "HANG",
    "IDLE",
    "IDLE_W",
    "PHASES",
    "THROTTLE_HW_THERMAL",
    "THROTTLE_SW_POWER_CAP",
    "THROTTLE_SW_THERMAL",
    "SimConfig",
    "StepReport",
]

PHASES = ("data_wait", "forward", "backward", "comm", "optimizer")
# A rank's timeline also knows two states outside a step (after the five phases, 0..4).
HANG, IDLE = 5, 6
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
GIB = 1 << 30
IDLE_W = 75.0
CONTEXT_BYTES = 600 << 20  # what the CUDA context takes of each GPU


@dataclass(frozen=True)
class SimConfig:
    """Shape of the simulated job, its workload, hardware, faults, cadence and pace.

    >>> cfg = SimConfig(job_id="j", nodes=2, ranks_per_node=8)
    >>> cfg.world, cfg.node_names[1], round(cfg.nominal_step_ms)
    (16, 'j-node-1', 115)
    """

    job_id: str
    nodes: int = 1
    ranks_per_node: int = 4
    scenario: str = "custom"
    faults: tuple[Fault, ...] = ()
    node_prefix: str = ""  # "" → "<job_id>-node"
    # workload: an image model, data parallel, bf16 gradients
    model_name: str = "vit-h-14"
    model_params: int = 632_000_000
    batch_size: int = 32
    tokens_per_sample: int = 257
    forward_ms: float = 30.0
    backward_ms: float = 58.0
    optimizer_ms: float = 8.0
    load_ms: float = 120.0
    num_workers: int = 2
    prefetch_factor: int = 2
    activation_bytes: int = 24 * GIB
    steps_per_epoch: int = 5000
    # hardware
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    gpu_mem_bytes: int = 81559 << 20
    power_limit_w: float = 700.0
    intra_node_gbps: float = 200.0  # all-reduce bus bandwidth over NVLink, GB/s
    inter_node_gbps: float = 40.0  # across nodes (400 Gb/s NICs)
    comm_overlap: float = 0.7  # share of backward the all-reduce can hide under
    cpu_count: int = 96
    host_mem_bytes: int = 2048 * GIB
    # telemetry cadence and pace
    gpu_interval_ms: float = 100.0
    host_interval_ms: float = 1000.0
    publish_interval_ms: float = 250.0
    speed: float = 1.0
    rate: float | None = None  # samples/s; sets the pace instead of ``speed``
    seed: int = 0
    t0_ns: int | None = None
    chunk_steps: int | None = None  # steps generated at once; None: from the pace
    max_batch_samples: int = 5000
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "batch_size", "prefetch_factor"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be ≥ 0, got {self.num_workers}")
        for name in ("speed", "gpu_interval_ms", "host_interval_ms", "publish_interval_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be > 0, got {v!r}")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ConfigError(f"rate must be > 0 samples/s, got {self.rate!r}")
        for f in self.faults:
            bad = [r for r in f.ranks if r >= self.world]
            if bad:
                raise ConfigError(
                    f"{f.kind} names ranks {bad} but the job has {self.world} (0..{self.world - 1})"
                )

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def node_names(self) -> list[str]:
        prefix = self.node_prefix or f"{self.job_id}-node"
        return [f"{prefix}-{i}" for i in range(self.nodes)]

    @property
    def node(self) -> str:
        """The first node's name (where job-wide events come from)."""
        return self.node_names[0]

    @property
    def grad_bytes(self) -> int:
        return 2 * self.model_params

    def allreduce_ms(self, bandwidth_divisor: float = 1.0) -> float:
        """One gradient all-reduce, ring algorithm, over the slowest link."""
        w = self.world
        if w < 2:
            return 0.0
        gbps = self.inter_node_gbps if self.nodes > 1 else self.intra_node_gbps
        return self.grad_bytes * 2 * (w - 1) / w / (gbps * 1e6 / bandwidth_divisor)

    def exposed_comm_ms(self, allreduce_ms: float) -> float:
        return max(allreduce_ms - self.comm_overlap * self.backward_ms, 0.1 * allreduce_ms)

    @property
    def nominal_step_ms(self) -> float:
        """A healthy step: compute, exposed all-reduce and the loader's wait."""
        busy = (
            self.forward_ms
            + self.backward_ms
            + self.optimizer_ms
            + self.exposed_comm_ms(self.allreduce_ms())
        )
        wait = self.load_ms if not self.num_workers else self.load_ms / self.num_workers - busy
        return busy + max(0.0, wait) + 0.4

    @property
    def static_mem_bytes(self) -> int:
        """Weights, gradients and Adam state in mixed precision (16 bytes per parameter)."""
        return 16 * self.model_params

    @property
    def leak_headroom_bytes(self) -> int:
        """How much a leak can take before the next step's activations no longer fit."""
        return self.gpu_mem_bytes - CONTEXT_BYTES - self.static_mem_bytes - self.activation_bytes

    @property
    def natural_rate(self) -> float:
        """Samples per simulated second of a healthy run."""
        per_step = 1 + len(PHASES) + (1 if self.world > 1 else 0)
        per_rank = (
            per_step * 1000 / self.nominal_step_ms
            + 1000 / self.gpu_interval_ms
            + 1000 / self.host_interval_ms
        )
        return per_rank * self.world


@dataclass(frozen=True)
class StepReport:
    """What one step looked like across the job (for live display)."""

    step: int
    elapsed_s: float
    step_time_ms: float
    data_wait_share: float
    num_workers: int
    fault_active: bool
