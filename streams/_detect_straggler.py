"""The straggler detector: a rank the others keep waiting for.

It reads, per complete step and rank, the compute the step detectors derive
(`perfloop.streams._detect_steps`): the on-time ranks' compute plus the rank's own lateness at
the collectives less its data wait and checkpoint/eval time (the ranks that wait are never
late). A step is slow for a rank when its *excess* over the on-time ranks, as a share of the
step, has a median over the last ``median_steps`` steps of at least ``score_threshold``; a
straggler is a rank slow for longer than the job's own noise (`Persistence`: on a busy
machine any rank falls behind for a second now and then; a straggler stays behind).

Its evidence: the score (``1 − median/compute``), its compute and the median, the step time,
its lateness (ms the others wait for it a step), how many steps in a row it was slow, and its
process CPU against the other ranks' (a rank whose process gets less CPU than the others
shares its CPUs with something else).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.streams._detect_persist import Persistence
from perfloop.streams._detect_state import Finding, JobState
from perfloop.streams._detect_steps import _replace, _start, nanmean, nanmedian, node_of, nz

__all__ = ["straggler_detector"]


def straggler_detector(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    """Update the job's ``straggler:r<rank>`` findings from its latest complete steps."""
    excess, step_ms = d["excess"], d["step_ms"]
    n, w = excess.shape
    share = excess / np.where(step_ms > 0, step_ms, np.nan)[:, None]
    pers = Persistence(
        job.det.setdefault("straggler", {}),
        width=w,
        persist_s=p.persist_s,
        max_persist_s=p.max_persist_s,
        persist_steps=p.persist_steps,
        clear_steps=p.clear_steps,
        warmup_steps=p.warmup_steps,
        scale=p.score_threshold,
    )
    if int(np.sum(~np.isnan(d["comp"][-1]))) < 2:
        pers.stop()
    else:
        for i in np.flatnonzero(new):
            m = nanmedian(share[max(0, i - p.median_steps + 1) : i + 1], 0)
            start = nz(_start(win, i, slice(None))).astype(np.int64)
            end = int(np.nanmax(win["end"][i]))
            spread = float(np.nanmax(share[i])) if np.isfinite(share[i]).any() else np.nan
            pers.update(m >= p.score_threshold, start=start, end=end, level=spread)
    active = pers.active
    if not active.any():
        _replace(job, "straggler:", {})
        return
    score, comp, med = d["score"], d["comp"], d["med"]
    steps = pers.st["steps"]
    found = {}
    for r in np.flatnonzero(active):
        k = int(min(n, 8))
        sc = float(nanmean(score[-k:, r]))
        late = float(nanmean(excess[-k:, r]))
        since = int(pers.since[r])
        onset = since if since > 0 else int(_start(win, n - k, r))
        found[f"straggler:r{r}"] = Finding(
            key=f"straggler:r{r}",
            bottleneck="straggler",
            onset_ns=onset,
            step_share=float(np.clip(job.det["excess_share"][r], 0, 1)),
            confidence=float(np.clip(0.5 + float(nanmean(share[-k:, r])), 0, 1)),
            ranks=[int(r)],
            nodes=node_of(job, int(r)),
            rank=int(r),
            step=int(win["step"][-1]),
            evidence={
                "score": round(sc, 4),
                "compute_ms": round(float(nanmean(comp[-k:, r])), 3),
                "median_compute_ms": round(float(nanmean(med[-k:])), 3),
                "step_time_ms": round(float(nanmean(step_ms[-k:])), 3),
                "lateness_ms": round(late, 3),
                "steps": float(steps[r]),
                **_cpu_evidence(job, int(r)),
            },
            summary=f"rank {r} computes {1 / max(1e-9, 1 - sc):.2f}x the job median per step; "
            f"the others wait {late:.0f} ms a step for it" + _cpu_note(job, int(r)),
        )
    _replace(job, "straggler:", found)


def _cpu_evidence(job: JobState, rank: int) -> dict[str, float]:
    """The rank's process CPU against the median of the others' (when the host sampler
    reports them)."""
    cpu = job.rank["proc_cpu"]
    if not (0 <= rank < len(cpu)) or cpu[rank] != cpu[rank] or len(cpu) < 2:
        return {}
    others = np.delete(cpu, rank)
    others = others[~np.isnan(others)]
    if not len(others):
        return {}
    return {"proc_cpu_pct": float(cpu[rank]), "others_proc_cpu_pct": float(np.median(others))}


def _cpu_note(job: JobState, rank: int) -> str:
    ev = _cpu_evidence(job, rank)
    if ev and ev["proc_cpu_pct"] < 0.8 * ev["others_proc_cpu_pct"]:
        return (
            f"; its process gets {ev['proc_cpu_pct']:.0f}% CPU against "
            f"{ev['others_proc_cpu_pct']:.0f}% for the others: something else runs on its CPUs"
        )
    return ""
