"""A simulated data-parallel training job: N nodes x G ranks publishing every telemetry kind.

Each step every rank waits for its batch (``data_wait``), runs ``forward`` and ``backward``,
meets the others in the gradient all-reduce (``comm``: waiting for the slowest rank plus the
part of the all-reduce not hidden under backward) and runs the ``optimizer``. Ranks therefore
share one step time, as in data parallel training. The data loader's ``W`` workers each take
``load_ms`` per batch, so a rank waits about ``max(0, load_ms / W - busy)`` (with no workers
the main process loads each batch itself). The all-reduce moves the bf16 gradients through a
ring: ``2 (n-1)/n x bytes / bus bandwidth`` (NVLink inside a node, the network across nodes).

GPU samples average each phase's signature (SM and memory utilisation, power, link traffic)
over the sampling interval, as NVML does; clocks, temperature, power caps, throttle reasons and
memory follow the faults and knobs. Host samples carry the process, its loader workers and the
node. Steps, phase spans and collectives are generated for many steps and ranks at once with
numpy, and each node's samples leave through its own `Emitter` (node ``<job_id>-node-<i>``).

Faults (`perfloop.producers.scenarios.Fault`) start and end at exact simulated times: GPU
samples change from that instant, steps from the first step that starts at or after it. A
memory leak grows until the GPU runs out of memory, then the job fails; a hang stops every
step while the processes (and their samples) live on. Each fault's `GroundTruth` is published
when it starts. Knob handlers (`knob_handlers`) apply commands between steps. Event time
advances with simulated time from ``t0_ns`` (injectable; by default chosen so that the run
ends at the wall time it is expected to end at); ``speed`` > 1 or ``rate`` (samples/s) runs
faster than real time. Same config and seed → the same events.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.producers.emitter import Emitter, Sends
from perfloop.producers.faults import Fault
from perfloop.schemas import GroundTruth, JobInfo, JobLifecycle, KnobValue

__all__ = ["PHASES", "SimConfig", "SimulatedJob", "StepReport"]

PHASES = ("data_wait", "forward", "backward", "comm", "optimizer")
_HANG, _IDLE = 5, 6
# Per phase: SM util %, memory util %, share of dynamic power, link activity (0..1).
_SIGNATURE = np.array(
    [
        [2.0, 1.0, 0.06, 0.0],  # data_wait: the GPU idles
        [96.0, 45.0, 0.82, 0.0],  # forward
        [98.0, 55.0, 0.92, 0.25],  # backward: gradient buckets start their all-reduce
        [55.0, 20.0, 0.30, 1.0],  # comm: NCCL kernels
        [75.0, 88.0, 0.55, 0.0],  # optimizer: memory-bound
        [100.0, 0.0, 0.10, 0.0],  # hang: an NCCL kernel spinning, little power
        [0.0, 0.0, 0.0, 0.0],  # idle: not started, or the rank that hung outside the GPU
    ]
)
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
_GIB = 1 << 30
_IDLE_W = 75.0
_MAX_CLOCK_MHZ = 1980.0
_CONTEXT_BYTES = 600 << 20
_FAR_MS = 1e12


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
    activation_bytes: int = 24 * _GIB
    steps_per_epoch: int = 5000
    # hardware
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    gpu_mem_bytes: int = 81559 << 20
    power_limit_w: float = 700.0
    intra_node_gbps: float = 200.0  # all-reduce bus bandwidth over NVLink, GB/s
    inter_node_gbps: float = 40.0  # across nodes (400 Gb/s NICs)
    comm_overlap: float = 0.7  # share of backward the all-reduce can hide under
    cpu_count: int = 96
    host_mem_bytes: int = 2048 * _GIB
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
        return self.gpu_mem_bytes - _CONTEXT_BYTES - self.static_mem_bytes - self.activation_bytes

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


@dataclass
class _State:
    """The faults' effect on the steps of one chunk."""

    load_mult: np.ndarray
    compute_mult: np.ndarray
    leak: np.ndarray
    comm_div: float = 1.0


class SimulatedJob:
    """Runs the simulated job; `step_boundary` hooks let a job agent apply commands.

    >>> class Collect:
    ...     def __init__(self): self.topics = set()
    ...     def publish(self, topic, key, value): self.topics.add(topic); return True
    >>> pub = Collect()
    >>> job = SimulatedJob(SimConfig(job_id="doc", ranks_per_node=2, t0_ns=0, speed=1e6), pub)
    >>> job.run(2.0) > 10, job.state, sorted(t.rsplit(".", 1)[1] for t in pub.topics)
    (True, 'finished', ['gpu', 'host', 'job', 'span', 'step'])
    """

    def __init__(
        self,
        config: SimConfig,
        publisher: Sends,
        *,
        on_ground_truth: Callable[[GroundTruth], None] | None = None,
    ) -> None:
        cfg = self.cfg = config
        self.publisher = publisher
        self.on_ground_truth = on_ground_truth
        self.world, self.per_node = cfg.world, cfg.ranks_per_node
        self.emitters = [
            Emitter(
                publisher,
                job_id=cfg.job_id,
                node=name,
                producer_id=f"sim-{name}",
                max_samples=cfg.max_batch_samples,
            )
            for name in cfg.node_names
        ]
        self.num_workers = cfg.num_workers
        self.prefetch_factor = cfg.prefetch_factor
        self.power_limit_w = cfg.power_limit_w
        self._rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.samples = 0
        self.state = "created"  # running, hung, finished, failed, stopped
        self.ground_truth: list[GroundTruth] = []
        self.t0_ns = 0
        self._published: set[int] = set()
        self._outbox: list[tuple[int, Any]] = []
        w = self.world
        self._start = np.zeros(w)  # each rank's next step start, ms
        self._clock = 0.0
        self._tl_b = np.array([[-10 * cfg.gpu_interval_ms, 0.0]] * w)  # timeline bounds, ms
        self._tl_p = np.full((w, 1), _IDLE)  # phase of each timeline segment
        self._leaked = np.zeros(w)
        self._reserved = np.full(w, float(cfg.static_mem_bytes + cfg.activation_bytes + _GIB))
        self._mem_hist: tuple[np.ndarray, np.ndarray, np.ndarray] = (
            np.empty(0),
            np.empty((0, w)),
            self._reserved,
        )
        self._energy = 1e9 + self._rng.uniform(0, 1e9, w)  # mJ since the driver loaded
        self._pids = self._rng.integers(2000, 60000, w)
        self._gpu_tick = 1
        self._host_tick = 1
        self._last = (np.full(w, cfg.nominal_step_ms), np.zeros(w))  # step ms, wait share
        speed = cfg.rate / cfg.natural_rate if cfg.rate else cfg.speed
        self.pace = speed
        chunk_ms = min(max(speed * 20.0, cfg.nominal_step_ms), 1000.0)
        self._k = cfg.chunk_steps or max(1, round(chunk_ms / cfg.nominal_step_ms))
        self._idle_ms = max(cfg.gpu_interval_ms, chunk_ms)

    # -- knobs -------------------------------------------------------------------------------
    def set_num_workers(self, value: KnobValue) -> None:
        """Knob handler for ``dataloader.num_workers``."""
        self.num_workers = int(_number("num_workers", value, 0, 1024))

    def set_prefetch_factor(self, value: KnobValue) -> None:
        """Knob handler for ``dataloader.prefetch_factor`` (smooths the loader's jitter)."""
        self.prefetch_factor = int(_number("prefetch_factor", value, 1, 64))

    def set_power_limit_w(self, value: KnobValue) -> None:
        """Knob handler for ``gpu.power_limit_w``: a lower cap lowers clocks and slows compute."""
        self.power_limit_w = _number("power_limit_w", value, 100, self.cfg.power_limit_w)

    def knob_handlers(self) -> dict[str, Callable[[KnobValue], None]]:
        """Knob name → handler, for `perfloop.actuators.JobAgent`."""
        return {
            "dataloader.num_workers": self.set_num_workers,
            "dataloader.prefetch_factor": self.set_prefetch_factor,
            "gpu.power_limit_w": self.set_power_limit_w,
        }

    def knob_value(self, knob: str) -> KnobValue | None:
        """A knob's current value (None for a knob the job does not have): what a rollback
        restores."""
        return {
            "dataloader.num_workers": self.num_workers,
            "dataloader.prefetch_factor": self.prefetch_factor,
            "gpu.power_limit_w": self.power_limit_w,
        }.get(knob)

    # -- state -------------------------------------------------------------------------------
    @property
    def clock_s(self) -> float:
        """Simulated seconds since the job started."""
        return self._clock / 1000

    def active_faults(self, t_s: float | None = None) -> list[Fault]:
        t = self.clock_s if t_s is None else t_s
        return [f for f in self.cfg.faults if f.active(t)]

    def _ranks(self, f: Fault) -> list[int]:
        return list(f.ranks) if f.ranks else list(range(self.world))

    def _fault_state(self, t_ms: float) -> _State:
        w = self.world
        st = _State(np.ones(w), np.full(w, 1.0 / self._power_clock()), np.zeros(w))
        for f in self.active_faults(t_ms / 1000):
            r, x = self._ranks(f), f.strength
            if f.kind == "dataloader_starvation":
                st.load_mult[r] *= x
            elif f.kind == "straggler":
                st.compute_mult[r] *= x
            elif f.kind == "thermal_throttle":
                st.compute_mult[r] /= x
            elif f.kind == "memory_leak":
                st.leak[r] += x
            elif f.kind == "comm_degradation":
                st.comm_div = max(st.comm_div, x)
        return st

    def _power_clock(self) -> float:
        """Clock multiplier the power cap imposes (dynamic power ~ clock³)."""
        need = self.cfg.power_limit_w - _IDLE_W
        return min(1.0, max(0.3, (self.power_limit_w - _IDLE_W) / need) ** (1 / 3))

    def _boundaries(self, after_ms: float) -> list[float]:
        times = []
        for f in self.cfg.faults:
            for t in (f.onset_s, f.end_s):
                if t is not None and t * 1000 > after_ms:
                    times.append(t * 1000)
        return times

    # -- run ---------------------------------------------------------------------------------
    def run(
        self,
        duration_s: float,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        step_boundary: Callable[[int], object] | None = None,
        stop: Callable[[], bool] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> int:
        """Run for ``duration_s`` of simulated time; return the number of steps taken.

        ``step_boundary(step)`` and ``stop()`` are called between chunks of steps (one step
        at a time unless the pace is high), ``on_step`` after each step, ``on_tick`` after
        each chunk.
        """
        cfg = self.cfg
        end_ms = duration_s * 1000
        if cfg.t0_ns is not None:
            self.t0_ns = cfg.t0_ns
        else:  # run at the pace, and end near the wall time the run is expected to end at
            self.t0_ns = time.time_ns() - int(max(0.0, duration_s * (1 - 1 / self.pace)) * 1e9)
        self._begin()
        self._send_events()
        wall0 = time.monotonic()
        last_flush = wall0
        while self.state in ("running", "hung") and self._clock < end_ms:
            if stop is not None and stop():
                self.state = "stopped"
                break
            if step_boundary is not None:
                step_boundary(self.step)
            chunk = self._advance(end_ms)
            parts = self._parts(chunk)
            # pace: samples leave no earlier than the chosen speed (or rate) allows
            if cfg.rate:
                target = (self.samples + sum(len(p[2]["ts_ns"]) for p in parts)) / cfg.rate
            else:
                target = self._clock / 1000 / cfg.speed
            ahead = target - (time.monotonic() - wall0)
            if ahead > 0:
                time.sleep(ahead)
            for node, kind, cols in parts:
                self.emitters[node].extend(kind, **cols)
                self.samples += len(cols["ts_ns"])
            if self._outbox:  # after the samples before them (a flush sends those first)
                self.flush_batches()
                self._send_events()
            if on_step is not None:
                for rep in chunk.get("reports", ()):
                    on_step(rep)
            if time.monotonic() - last_flush >= cfg.publish_interval_ms / 1000:
                self.flush_batches()
                last_flush = time.monotonic()
            if on_tick is not None:
                on_tick()
        self._end()
        self.flush_batches()
        self._send_events()
        return self.step

    def flush_batches(self) -> None:
        """Publish every node's pending samples, one message per kind (and size limit)."""
        for em in self.emitters:
            em.flush()

    # -- events ------------------------------------------------------------------------------
    def _ns(self, ms: np.ndarray | float) -> Any:
        return self.t0_ns + np.rint(np.asarray(ms) * 1e6).astype(np.int64)

    def _event(self, node: int, event: Any) -> None:
        """Queue a job event; it leaves with the telemetry of its chunk (`_send_events`)."""
        self._outbox.append((node, event))

    def _send_events(self) -> None:
        for node, event in self._outbox:
            self.emitters[node].event(event)
            if isinstance(event, GroundTruth) and self.on_ground_truth is not None:
                self.on_ground_truth(event)
        self._outbox.clear()

    def _begin(self) -> None:
        cfg, g = self.cfg, self.per_node
        self.state = "running"
        command = (
            f"perfloop simulate --scenario {cfg.scenario} --nodes {cfg.nodes} "
            f"--ranks-per-node {g} --seed {cfg.seed}"
        )
        for rank in range(self.world):
            self._event(
                rank // g,
                JobInfo(
                    ts_ns=self.t0_ns,
                    job_id=cfg.job_id,
                    node=cfg.node_names[rank // g],
                    rank=rank,
                    model_name=cfg.model_name,
                    model_params=cfg.model_params,
                    optimizer="adamw",
                    parallelism="ddp",
                    dp_size=self.world,
                    precision="bf16",
                    world_size=self.world,
                    local_world_size=g,
                    nodes=cfg.nodes,
                    batch_size=cfg.batch_size,
                    gpu_name=cfg.gpu_name,
                    gpu_count=g,
                    gpu_mem_bytes=cfg.gpu_mem_bytes,
                    cpu_count=cfg.cpu_count,
                    host_mem_bytes=cfg.host_mem_bytes,
                    framework="torch",
                    backend="nccl",
                    command=command,
                    extra={"simulated": "true", "scenario": cfg.scenario, **cfg.extra},
                ),
            )
            self._lifecycle(0.0, rank, "started")
        self._lifecycle(0.0, -1, "started")

    def _lifecycle(
        self, t_ms: float, rank: int, state: str, code: int | None = None, message: str = ""
    ) -> None:
        """Queue one rank's (or, with rank -1, the job's) lifecycle event."""
        node = 0 if rank < 0 else rank // self.per_node
        event = JobLifecycle(
            ts_ns=int(self._ns(t_ms)),
            job_id=self.cfg.job_id,
            node=self.cfg.node_names[node],
            rank=rank,
            state=state,  # type: ignore[arg-type]
            exit_code=code,
            message=message,
        )
        self._event(node, event)

    def _end(self) -> None:
        if self.state == "failed":
            return  # the out-of-memory path said everything already
        message = ""
        if self.state == "hung":
            state, code = "killed", 137
            message = "no progress since the hang; stopped at the end of the simulation"
        elif self.state == "stopped":
            state, code, message = "killed", 130, "stopped before the end of the simulation"
        else:
            state, code = "finished", 0
        for rank in [*range(self.world), -1]:
            self._lifecycle(self._clock, rank, state, code, message)
        if self.state == "running":
            self.state = "finished"

    def _truth(
        self, fault: str, onset_ms: float, end_ms: float | None, ranks: list[int], detail: str
    ) -> None:
        cfg, g = self.cfg, self.per_node
        nodes = sorted({r // g for r in ranks})
        gt = GroundTruth(
            ts_ns=int(self._ns(onset_ms)),
            job_id=cfg.job_id,
            node=cfg.node_names[nodes[0]],
            rank=-1,
            scenario=cfg.scenario,
            fault=fault,  # type: ignore[arg-type]
            onset_ns=int(self._ns(onset_ms)),
            end_ns=int(self._ns(end_ms)) if end_ms is not None else 0,
            ranks=ranks,
            nodes=[cfg.node_names[n] for n in nodes],
            detail=detail,
        )
        self.ground_truth.append(gt)
        self._event(nodes[0], gt)

    def _publish_truth(self, until_ms: float) -> None:
        for i, f in enumerate(self.cfg.faults):
            if i not in self._published and f.onset_s * 1000 <= until_ms:
                self._published.add(i)
                end = None if f.end_s is None else f.end_s * 1000
                self._truth(f.kind, f.onset_s * 1000, end, self._ranks(f), f.describe())

    # -- generation --------------------------------------------------------------------------
    def _advance(self, end_ms: float) -> dict[str, Any]:
        """Generate the next chunk: steps (unless hung), then GPU and host samples."""
        if self.state == "hung":
            until = min(self._clock + self._idle_ms, end_ms)
            chunk: dict[str, Any] = {}
            self._clock = until
        else:
            chunk = self._steps(end_ms)
            until = chunk.pop("until")
        chunk["gpu"] = self._gpu(until)
        chunk["host"] = self._host(until)
        self._publish_truth(until)
        return chunk

    def _steps(self, end_ms: float) -> dict[str, Any]:
        cfg, rng, w, k = self.cfg, self._rng, self.world, self._k
        s0 = self._start
        clock = float(s0.max())
        bounds = [b for b in self._boundaries(clock) if b > clock]
        bound = min([*bounds, end_ms])
        hangs = [f.onset_s * 1000 for f in cfg.faults if f.kind == "hang"]
        t_hang = min([t for t in hangs if t > clock], default=None)
        st = self._fault_state(clock)
        shape = (k, w)
        cm = st.compute_mult
        fwd = cfg.forward_ms * cm * rng.normal(1.0, 0.02, shape)
        bwd = cfg.backward_ms * cm * rng.normal(1.0, 0.02, shape)
        opt = cfg.optimizer_ms * cm * rng.normal(1.0, 0.03, shape)
        load = cfg.load_ms * st.load_mult * rng.normal(1.0, 0.03, shape)
        ar = cfg.allreduce_ms(st.comm_div) * rng.normal(1.0, 0.03, k)
        ex = np.maximum(ar - cfg.comm_overlap * cfg.backward_ms, 0.1 * ar)
        busy = fwd + bwd + opt + ex[:, None]
        nw = self.num_workers
        wait = np.maximum(0.0, load / nw - busy) if nw else load
        wait = wait + np.abs(rng.normal(0.0, 1.0 / self.prefetch_factor, shape))
        pre = wait + fwd + bwd
        d = np.empty(k)
        d[0] = (s0 + pre[0]).max()
        d[1:] = (opt[:-1] + pre[1:]).max(axis=1)
        a = np.cumsum(d + ex)  # end of each step's all-reduce (shared by every rank)
        s = np.empty(shape)
        s[0] = s0
        s[1:] = a[:-1, None] + opt[:-1]
        e = a[:, None] + opt
        smax = s.max(axis=1)
        late = smax >= bound
        n = int(np.argmax(late)) if late.any() else k  # ≥ 1: smax[0] == clock < bound
        # memory: the leak grows per step; out of memory when the next activations do not fit
        leaked = self._leaked + st.leak * np.arange(1, k + 1)[:, None]
        peak = cfg.static_mem_bytes + cfg.activation_bytes + leaked
        # the caching allocator keeps what it reserved; it cannot reserve past the device
        grown = np.minimum(peak + _GIB, cfg.gpu_mem_bytes - _CONTEXT_BYTES)
        reserved = np.maximum(self._reserved, np.maximum.accumulate(grown, axis=0))
        oom = (peak[:n] + _CONTEXT_BYTES) > cfg.gpu_mem_bytes
        t_cut: float | None = None
        oom_at: tuple[int, int] | None = None
        if oom.any():
            ko = int(np.argmax(oom.any(axis=1)))
            ro = int(np.argmax(oom[ko]))
            t_oom = float(s[ko, ro] + wait[ko, ro] + 0.5 * fwd[ko, ro])
            if t_hang is None or t_oom < t_hang:
                oom_at, t_cut, n = (ko, ro), t_oom, ko
        hang = oom_at is None and t_hang is not None and e[n - 1].max() >= t_hang
        if hang:
            assert t_hang is not None
            t_cut = t_hang
        done = n
        if t_cut is not None:
            done = int(np.searchsorted(e[:n].max(axis=1), t_cut, side="right"))
        tl_rows = min(n + 1, k) if t_cut is not None else n
        # timeline of phases per rank (for the GPU samples)
        starts = np.stack(
            [s, s + wait, s + wait + fwd, s + pre, np.broadcast_to(a[:, None], shape)], axis=2
        )[:tl_rows]
        tb = np.concatenate(
            [starts.transpose(1, 0, 2).reshape(w, 5 * tl_rows), e[tl_rows - 1][:, None]], axis=1
        )
        tp = np.tile(np.arange(5), (w, tl_rows))
        if t_cut is not None:
            tb = np.minimum(tb, t_cut)
            last = np.full(w, _IDLE if oom_at else _HANG)
            if hang:
                last[[r for f in cfg.faults if f.kind == "hang" for r in self._ranks(f)]] = _IDLE
            tb = np.concatenate([tb, np.full((w, 1), _FAR_MS)], axis=1)
            tp = np.concatenate([tp, last[:, None]], axis=1)
        self._tl_b = np.concatenate([self._tl_b[:, :-1], tb], axis=1)
        self._tl_p = np.concatenate([self._tl_p, tp], axis=1)
        # bookkeeping
        first_step = self.step
        self.step += done
        self._mem_hist = (smax[:done], reserved[:done], self._reserved)
        if done:
            self._leaked = leaked[done - 1]
            self._reserved = reserved[done - 1]
            st_ms = e[:done] - s[:done]
            self._last = (st_ms.mean(axis=0), (wait[:done] / st_ms).mean(axis=0))
        if oom_at is not None:
            until = float(t_cut)  # type: ignore[arg-type]
            self._oom(oom_at, until, float(peak[oom_at] + _CONTEXT_BYTES))
        elif hang:
            until = float(t_cut)  # type: ignore[arg-type]
            self.state = "hung"
            self._last = (np.full(w, np.inf), np.zeros(w))
        else:
            until = float(e[n - 1].min())
            self._start = e[n - 1].copy()
        self._clock = until if t_cut is not None else float(self._start.max())
        comm = a[:done, None] - (s[:done] + pre[:done])
        reports = []
        for i in range(done):
            t = float(e[i].max())
            reports.append(
                StepReport(
                    first_step + i,
                    t / 1000,
                    float((e[i] - s[i]).max()),
                    float((wait[i] / (e[i] - s[i])).mean()),
                    nw,
                    bool(self.active_faults(float(smax[i]) / 1000)),
                )
            )
        return {
            "until": until,
            "first_step": first_step,
            "s": s[:done],
            "e": e[:done],
            "phases": np.stack([wait, fwd, bwd, np.zeros(shape), opt], axis=2)[:done],
            "starts": starts[:done],
            "comm": comm,
            "ar_start": (s + pre)[:done] - (ar - ex)[:done, None],
            "a": a[:done],
            "leaked": leaked[:done],
            "reserved": reserved[:done],
            "peak": peak[:done],
            "reports": reports,
        }

    def _oom(self, at: tuple[int, int], t_ms: float, need: float) -> None:
        cfg = self.cfg
        step, rank = self.step, at[1]
        self.state = "failed"
        self._publish_truth(t_ms)
        self._truth(
            "oom",
            t_ms,
            None,
            [rank],
            f"CUDA out of memory on rank {rank} at step {step}: needs {need / _GIB:.1f} GiB "
            f"of {cfg.gpu_mem_bytes / _GIB:.1f} GiB",
        )
        for r in range(self.world):
            if r == rank:
                self._lifecycle(t_ms, r, "failed", 1, "torch.OutOfMemoryError: CUDA out of memory")
            else:
                self._lifecycle(t_ms, r, "killed", -15, f"terminated: rank {rank} failed")
        self._lifecycle(t_ms, -1, "failed", 1, f"rank {rank} ran out of GPU memory at step {step}")

    def _averages(self, ticks: np.ndarray) -> np.ndarray:
        """Each signature channel averaged over the interval before each tick: (C, T, W)."""
        dt, w = self.cfg.gpu_interval_ms, self.world
        b = self._tl_b
        base = float(b[:, 0].min())
        x = np.minimum(b, ticks[-1] + dt) - base  # far bounds would cost float precision
        span = float(x.max()) + 2 * dt + 1
        off = np.arange(w)[:, None] * span
        xp = (x + off).ravel()
        vals = _SIGNATURE[self._tl_p]  # (W, M, C)
        cum = np.concatenate(
            [np.zeros((w, 1, vals.shape[2])), np.cumsum(vals * np.diff(x, axis=1)[..., None], 1)],
            axis=1,
        )
        hi = ((ticks - base)[None, :] + off).ravel()
        out = np.empty((vals.shape[2], len(ticks), w))
        for c in range(vals.shape[2]):
            fp = cum[..., c].ravel()
            avg = (np.interp(hi, xp, fp) - np.interp(hi - dt, xp, fp)) / dt
            out[c] = avg.reshape(w, len(ticks)).T
        return out

    def _trim(self, need_ms: float) -> None:
        j = int(np.searchsorted(self._tl_b.max(axis=0), need_ms)) - 1
        if j > 0:
            self._tl_b, self._tl_p = self._tl_b[:, j:], self._tl_p[:, j:]

    def _gpu(self, until_ms: float) -> dict[str, np.ndarray] | None:
        cfg, rng, w = self.cfg, self._rng, self.world
        dt = cfg.gpu_interval_ms
        last = math.floor(until_ms / dt + 1e-9)
        if last < self._gpu_tick:
            return None
        ticks = np.arange(self._gpu_tick, last + 1) * dt
        self._gpu_tick = last + 1
        util, mem_util, act, link = self._averages(ticks)
        self._trim(self._gpu_tick * dt - dt)
        shape = util.shape
        clock = np.full(shape, self._power_clock())
        throttle = np.full(shape, THROTTLE_SW_POWER_CAP if clock[0, 0] < 1 else 0, dtype=np.int64)
        temp_floor = np.zeros(shape)
        for f in cfg.faults:
            if f.kind != "thermal_throttle":
                continue
            r = self._ranks(f)
            on = (ticks >= f.onset_s * 1000) & (
                ticks < (f.end_s * 1000 if f.end_s is not None else np.inf)
            )
            mask = on[:, None] & np.isin(np.arange(w), r)[None, :]
            clock = np.where(mask, np.minimum(clock, f.strength), clock)
            bits = THROTTLE_SW_THERMAL | (THROTTLE_HW_THERMAL if f.strength < 0.7 else 0)
            throttle = np.where(mask, throttle | bits, throttle)
            # the GPU heats up over the 15 s before it throttles
            ramp = np.clip(1 - (f.onset_s * 1000 - ticks) / 15000, 0, 1) * (
                ticks < f.onset_s * 1000
            )
            heat = np.where(ramp > 0, 66.0 + 20.0 * ramp, 0.0)
            temp_floor = np.maximum(
                temp_floor, np.where(np.isin(np.arange(w), r)[None, :], heat[:, None], 0.0)
            )
            temp_floor = np.where(mask, 87.0, temp_floor)
        util = np.clip(util + rng.normal(0, 0.8, shape), 0, 100)
        power = _IDLE_W + (cfg.power_limit_w - _IDLE_W - 50) * act * clock**2
        power = np.clip(power + rng.normal(0, 4.0, shape), 40, self.power_limit_w)
        temp = 31 + 0.068 * power + rng.normal(0, 0.4, shape)
        temp = np.where(temp_floor > temp, temp_floor + rng.normal(0, 0.6, shape), temp)
        energy = self._energy + np.cumsum(power * dt, axis=0)  # W x ms = mJ
        self._energy = energy[-1]
        st = self._fault_state(float(ticks[-1]))
        # while communicating, links move data at the ring's pace (its slowest link)
        ring_gbps = cfg.inter_node_gbps if cfg.nodes > 1 else cfg.intra_node_gbps
        link_bps = link * (ring_gbps * 1e9) / st.comm_div
        mem = self._mem_at(ticks) + _CONTEXT_BYTES
        return {
            "ts_ns": np.broadcast_to(self._ns(ticks)[:, None], shape),
            "rank": np.broadcast_to(np.arange(w), shape),
            "device": np.broadcast_to(np.arange(w) % self.per_node, shape),
            "sm_util_pct": np.round(util, 1),
            "mem_util_pct": np.round(np.clip(mem_util + rng.normal(0, 0.5, shape), 0, 100), 1),
            "mem_used_bytes": mem,
            "mem_total_bytes": np.full(shape, cfg.gpu_mem_bytes),
            "power_w": np.round(power, 1),
            "temp_c": np.round(temp, 1),
            "sm_clock_mhz": np.round(_MAX_CLOCK_MHZ * clock / 15) * 15,
            "power_limit_w": np.full(shape, self.power_limit_w),
            "energy_mj": np.rint(energy).astype(np.int64),
            "mem_clock_mhz": np.full(shape, 2619.0),
            "throttle_reasons": throttle,
            "pcie_rx_bytes_per_s": np.round(util * 4.0e6),
            "pcie_tx_bytes_per_s": np.round(util * 0.5e6),
            "nvlink_rx_bytes_per_s": np.round(link_bps),
            "nvlink_tx_bytes_per_s": np.round(link_bps),
            "process_mem_bytes": mem,
        }

    def _mem_at(self, ticks: np.ndarray) -> np.ndarray:
        """Device memory reserved by each rank at each tick (bytes)."""
        starts, reserved, before = self._mem_hist
        if not len(starts):
            return np.broadcast_to(before, (len(ticks), self.world)).astype(np.int64)
        idx = np.searchsorted(starts, ticks, side="right") - 1
        out = np.where(idx[:, None] >= 0, reserved[np.maximum(idx, 0)], before)
        return out.astype(np.int64)

    def _host(self, until_ms: float) -> dict[str, np.ndarray] | None:
        cfg, rng, w, g = self.cfg, self._rng, self.world, self.per_node
        dt = cfg.host_interval_ms
        last = math.floor(until_ms / dt + 1e-9)
        if last < self._host_tick:
            return None
        ticks = np.arange(self._host_tick, last + 1) * dt
        self._host_tick = last + 1
        shape = (len(ticks), w)
        step_ms, wait_share = self._last
        steps_per_s = np.where(np.isfinite(step_ms), 1000 / step_ms, 0.0)
        st = self._fault_state(float(ticks[-1]))
        nw = self.num_workers
        load_ms = cfg.load_ms * st.load_mult
        loader_busy = np.minimum(1.0, load_ms * steps_per_s / 1000 / max(nw, 1))
        loader_cpu = 100.0 * nw * loader_busy * rng.normal(1, 0.03, shape)
        hung = self.state == "hung"
        proc_cpu = 30 + 90 * (1 - wait_share) + (0 if nw else 100 * loader_busy)
        proc_cpu = np.broadcast_to(100.0 if hung else proc_cpu, shape) + rng.normal(0, 3, shape)
        if hung:
            culprits = [r for f in cfg.faults if f.kind == "hang" for r in self._ranks(f)]
            proc_cpu[:, culprits] = np.abs(rng.normal(2, 0.5, (len(ticks), len(culprits))))
        proc_cpu = np.maximum(proc_cpu, 0.0)

        def per_node(a: np.ndarray) -> np.ndarray:  # a node-wide figure, on each of its ranks
            return np.repeat(a.reshape(len(ticks), cfg.nodes, g).sum(axis=2), g, axis=1)

        sys_cpu = np.clip(per_node(proc_cpu + loader_cpu) / cfg.cpu_count + 1.5, 0, 100)
        starving = np.zeros(w)
        for f in self.active_faults(float(ticks[-1]) / 1000):
            if f.kind == "dataloader_starvation":
                starving[self._ranks(f)] = 1.0
        # a starving node waits on its storage: iowait is node-wide
        node_starving = np.repeat(starving.reshape(cfg.nodes, g).max(axis=1), g)
        iowait = np.clip((0.6 + 8.4 * node_starving) * rng.normal(1, 0.1, shape), 0, 100)
        read = per_node(np.broadcast_to(cfg.batch_size * 110e3 * steps_per_s, shape))
        net = 0.0
        if cfg.nodes > 1:
            net = cfg.grad_bytes * 2 * (cfg.nodes - 1) / cfg.nodes / g * steps_per_s
        net_node = per_node(np.broadcast_to(net, shape))
        rss = 7.5 * _GIB + self._pids % 97 * (16 << 20)
        loader_rss = nw * 1.2 * _GIB
        return {
            "ts_ns": np.broadcast_to(self._ns(ticks)[:, None], shape),
            "rank": np.broadcast_to(np.arange(w), shape),
            "pid": np.broadcast_to(self._pids, shape),
            "proc_cpu_pct": np.round(proc_cpu, 1),
            "proc_rss_bytes": np.broadcast_to(rss.astype(np.int64), shape),
            "proc_threads": np.full(shape, 38 + nw),
            "sys_cpu_pct": np.round(sys_cpu, 1),
            "sys_iowait_pct": np.round(iowait, 1),
            "load_avg_1m": np.round(sys_cpu / 100 * cfg.cpu_count, 2),
            "sys_mem_used_bytes": np.full(
                shape, int(96 * _GIB + g * (7.5 * _GIB + loader_rss)), dtype=np.int64
            ),
            "sys_mem_total_bytes": np.full(shape, cfg.host_mem_bytes),
            "disk_read_bytes_per_s": np.round(read),
            "disk_write_bytes_per_s": np.full(shape, 2.0e6),
            "net_rx_bytes_per_s": np.round(net_node),
            "net_tx_bytes_per_s": np.round(net_node),
            "loader_workers": np.full(shape, nw),
            "loader_cpu_pct": np.round(np.maximum(loader_cpu, 0), 1),
            "loader_rss_bytes": np.full(shape, int(loader_rss), dtype=np.int64),
        }

    # -- emission ----------------------------------------------------------------------------
    def _parts(self, chunk: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
        """The chunk's columns split by node: (node, kind, columns)."""
        out = []
        for kind, cols in self._kinds(chunk):
            for n in range(len(self.emitters)):
                lo, hi = n * self.per_node, (n + 1) * self.per_node
                part = {
                    c: v[:, lo:hi].ravel() if isinstance(v, np.ndarray) else v(n)
                    for c, v in cols.items()
                }
                if len(part["ts_ns"]):
                    out.append((n, kind, part))
        return out

    def _kinds(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if "s" in chunk and len(chunk["s"]):
            out.extend(self._step_kinds(chunk))
        for kind in ("gpu", "host"):
            if chunk.get(kind) is not None:
                out.append((kind, chunk[kind]))
        return out

    def _step_kinds(self, c: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        cfg, rng, w = self.cfg, self._rng, self.world
        s, e, ph = c["s"], c["e"], c["phases"]
        k = len(s)
        shape = (k, w)
        ph = ph.copy()
        ph[:, :, 3] = c["comm"]
        steps = c["first_step"] + np.arange(k)
        step_col = np.broadcast_to(steps[:, None], shape)
        ranks = np.broadcast_to(np.arange(w), shape)
        st_ms = e - s
        loss = 0.9 + 5.0 * np.exp(-steps / 1500.0)[:, None] + rng.normal(0, 0.03, shape)
        lr = 3e-4 * np.minimum(1.0, (steps + 1) / 500.0)
        rss = (7.5 * _GIB + self._pids % 97 * (16 << 20)).astype(np.int64)
        static = cfg.static_mem_bytes
        g = self.per_node
        step_cols = {
            "ts_ns": self._ns(e),
            "rank": ranks,
            "step": step_col,
            "step_time_ms": np.round(st_ms, 3),
            "data_wait_ms": np.round(ph[:, :, 0], 3),
            "batch_size": np.full(shape, cfg.batch_size),
            "num_workers": np.full(shape, self.num_workers),
            "epoch": step_col // cfg.steps_per_epoch,
            "samples": np.full(shape, cfg.batch_size),
            "tokens": np.full(shape, cfg.batch_size * cfg.tokens_per_sample),
            "loss": np.round(np.maximum(loss, 0.01), 4),
            "grad_norm": np.round(np.abs(rng.normal(1.0, 0.08, shape)), 4),
            "lr": np.broadcast_to(lr[:, None], shape),
            "mem_allocated_bytes": (static + c["leaked"]).astype(np.int64),
            "mem_reserved_bytes": c["reserved"].astype(np.int64),
            "mem_peak_bytes": c["peak"].astype(np.int64),
            "rss_bytes": np.broadcast_to(rss, shape),
        }
        span_shape = (k, w, len(PHASES))
        spans = {
            "ts_ns": self._ns(c["starts"]),
            "rank": np.broadcast_to(np.arange(w)[:, None], span_shape),
            "step": np.broadcast_to(steps[:, None, None], span_shape),
            "phase": lambda n: list(PHASES) * (k * g),
            "name": lambda n: list(PHASES) * (k * g),
            "duration_ms": np.round(ph, 3),
        }
        out = [("step", step_cols), ("span", spans)]
        if w > 1:
            ar_start = c["ar_start"]
            out.append(
                (
                    "collective",
                    {
                        "ts_ns": self._ns(ar_start),
                        "rank": ranks,
                        "step": step_col,
                        "op": lambda n: ["all_reduce"] * (k * g),
                        "size_bytes": np.full(shape, cfg.grad_bytes),
                        "group": lambda n: ["dp"] * (k * g),
                        "group_size": np.full(shape, w),
                        "duration_ms": np.round(c["a"][:, None] - ar_start, 3),
                        "dtype": lambda n: ["bf16"] * (k * g),
                    },
                )
            )
        return out


def _number(name: str, value: KnobValue, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)
