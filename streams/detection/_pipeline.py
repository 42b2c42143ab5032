"""A pipeline's step detectors: its straggler and its load imbalance.

A pipeline's ranks send and receive point to point (`pipeline`, in
`perfloop.streams.detection.steps`) and its stages do different work by design, so
the data-parallel detectors, which compare the ranks' compute as peers, would call a stage cut
heavier than the others a straggler. Here:

* straggler (`stage_straggler`) — a rank whose own compute rose well above its own past while
  the other ranks' did not, and the pipeline's step time rose with it;
* load_imbalance (`stage_imbalance`) — the same ranks compute well above the others over the
  detectors' window (a stage cut heavier costs the whole pipeline its pace); a stage the
  straggler detector holds open is not also an imbalance.

Both read each rank's own compute (its spans, before anyone's waits): in a pipeline the
others' receives wait for the slow stage and for the schedule's bubble alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.streams.detection._common import (
    nanmean,
    nanmedian,
    node_of,
    nz,
    replace_findings,
    step_start,
)
from perfloop.streams.detection._persistence import Persistence
from perfloop.streams.detection._straggler import _cpu_evidence, _cpu_note
from perfloop.streams.detection.job_state import Finding, JobState

__all__ = ["stage_imbalance", "stage_straggler"]


def stage_straggler(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    """A pipeline's straggler: a rank whose own compute rose well above its own baseline
    while the other ranks' did not, and the pipeline's step time rose with it.

    A pipeline's stages do different work, so a rank is compared with its own past, not with
    its peers: after the warm-up each rank's compute (its spans, before anyone's waits) over
    ``baseline_steps`` steps sets its baseline, and the step time's too; both follow slow
    drift while nothing is slow. A rank is slow in a step when the median over its last
    ``median_steps`` steps is at least ``1 + stage_slowdown`` times its baseline, no other
    rank's rose by more than ``stage_slowdown / 2`` or a quarter of its rise (a slowdown every
    rank shares, a new phase or a busier machine, is nobody's; a neighbour's compute moves a
    little when a slow rank's work takes CPU or memory bandwidth from it), and the step
    time's median is up by ``stage_slowdown / 2`` (the pipeline runs at the slow rank's
    pace). `Persistence` then holds it as for any straggler.
    The others' waits are not read: in a pipeline they wait for the slow rank's sends and for
    the schedule's bubble alike. A rank slowed from outside may not compute any slower,
    though: another process on its CPU gives way whenever the rank wakes to compute, and
    takes the CPU from the threads that move its sends and receives (gloo's). Its threads'
    wait for a CPU says so (`HostSample.proc_run_delay_pct`, learned into a baseline with the
    compute's): a rank whose wait rose by ``stage_wait_pct`` points of a core over its own
    baseline, no other rank's by more than half that or a quarter of its rise, is slow too
    when the step time's median is up as above; while it is held, another rank's compute
    rising is not a straggler of its own (what the crowded CPU no longer runs lands on the
    others': on this machine a neighbour's compute rose 1.6x for a few seconds).
    """
    st = job.det.setdefault("stage_straggler", {"seen": 0, "learn": [], "learn_st": []})
    raw, step_ms = d["raw"], d["step_ms"]
    n, w = raw.shape
    delay = np.full(w, np.nan)  # each rank's threads' latest wait for a CPU, % of a core
    known = job.rank["run_delay"][:w]
    delay[: len(known)] = known
    base_wait = _widen(st.get("base_wait"), w)
    why = _widen(st.get("why"), w)  # per rank, 1: its compute rose; 2: its wait for a CPU
    k, up = p.median_steps, p.stage_slowdown
    pers = Persistence(
        st.setdefault("persist", {}),
        width=w,
        persist_s=p.persist_s,
        max_persist_s=p.max_persist_s,
        persist_steps=p.persist_steps,
        clear_steps=p.clear_steps,
        warmup_steps=0,
        bridge_steps=p.clear_steps,
    )
    base, base_st = st.get("base"), float(st.get("base_st", 0.0))
    if base is not None and len(base) < w:
        base = np.pad(base, (0, w - len(base)), constant_values=np.nan)
    hist = st.get("hist", np.zeros((0, w)))
    hist = np.pad(hist, ((0, 0), (0, max(0, w - hist.shape[1]))), constant_values=np.nan)[:, :w]
    hist_st = st.get("hist_st", np.zeros(0))
    for i in np.flatnonzero(new):
        c, s = raw[i], float(step_ms[i])
        if not (s > 0) or int(np.sum(~np.isnan(c))) < 2:
            continue
        st["seen"] += 1
        if st["seen"] <= p.warmup_steps:
            continue
        if base is None:
            st["learn"].append(c.tolist())
            st["learn_st"].append(s)
            st.setdefault("learn_wait", []).append(delay.tolist())
            if len(st["learn"]) >= p.baseline_steps:
                base = nanmedian(np.array(st["learn"], dtype=np.float64).T, 1)
                base_st = float(np.median(st["learn_st"]))
                base_wait = nanmedian(np.array(st["learn_wait"], dtype=np.float64).T, 1)
                st["learn"], st["learn_st"], st["learn_wait"] = [], [], []
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(base > 0, c / base, np.nan)
        hist = np.vstack([hist, ratio[None, :]])[-k:]
        hist_st = np.append(hist_st, s / base_st)[-k:]
        med = nanmedian(hist.T, 1)
        med_st = float(np.median(hist_st))
        rise = nz(med) - 1
        others = np.array([np.nanmax(np.delete(rise, r), initial=0.0) for r in range(w)])
        alone = others <= np.maximum(up / 2, rise / 4)  # the others rose far less, if at all
        slower = med_st >= 1 + up / 2  # the pipeline runs at some rank's pace
        rising = _waits_for_cpu(delay - base_wait, p.stage_wait_pct)
        waits = rising & slower
        # a rank held for its wait for a CPU explains its neighbours' compute rising: the
        # work its CPU no longer runs (the job's other threads, perfloop's) lands on theirs
        held = pers.active & (why == 2)
        crowded = np.array([np.delete(held, r).any() for r in range(w)])
        computes = (rise >= up) & alone & slower & ~crowded
        why = np.where(computes, 1, np.where(waits, 2, why))
        end = int(np.nanmax(win["end"][i]))
        begun = int(np.nanmin(step_start(win, i, slice(None))))
        pers.update(computes | waits, start=begun, end=end)
        calm = np.all(np.abs(nz(ratio) - 1) < up / 2) and abs(s / base_st - 1) < up / 2
        if calm and not pers.active.any():  # healthy: follow slow drift
            base = np.where(np.isnan(c), base, base + 0.02 * (c - base))
            base_st += 0.02 * (s - base_st)
        if not pers.active.any() and not rising.any():
            base_wait = np.where(
                np.isnan(base_wait), delay, np.where(np.isnan(delay), base_wait,
                                                     base_wait + 0.02 * (delay - base_wait))
            )  # fmt: skip
    if base is not None:
        st["base"], st["base_st"] = base, base_st
        st["hist"], st["hist_st"] = hist, hist_st
        st["base_wait"], st["why"] = base_wait, why
    active = pers.active if base is not None else np.zeros(w, bool)
    found = {}
    for r in np.flatnonzero(active):
        since = int(pers.since[r])
        comp = float(nanmean(raw[-8:, r]))
        step_now = float(nanmean(step_ms[-8:]))
        ratio_r = comp / float(base[r])
        others = float(np.nanmax(np.delete(nanmedian(hist.T, 1), r), initial=0.0))
        evidence = {
            "compute_ms": round(comp, 3),
            "baseline_compute_ms": round(float(base[r]), 3),
            "ratio": round(ratio_r, 3),
            "others_ratio": round(others, 3),
            "step_time_ms": round(step_now, 3),
            "baseline_step_ms": round(base_st, 3),
            "pipeline": 1.0,
            **_cpu_evidence(job, int(r)),
        }
        pace = f"the pipeline runs at its pace: {step_now:.1f} ms a step against {base_st:.1f} ms"
        if why[r] == 2 and "run_delay_pct" in evidence:  # its threads waited for a CPU
            wait, others_wait = evidence["run_delay_pct"], evidence["others_run_delay_pct"]
            was = float(base_wait[r])
            evidence["baseline_run_delay_pct"] = round(was, 1)
            confidence = 0.5 + (wait - was) / 200
            summary = (
                f"rank {r}'s threads wait for a CPU {wait:.0f}% of a core against {was:.0f}% "
                f"before ({others_wait:.0f}% on the other ranks): something else runs on its "
                f"CPUs; {pace}"
            )
        else:
            confidence = 0.5 + (ratio_r - 1.0) / 2
            summary = (
                f"rank {r} computes {ratio_r:.2f}x its own baseline ({comp:.1f} ms a step "
                f"against {float(base[r]):.1f} ms) while the other ranks stay near theirs; "
                f"{pace}" + _cpu_note(job, int(r))
            )
        found[f"straggler:r{r}"] = Finding(
            key=f"straggler:r{r}",
            bottleneck="straggler",
            onset_ns=since if since > 0 else int(step_start(win, max(n - 8, 0), r)),
            step_share=float(np.clip(1.0 - base_st / step_now, 0, 1)) if step_now > 0 else 0.0,
            confidence=float(np.clip(confidence, 0, 1)),
            ranks=[int(r)],
            nodes=node_of(job, int(r)),
            rank=int(r),
            step=int(win["step"][-1]),
            evidence=evidence,
            summary=summary,
        )
    replace_findings(job, "straggler:", found)


def _widen(a: np.ndarray | None, w: int) -> np.ndarray:
    """A per-rank state array for ``w`` ranks (NaN for ranks it did not know)."""
    out = np.full(w, np.nan)
    if a is not None:
        out[: min(w, len(a))] = a[:w]
    return out


def _waits_for_cpu(rise: np.ndarray, points: float) -> np.ndarray:
    """Ranks whose threads' wait for a CPU rose by ``points`` (of a core) or more over their
    baseline while no other rank's rose by more than half that or a quarter of its rise (a
    busier machine makes every rank wait).

    >>> _waits_for_cpu(np.array([35.0, -5.0]), 20).tolist()
    [True, False]
    >>> _waits_for_cpu(np.array([35.0, 15.0]), 20).tolist()  # both wait more: nobody's
    [False, False]
    >>> _waits_for_cpu(np.array([35.0, np.nan]), 20).tolist()  # one rank not measured
    [True, False]
    """
    rise = nz(rise)
    others = np.array([np.max(np.delete(rise, r), initial=0.0) for r in range(len(rise))])
    return (rise >= points) & (others <= np.maximum(points / 2, rise / 4))


def stage_imbalance(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    """A pipeline's load imbalance: the same ranks compute well above the others step after
    step. Every stage of a pipeline runs at the pace of the slowest (its neighbours wait for
    its sends), so ``1 - mean / max`` of the ranks' median compute over the window is the
    share of each step the imbalance costs; it holds from ``stage_threshold`` when the ranks
    whose median is near the top (a stage's replicas alike) compute most in ``stage_share`` of
    the window's steps. Medians, not step-by-step flags: an uneven cut is there in every step,
    and a rank's passing spikes move no median. Read from each rank's own compute (its spans),
    not from the waits: in a pipeline the others' receives wait for the slow stage, and for
    its own bubble too."""
    st = job.det.setdefault("stage_imbalance", {"active": False})
    comp = d["raw"]
    seen = ~np.isnan(comp)
    whole = seen.sum(axis=1) >= 2  # steps at least two ranks computed in
    comp, seen = comp[whole], seen[whole]
    n = len(comp)
    if n < p.window_steps or int(job.det.get("steps_seen", 0)) < p.warmup_steps + n:
        return  # too few whole steps to judge (a rank's rows are late): nothing changes
    # once open, it holds down to 3/4 of the thresholds (an imbalance near the threshold
    # must not open and resolve with every window's noise)
    k = 0.75 if st["active"] else 1.0
    ranks: list[int] = []
    per_rank = nanmedian(comp.T, 1)
    most = float(np.nanmax(per_rank)) if np.isfinite(per_rank).any() else 0.0
    share = 1.0 - float(nanmean(per_rank)) / most if most > 0 else 0.0
    if most > 0 and share >= k * p.stage_threshold:
        heavy = per_rank >= 0.9 * most
        tops = np.argmax(np.where(seen, comp, -1.0), axis=1)
        if np.isin(tops, np.flatnonzero(heavy)).mean() >= k * p.stage_share:
            ranks = [int(x) for x in np.flatnonzero(heavy)]
        if ranks and _slowed(job, ranks):
            ranks = []  # it became heavy: a straggler's (`stage_straggler`), not the cut
    held = bool(ranks)
    end = int(np.nanmax(win["end"][-1]))
    begun = int(np.nanmin(step_start(win, len(win["step"]) - len(d["raw"]), slice(None))))
    pers = Persistence(
        st.setdefault("persist", {}),
        width=1,
        persist_s=p.persist_s,
        max_persist_s=p.max_persist_s,
        persist_steps=p.persist_steps,
        clear_steps=p.clear_steps,
        warmup_steps=0,
    )
    was = bool(st["active"])
    st["active"] = bool(pers.update(np.array([held]), start=begun, end=end)[0])
    if was and not held:
        st["active"] = False
        pers.stop()
    found = {}
    if st["active"]:
        heavy_ms = float(nanmean(per_rank[ranks]))
        mean_ms = float(nanmean(per_rank))
        with np.errstate(invalid="ignore", divide="ignore"):
            per_step = 1.0 - nanmean(comp, axis=1) / np.fmax.reduce(comp, axis=1)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        found["load_imbalance"] = Finding(
            key="load_imbalance",
            bottleneck="load_imbalance",
            onset_ns=int(pers.since[0]) or begun,
            step_share=float(np.clip(share, 0, 1)),
            confidence=float(min(1.0, 0.4 + 2.0 * share)),
            ranks=ranks,
            step=int(win["step"][-1]),
            evidence={
                "imbalance": round(share, 4),
                "imbalanced_steps": float(np.sum(nz(per_step) >= p.stage_threshold)),
                "window_steps": float(n),
                "stage_compute_ms": round(heavy_ms, 3),
                "mean_compute_ms": round(mean_ms, 3),
                "pipeline": 1.0,
            },
            summary=f"the pipeline stage on {who} computes {heavy_ms:.1f} ms a step against "
            f"{mean_ms:.1f} ms on average over the ranks: the pipeline runs at its pace, "
            f"~{100 * share:.0f}% of each step lost (move work off it)",
        )
    replace_findings(job, "load_imbalance", found)


def _slowed(job: JobState, ranks: list[int]) -> bool:
    """Whether every one of ``ranks`` is a pipeline straggler now (`stage_straggler`, which
    ran first in this tick): a stage that became heavy while the job ran, not one cut heavy.
    Its open diagnosis, not a slow run still unconfirmed: a stage cut heavy whose compute
    wanders above its early baseline for a moment stays the imbalance it is."""
    active = job.det.get("stage_straggler", {}).get("persist", {}).get("active")
    if active is None or max(ranks) >= len(active):
        return False
    return bool(np.all(np.asarray(active)[ranks]))
