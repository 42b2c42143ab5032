"""Section 7 of the models bench: the cost of every registered model per call.

µs per ``learn_one`` + answer over each model's registered example stream, calls/s/core
against ``SAMPLES_TARGET``, and the raw samples one call stands for (`raw_per_call`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from bench._common import say
from bench._models_sim import SimRun, _f

SAMPLES_TARGET = 50_000
ROUND_S = 0.1  # each cost round replays a model's stream for at least this long


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
