"""A simulated data-parallel training job: N ranks publishing steps and GPU samples.

Each step every rank computes for about ``compute_ms`` and waits for its next batch when the
data loader cannot keep up: ``W`` workers prepare a batch every ``load_ms / W``, so a rank
waits ``max(0, load_ms / W - compute_ms)``. Ranks synchronise at the end of the step, as in
data parallel training. The injectable fault, data-loader starvation, makes each batch costlier
to load from ``fault_at_s`` on (a slow transform, a cold cache), so the data-wait share of
every step rises; more loader workers bring it back down. Event time advances with simulated
step time; ``speed`` > 1 runs faster than real time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from perfloop.catalog import Topics
from perfloop.producers.publisher import Publisher
from perfloop.schemas import BatchBuilder, KnobValue

__all__ = ["SimConfig", "SimulatedJob", "StepReport"]


@dataclass(frozen=True)
class SimConfig:
    """Shape of the simulated job and of its fault."""

    job_id: str
    ranks: int = 4
    node: str = "sim-node-0"
    compute_ms: float = 100.0
    load_ms: float = 120.0
    num_workers: int = 2
    batch_size: int = 32
    fault_at_s: float | None = None
    fault_load_ms: float = 400.0
    gpu_interval_ms: float = 100.0
    publish_interval_ms: float = 250.0
    speed: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class StepReport:
    """What one step looked like across the job (for live display)."""

    step: int
    elapsed_s: float
    step_time_ms: float
    data_wait_share: float
    num_workers: int
    fault_active: bool


class SimulatedJob:
    """Runs the simulated job; `step_boundary` hooks let a job agent apply commands."""

    def __init__(self, config: SimConfig, publisher: Publisher) -> None:
        self.cfg = config
        self.publisher = publisher
        self.num_workers = config.num_workers
        self._rng = np.random.default_rng(config.seed)
        self._steps = BatchBuilder(
            "step", job_id=config.job_id, node=config.node, producer_id=f"sim-{config.node}"
        )
        self._gpu = BatchBuilder(
            "gpu", job_id=config.job_id, node=config.node, producer_id=f"sim-{config.node}"
        )
        self.step = 0

    def set_num_workers(self, value: KnobValue) -> None:
        """Knob handler for ``dataloader.num_workers``."""
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"num_workers must be a non-negative number, got {value!r}")
        self.num_workers = int(value)

    def _one_step(self, fault: bool) -> tuple[np.ndarray, np.ndarray]:
        cfg, r = self.cfg, self._rng
        load = (cfg.fault_load_ms if fault else cfg.load_ms) * r.normal(1.0, 0.03, cfg.ranks)
        compute = cfg.compute_ms * r.normal(1.0, 0.02, cfg.ranks)
        # With no workers the main process loads each batch itself, in series with compute.
        per_batch = load / max(self.num_workers, 1)
        wait = np.maximum(0.0, per_batch - compute) if self.num_workers else load
        wait = wait + np.abs(r.normal(0.0, 0.5, cfg.ranks))  # a little jitter even when fed
        return compute + wait, wait

    def run(
        self,
        duration_s: float,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        step_boundary: Callable[[int], object] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> int:
        """Run for ``duration_s`` of simulated time; return the number of steps taken."""
        cfg = self.cfg
        t0_ns = time.time_ns()
        wall0 = time.monotonic()
        sim_ns = 0
        next_gpu_ns = 0
        next_pub_ns = int(cfg.publish_interval_ms * 1e6)
        ranks = np.arange(cfg.ranks)
        while sim_ns < duration_s * 1e9 and not (stop and stop()):
            if step_boundary is not None:
                step_boundary(self.step)
            fault = cfg.fault_at_s is not None and sim_ns >= cfg.fault_at_s * 1e9
            step_ms, wait_ms = self._one_step(fault)
            sync_ms = float(step_ms.max())  # ranks meet at the gradient all-reduce
            sim_ns += int(sync_ms * 1e6)
            ts = t0_ns + sim_ns
            for rank in ranks:
                self._steps.add(
                    ts_ns=ts,
                    rank=int(rank),
                    step=self.step,
                    step_time_ms=sync_ms,
                    data_wait_ms=float(wait_ms[rank]),
                    batch_size=cfg.batch_size,
                    num_workers=self.num_workers,
                )
            busy = 1.0 - float(wait_ms.mean()) / sync_ms
            while next_gpu_ns <= sim_ns:
                for rank in ranks:
                    util = float(np.clip(100 * busy + self._rng.normal(0, 2), 0, 100))
                    self._gpu.add(
                        ts_ns=t0_ns + next_gpu_ns,
                        rank=int(rank),
                        device=int(rank) % 8,
                        sm_util_pct=util,
                        mem_util_pct=util * 0.6,
                        mem_used_bytes=60 << 30,
                        mem_total_bytes=80 << 30,
                        power_w=120 + 5.8 * util,
                        temp_c=45 + 0.3 * util,
                        sm_clock_mhz=1980.0,
                    )
                next_gpu_ns += int(cfg.gpu_interval_ms * 1e6)
            if sim_ns >= next_pub_ns:
                self.flush_batches()
                next_pub_ns = sim_ns + int(cfg.publish_interval_ms * 1e6)
            if on_step is not None:
                on_step(
                    StepReport(
                        self.step,
                        sim_ns / 1e9,
                        sync_ms,
                        float(wait_ms.mean()) / sync_ms,
                        self.num_workers,
                        fault,
                    )
                )
            self.step += 1
            ahead = sim_ns / 1e9 / cfg.speed - (time.monotonic() - wall0)
            if ahead > 0:
                time.sleep(ahead)
        self.flush_batches()
        return self.step

    def flush_batches(self) -> None:
        """Publish the pending step and GPU samples, one message per kind."""
        if len(self._steps):
            self.publisher.publish(Topics.STEP, self.cfg.job_id, self._steps.encode())
        if len(self._gpu):
            self.publisher.publish(Topics.GPU, self.cfg.job_id, self._gpu.encode())
