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

This module holds the job's knobs, its state and its run loop; the rest lives in private
modules of this package: the config, the phases and the hardware's constants
(`_simulator_config`, with `SimConfig` and `StepReport`), the faults' effects
(`_simulator_faults`), the per-rank step model (`_simulator_steps`), the GPU and host samples
(`_simulator_samples`), and the records, job events and ground truth the job emits
(`_simulator_emission`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from perfloop.producers._simulator_config import GIB, IDLE, PHASES, SimConfig, StepReport
from perfloop.producers._simulator_config import THROTTLE_HW_THERMAL as THROTTLE_HW_THERMAL
from perfloop.producers._simulator_config import THROTTLE_SW_POWER_CAP as THROTTLE_SW_POWER_CAP
from perfloop.producers._simulator_config import THROTTLE_SW_THERMAL as THROTTLE_SW_THERMAL
from perfloop.producers._simulator_emission import Emission
from perfloop.producers._simulator_faults import FaultEffects
from perfloop.producers._simulator_samples import Samples
from perfloop.producers._simulator_steps import StepModel
from perfloop.producers.emitter import Emitter, Sends
from perfloop.producers.faults import Fault
from perfloop.schemas import GroundTruth, KnobValue

__all__ = ["PHASES", "SimConfig", "SimulatedJob", "StepReport"]


class SimulatedJob(FaultEffects, StepModel, Samples, Emission):
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
        self._tl_p = np.full((w, 1), IDLE)  # phase of each timeline segment
        self._leaked = np.zeros(w)
        self._reserved = np.full(w, float(cfg.static_mem_bytes + cfg.activation_bytes + GIB))
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

    # -- knobs ---------------------------------------------------------------------------------
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

    # -- state ---------------------------------------------------------------------------------
    @property
    def clock_s(self) -> float:
        """Simulated seconds since the job started."""
        return self._clock / 1000

    def active_faults(self, t_s: float | None = None) -> list[Fault]:
        t = self.clock_s if t_s is None else t_s
        return [f for f in self.cfg.faults if f.active(t)]

    # -- run -----------------------------------------------------------------------------------
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


def _number(name: str, value: KnobValue, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)
