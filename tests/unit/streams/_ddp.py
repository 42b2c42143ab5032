"""A DDP job on CPUs as the training hooks report it (test helper).

Each step every rank waits for its batch, may save a checkpoint or run an evaluation, runs
forward, then backward: its gradient buckets become ready at fixed fractions of its backward
compute and are all-reduced in order, each completing once the last rank has reached it (plus
a transfer time), and backward ends when the rank's own compute and the last all-reduce are
done (DDP waits for them). Then the optimizer steps. The hooks report per rank: a ``step``
row, depth-0 spans that tile the step, depth-1 ``comm`` spans inside ``backward`` covering
the union of the intervals with a bucket all-reduce in flight, and one ``collective`` row per
bucket timed from the rank's arrival (its gradients ready) to the completion. So the rank that
waits has long collectives and a long backward; the rank it waits for, short ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from perfloop.schemas.codec import decode_batch, encode_batch

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
S = 1_000_000_000

PerRank = Callable[[int], Any] | Any


def _union(a: np.ndarray, b: np.ndarray) -> float:
    """Total length of the union of intervals [a_k, b_k] (sorted by a)."""
    total, end = 0.0, -np.inf
    for lo, hi in sorted(zip(a.tolist(), b.tolist(), strict=True)):
        lo = max(lo, end)
        if hi > lo:
            total += hi - lo
            end = hi
    return total


class DDPJob:
    """``ranks`` ranks on ``nodes`` nodes; times in ms, with ``noise`` relative spread."""

    def __init__(
        self,
        ranks: int = 2,
        *,
        nodes: int = 1,
        forward: float = 20.0,
        backward: float = 40.0,
        optimizer: float = 4.0,
        wait: float = 1.0,
        buckets: tuple[float, ...] = (0.35, 1.0),
        transfer: float = 2.0,
        noise: float = 0.04,
        delay_ms: float = 300.0,
        seed: int = 0,
        job: str = "ddp",
    ) -> None:
        self.world, self.nodes = ranks, nodes
        self.per_node = -(-ranks // nodes)
        self.fwd, self.bwd, self.opt, self.wait = forward, backward, optimizer, wait
        self.buckets, self.transfer, self.noise = np.asarray(buckets), transfer, noise
        self.delay = int(delay_ms * MS)
        self.rng = np.random.default_rng(seed)
        self.job = job
        self.start = np.full(ranks, float(T0 / MS))  # each rank's step start, ms
        self.step = 0
        self.next_host = T0
        self.cpu = np.full(nodes, 50.0)
        self.items: list[tuple[int, Any]] = []
        self._next_tick: int | None = None

    def node(self, n: int) -> str:
        return f"{self.job}-node-{n}"

    def _per_rank(self, x: PerRank, default: float) -> np.ndarray:
        x = x(self.step) if callable(x) else x
        return np.broadcast_to(np.asarray(default if x is None else x, float), (self.world,))

    def _jitter(self, base: np.ndarray) -> np.ndarray:
        return base * self.rng.normal(1.0, self.noise, self.world).clip(0.5, 1.5)

    def _emit(self, kind: str, cols: dict[str, list], owner: np.ndarray, newest_ms: float) -> None:
        for n in range(self.nodes):
            mine = owner == n
            if not mine.any():
                continue
            part = {k: np.asarray(v, dtype=object if isinstance(v[0], str) else None)[mine].tolist()
                    for k, v in cols.items()}  # fmt: skip
            data = encode_batch(kind, part, job_id=self.job, node=self.node(n))
            self.items.append((int(newest_ms * MS) + self.delay, decode_batch(data)))

    def event(self, event: Any) -> None:
        self.items.append((event.ts_ns + self.delay, event))

    def steps(
        self,
        n: int,
        *,
        slow: PerRank = None,
        extra_ms: PerRank = None,
        wait: PerRank = None,
        checkpoint: PerRank = None,
        evaluate: PerRank = None,
    ) -> None:
        """``n`` steps. Per rank (a scalar, an array, or a callable of the step number):
        ``slow`` multiplies its compute, ``extra_ms`` adds to its forward, ``wait`` is its data
        wait, ``checkpoint`` / ``evaluate`` the ms it saves a checkpoint / evaluates before
        its forward."""
        w = self.world
        ranks = np.arange(w)
        owner = ranks // self.per_node
        for _ in range(n):
            mult = self._per_rank(slow, 1.0)
            d = np.abs(self._jitter(self._per_rank(wait, self.wait)))
            ck = self._per_rank(checkpoint, 0.0)
            ev = self._per_rank(evaluate, 0.0)
            f = self._jitter(mult * self.fwd) + self._per_rank(extra_ms, 0.0)
            b = self._jitter(mult * self.bwd)
            o = self._jitter(mult * self.opt)
            t = self.start.copy()
            bwd_start = t + d + ck + ev + f
            arrive = bwd_start[:, None] + self.buckets[None, :] * b[:, None]  # (ranks, k)
            done = np.empty(len(self.buckets))
            prev = -np.inf
            for k in range(len(self.buckets)):
                prev = done[k] = max(arrive[:, k].max(), prev) + self.transfer
            bwd_end = np.maximum(bwd_start + b, done[-1])
            end = bwd_end + o
            inflight = np.array([_union(arrive[i], done) for i in range(w)])
            # spans: depth 0 tiles the step; depth-1 comm inside backward
            rows: dict[str, list] = {c: [] for c in
                                     ("ts_ns", "rank", "step", "phase", "name", "duration_ms",
                                      "depth")}  # fmt: skip
            span_owner = []

            def span(
                i: int,
                phase: str,
                start: float,
                ms: float,
                depth: int = 0,
                rows: dict = rows,
                span_owner: list = span_owner,
            ) -> None:
                rows["ts_ns"].append(int(start * MS))
                rows["rank"].append(i)
                rows["step"].append(self.step)
                rows["phase"].append(phase)
                rows["name"].append(phase)
                rows["duration_ms"].append(round(float(ms), 4))
                rows["depth"].append(depth)
                span_owner.append(owner[i])

            for i in range(w):
                x = t[i]
                for phase, ms in (("data_wait", d[i]), ("checkpoint", ck[i]), ("eval", ev[i])):
                    if ms > 0:
                        span(i, phase, x, ms)
                        x += ms
                span(i, "forward", x, f[i])
                span(i, "backward", bwd_start[i], bwd_end[i] - bwd_start[i])
                span(i, "comm", arrive[i, 0], inflight[i], depth=1)
                span(i, "optimizer", bwd_end[i], o[i])
            self._emit("span", rows, np.asarray(span_owner), float(end.max()))
            k = len(self.buckets)
            self._emit(
                "collective",
                {
                    "ts_ns": (arrive * MS).astype(np.int64).ravel().tolist(),
                    "rank": np.repeat(ranks, k).tolist(),
                    "step": [self.step] * (w * k),
                    "op": ["all_reduce"] * (w * k),
                    "size_bytes": [1 << 20] * (w * k),
                    "group": ["0"] * (w * k),
                    "group_size": [w] * (w * k),
                    "duration_ms": (done[None, :] - arrive).ravel().round(4).tolist(),
                },
                np.repeat(owner, k),
                float(end.max()),
            )
            self._emit(
                "step",
                {
                    "ts_ns": (end * MS).astype(np.int64).tolist(),
                    "rank": ranks.tolist(),
                    "step": [self.step] * w,
                    "step_time_ms": (end - t).round(4).tolist(),
                    "data_wait_ms": d.round(4).tolist(),
                },
                owner,
                float(end.max()),
            )
            self._host(int(end.max() * MS))
            self.start = end
            self.step += 1

    def pause(self, seconds: float, where: dict[int, str], *, every_s: float = 2.0) -> None:
        """No step completes for ``seconds``: each rank in ``where`` reports its phase
        (`RankProgress`) every ``every_s`` once its step has lasted 2 s; the others say
        nothing. Then the steps go on."""
        from perfloop.schemas import RankProgress

        t0 = float(self.start.max())
        step_start = int(t0 * MS)
        for k in range(1, int(seconds / every_s) + 1):
            t = t0 + 1000 * (2.0 + (k - 1) * every_s)
            if t > t0 + 1000 * seconds:
                break
            for r, phase in where.items():
                self.event(RankProgress(ts_ns=int(t * MS), job_id=self.job, node=self.node(
                    r // self.per_node), rank=r, step=self.step, phase=phase,
                    op="all_reduce" if phase == "comm" else "", since_ns=step_start + MS,
                    step_start_ns=step_start))  # fmt: skip
            self._host(int(t * MS))
        self.start = np.full(self.world, t0 + 1000 * seconds)

    def _host(self, until_ns: int) -> None:
        ticks = np.arange(self.next_host, until_ns, S)
        if not len(ticks):
            return
        self.next_host = int(ticks[-1]) + S
        w = self.world
        self._emit(
            "host",
            {
                "ts_ns": [int(ticks[-1])] * w,
                "rank": list(range(w)),
                "sys_cpu_pct": np.repeat(self.cpu, self.per_node)[:w].tolist(),
                "proc_cpu_pct": [100.0] * w,
            },
            np.arange(w) // self.per_node,
            ticks[-1] / MS,
        )

    def feed(self, component: Any, *, tail_s: float = 3.0) -> list[Any]:
        """Deliver every item in arrival order to a `Funnel`, ticking every 250 ms."""
        out: list[Any] = []
        items = sorted(self.items, key=lambda x: x[0])
        self.items = []
        tick = self._next_tick if self._next_tick is not None else items[0][0]
        for wall, item in items:
            while tick <= wall:
                out += component.tick(tick)
                tick += 250 * MS
            if hasattr(item, "columns"):
                component.observe(item, wall)
            else:
                component.observe_event(item, wall)
        end = (items[-1][0] if items else tick) + int(tail_s * S)
        while tick <= end:
            out += component.tick(tick)
            tick += 250 * MS
        self._next_tick = tick
        return out
