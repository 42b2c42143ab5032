"""Accuracy and cost of perfloop's online models against simple baselines, in one run.

    python bench/models.py                  # ~1.5-2 min on 2 cores: seeds 100-104, 300-s 2x4 jobs
    python bench/models.py --quick          # ~30 s smoke run (1 seed, 120-s jobs, short torch)
    python bench/models.py --seeds 100:110 --skip-torch
    python bench/models.py --shape 1x4 --duration 600

Data. Every simulated scenario (`perfloop.producers.scenarios`: healthy, dataloader_starvation,
straggler, thermal_throttle, comm_degradation, memory_leak, mixed, hang) runs for each seed in
process (`SimulatedJob`, fixed ``t0_ns``, flat out), its messages decoded with `decode_batch`
and `decode_event`; the simulator's `GroundTruth` events are the answer key, and the OOM is
its ``oom`` ground truth (the job's failed `JobLifecycle` otherwise). The job-level series
are built with numpy: per step the median over ranks of ``step_time_ms`` and of each phase's
summed depth-0 span ``duration_ms``, in step order; per complete 1-s window of event time the
job's window features (`window_features`). The default seeds 100-104 are among the funnel's
report seeds (`perfloop.streams.evaluation.REPORT_SEEDS`); no model was tuned on them here.

1. **Step-time forecasting** — `StepTimeForecaster` (defaults) against `LastValue` and
   `Ewma` (alpha 0.2, the a-priori baseline), one step ahead: MAPE of the next step's time and
   of each phase's time over every step after the first ``SKIP`` (pooled over seeds); also the
   best EWMA alpha in hindsight on a grid 0.02-0.5 (**oracle**: chosen on the very data it is
   scored on, so no online method is promised to reach it). On the simulator the learned/EWMA
   ratio is also split into the ``CHANGE_STEPS`` steps after each ground-truth change and the
   calm rest. Hang runs are left out (their series stop at the hang). A phase whose median is
   under 1 ms (the simulator's data wait without a fault: jitter around 0.4 ms) is marked: its
   MAPE measures noise. On **real torch CPU runs** too (``--skip-torch`` leaves them out): a
   3-layer MLP (hidden ``HIDDEN``) on synthetic data trained in this process with
   ``torch.set_num_threads(1)`` (2, then 1, in the thread configuration), ``--torch-steps``
   steps or ``TORCH_LIMIT_S`` each, every phase timed with ``time.perf_counter``: data wait
   (``next()`` on the loader), forward (with the loss), backward, optimizer. Configurations: a
   loader with a costly per-sample transform and ``num_workers=0``; threads 2 → 1 half-way;
   batch size 64 → 256 half-way (half the steps, or half the time limit if that comes first);
   a loader that stalls 15 ms every 8th batch. The machine is
   shared: these series carry its noise, as a real job's do, and differ from run to run.
2. **Regime changes** — `RegimeDetector` (adwin and page_hinkley, defaults) on the per-step
   job features (step time and phase shares). Ground-truth changes are the onsets and ends of
   the faults that move step time or a share (starvation, straggler, throttle, comm
   degradation; a leak moves neither until the OOM). A detection matches a change when it
   comes at most ``--tolerance-s`` (10 s) after it; precision = matched detections / all, over
   every run (healthy and leak runs included); recall = changes with a match / changes;
   delay = steps from the change to its first match (median); false changes per hour on
   healthy runs.
3. **Window anomalies** — `WindowAnomaly` (defaults) over each job's 1-s windows, learning
   online (score, then learn), flagging at ``ALARM_SCORE`` (0.9999: the score from which the
   stream worker reports a window; about ``1 − t`` of independent Gaussian windows reach a
   threshold ``t``); a window is positive
   when it overlaps a fault interval of its run (onset to end, or to the run's end). Per fault
   kind: the faults with at least one flagged window, recall over its windows, the lag of the
   first flag; per scenario: precision of flagged windows, false flags within ``RECOVERY_S``
   after a fault ended, flags per hour (healthy runs: all false). Features: the stream tier's
   default window metrics reduced to the job (``ANOMALY_FEATURES``); one line repeats it with
   only the features the model's docstring names (``ANOMALY_CORE``).
4. **OOM warnings** — one `TimeToOOM` (defaults) per rank, fed every step of its rank
   (``ts_s``, ``mem_peak_bytes``, ``mem_total_bytes`` from the rank's latest GPU sample); a
   warning is `TimeToOOM.warning` at its documented default horizon. On memory_leak runs, the
   lead time of the first warning before the OOM (target ≥ ``OOM_LEAD_TARGET_S``); on every
   other run, the warnings raised (target 0).
5. **Phase transitions** — `PhaseTransitionForecaster` (defaults) against "the phase lasts as
   long as it did last time": MAE of the time left in the current phase, asked at its start
   and at 1/4, 1/2, 3/4 of it, once both answer. The simulator has no run-level eval or
   checkpoint phases, so the run level is **synthetic** (`_run_level`: steady ~600 s and eval
   ~30 s with jitter, a checkpoint after every 3rd eval; and a variant whose lengths drift);
   the simulator's own step-level phases (rank 0's spans) are scored too.
6. **Cross-run prediction** — `CrossRunPredictor` (defaults) over a synthetic population of
   ``--jobs`` jobs: each job's workload knobs follow a documented law (`_population`), its
   median step time and peak memory are measured by running the simulator on them; jobs arrive
   one at a time (predict, then learn). MAPE against "the median of past jobs".
7. **Cost** — every registered model (`perfloop.models.base.registered()`, after importing
   `perfloop.models` and its oom, anomaly and crossrun modules): µs per ``learn_one`` +
   answer over its registered example stream (fresh models replayed for ``ROUND_S`` a round,
   best of 3 rounds) and calls per second per core, against the target of
   ``SAMPLES_TARGET`` samples/s/core. None runs on raw samples: each call is a job's step or
   window, a rank's step, a phase change or a whole job, and stands for many raw samples
   (a 2x4 job's step summarises 56 step, span and collective samples), so the strict reading
   (a call is a sample) is shown beside the raw samples a call stands for.

Figures go to stdout, to ``bench/results/models-<time>.json`` and as one final JSON line; the
figures that miss a target or do not beat their baseline are listed at the end ("missed").
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as `python bench/models.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import raise_on_sigterm, save_result, say

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
SKIP = 20  # steps every forecaster sees before it is scored
CHANGE_STEPS = 30  # steps after a ground-truth change scored apart ("after change")
EWMA_GRID = (0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
OOM_LEAD_TARGET_S = 30.0
SAMPLES_TARGET = 50_000
TORCH_LIMIT_S = 20.0
ROUND_S = 0.1  # each cost round replays a model's stream for at least this long


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

    The stream tier's default window metrics (`perfloop.streams._extract.DEFAULT_METRICS`)
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


# -- 1. step-time forecasting -----------------------------------------------------------------
def _forecast_errors(y: np.ndarray, near: np.ndarray | None = None) -> dict[str, Any]:
    """Absolute percentage errors of each forecaster, one step ahead, on series ``y``; with
    ``near`` (steps within ``CHANGE_STEPS`` after a ground-truth change) also split there."""
    from perfloop.models import Ewma, LastValue, StepTimeForecaster

    models = {
        "last": LastValue(target="y"),
        "ewma": Ewma(target="y", alpha=0.2),
        "learned": StepTimeForecaster(target="y"),
    }
    preds = {k: np.empty(len(y)) for k in models}
    for t, v in enumerate(y):
        x = {"y": float(v)}
        for k, m in models.items():
            preds[k][t] = m.predict_one({})
            m.learn_one(x)
    grid = np.array(EWMA_GRID)
    g = np.empty((len(y), len(grid)))
    mean = np.full(len(grid), float(y[0]) if len(y) else 0.0)
    for t, v in enumerate(y):
        g[t] = mean
        mean += grid * (v - mean)
    scored = np.arange(len(y)) >= SKIP
    scored &= y > 0
    yy = y[scored]
    out: dict[str, Any] = {"n": int(scored.sum()), "sum_y": float(yy.sum())}
    for k, p in preds.items():
        e = np.abs(p[scored] - yy)
        out[k] = (float((e / yy).sum()), float(e.sum()))
    ge = np.abs(g[scored] - yy[:, None])
    out["grid"] = ((ge / yy[:, None]).sum(axis=0), ge.sum(axis=0))
    if near is not None:
        for part, mask in (("after_change", near), ("calm", ~near)):
            m = scored & mask
            out[part] = {
                "n": int(m.sum()),
                **{
                    k: float((np.abs(preds[k][m] - y[m]) / y[m]).sum()) for k in ("ewma", "learned")
                },
            }
    return out


@dataclass
class _Pool:
    """Errors pooled over the seeds of one (source, case, series)."""

    n: int = 0
    sum_y: float = 0.0
    ape: dict[str, float] = field(default_factory=dict)
    ae: dict[str, float] = field(default_factory=dict)
    grid_ape: np.ndarray = field(default_factory=lambda: np.zeros(len(EWMA_GRID)))
    grid_ae: np.ndarray = field(default_factory=lambda: np.zeros(len(EWMA_GRID)))
    median_y: list[float] = field(default_factory=list)
    split: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, e: dict[str, Any], y: np.ndarray) -> None:
        for part in ("after_change", "calm"):
            if part in e:
                acc = self.split.setdefault(part, {"n": 0, "ewma": 0.0, "learned": 0.0})
                for k in acc:
                    acc[k] += e[part][k]
        self.n += e["n"]
        self.sum_y += e["sum_y"]
        for k in ("last", "ewma", "learned"):
            self.ape[k] = self.ape.get(k, 0.0) + e[k][0]
            self.ae[k] = self.ae.get(k, 0.0) + e[k][1]
        self.grid_ape += e["grid"][0]
        self.grid_ae += e["grid"][1]
        self.median_y.append(float(np.median(y)) if len(y) else math.nan)

    def result(self) -> dict[str, Any]:
        n = max(self.n, 1)
        mape = {k: 100 * v / n for k, v in self.ape.items()}
        wape = {k: 100 * v / max(self.sum_y, 1e-12) for k, v in self.ae.items()}
        gm = 100 * self.grid_ape / n
        best = int(np.argmin(gm))
        split = {}
        for part, acc in self.split.items():
            k = max(acc["n"], 1)
            split[part] = {
                "steps": int(acc["n"]),
                "mape_pct": {"ewma": 100 * acc["ewma"] / k, "learned": 100 * acc["learned"] / k},
                "learned_over_ewma": acc["learned"] / acc["ewma"] if acc["ewma"] > 0 else math.nan,
            }
        return {
            "steps": self.n,
            "median_value": float(np.median(self.median_y)),
            "mape_pct": mape,
            "wape_pct": wape,
            "oracle_ewma_alpha": EWMA_GRID[best],
            "oracle_ewma_mape_pct": float(gm[best]),
            "ewma_grid_mape_pct": {str(a): float(v) for a, v in zip(EWMA_GRID, gm, strict=True)},
            "learned_over_ewma": mape["learned"] / mape["ewma"] if mape["ewma"] > 0 else math.nan,
            "learned_beats_ewma": mape["learned"] < mape["ewma"],
            "learned_over_oracle": mape["learned"] / gm[best] if gm[best] > 0 else math.nan,
            **split,
        }


def forecast_section(
    cases: dict[str, list[dict[str, np.ndarray]]], source: str
) -> dict[str, dict[str, Any]]:
    """``cases``: case name → one dict of series (``step_time`` and phases) per seed/run."""
    out: dict[str, dict[str, Any]] = {}
    for case, seriess in cases.items():
        pools: dict[str, _Pool] = {}
        for series in seriess:
            near = series.get("_near")
            for name, y in series.items():
                if not name.startswith("_"):
                    pools.setdefault(name, _Pool()).add(_forecast_errors(y, near), y)
        out[case] = {name: p.result() for name, p in pools.items()}
    _print_forecast(out, source)
    return out


def _print_forecast(res: dict[str, dict[str, Any]], source: str) -> None:
    say(f"\n[1] step-time forecasting, {source}: MAPE % of the next value (steps after {SKIP})")
    split = any("calm" in s.get("step_time", {}) for s in res.values())
    head = (
        f"{'case':<24}{'steps':>7}{'med ms':>8}{'last':>7}{'ewma.2':>8}{'oracle(α)':>13}"
        f"{'learned':>9}{'l/ewma':>8}  beats" + ("  l/ewma calm | after change" if split else "")
    )
    say(head)
    say("-" * len(head))
    for case, series in res.items():
        r = series.get("step_time")
        if r is None:
            continue
        m = r["mape_pct"]
        say(
            f"{case:<24}{r['steps']:>7}{r['median_value']:>8.1f}{m['last']:>7.2f}{m['ewma']:>8.2f}"
            f"{r['oracle_ewma_mape_pct']:>7.2f}({r['oracle_ewma_alpha']:<4g})"
            f"{m['learned']:>9.2f}{r['learned_over_ewma']:>8.3f}  "
            f"{'yes' if r['learned_beats_ewma'] else 'NO ':<5}"
            + (
                f"{_f(r['calm']['learned_over_ewma'], 3):>13} | "
                f"{_f(r['after_change']['learned_over_ewma'], 3)}"
                f" ({r['after_change']['steps']} steps)"
                if "calm" in r
                else ""
            )
        )
    say(
        "phases: learned/ewma MAPE ratio (learned MAPE %); '*' = the phase's median is < 1 ms,"
        " MAPE of noise"
    )
    phases = [p for p in PHASES if any(p in s for s in res.values())]
    say(f"{'case':<24}" + "".join(f"{p:>17}" for p in phases))
    for case, series in res.items():
        cells = []
        for p in phases:
            r = series.get(p)
            if r is None:
                cells.append(f"{'—':>17}")
                continue
            mark = "*" if r["median_value"] < 1.0 else " "
            flag = "" if r["learned_beats_ewma"] else "!"
            cells.append(
                f"{r['learned_over_ewma']:>7.3f}{flag:1}({r['mape_pct']['learned']:6.1f}){mark}"
            )
        say(f"{case:<24}" + "".join(cells))
    say("  '!' = learned not below EWMA(0.2)")


def sim_forecast_cases(runs: Sequence[SimRun]) -> dict[str, list[dict[str, np.ndarray]]]:
    cases: dict[str, list[dict[str, np.ndarray]]] = {}
    for r in runs:
        if r.scenario not in FORECAST_SCENARIOS:
            continue
        near = np.zeros(len(r.step_ms), dtype=bool)
        for _, t in _changes(r):
            i = int(np.searchsorted(r.step_end_s, t))
            near[i : i + CHANGE_STEPS] = True
        cases.setdefault(r.scenario, []).append(
            {"step_time": r.step_ms, **r.phase_ms, "_near": near}
        )
    return cases


# -- 1b. real torch CPU runs ------------------------------------------------------------------
def _torch_run(config: str, steps: int, limit_s: float) -> dict[str, np.ndarray]:
    """Train a 3-layer MLP on synthetic data in this process; each step's phases, ms."""
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, Dataset

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if config == "threads_2_to_1" else 1)

    class Data(Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int, transform_rounds: int, stall_every: int) -> None:
            g = torch.Generator().manual_seed(1)
            self.x = torch.randn(n, 784, generator=g)
            self.y = torch.randint(0, 10, (n,), generator=g)
            self.rounds, self.stall_every = transform_rounds, stall_every
            self.batch = 64

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            v = self.x[i]
            if self.stall_every and i % (self.batch * self.stall_every) == 0:
                time.sleep(0.015)  # a slow shard: one batch in `stall_every` waits on storage
            if self.rounds:
                a = v.numpy()
                for _ in range(self.rounds):  # a costly augmentation, in the main process
                    a = np.tanh(a * 1.01) + 0.001 * np.roll(a, 1)
                v = torch.from_numpy(a.astype(np.float32))
            return v, self.y[i]

    rounds = 12 if config == "slow_loader" else 0
    stall = 8 if config == "periodic_stall" else 0
    data = Data(256 * steps + 4096, rounds, stall)
    model = nn.Sequential(
        nn.Linear(784, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def loader(bs: int) -> Iterator[Any]:
        data.batch = bs
        return iter(DataLoader(data, batch_size=bs, shuffle=False, num_workers=0))

    it = loader(64)
    out = {k: np.empty(steps) for k in ("step_time", *[p for p in PHASES if p != "comm"])}
    t_start = time.perf_counter()
    n = 0
    switched, switch_at = False, -1
    for i in range(steps):
        # the change half-way: at half the steps, or half the time limit on a slow machine
        if not switched and (i >= steps // 2 or time.perf_counter() - t_start > limit_s / 2):
            switched, switch_at = True, i
            if config == "threads_2_to_1":
                torch.set_num_threads(1)
            if config == "batch_64_to_256":
                it = loader(256)
        t0 = time.perf_counter()
        xb, yb = next(it)
        t1 = time.perf_counter()
        loss = loss_fn(model(xb), yb)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        for k, v in (
            ("step_time", t4 - t0),
            ("data_wait", t1 - t0),
            ("forward", t2 - t1),
            ("backward", t3 - t2),
            ("optimizer", t4 - t3),
        ):
            out[k][i] = v * 1000
        n = i + 1
        if t4 - t_start > limit_s:
            break
    torch.set_num_threads(threads)
    return {k: v[:n] for k, v in out.items()} | {"_switch": np.array([switch_at])}


HIDDEN = 1536
TORCH_CONFIGS = ("slow_loader", "threads_2_to_1", "batch_64_to_256", "periodic_stall")


def torch_section(args: argparse.Namespace) -> dict[str, Any]:
    cases: dict[str, list[dict[str, np.ndarray]]] = {}
    info: dict[str, Any] = {}
    for cfg in TORCH_CONFIGS:
        t = time.perf_counter()
        series = _torch_run(cfg, args.torch_steps, TORCH_LIMIT_S)
        wall = time.perf_counter() - t
        switch_at = int(series.pop("_switch")[0])
        y = series["step_time"]
        n = len(y)
        # one-off stalls (the shared machine, the allocator): > 3x the median of the 20 before
        spikes = [i for i in range(20, n) if y[i] > 3 * np.median(y[i - 20 : i])]
        info[cfg] = {
            "steps": n,
            "wall_s": wall,
            "median_step_ms": float(np.median(y)),
            "max_step_ms": float(y.max()),
            "change_at_step": switch_at if cfg in ("threads_2_to_1", "batch_64_to_256") else None,
            "spikes_over_3x": spikes,
            "step_time_ms": [round(float(v), 3) for v in y],  # to re-score or inspect later
        }
        change = info[cfg]["change_at_step"]
        say(
            f"torch {cfg}: {n} steps in {wall:.1f} s"
            + (f" (change at step {change})" if change is not None else "")
            + f", median step {np.median(y):.1f} ms (max "
            f"{y.max():.1f}), data wait {np.median(series['data_wait']):.1f} ms; one-off "
            f"stalls > 3x the last 20 steps' median: {len(spikes)}"
            + (f" (steps {', '.join(map(str, spikes[:8]))})" if spikes else "")
        )
        cases[cfg] = [series]
    res = forecast_section(
        cases,
        f"real torch CPU runs (3-layer MLP, hidden {HIDDEN}, 1 thread; 2 → 1 in threads_2_to_1)",
    )
    return {"runs": info, "forecast": res}


# -- 2. regime changes ------------------------------------------------------------------------
def _step_features(r: SimRun) -> list[dict[str, float]]:
    st = r.step_ms
    feats = []
    cols = {f"{p}_share": r.phase_ms[p] / st for p in PHASES if p in r.phase_ms}
    for i in range(len(st)):
        x = {"step_time_ms": float(st[i])}
        for k, v in cols.items():
            x[k] = float(v[i])
        feats.append(x)
    return feats


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


def regime_section(runs: Sequence[SimRun], tol_s: float) -> dict[str, Any]:
    from perfloop.models import RegimeDetector

    res: dict[str, Any] = {}
    say(
        f"\n[2] regime changes (RegimeDetector, defaults): a detection matches a change at most "
        f"{tol_s:g} s after it"
    )
    head = (
        f"{'method':<14}{'changes':>8}{'found':>7}{'recall':>8}{'detect':>8}{'prec':>7}"
        f"{'delay p50':>11}{'healthy h':>11}{'false/h':>9}"
    )
    say(head)
    say("-" * len(head))
    for method in ("adwin", "page_hinkley"):
        changes = found = detections = matched = 0
        delays: list[int] = []
        healthy_h = healthy_false = 0.0
        per_kind: dict[str, list[int]] = {}
        per_scenario: dict[str, dict[str, int]] = {}
        t_model = 0.0
        n_steps = 0
        for r in runs:
            if r.scenario not in FORECAST_SCENARIOS or not len(r.step_ms):
                continue
            det = RegimeDetector(method=method)
            hits: list[int] = []
            t = time.perf_counter()
            for i, x in enumerate(_step_features(r)):
                det.learn_one(x)
                if det.score_one(x) >= 1.0:
                    hits.append(i)
            t_model += time.perf_counter() - t
            n_steps += len(r.step_ms)
            cps = _changes(r)
            hit_t = [float(r.step_end_s[i]) for i in hits]
            ok = [any(c <= h <= c + tol_s for _, c in cps) for h in hit_t]
            detections += len(hits)
            matched += sum(ok)
            sc = per_scenario.setdefault(r.scenario, {"changes": 0, "found": 0, "detections": 0})
            sc["detections"] += len(hits)
            for what, c in cps:
                changes += 1
                sc["changes"] += 1
                first = [i for i, h in zip(hits, hit_t, strict=True) if c <= h <= c + tol_s]
                kind = what.split()[0] + (" end" if what.endswith("end") else " onset")
                per_kind.setdefault(kind, [0, 0])[0] += 1
                if first:
                    found += 1
                    sc["found"] += 1
                    per_kind[kind][1] += 1
                    step_c = int(np.searchsorted(r.step_end_s, c, side="left"))
                    delays.append(first[0] - step_c)
            if r.scenario == "healthy":
                healthy_h += r.end_s / 3600
                healthy_false += len(hits)
        out = {
            "changes": changes,
            "found": found,
            "recall": found / changes if changes else math.nan,
            "detections": detections,
            "matched": matched,
            "precision": matched / detections if detections else math.nan,
            "delay_steps_median": float(np.median(delays)) if delays else math.nan,
            "delay_steps_p90": float(np.quantile(delays, 0.9)) if delays else math.nan,
            "healthy_hours": healthy_h,
            "healthy_false_changes": healthy_false,
            "false_per_hour_healthy": healthy_false / healthy_h if healthy_h else math.nan,
            "per_change_kind": {k: {"changes": v[0], "found": v[1]} for k, v in per_kind.items()},
            "per_scenario": per_scenario,
            "us_per_step": t_model / max(n_steps, 1) * 1e6,
        }
        res[method] = out
        say(
            f"{method:<14}{changes:>8}{found:>7}{_f(out['recall'], 3):>8}{detections:>8}"
            f"{_f(out['precision'], 3):>7}{_f(out['delay_steps_median'], 0):>11}"
            f"{healthy_h:>11.2f}{_f(out['false_per_hour_healthy'], 1):>9}"
        )
    for method, out in res.items():
        say(
            f"  {method}: found/changes by kind: "
            + ", ".join(
                f"{k} {v['found']}/{v['changes']}" for k, v in out["per_change_kind"].items()
            )
        )
        say(
            f"  {method}: detections by scenario: "
            + ", ".join(f"{k} {v['detections']}" for k, v in out["per_scenario"].items())
        )
    return res


def _f(x: float, digits: int, unit: str = "") -> str:
    return "—" if x is None or x != x else f"{x:.{digits}f}{unit}"


# -- 4. OOM warnings --------------------------------------------------------------------------
def oom_section(runs: Sequence[SimRun]) -> dict[str, Any]:
    import inspect

    from perfloop.models.oom import TimeToOOM

    horizon = inspect.signature(TimeToOOM.warning).parameters["horizon_s"].default
    say(
        f"\n[4] OOM warnings (TimeToOOM per rank, defaults; warning at its default horizon "
        f"{horizon:g} s): lead time on memory_leak runs (target ≥ {OOM_LEAD_TARGET_S:g} s), "
        "warnings elsewhere (target 0)"
    )
    leaks: list[dict[str, Any]] = []
    others: dict[str, dict[str, Any]] = {}
    t_model = 0.0
    calls = 0
    for r in runs:
        first_warn = math.inf
        episodes = 0
        warned_steps = 0
        for rs in r.rank_steps:
            m = TimeToOOM()
            on = False
            ts, peak, total = rs["ts_s"], rs["mem_peak_bytes"], rs["mem_total_bytes"]
            t = time.perf_counter()
            for i in range(len(ts)):
                x = {
                    "ts_s": float(ts[i]),
                    "mem_peak_bytes": float(peak[i]),
                    "mem_total_bytes": float(total[i]),
                }
                m.learn_one(x)
                w = m.warning(x)
                if w:
                    warned_steps += 1
                    first_warn = min(first_warn, float(ts[i]))
                    if not on:
                        episodes += 1
                on = w
            t_model += time.perf_counter() - t
            calls += len(ts)
        if r.scenario == "memory_leak":
            leak = next((f for f in r.faults if f.kind == "memory_leak"), None)
            lead = (r.oom_s - first_warn) if r.oom_s is not None else math.nan
            leaks.append(
                {
                    "seed": r.seed,
                    "leak_onset_s": leak.onset_s if leak else math.nan,
                    "oom_s": r.oom_s,
                    "first_warning_s": first_warn if math.isfinite(first_warn) else None,
                    "lead_s": lead if math.isfinite(lead) else None,
                    "after_onset_s": (first_warn - leak.onset_s)
                    if leak and math.isfinite(first_warn)
                    else None,
                    "meets_target": bool(math.isfinite(lead) and lead >= OOM_LEAD_TARGET_S),
                    "warning_episodes": episodes,
                }
            )
        else:
            o = others.setdefault(r.scenario, {"runs": 0, "warning_episodes": 0, "warned_steps": 0})
            o["runs"] += 1
            o["warning_episodes"] += episodes
            o["warned_steps"] += warned_steps
    say(
        f"{'seed':>6}{'leak at':>9}{'OOM at':>9}{'1st warn':>10}{'lead s':>8}"
        f"{'after onset':>13}  ≥target"
    )
    for e in leaks:
        say(
            f"{e['seed']:>6}{e['leak_onset_s']:>9.1f}{_f(e['oom_s'], 1):>9}"
            f"{_f(e['first_warning_s'], 1):>10}{_f(e['lead_s'], 1):>8}"
            f"{_f(e['after_onset_s'], 1):>13}"
            f"  {'yes' if e['meets_target'] else 'NO'}"
        )
    say(
        "warnings on other runs (episodes, summed over ranks): "
        + ", ".join(f"{k} {v['warning_episodes']} in {v['runs']} runs" for k, v in others.items())
    )
    total_false = sum(v["warning_episodes"] for v in others.values())
    return {
        "horizon_s": horizon,
        "lead_target_s": OOM_LEAD_TARGET_S,
        "leak_runs": leaks,
        "leads_meeting_target": sum(e["meets_target"] for e in leaks),
        "other_runs": others,
        "false_warning_episodes": total_false,
        "us_per_step": t_model / max(calls, 1) * 1e6,
    }


# -- 5. phase transitions ---------------------------------------------------------------------
class _LastLength:
    """Baseline: the current phase lasts as long as it did last time."""

    def __init__(self) -> None:
        self.length: dict[int, float] = {}
        self.cur: int | None = None
        self.since = 0.0

    def learn_one(self, x: dict[str, float]) -> None:
        t, code = x["ts_s"], int(x["phase"])
        if self.cur is not None:
            self.length[self.cur] = t - self.since
        self.cur, self.since = code, t

    def predict_one(self, x: dict[str, float]) -> float:
        m = self.length.get(self.cur) if self.cur is not None else None
        return math.inf if m is None else max(0.0, self.since + m - x["ts_s"])


def _run_level(seed: int, drift: bool, cycles: int = 40) -> list[tuple[float, int]]:
    """Synthetic run-level phases: steady (1) ~600 ± 20 s, eval (2) ~30 ± 2 s, a checkpoint (3)
    of ~20 ± 3 s after every 3rd eval; with ``drift`` steady grows 1 % and eval 2 % a cycle."""
    rng = np.random.default_rng([seed, 5])
    t, out = 0.0, []
    for c in range(cycles):
        g_s, g_e = (1 + 0.01 * c, 1 + 0.02 * c) if drift else (1.0, 1.0)
        out.append((t, 1))
        t += float(600 * g_s + rng.normal(0, 20))
        out.append((t, 2))
        t += float(30 * g_e + rng.normal(0, 2))
        if c % 3 == 2:
            out.append((t, 3))
            t += float(20 + rng.normal(0, 3))
    out.append((t, 1))
    return out


def _phase_errors(events: Sequence[tuple[float, int]]) -> dict[str, list[float]]:
    from perfloop.models import PhaseTransitionForecaster

    f, base = PhaseTransitionForecaster(), _LastLength()
    err: dict[str, list[float]] = {"learned": [], "last_length": []}
    for (t, code), (t_next, _) in itertools.pairwise(events):
        x = {"ts_s": t, "phase": float(code)}
        f.learn_one(x)
        base.learn_one(x)
        for u in (0.0, 0.25, 0.5, 0.75):
            now = {"ts_s": t + u * (t_next - t)}
            a, b = f.predict_one(now), base.predict_one(now)
            if math.isfinite(a) and math.isfinite(b):
                truth = t_next - now["ts_s"]
                err["learned"].append(abs(a - truth))
                err["last_length"].append(abs(b - truth))
    return err


def phase_section(runs: Sequence[SimRun], seeds: Sequence[int]) -> dict[str, Any]:
    say(
        "\n[5] phase transitions (PhaseTransitionForecaster, defaults) vs 'lasts as long as "
        "last time': MAE of the time left, asked at 0, 1/4, 1/2, 3/4 of each phase"
    )
    cases: dict[str, tuple[list[list[tuple[float, int]]], str, float]] = {
        "synthetic run-level, jittered": ([_run_level(s, False) for s in seeds], "s", 1.0),
        "synthetic run-level, drifting": ([_run_level(s, True) for s in seeds], "s", 1.0),
    }
    for sc in ("healthy", "mixed"):
        evs = []
        for r in runs:
            if r.scenario == sc and len(r.spans0[0]):
                ts, codes = r.spans0
                evs.append([(float(a), int(b)) for a, b in zip(ts, codes, strict=True)])
        if evs:
            cases[f"simulator step-level, {sc}"] = (evs, "ms", 1000.0)
    say(f"{'case':<34}{'asks':>8}{'learned':>11}{'last len':>11}{'ratio':>8}  beats")
    out: dict[str, Any] = {}
    for case, (evss, unit, scale) in cases.items():
        errs: dict[str, list[float]] = {"learned": [], "last_length": []}
        for evs in evss:
            for k, v in _phase_errors(evs).items():
                errs[k].extend(v)
        mae = {k: float(np.mean(v)) * scale if v else math.nan for k, v in errs.items()}
        ratio = mae["learned"] / mae["last_length"] if mae["last_length"] > 0 else math.nan
        out[case] = {
            "unit": unit,
            "asks": len(errs["learned"]),
            "mae": mae,
            "learned_over_baseline": ratio,
            "learned_beats_baseline": mae["learned"] < mae["last_length"],
        }
        say(
            f"{case:<34}{len(errs['learned']):>8}{mae['learned']:>9.2f}{unit:>2}"
            f"{mae['last_length']:>9.2f}{unit:>2}{ratio:>8.3f}  "
            f"{'yes' if out[case]['learned_beats_baseline'] else 'NO'}"
        )
    return out


# -- 7. cost ----------------------------------------------------------------------------------
INPUTS = {
    "StepTimeForecaster": "job step",
    "LagRegressionForecaster": "job step",
    "Ewma": "job step",
    "LastValue": "job step",
    "RegimeDetector": "job step",
    "PhaseTransitionForecaster": "phase change",
    "TimeToOOM": "rank step",
    "WindowAnomaly": "job window",
    "CrossRunPredictor": "job",
    "GradientNoiseScale": "job step",
}
"""What one call of each model stands for (none runs on raw samples)."""


def raw_per_call(runs: Sequence[SimRun]) -> dict[str, float]:
    """Raw telemetry samples one call stands for, on the healthy simulated runs."""
    h = [r for r in runs if r.scenario == "healthy"] or list(runs)
    steps = sum(len(r.step_ms) for r in h)
    all_samples = sum(sum(r.samples.values()) for r in h)
    per_step = sum(r.samples.get(k, 0) for r in h for k in ("step", "span", "collective"))
    windows = sum(len(r.windows["t_s"]) for r in h)
    ranks = h[0].world if h else 1
    return {
        "job step": per_step / max(steps, 1),
        "rank step": all_samples / max(steps * ranks, 1),
        "job window": all_samples / max(windows, 1),
        "phase change": 1.0,  # a span (step level); a run-level change stands for far more
    }


def cost_section(runs: Sequence[SimRun], repeats: int = 3) -> dict[str, Any]:
    from perfloop.models.base import registered
    from perfloop.models.checks import answer

    per_call = raw_per_call(runs)
    say(
        f"\n[7] cost per learn_one + answer on each registered model's example stream (fresh "
        f"models replayed for {ROUND_S:g} s a round), best of {repeats} rounds; target "
        f"{SAMPLES_TARGET:,} samples/s/core"
    )
    head = (
        f"{'model':<27}{'items':>6}{'µs/call':>9}{'calls/s':>10}{'input':>14}{'raw/call':>10}"
        f"{'raw samples/s':>15}  ≥target(calls | raw)"
    )
    say(head)
    say("-" * len(head))
    out: dict[str, Any] = {}
    for name, reg in sorted(registered().items()):
        items = list(reg.stream(0))
        best = math.inf
        for _ in range(repeats):  # a round: fresh models over the stream for >= ROUND_S
            spent, passes = 0.0, 0
            while spent < ROUND_S or not passes:
                model = reg.example()
                t = time.perf_counter()
                for x, y in items:
                    answer(model, x)
                    model.learn_one(x, y)
                spent += time.perf_counter() - t
                passes += 1
            best = min(best, spent / passes)
        us = best / len(items) * 1e6
        calls = 1e6 / us
        inp = INPUTS.get(name, "?")
        raw = per_call.get(inp, math.nan)
        out[name] = {
            "items": len(items),
            "us_per_call": us,
            "calls_per_s_core": calls,
            "input": inp,
            "raw_samples_per_call": raw,
            "raw_samples_per_s_core": calls * raw if raw == raw else None,
            "meets_target_per_call": calls >= SAMPLES_TARGET,
            "meets_target_raw": bool(raw == raw and calls * raw >= SAMPLES_TARGET),
        }
        say(
            f"{name:<27}{len(items):>6}{us:>9.2f}{calls:>10,.0f}{inp:>14}{_f(raw, 1):>10}"
            f"{(f'{calls * raw:,.0f}' if raw == raw else '—'):>15}  "
            f"{'yes' if calls >= SAMPLES_TARGET else 'NO'} | "
            f"{('yes' if out[name]['meets_target_raw'] else 'NO') if raw == raw else '—'}"
        )
    say(
        "  raw/call: raw samples one call stands for in the healthy simulated jobs ("
        + ", ".join(f"{k} {v:.1f}" for k, v in per_call.items())
        + "); a CrossRunPredictor call is one whole job"
    )
    return {"raw_samples_per_call": per_call, "models": out}


# -- 3. window anomalies ----------------------------------------------------------------------
ANOMALY_CORE = ("step_time_ms", "data_wait_share", "comm_share", "sm_util_pct", "power_w")
RECOVERY_S = 10.0  # flags this soon after a fault's end are counted apart (the return to normal)


def _anomaly_runs(
    runs: Sequence[SimRun], features: Sequence[str], thr: float
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], float]:
    """Score every run's windows with a fresh `WindowAnomaly`: per fault kind and per
    scenario counts, and µs per window (score + learn)."""
    from perfloop.models.anomaly import WindowAnomaly

    kinds: dict[str, dict[str, Any]] = {}
    scen: dict[str, dict[str, Any]] = {}
    t_model = 0.0
    calls = 0
    for r in runs:
        w = r.windows
        n = len(w["t_s"])
        feats = {f: w[f] for f in features if f in w}
        m = WindowAnomaly()
        flags = np.zeros(n, dtype=bool)
        t = time.perf_counter()
        for i in range(n):
            x = {f: float(v[i]) for f, v in feats.items() if v[i] == v[i]}
            flags[i] = m.score_one(x) >= thr
            m.learn_one(x)
        t_model += time.perf_counter() - t
        calls += n
        t0, t1 = w["t_s"], w["t_s"] + 1.0
        positive = np.zeros(n, dtype=bool)
        recovery = np.zeros(n, dtype=bool)
        for f in r.faults:
            end = r.end_s if f.end_s is None else f.end_s
            on = (t0 < end) & (t1 > f.onset_s)
            positive |= on
            if f.end_s is not None:
                recovery |= (t0 >= f.end_s) & (t0 < f.end_s + RECOVERY_S)
            k = kinds.setdefault(
                f.kind, dict.fromkeys(("faults", "detected", "windows", "flagged", "warm"), 0)
            )
            k.setdefault("lags_s", [])
            k["faults"] += 1
            k["warm"] += int(f.onset_s < m.warmup)  # onset while the scorer still warms up
            k["windows"] += int(on.sum())
            k["flagged"] += int((on & flags).sum())
            hit = np.flatnonzero(on & flags)
            if len(hit):
                k["detected"] += 1
                k["lags_s"].append(max(0.0, float(t0[hit[0]]) - f.onset_s))
        recovery &= ~positive
        sc = scen.setdefault(
            r.scenario,
            dict.fromkeys(("runs", "windows", "flagged", "flagged_true", "flagged_recovery"), 0)
            | {"hours": 0.0},
        )
        sc["runs"] += 1
        sc["windows"] += n
        sc["flagged"] += int(flags.sum())
        sc["flagged_true"] += int((flags & positive).sum())
        sc["flagged_recovery"] += int((flags & recovery).sum())
        sc["hours"] += n / 3600
    out_k = {
        kind: {
            "faults": k["faults"],
            "detected": k["detected"],
            "windows": k["windows"],
            "window_recall": k["flagged"] / k["windows"] if k["windows"] else math.nan,
            "lag_s_median": float(np.median(k["lags_s"])) if k["lags_s"] else math.nan,
            "onset_in_warmup": k["warm"],
        }
        for kind, k in kinds.items()
    }
    out_s = {
        name: {
            **sc,
            "precision": sc["flagged_true"] / sc["flagged"] if sc["flagged"] else math.nan,
            "flags_per_hour": sc["flagged"] / sc["hours"] if sc["hours"] else math.nan,
        }
        for name, sc in scen.items()
    }
    return out_k, out_s, t_model / max(calls, 1) * 1e6


def anomaly_section(runs: Sequence[SimRun]) -> dict[str, Any]:
    from perfloop.models.anomaly import ALARM_SCORE

    # The score from which a window is reported (the stream worker's default threshold).
    thr = ALARM_SCORE
    say(
        f"\n[3] window anomalies (WindowAnomaly, defaults; flag at score ≥ ALARM_SCORE {thr:g}) "
        "on 1-s job "
        f"windows; labels: the fault intervals. Features: the stream's default window metrics "
        f"reduced to the job ({len(ANOMALY_FEATURES)}: {', '.join(ANOMALY_FEATURES)})"
    )
    kinds, scen, us = _anomaly_runs(runs, ANOMALY_FEATURES, thr)
    say(
        f"{'fault kind':<24}{'faults':>7}{'found':>7}{'win recall':>12}{'lag p50 s':>11}"
        f"{'onset in warm-up':>18}"
    )
    for kind, o in kinds.items():
        say(
            f"{kind:<24}{o['faults']:>7}{o['detected']:>7}{_f(o['window_recall'], 3):>12}"
            f"{_f(o['lag_s_median'], 1):>11}{o['onset_in_warmup']:>18}"
        )
    say(
        f"{'scenario':<24}{'windows':>8}{'flagged':>8}{'precision':>11}{'after end':>11}"
        f"{'flags/h':>9}"
    )
    for name, sc in scen.items():
        say(
            f"{name:<24}{int(sc['windows']):>8}{int(sc['flagged']):>8}{_f(sc['precision'], 3):>11}"
            f"{int(sc['flagged_recovery']):>11}{sc['flags_per_hour']:>9.1f}"
        )
    flagged = sum(s["flagged"] for s in scen.values())
    true = sum(s["flagged_true"] for s in scen.values())
    overall = true / flagged if flagged else math.nan
    say(
        f"  precision over every run {_f(overall, 3)} ({int(true)}/{int(flagged)} flagged windows"
        f" inside a fault); 'after end': false flags within {RECOVERY_S:g} s after a fault ended"
    )
    # the same with only the features WindowAnomaly's docstring names (fewer, less correlated)
    k5, s5, _ = _anomaly_runs(runs, ANOMALY_CORE, thr)
    f5 = sum(s["flagged"] for s in s5.values())
    t5 = sum(s["flagged_true"] for s in s5.values())
    h5 = s5.get("healthy", {})
    say(
        f"  with only {', '.join(ANOMALY_CORE)}: found "
        + ", ".join(f"{k} {o['detected']}/{o['faults']}" for k, o in k5.items())
        + f"; precision {_f(t5 / f5 if f5 else math.nan, 3)}; healthy "
        f"{int(h5.get('flagged', 0))} flags ({_f(h5.get('flags_per_hour', math.nan), 1)}/h)"
    )
    return {
        "threshold": thr,
        "features": list(ANOMALY_FEATURES),
        "per_kind": kinds,
        "per_scenario": scen,
        "precision": overall,
        "us_per_window": us,
        "core_features": {
            "features": list(ANOMALY_CORE),
            "per_kind": k5,
            "per_scenario": s5,
            "precision": t5 / f5 if f5 else math.nan,
        },
    }


# -- 6. cross-run prediction ------------------------------------------------------------------
GPUS = ((989e12, 81559 << 20, "NVIDIA H100 80GB HBM3"), (312e12, 81920 << 20, "NVIDIA A100 80GB"))


def _population(n: int, seed: int) -> Iterator[tuple[dict[str, float], dict[str, Any]]]:
    """Synthetic jobs: (features known at start, `SimConfig` workload overrides).

    The law (documented, not measured): a transformer of ``params`` P = 10^U(8, 9.4) with
    hidden size h = (128 P / 12)^(1/3) and L = h / 128 layers; batch B in 8..64, sequence T in
    256..2048; world = nodes (1, 2, 4) x ranks per node (2, 4, 8); one of two GPUs (peak bf16
    989 or 312 TFLOP/s). forward = 2 P B T / (peak x MFU), MFU ~ 0.4 x lognormal(0, 0.15) per
    job (what no feature tells); backward = 2 x forward; optimizer = 16 P bytes at 2 TB/s;
    loading 3 ms x lognormal(0, 0.3) per sample, on ``num_workers`` in 0..8 workers;
    activations 34 h L B T bytes x lognormal(0, 0.05). Jobs whose weights, optimizer state and
    activations would not fit in 90 % of the GPU are drawn again (they would not be run).
    The simulator then adds the all-reduce (ring over NVLink or the network), the loader's wait,
    jitter, and reports step time and peak memory.
    """
    rng = np.random.default_rng([seed, 0xC805])
    made = 0
    while made < n:
        p = float(10 ** rng.uniform(8, 9.4))
        b = int(2 ** rng.integers(3, 7))
        t = int(2 ** rng.integers(8, 12))
        nodes = int(2 ** rng.integers(0, 3))
        per_node = int(2 ** rng.integers(1, 4))
        workers = int(rng.choice([0, 1, 2, 4, 8]))
        peak, mem, gpu = GPUS[int(rng.integers(0, len(GPUS)))]
        h = (128 * p / 12) ** (1 / 3)
        layers = max(1.0, h / 128)
        act = 34 * h * layers * b * t * float(rng.lognormal(0, 0.05))
        if 16 * p + act + (2 << 30) > 0.9 * mem:
            continue
        fwd = 2 * p * b * t / (peak * 0.4 * float(rng.lognormal(0, 0.15))) * 1000
        feats = {
            "params": p,
            "world": float(nodes * per_node),
            "nodes": float(nodes),
            "batch_size": float(b),
            "seq_len": float(t),
            "num_workers": float(workers),
            "gpu_peak_flops": peak,
            "gpu_memory_bytes": float(mem),
            "precision_bits": 16.0,
        }
        knobs = {
            "nodes": nodes,
            "ranks_per_node": per_node,
            "model_params": int(p),
            "batch_size": b,
            "tokens_per_sample": t,
            "forward_ms": fwd,
            "backward_ms": 2 * fwd,
            "optimizer_ms": 16 * p / 2e12 * 1000,
            "load_ms": 3.0 * b * float(rng.lognormal(0, 0.3)),
            "num_workers": workers,
            "activation_bytes": int(act),
            "gpu_name": gpu,
            "gpu_mem_bytes": int(mem),
        }
        made += 1
        yield feats, knobs


def _measure_job(i: int, knobs: dict[str, Any], steps: int) -> tuple[float, float]:
    """Run the simulator on a job's knobs for ``steps`` steps: (median step ms, peak bytes)."""
    from perfloop.producers.simulator import SimConfig, SimulatedJob
    from perfloop.schemas.codec import decode_batch

    cfg = SimConfig(
        job_id=f"bench-models-pop-{i}",
        t0_ns=T0_NS,
        speed=1e9,
        seed=i,
        gpu_interval_ms=1000.0,
        host_interval_ms=10000.0,
        **knobs,
    )
    sink = _Collect()
    SimulatedJob(cfg, sink).run(steps * cfg.nominal_step_ms / 1000)
    st, rk, ms, pk = [], [], [], []
    for topic, value in sink.msgs:
        if topic.endswith(".step"):
            c = decode_batch(value).columns
            st.append(c["step"])
            rk.append(c["rank"])
            ms.append(c["step_time_ms"])
            pk.append(c["mem_peak_bytes"])
    grid = _per_step(
        np.concatenate(st).astype(np.int64),
        np.concatenate(rk).astype(np.int64),
        np.concatenate(ms),
        cfg.world,
    )
    return float(np.median(_nanmedian(grid, 1))), float(np.concatenate(pk).max())


def crossrun_section(args: argparse.Namespace, warm: int = 10) -> dict[str, Any]:
    from perfloop.models.crossrun import CrossRunPredictor

    t0 = time.perf_counter()
    jobs = []
    for i, (feats, knobs) in enumerate(_population(args.jobs, args.seed_list[0])):
        step_ms, peak = _measure_job(i, knobs, steps=24)
        jobs.append((feats, {"step_time_ms": step_ms, "mem_peak_bytes": peak}))
    sim_s = time.perf_counter() - t0
    say(
        f"\n[6] cross-run prediction (CrossRunPredictor, defaults) on {len(jobs)} synthetic jobs "
        f"(simulated in {sim_s:.1f} s; law in `_population`): jobs arrive one at a time, "
        f"scored after the first {warm}"
    )
    say(
        f"{'target':<16}{'jobs':>6}{'learned MAPE':>14}{'past median':>13}{'ratio':>8}"
        f"{'learned p50 APE':>17}{'past p50 APE':>14}  beats"
    )
    out: dict[str, Any] = {"jobs": len(jobs), "warm": warm, "simulate_s": sim_s}
    for target in ("step_time_ms", "mem_peak_bytes"):
        m = CrossRunPredictor(target=target)
        past: list[float] = []
        ape_m: list[float] = []
        ape_b: list[float] = []
        for feats, ys in jobs:
            y = ys[target]
            if len(past) >= warm:
                ape_m.append(abs(m.predict_one(feats) - y) / y)
                ape_b.append(abs(float(np.median(past)) - y) / y)
            m.learn_one(feats, y)
            past.append(y)
        r = {
            "scored": len(ape_m),
            "mape_pct": 100 * float(np.mean(ape_m)),
            "baseline_mape_pct": 100 * float(np.mean(ape_b)),
            "median_ape_pct": 100 * float(np.median(ape_m)),
            "baseline_median_ape_pct": 100 * float(np.median(ape_b)),
        }
        r["learned_over_baseline"] = r["mape_pct"] / r["baseline_mape_pct"]
        r["learned_beats_baseline"] = r["mape_pct"] < r["baseline_mape_pct"]
        out[target] = r
        say(
            f"{target:<16}{r['scored']:>6}{r['mape_pct']:>13.1f}%{r['baseline_mape_pct']:>12.1f}%"
            f"{r['learned_over_baseline']:>8.3f}{r['median_ape_pct']:>16.1f}%"
            f"{r['baseline_median_ape_pct']:>13.1f}%  "
            f"{'yes' if r['learned_beats_baseline'] else 'NO'}"
        )
    return out


def misses(doc: dict[str, Any]) -> list[str]:
    """Every figure that misses its target or does not beat its baseline, in words."""
    out = []
    for src in ("forecast_sim", "forecast_torch"):
        res = doc.get(src, {})
        res = res.get("forecast", res) if src == "forecast_torch" else res
        for case, series in res.items():
            for name, r in series.items():
                if r["learned_beats_ewma"]:
                    continue
                noise = " (median < 1 ms: noise)" if r["median_value"] < 1.0 else ""
                out.append(
                    f"StepTimeForecaster {src.split('_')[1]} {case} {name}: MAPE "
                    f"{r['mape_pct']['learned']:.2f} % vs EWMA(0.2) {r['mape_pct']['ewma']:.2f} %"
                    f"{noise}"
                )
    for method, r in doc.get("regime", {}).items():
        if r["healthy_false_changes"]:
            out.append(
                f"RegimeDetector {method}: {r['healthy_false_changes']:g} changes on healthy runs"
                f" ({r['false_per_hour_healthy']:.1f}/h)"
            )
    an = doc.get("anomaly", {})
    for kind, k in an.get("per_kind", {}).items():
        if k["detected"] < k["faults"]:
            out.append(
                f"WindowAnomaly {kind}: {k['faults'] - k['detected']} of {k['faults']} faults "
                "with no flagged window"
            )
    h = an.get("per_scenario", {}).get("healthy")
    if h and h["flagged"]:
        out.append(
            f"WindowAnomaly: {int(h['flagged'])} flagged windows on healthy runs "
            f"({h['flags_per_hour']:.1f}/h)"
        )
    oom = doc.get("oom", {})
    for e in oom.get("leak_runs", []):
        if not e["meets_target"]:
            out.append(
                f"TimeToOOM memory_leak seed {e['seed']}: lead {_f(e['lead_s'], 1)} s "
                f"< {OOM_LEAD_TARGET_S:g} s"
            )
    for sc, o in oom.get("other_runs", {}).items():
        if o["warning_episodes"]:
            out.append(f"TimeToOOM {sc}: {o['warning_episodes']} warnings in {o['runs']} runs")
    for case, r in doc.get("phase", {}).items():
        if not r["learned_beats_baseline"]:
            out.append(
                f"PhaseTransitionForecaster {case}: MAE {r['mae']['learned']:.2f} {r['unit']} "
                f"vs last length {r['mae']['last_length']:.2f} {r['unit']}"
            )
    for target in ("step_time_ms", "mem_peak_bytes"):
        r = doc.get("crossrun", {}).get(target)
        if r and not r["learned_beats_baseline"]:
            out.append(
                f"CrossRunPredictor {target}: MAPE {r['mape_pct']:.1f} % vs past median "
                f"{r['baseline_mape_pct']:.1f} %"
            )
    # The target: >= 50k samples/s/core, or the model runs on window or step features rather
    # than raw samples (every input here is a step, a window, a phase change or a job).
    for name, c in doc.get("cost", {}).get("models", {}).items():
        if not c["meets_target_per_call"] and c["input"] == "raw sample":
            out.append(
                f"{name}: {c['calls_per_s_core']:,.0f} calls/s/core < {SAMPLES_TARGET:,} "
                f"(input: {c['input']}, {_f(c['raw_samples_per_call'], 1)} raw samples a call)"
            )
    return out


def _clean(v: Any) -> Any:
    """NaN and infinities → None, numpy scalars → Python, so the JSON is strict."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# -- main -------------------------------------------------------------------------------------
def _seeds(text: str) -> list[int]:
    if ":" in text:
        lo, hi = text.split(":")
        return list(range(int(lo), int(hi)))
    return [int(s) for s in text.split(",")]


def _import_models() -> None:
    """Register every model: the package and the modules it may not import itself."""
    import perfloop.models
    import perfloop.models.anomaly
    import perfloop.models.crossrun
    import perfloop.models.oom  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="100:105", help="lo:hi or a,b,c (default 100:105)")
    p.add_argument("--shape", default="2x4", help="nodes x ranks per node (default 2x4)")
    p.add_argument("--duration", type=float, default=300.0, help="simulated s per run")
    p.add_argument("--tolerance-s", type=float, default=10.0, help="regime-change tolerance")
    p.add_argument("--torch-steps", type=int, default=300, help="steps per torch run")
    p.add_argument("--jobs", type=int, default=300, help="cross-run population size")
    p.add_argument("--skip-torch", action="store_true", help="leave out the torch CPU runs")
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.duration, args.torch_steps, args.jobs = "100", 120.0, 60, 60
    args.seed_list = _seeds(args.seeds)
    args.nodes, args.per_node = (int(v) for v in args.shape.split("x"))
    raise_on_sigterm()
    _import_models()
    t0 = time.perf_counter()
    say(
        f"models bench: seeds {args.seed_list}, {args.shape} jobs of {args.duration:g} s; "
        f"{os.cpu_count()} cpus"
    )
    runs = simulate_all(args)
    doc: dict[str, Any] = {
        "bench": "models",
        "args": {k: str(v) for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "simulated_runs": len(runs),
    }
    doc["forecast_sim"] = forecast_section(
        sim_forecast_cases(runs), f"simulator ({args.shape}, seeds {args.seeds})"
    )
    if not args.skip_torch:
        doc["forecast_torch"] = torch_section(args)
    doc["regime"] = regime_section(runs, args.tolerance_s)
    doc["anomaly"] = anomaly_section(runs)
    doc["oom"] = oom_section(runs)
    doc["phase"] = phase_section(runs, args.seed_list)
    doc["crossrun"] = crossrun_section(args)
    doc["cost"] = cost_section(runs)
    doc["misses"] = misses(doc)
    doc["wall_s"] = time.perf_counter() - t0
    say("\nmissed targets:" + ("" if doc["misses"] else " none"))
    for m in doc["misses"]:
        say(f"  - {m}")
    say(f"wall {doc['wall_s']:.0f} s")
    save_result("models", _clean(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
