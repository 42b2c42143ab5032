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
report seeds (`perfloop.evaluation.REPORT_SEEDS`); no model was tuned on them here.

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

Code: this file is the entry point (arguments, the run, the missed list, the result); the
sections live beside it in ``bench/_models_sim.py`` (the simulated runs, their series and
window features), ``_models_forecast.py`` (1), ``_models_detect.py`` (2-4),
``_models_lifecycle.py`` (5, 6) and ``_models_cost.py`` (7).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as `python bench/models.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import raise_on_sigterm, save_result, say
from bench._models_cost import SAMPLES_TARGET, cost_section
from bench._models_detect import OOM_LEAD_TARGET_S, anomaly_section, oom_section, regime_section
from bench._models_forecast import forecast_section, sim_forecast_cases, torch_section
from bench._models_lifecycle import crossrun_section, phase_section
from bench._models_sim import _f, simulate_all


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
