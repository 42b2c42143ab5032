"""Sections 5 and 6 of the models bench: forecasts over a job's course, not its next step.

Phase transitions (`PhaseTransitionForecaster` vs "lasts as long as last time", on synthetic
run-level phases and the simulator's step-level spans) and cross-run prediction
(`CrossRunPredictor` vs the median of past jobs, on a synthetic population of simulated jobs).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from bench._common import say
from bench._models_sim import T0_NS, SimRun, _Collect, _nanmedian, _per_step


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
