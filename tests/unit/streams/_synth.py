"""A hand-made job for the funnel's detector tests (`test_detectors`, `test_pipeline_detectors`):
every rank's steps, spans, collectives and GPU samples, fed to a `Funnel` as its messages
would arrive."""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.schemas import Diagnosis
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
S = 1_000_000_000
GIB = float(1 << 30)


class Synth:
    """A hand-made data-parallel job. Each step every rank waits for its batch (``wait``),
    computes (``compute``: forward, backward, optimizer), then all meet in an all-reduce that
    takes ``comm`` ms once the last rank arrives, so every rank shares the step time. GPU
    samples every 100 ms per rank; messages arrive ``delay`` after their newest sample."""

    def __init__(
        self,
        *,
        nodes: int = 1,
        per_node: int = 4,
        compute: float = 90.0,
        comm: float = 10.0,
        spans: bool = True,
        collectives: bool = True,
        delay_ms: float = 300.0,
        job: str = "j",
        comm_name: str = "comm",
    ) -> None:
        self.job, self.nodes, self.per_node = job, nodes, per_node
        self.comm_name = comm_name  # the comm spans' name ("send"/"recv": point-to-point)
        self.world = nodes * per_node
        self.compute, self.comm = compute, comm
        self.spans, self.collectives = spans, collectives
        self.delay = int(delay_ms * MS)
        self.t = T0
        self.step = 0
        self.next_gpu = T0
        self.mem = np.full(self.world, 20 * GIB)
        self.rng = np.random.default_rng(0)
        self.items: list[tuple[int, Any]] = []
        self.gpu_util = np.full(self.world, 90.0)
        self.gpu_clock = np.full(self.world, 1980.0)
        self.gpu_reasons = np.zeros(self.world, dtype=np.int64)
        self.gpu_xid = np.zeros(self.world, dtype=np.int64)
        self.gpu_rank = np.arange(self.world)  # -1: a GPU no rank claims
        self.cpu = np.full(nodes, 20.0)
        self.run_delay = np.full(self.world, 10.0)  # each rank's wait for a CPU, % of a core

    def node(self, n: int) -> str:
        return f"{self.job}-node-{n}"

    def _emit(self, kind: str, cols: dict[str, np.ndarray], newest: int) -> None:
        owner = cols.pop("_node", cols["rank"] // self.per_node)
        for n in range(self.nodes):
            mine = owner == n
            if not mine.any():
                continue
            part = {k: v[mine].tolist() for k, v in cols.items()}
            data = encode_batch(kind, part, job_id=self.job, node=self.node(n))
            self.items.append((newest + self.delay, decode_batch(data)))

    def event(self, event: Any) -> None:
        self.items.append((event.ts_ns + self.delay, event))

    def steps(
        self,
        n: int,
        *,
        compute: Any = None,
        wait: Any = 0.0,
        comm: float | None = None,
        leak: Any = 0.0,
    ) -> None:
        """``n`` steps; ``compute`` / ``wait`` / ``leak`` are per rank (scalar or array, or a
        callable of the step index giving one)."""
        w = self.world
        for _ in range(n):

            def per_rank(x: Any, default: float) -> np.ndarray:
                x = x(self.step) if callable(x) else x
                return np.broadcast_to(np.asarray(default if x is None else x, float), (w,))

            c = per_rank(compute, self.compute) * self.rng.normal(1, 0.01, w)
            wt = per_rank(wait, 0.0) + np.abs(self.rng.normal(0, 0.3, w))
            self.mem += per_rank(leak, 0.0)
            arrive = wt + c
            end = arrive.max() + (self.comm if comm is None else comm) * self.rng.normal(1, 0.01)
            end_ns = self.t + int(end * MS)
            ranks = np.arange(w)
            self._gpu(end_ns)
            step_col = np.full(w, self.step)
            if self.spans:
                phases = ["data_wait", "forward", "backward", "comm", "optimizer"]
                dur = np.stack([wt, 0.35 * c, 0.55 * c, end - arrive, 0.1 * c], axis=1)
                self._emit(
                    "span",
                    {
                        "ts_ns": np.full(w * 5, self.t),
                        "rank": np.repeat(ranks, 5),
                        "step": np.repeat(step_col, 5),
                        "phase": np.array(phases * w, dtype=object),
                        "name": np.array(
                            [self.comm_name if p == "comm" else p for p in phases] * w,
                            dtype=object,
                        ),
                        "duration_ms": dur.ravel(),
                    },
                    end_ns,
                )
            if self.collectives:
                self._emit(
                    "collective",
                    {
                        "ts_ns": self.t + (arrive * MS).astype(np.int64),
                        "rank": ranks,
                        "step": step_col,
                        "op": np.array(
                            [self.comm_name if self.comm_name != "comm" else "all_reduce"] * w,
                            dtype=object,
                        ),
                        "duration_ms": end - arrive,
                    },
                    end_ns,
                )
            self._emit(
                "step",
                {
                    "ts_ns": np.full(w, end_ns),
                    "rank": ranks,
                    "step": step_col,
                    "step_time_ms": np.full(w, end),
                    "data_wait_ms": wt,
                    "mem_allocated_bytes": self.mem.astype(np.int64),
                    "mem_peak_bytes": (self.mem + 10 * GIB).astype(np.int64),
                },
                end_ns,
            )
            self.t = end_ns
            self.step += 1

    def stall(self, seconds: float) -> None:
        """No step completes for ``seconds``; GPU samples go on."""
        self.t += int(seconds * S)
        self._gpu(self.t)

    def _gpu(self, until_ns: int) -> None:
        ticks = np.arange(self.next_gpu, until_ns, 100 * MS)
        if not len(ticks):
            return
        self.next_gpu = int(ticks[-1]) + 100 * MS
        w, k = self.world, len(ticks)
        ranks = np.tile(np.arange(w), k)
        self._emit(
            "gpu",
            {
                "ts_ns": np.repeat(ticks, w),
                "rank": np.tile(self.gpu_rank, k),
                "device": ranks % self.per_node,
                "sm_util_pct": np.tile(self.gpu_util, k),
                "mem_util_pct": np.tile(self.gpu_util * 0.4, k),
                "sm_clock_mhz": np.tile(self.gpu_clock, k),
                "throttle_reasons": np.tile(self.gpu_reasons, k),
                "temp_c": np.tile(np.where(self.gpu_reasons & 0x60, 88.0, 60.0), k),
                "xid_events": np.tile(self.gpu_xid, k),
                "last_xid": np.tile(np.where(self.gpu_xid > 0, 79, 0), k),
                "mem_total_bytes": np.full(w * k, int(80 * GIB)),
                "_node": ranks // self.per_node,
            },
            int(ticks[-1]),
        )
        self.gpu_xid[:] = 0
        self._emit(
            "host",
            {
                "ts_ns": np.full(w, int(ticks[-1])),
                "rank": np.arange(w),
                "sys_cpu_pct": np.repeat(self.cpu, self.per_node),
                "proc_cpu_pct": np.full(w, 100.0),
                "proc_run_delay_pct": self.run_delay.copy(),
            },
            int(ticks[-1]),
        )

    def feed(self, funnel: Funnel, *, tail_s: float = 3.0) -> list[Diagnosis]:
        """Deliver every item in arrival order, ticking every 250 ms; return the diagnoses."""
        out: list[Diagnosis] = []
        items = sorted(self.items, key=lambda x: x[0])
        self.items = []
        next_tick = getattr(self, "_next_tick", items[0][0] if items else T0)
        for wall, item in items:
            while next_tick <= wall:
                out += funnel.tick(next_tick)
                next_tick += 250 * MS
            if hasattr(item, "columns"):
                funnel.observe(item, wall)
            else:
                funnel.observe_event(item, wall)
        end = (items[-1][0] if items else next_tick) + int(tail_s * S)
        while next_tick <= end:
            out += funnel.tick(next_tick)
            next_tick += 250 * MS
        self._next_tick = next_tick
        return out


def opened(diags: list[Diagnosis], bottleneck: str | None = None) -> list[Diagnosis]:
    return [d for d in diags if d.state == "open" and bottleneck in (None, d.bottleneck)]


def roots(diags: list[Diagnosis]) -> set[str]:
    """Root diagnoses that are not kernel-level context."""
    return {d.bottleneck for d in opened(diags) if not d.explained_by and d.level != "kernel"}
