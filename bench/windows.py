"""How fast `WindowSet` windows a realistic telemetry mix, against a naive baseline.

    python bench/windows.py                      # 8 jobs x 2 nodes x 8 ranks, 120 s (~1 min)
    python bench/windows.py --jobs 1 --sim-s 600 # one job: fewer samples per close
    python bench/windows.py --ranks 64 --batch-s 1.0

The mix, per node (8 ranks, 8 GPUs): GPU samples at 10 Hz per device, host samples at 1 Hz
per rank, ~10 steps/s per rank and 5 depth-0 phase spans per step, published every
``--batch-s`` of event time per node and kind. Batches are encoded and decoded with the real
codec first (not timed), then fed in event-time order with a wall clock 0.3 s behind, with an
``advance`` after each publish interval (as the stream engine ticks after each batch group).

Two measurements in this process, on the same batches and the same metrics:

1. **WindowSet**: ``observe`` + ``advance`` (default specs 1, 10, 60 s tumbling and 60 s
   every 10 s; count, mean, min, max, p50/p95/p99, rate, slope, phase shares).
2. **Naive baseline** (like the old single-timescale ``TumblingWindows``): per series and
   window a Python dict of lists of arrays; at close, concatenate and ``np.percentile``; one
   window set per spec, every sample appended to each hopping window it falls in. Run on the
   first ``--naive-s`` seconds only (it is slow); rates are per sample, so they compare.

Figures: samples/s (telemetry rows) and µs/sample from this process's CPU time (the cost on
one core; wall time is printed too and is higher on a busy machine), windows emitted, and the
ratio. Printed, saved to ``bench/results/windows-<time>.json``; the last line is the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as `python bench/windows.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import raise_on_sigterm, save_result, say

NS = 1_000_000_000
PHASES = ("data_wait", "forward", "backward", "comm", "optimizer")
PHASE_SHARE = np.array([0.1, 0.25, 0.45, 0.1, 0.1])


def make_batches(
    nodes: int, ranks: int, sim_s: float, batch_s: float, jobs: int = 1, seed: int = 0
) -> list[list[Any]]:
    """Decoded batches grouped per publish interval, in event-time order."""
    from perfloop.schemas import decode_batch, encode_batch

    rng = np.random.default_rng(seed)
    t0 = 1_700_000_000 * NS
    groups = []
    step_ms = 100.0
    step_ns = int(step_ms * 1e6)
    for i in range(int(sim_s / batch_s)):
        lo = t0 + int(i * batch_s * NS)
        hi = lo + int(batch_s * NS)
        group: list[Any] = []
        for job, n in itertools.product(range(jobs), range(nodes)):
            node = f"bench-node-{n}"
            rk = np.arange(n * ranks, (n + 1) * ranks)

            def enc(
                kind: str,
                cols: dict[str, Any],
                node: str = node,
                job: int = job,
                out: list[Any] = group,
            ) -> None:
                if len(cols["ts_ns"]):
                    data = encode_batch(kind, cols, job_id=f"bench-{job}", node=node)
                    out.append(decode_batch(data))

            ts = np.arange(lo, hi, NS // 10)
            g_ts, g_dev = np.repeat(ts, ranks), np.tile(np.arange(ranks), len(ts))
            m = len(g_ts)
            enc(
                "gpu",
                {
                    "ts_ns": g_ts,
                    "rank": rk[g_dev],
                    "device": g_dev,
                    "sm_util_pct": rng.uniform(80, 100, m).round(1),
                    "mem_util_pct": rng.uniform(30, 60, m).round(1),
                    "mem_used_bytes": rng.integers(60 << 30, 70 << 30, m),
                    "power_w": rng.normal(600, 30, m).clip(0).round(1),
                    "temp_c": rng.normal(70, 2, m).round(1),
                    "sm_clock_mhz": np.full(m, 1980.0),
                },
            )
            h_ts = np.arange(lo, hi, NS)
            h = len(h_ts) * ranks
            enc(
                "host",
                {
                    "ts_ns": np.repeat(h_ts, ranks),
                    "rank": np.tile(rk, len(h_ts)),
                    "proc_cpu_pct": rng.uniform(100, 300, h),
                    "sys_cpu_pct": rng.uniform(20, 60, h),
                    "sys_iowait_pct": rng.uniform(0, 5, h),
                    "proc_rss_bytes": rng.integers(8 << 30, 9 << 30, h),
                    "sys_mem_used_bytes": rng.integers(200 << 30, 210 << 30, h),
                    "loader_cpu_pct": rng.uniform(50, 400, h),
                },
            )
            # Steps of each rank end on a 100 ms grid (offset by rank); durations vary.
            first = -(-(lo - t0) // step_ns)
            ends = np.arange(first, -(-(hi - t0) // step_ns)) * step_ns + t0
            s_ts = np.repeat(ends, ranks) + np.tile(rk * 1000, len(ends))
            s_rank = np.tile(rk, len(ends))
            s_step = np.repeat(np.arange(first, first + len(ends)), ranks)
            st, k = s_ts, len(s_ts)
            dur = step_ms * rng.uniform(0.9, 1.2, k)
            enc(
                "step",
                {
                    "ts_ns": st,
                    "rank": s_rank,
                    "step": s_step,
                    "step_time_ms": dur,
                    "data_wait_ms": dur * rng.uniform(0.05, 0.15, k),
                    "samples": np.full(k, 32),
                    "tokens": np.full(k, 32 * 2048),
                    "mem_allocated_bytes": rng.integers(40 << 30, 41 << 30, k),
                },
            )
            span_dur = (dur[:, None] * PHASE_SHARE[None, :]).ravel()
            starts = (st[:, None] - (dur[:, None] * 1e6).astype(np.int64)) + np.concatenate(
                [np.zeros((k, 1)), np.cumsum(dur[:, None] * PHASE_SHARE * 1e6, axis=1)[:, :-1]],
                axis=1,
            ).astype(np.int64)
            enc(
                "span",
                {
                    "ts_ns": starts.ravel(),
                    "rank": np.repeat(s_rank, 5),
                    "step": np.repeat(s_step, 5),
                    "phase": list(PHASES) * k,
                    "name": list(PHASES) * k,
                    "duration_ms": span_dur,
                    "depth": np.zeros(5 * k, dtype=np.int64),
                },
            )
        groups.append(group)
    return groups


def run_windowset(groups: list[list[Any]]) -> dict[str, Any]:
    from perfloop.streams.windows import WindowSet

    ws = WindowSet(lateness_s=2.0)
    rows = windows = 0
    wall = 0
    t, c = time.perf_counter(), time.process_time()
    for group in groups:
        wall = 0
        for b in group:
            wall = int(b.columns["ts_ns"].max()) + 300_000_000
            ws.observe(b, wall)
            rows += len(b)
        windows += len(ws.advance(wall)["ts_ns"])
    windows += len(ws.advance(wall + 300 * NS)["ts_ns"])
    cpu, dt = time.process_time() - c, time.perf_counter() - t
    return {
        "samples": rows,
        "cpu_s": cpu,
        "wall_s": dt,
        "windows": windows,
        "late": ws.late_samples,
    }


class Naive:
    """Per series and window: a list of arrays; np.percentile when the window closes."""

    SPECS = ((1, 1), (10, 10), (60, 60), (60, 10))

    def __init__(self, metrics: dict[str, tuple[str, ...]], lateness_s: float = 2.0) -> None:
        self.metrics = metrics
        self.lateness_ns = int(lateness_s * NS)
        self.open: dict[tuple[Any, ...], list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        self.wm: dict[str, int] = {}

    def _add(self, key: tuple[Any, ...], ts: np.ndarray, v: np.ndarray) -> None:
        for size, hop in self.SPECS:
            s_ns, h_ns = size * NS, hop * NS
            for j in range(size // hop):
                starts = (ts // h_ns - j) * h_ns
                for start in np.unique(starts):
                    sel = starts == start
                    self.open[(*key, size, hop, int(start))].append((ts[sel], v[sel]))
            del s_ns

    def observe(self, b: Any) -> None:
        c = b.columns
        ts = c["ts_ns"]
        self.wm[b.node] = max(self.wm.get(b.node, 0), int(ts.max()))
        if b.kind == "span":
            totals: dict[tuple[int, int], float] = defaultdict(float)
            for r, s, d in zip(
                c["rank"].tolist(), c["step"].tolist(), c["duration_ms"].tolist(), strict=True
            ):
                totals[(r, s)] += d
            share = np.array(
                [
                    d / totals[(r, s)]
                    for r, s, d in zip(
                        c["rank"].tolist(),
                        c["step"].tolist(),
                        c["duration_ms"].tolist(),
                        strict=True,
                    )
                ]
            )
            for phase in set(c["phase"].tolist()):
                for r in np.unique(c["rank"]):
                    sel = (c["phase"] == phase) & (c["rank"] == r)
                    self._add(
                        (b.node, int(r), -1, f"phase.{phase}_ms"), ts[sel], c["duration_ms"][sel]
                    )
                    self._add((b.node, int(r), -1, f"phase.{phase}_share"), ts[sel], share[sel])
            return
        dev = c.get("device", np.full(len(ts), -1))
        for m in self.metrics[b.kind]:
            if m == "data_wait_share":
                vals = c["data_wait_ms"] / c["step_time_ms"]
            elif m == "tokens_per_s":
                vals = 1e3 * c["tokens"] / c["step_time_ms"]
            elif m == "samples_per_s":
                vals = 1e3 * c["samples"] / c["step_time_ms"]
            else:
                vals = c[m].astype(np.float64)
            for r, d in set(zip(c["rank"].tolist(), dev.tolist(), strict=True)):
                sel = (c["rank"] == r) & (dev == d)
                self._add((b.node, r, d, m), ts[sel], vals[sel])

    def advance(self) -> int:
        horizon = min(self.wm.values()) - self.lateness_ns
        due = [k for k in self.open if k[-1] + k[-3] * NS <= horizon]
        for key in due:
            parts = self.open.pop(key)
            ts = np.concatenate([p[0] for p in parts])
            v = np.concatenate([p[1] for p in parts])
            np.percentile(v, [50, 95, 99])
            v.mean(), v.min(), v.max()
            if len(v) > 1:
                t = (ts - ts.min()) / NS
                tc = t - t.mean()
                d = float(tc @ tc)
                if d > 0:
                    float(tc @ (v - v.mean())) / d
        return len(due)


def run_naive(groups: list[list[Any]]) -> dict[str, Any]:
    from perfloop.streams.windows import DEFAULT_METRICS

    nv = Naive(DEFAULT_METRICS)
    rows = windows = 0
    t, c = time.perf_counter(), time.process_time()
    for group in groups:
        for b in group:
            nv.observe(b)
            rows += len(b)
        windows += nv.advance()
    for node in nv.wm:
        nv.wm[node] += 3600 * NS
    windows += nv.advance()
    cpu, dt = time.process_time() - c, time.perf_counter() - t
    return {"samples": rows, "cpu_s": cpu, "wall_s": dt, "windows": windows}


def main() -> None:
    raise_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8, help="jobs windowed together")
    ap.add_argument("--nodes", type=int, default=2, help="nodes per job")
    ap.add_argument("--ranks", type=int, default=8, help="ranks (and GPUs) per node")
    ap.add_argument("--sim-s", type=float, default=120.0, help="event time to window")
    ap.add_argument("--batch-s", type=float, default=0.25, help="event time per batch")
    ap.add_argument("--naive-s", type=float, default=15.0, help="event time for the baseline")
    ap.add_argument("--repeat", type=int, default=3, help="best of N WindowSet runs")
    args = ap.parse_args()

    say(
        f"generating {args.sim_s:g} s of telemetry: {args.jobs} job(s) x {args.nodes} nodes "
        f"x {args.ranks} ranks, a batch per node and kind every {args.batch_s:g} s"
    )
    groups = make_batches(args.nodes, args.ranks, args.sim_s, args.batch_s, args.jobs)
    n_batches = sum(len(g) for g in groups)
    rows = sum(len(b) for g in groups for b in g)
    say(f"  {rows:,} samples in {n_batches:,} batches ({rows / n_batches:.0f} per batch)")

    runs = [run_windowset(groups) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["cpu_s"])
    ws_rate = best["samples"] / best["cpu_s"]
    say(
        f"WindowSet: {ws_rate:,.0f} samples/s ({1e6 / ws_rate:.2f} µs/sample CPU, "
        f"{1e6 * best['wall_s'] / best['samples']:.2f} wall), {best['windows']:,} windows, "
        f"{best['late']} late (best of {args.repeat})"
    )

    n_naive = max(1, int(len(groups) * min(1.0, args.naive_s / args.sim_s)))
    naive = run_naive(groups[:n_naive])
    nv_rate = naive["samples"] / naive["cpu_s"]
    say(
        f"naive:     {nv_rate:,.0f} samples/s ({1e6 / nv_rate:.2f} µs/sample CPU), "
        f"{naive['windows']:,} windows over the first {args.naive_s:g} s"
    )
    ratio = ws_rate / nv_rate
    say(f"ratio WindowSet / naive: {ratio:.1f}x")
    doc = {
        "bench": "windows",
        "jobs": args.jobs,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks,
        "sim_s": args.sim_s,
        "batch_s": args.batch_s,
        "samples": rows,
        "batches": n_batches,
        "windowset_samples_per_s": round(ws_rate),
        "windowset_us_per_sample_cpu": round(1e6 / ws_rate, 3),
        "windowset_us_per_sample_wall": round(1e6 * best["wall_s"] / best["samples"], 3),
        "windowset_windows": best["windows"],
        "naive_samples_per_s": round(nv_rate),
        "naive_us_per_sample_cpu": round(1e6 / nv_rate, 3),
        "ratio": round(ratio, 2),
    }
    save_result("windows", doc)


if __name__ == "__main__":
    main()
