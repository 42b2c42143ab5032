"""Sections 2-4 of the models bench: detecting that something changed or goes wrong.

Regime changes (`RegimeDetector` on the per-step job features), window anomalies
(`WindowAnomaly` on 1-s job windows, labelled by the fault intervals) and OOM warnings
(`TimeToOOM` per rank: lead time on leak runs, false warnings elsewhere).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench._common import say
from bench._models_sim import ANOMALY_FEATURES, FORECAST_SCENARIOS, PHASES, SimRun, _changes, _f

OOM_LEAD_TARGET_S = 30.0


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
