"""Simulated runs for the models bench, reduced to what its sections score.

Every scenario runs in process (`SimulatedJob`, fixed ``t0_ns``, flat out); its messages are
decoded and reduced with numpy to per-step job series (median over ranks of step time and of
each phase's time), per-rank memory steps, rank 0's phase spans and per-1-s-window job
features (`window_features`); `_changes` lists a run's ground-truth regime changes. Also the
constants and the table-cell formatter (`_f`) the sections share.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from bench._common import say

NS = 1_000_000_000
T0_NS = 1_700_000_000_000_000_000
SCENARIOS = (
    "healthy",
    "dataloader_starvation",
    "straggler",
    "thermal_throttle",
    "comm_degradation",
    "memory_leak",
    "mixed",
    "hang",
)
FORECAST_SCENARIOS = tuple(s for s in SCENARIOS if s != "hang")
PHASES = ("data_wait", "forward", "backward", "comm", "optimizer")
CHANGE_KINDS = ("dataloader_starvation", "straggler", "thermal_throttle", "comm_degradation")


# -- simulated runs ---------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    onset_s: float
    end_s: float | None  # None: to the end of the run
    ranks: list[int]


@dataclass
class SimRun:
    """One simulated job, reduced to what the sections score."""

    scenario: str
    seed: int
    world: int
    end_s: float  # the run's last event time, s from t0
    faults: list[Fault]
    oom_s: float | None
    step_end_s: np.ndarray  # per step: when its last rank finished
    step_ms: np.ndarray  # per step: median over ranks of step_time_ms
    phase_ms: dict[str, np.ndarray]  # per step: median over ranks of each phase's time
    rank_steps: list[dict[str, np.ndarray]]  # per rank: ts_s, mem_peak_bytes, mem_total_bytes
    windows: dict[str, np.ndarray]  # 1-s window features; "t_s" is each window's start
    spans0: tuple[np.ndarray, np.ndarray]  # rank 0's phase starts (s) and phase codes
    samples: dict[str, int]  # raw samples per kind
    steps_per_s: float = 0.0


class _Collect:
    def __init__(self) -> None:
        self.msgs: list[tuple[str, bytes]] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.msgs.append((topic, value))
        return True


def _per_step(steps: np.ndarray, ranks: np.ndarray, vals: np.ndarray, world: int) -> np.ndarray:
    """(steps x ranks) array of ``vals`` (NaN where a rank has no value), summing repeats."""
    n = int(steps.max()) + 1 if len(steps) else 0
    out = np.zeros((n, world))
    seen = np.zeros((n, world), dtype=bool)
    np.add.at(out, (steps, ranks), vals)
    seen[steps, ranks] = True
    out[~seen] = np.nan
    return out


def _nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """``np.nanmedian`` without its warning for all-NaN rows (they stay NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)


def simulate(scenario: str, seed: int, nodes: int, per_node: int, duration_s: float) -> SimRun:
    """Run one scenario in process and reduce its messages to per-step and window series."""
    from perfloop.producers.scenarios import scenario_config
    from perfloop.producers.simulator import SimulatedJob
    from perfloop.schemas import GroundTruth, JobLifecycle
    from perfloop.schemas.codec import decode_batch, decode_event

    cfg = scenario_config(
        scenario,
        job_id=f"bench-models-{scenario.replace('_', '-')}-s{seed}",
        nodes=nodes,
        ranks_per_node=per_node,
        duration_s=duration_s,
        seed=seed,
        t0_ns=T0_NS,
        speed=1e9,
    )
    sink = _Collect()
    SimulatedJob(cfg, sink).run(duration_s)
    cols: dict[str, list[dict[str, np.ndarray]]] = {}
    truth: list[GroundTruth] = []
    failed: list[float] = []
    end_ns = T0_NS
    for topic, value in sink.msgs:
        if topic.endswith(".job"):
            ev = decode_event(value)
            if isinstance(ev, GroundTruth):
                truth.append(ev)
            elif isinstance(ev, JobLifecycle) and ev.rank == -1 and ev.state == "failed":
                failed.append((ev.ts_ns - T0_NS) / NS)
            end_ns = max(end_ns, ev.ts_ns)
            continue
        b = decode_batch(value)
        cols.setdefault(b.kind, []).append(b.columns)
        end_ns = max(end_ns, int(b.columns["ts_ns"].max()))

    def cat(kind: str, name: str) -> np.ndarray:
        return np.concatenate([c[name] for c in cols.get(kind, [])] or [np.empty(0)])

    w = cfg.world
    faults = [
        Fault(
            g.fault,
            (g.onset_ns - T0_NS) / NS,
            (g.end_ns - T0_NS) / NS if g.end_ns else None,
            list(g.ranks),
        )
        for g in truth
        if g.fault != "oom"
    ]
    ooms = [(g.onset_ns - T0_NS) / NS for g in truth if g.fault == "oom"] or failed
    # steps: job level, median over ranks
    st_step = cat("step", "step").astype(np.int64)
    st_rank = cat("step", "rank").astype(np.int64)
    st_ts = (cat("step", "ts_ns") - T0_NS) / NS
    grid = _per_step(st_step, st_rank, cat("step", "step_time_ms"), w)
    ok = np.isfinite(grid).any(axis=1)
    step_ms = _nanmedian(grid, 1)[ok]
    ends = np.full(grid.shape, np.nan)
    ends[st_step, st_rank] = st_ts
    step_end_s = np.nanmax(np.where(np.isnan(ends), -np.inf, ends), axis=1)[ok]
    # phases: depth-0 spans, summed per step and rank, median over ranks
    sp_depth = cat("span", "depth")
    keep = sp_depth == 0 if len(sp_depth) else np.ones(0, dtype=bool)
    sp_phase = np.concatenate([np.asarray(c["phase"], dtype=object) for c in cols["span"]])[keep]
    sp_step = cat("span", "step").astype(np.int64)[keep]
    sp_rank = cat("span", "rank").astype(np.int64)[keep]
    sp_dur = cat("span", "duration_ms")[keep]
    sp_ts = (cat("span", "ts_ns")[keep] - T0_NS) / NS
    phase_ms: dict[str, np.ndarray] = {}
    for ph in PHASES:
        m = sp_phase == ph
        if m.any():
            g = _per_step(sp_step[m], sp_rank[m], sp_dur[m], w)
            g = np.vstack([g, np.full((len(ok) - len(g), w), np.nan)]) if len(g) < len(ok) else g
            phase_ms[ph] = _nanmedian(g[: len(ok)], 1)[ok]
    r0 = sp_rank == 0
    order = np.argsort(sp_ts[r0], kind="stable")
    code = {p: i for i, p in enumerate(PHASES)}
    spans0 = (
        sp_ts[r0][order],
        np.array([code.get(p, -1) for p in sp_phase[r0][order]], dtype=float),
    )
    # per rank: memory per step, the device's total from its latest GPU sample
    g_ts = (cat("gpu", "ts_ns") - T0_NS) / NS
    g_rank = cat("gpu", "rank").astype(np.int64)
    g_total = cat("gpu", "mem_total_bytes")
    peak = cat("step", "mem_peak_bytes")
    rank_steps = []
    for r in range(w):
        sm = st_rank == r
        o = np.argsort(st_ts[sm], kind="stable")
        gm = g_rank == r
        go = np.argsort(g_ts[gm], kind="stable")
        gt, gv = g_ts[gm][go], g_total[gm][go]
        ts = st_ts[sm][o]
        idx = np.searchsorted(gt, ts, side="right") - 1
        total = np.where(idx >= 0, gv[np.maximum(idx, 0)] if len(gv) else np.nan, np.nan)
        rank_steps.append({"ts_s": ts, "mem_peak_bytes": peak[sm][o], "mem_total_bytes": total})
    end_s = (end_ns - T0_NS) / NS
    windows = window_features(cols, end_s, w)
    return SimRun(
        scenario,
        seed,
        w,
        end_s,
        faults,
        min(ooms) if ooms else None,
        step_end_s,
        step_ms,
        phase_ms,
        rank_steps,
        windows,
        spans0,
        {k: sum(len(c["ts_ns"]) for c in v) for k, v in cols.items()},
        steps_per_s=len(step_ms) / max(end_s, 1e-9),
    )


WINDOW_GPU = ("sm_util_pct", "sm_clock_mhz", "power_w", "mem_used_bytes")
WINDOW_HOST = ("proc_cpu_pct", "loader_cpu_pct")
WINDOW_MIN = ("sm_util_pct", "sm_clock_mhz", "power_w")
ANOMALY_FEATURES = (
    "step_time_ms",
    "data_wait_share",
    "comm_share",
    "collective_ms",
    *WINDOW_GPU,
    *(f"{n}_min" for n in WINDOW_MIN),
    *WINDOW_HOST,
)


def window_features(
    cols: dict[str, list[dict[str, np.ndarray]]], end_s: float, world: int
) -> dict[str, np.ndarray]:
    """A job's features per complete 1-s window of event time (windows start at t0 + k s).

    The stream tier's default window metrics (`perfloop.streams.windows.DEFAULT_METRICS`)
    reduced to the job: ``step_time_ms`` (median of the window's step samples),
    ``data_wait_share`` (summed wait / summed step time), ``comm_share`` (summed comm spans /
    summed step time), ``collective_ms`` (mean all-reduce); the mean over the window and ranks
    of the GPU metrics ``WINDOW_GPU`` and host metrics ``WINDOW_HOST``, and for ``WINDOW_MIN``
    also the lowest rank's mean (``<name>_min``: a fault on one rank of many). A window with
    no sample of a kind has NaN there (a missing feature). ``steps`` counts step samples.
    """

    def cat(kind: str, name: str) -> np.ndarray:
        return np.concatenate([c[name] for c in cols.get(kind, [])] or [np.empty(0)])

    n = max(1, math.floor(end_s))  # complete windows only: a stream closes no partial one
    out: dict[str, np.ndarray] = {"t_s": np.arange(n, dtype=float)}

    def bucket(kind: str) -> np.ndarray:  # samples past the last complete window go to bin n
        return np.clip((cat(kind, "ts_ns") - T0_NS) // NS, 0, n).astype(np.int64)

    def bc(idx: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(idx, w, minlength=n + 1)[:n].astype(float)

    def ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)

    k = bucket("step")
    st = cat("step", "step_time_ms")
    out["steps"] = bc(k)
    med = np.full(n + 1, np.nan)
    if len(k):
        order = np.argsort(k, kind="stable")
        ks, vs = k[order], st[order]
        cuts = np.flatnonzero(np.diff(ks)) + 1
        for grp_k, grp_v in zip(np.split(ks, cuts), np.split(vs, cuts), strict=True):
            med[grp_k[0]] = np.median(grp_v)
    out["step_time_ms"] = med[:n]
    step_sum = bc(k, st)
    out["data_wait_share"] = ratio(bc(k, cat("step", "data_wait_ms")), step_sum)
    if cols.get("span"):
        ph = np.concatenate([np.asarray(c["phase"], dtype=object) for c in cols["span"]])
        comm = (ph == "comm") & (cat("span", "depth") == 0)
        out["comm_share"] = ratio(
            bc(bucket("span"), np.where(comm, cat("span", "duration_ms"), 0.0)), step_sum
        )
    if cols.get("collective"):
        kc = bucket("collective")
        out["collective_ms"] = ratio(bc(kc, cat("collective", "duration_ms")), bc(kc))
    for kind, names in (("gpu", WINDOW_GPU), ("host", WINDOW_HOST)):
        kk = bucket(kind)
        rr = cat(kind, "rank").astype(np.int64)
        cnt = np.zeros((n + 1, world))
        np.add.at(cnt, (kk, rr), 1.0)
        for name in names:
            v = cat(kind, name).astype(float)
            out[name] = ratio(bc(kk, v), bc(kk))
            if name in WINDOW_MIN:
                s = np.zeros((n + 1, world))
                np.add.at(s, (kk, rr), v)
                lo = np.where(cnt > 0, s / np.maximum(cnt, 1.0), np.inf).min(axis=1)[:n]
                out[f"{name}_min"] = np.where(np.isfinite(lo), lo, np.nan)
    return out


def simulate_all(args: argparse.Namespace) -> list[SimRun]:
    runs = []
    t0 = time.perf_counter()
    for sc in SCENARIOS:
        for seed in args.seed_list:
            runs.append(simulate(sc, seed, args.nodes, args.per_node, args.duration))
    say(
        f"simulated {len(runs)} runs ({len(SCENARIOS)} scenarios x {len(args.seed_list)} seeds, "
        f"{args.nodes}x{args.per_node} ranks, {args.duration:g} s each) in "
        f"{time.perf_counter() - t0:.1f} s; {np.mean([r.steps_per_s for r in runs]):.1f} "
        "steps/s of simulated time"
    )
    return runs


def _changes(r: SimRun) -> list[tuple[str, float]]:
    """Ground-truth regime changes of a run: (what, time s) — onsets and ends of the faults
    that move step time or a phase share, when they fall inside the run's steps."""
    last = float(r.step_end_s[-1]) if len(r.step_end_s) else 0.0
    out = []
    for f in r.faults:
        if f.kind not in CHANGE_KINDS:
            continue
        out.append((f"{f.kind} onset", f.onset_s))
        if f.end_s is not None:
            out.append((f"{f.kind} end", f.end_s))
    return [(w, t) for w, t in out if t < last]


def _f(x: float, digits: int, unit: str = "") -> str:
    return "—" if x is None or x != x else f"{x:.{digits}f}{unit}"
