"""What a simulated job emits (a mixin of `perfloop.producers.simulator.SimulatedJob`, private
to it): the step, span and collective records of a chunk's steps and the split of every
kind's columns by node (each node has its own `Emitter`), and the job events (job info,
lifecycle, ground truth, the out-of-memory failure) queued to leave after the samples of
their chunk, at simulated event time from ``t0_ns``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from perfloop.producers._simulator_config import GIB, PHASES, SimConfig
from perfloop.producers.emitter import Emitter
from perfloop.schemas import GroundTruth, JobInfo, JobLifecycle

__all__ = ["Emission"]


class Emission:
    """Events and records of `SimulatedJob`, which holds the state below; they call
    `FaultEffects`' ``_ranks``."""

    cfg: SimConfig
    world: int
    per_node: int
    num_workers: int
    emitters: list[Emitter]
    on_ground_truth: Callable[[GroundTruth], None] | None
    state: str
    step: int
    t0_ns: int
    ground_truth: list[GroundTruth]
    _rng: np.random.Generator
    _clock: float
    _pids: np.ndarray
    _published: set[int]
    _outbox: list[tuple[int, Any]]

    # -- job events ----------------------------------------------------------------------------
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
            f"CUDA out of memory on rank {rank} at step {step}: needs {need / GIB:.1f} GiB "
            f"of {cfg.gpu_mem_bytes / GIB:.1f} GiB",
        )
        for r in range(self.world):
            if r == rank:
                self._lifecycle(t_ms, r, "failed", 1, "torch.OutOfMemoryError: CUDA out of memory")
            else:
                self._lifecycle(t_ms, r, "killed", -15, f"terminated: rank {rank} failed")
        self._lifecycle(t_ms, -1, "failed", 1, f"rank {rank} ran out of GPU memory at step {step}")

    # -- records of steps, split by node -------------------------------------------------------
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
        rss = (7.5 * GIB + self._pids % 97 * (16 << 20)).astype(np.int64)
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
