"""The straggler detector: a rank the others keep waiting for.

It reads, per complete step and rank, the compute the step detectors derive
(`perfloop.streams.detection.steps`): the on-time ranks' compute plus the rank's
own lateness at the collectives less its data wait and checkpoint/eval time (the ranks that
wait are never late). A step is slow for a rank when its *excess* over the on-time ranks, as a
share of the step, has a median over the last ``median_steps`` steps of at least
``score_threshold``; a straggler is a rank slow for longer than the job's own noise
(`Persistence`: on a busy machine any rank falls behind for a second now and then; a
straggler stays behind).

The median is over the rank's last ``median_steps`` steps however many a batch brings (the
detectors' window may hold fewer), and long enough that a rank slowed by CPU contention stays
slow in it: a process that shares its CPU with another runs whole time slices on time and
then waits a whole slice, so a third or so of its steps are on time, scattered; over a handful
of steps the median flickers, each flicker ends the slow run, and the runs that ended teach
`Persistence` that the job's noise is as long as they were. Even over 15 steps the median of a
contended rank dips for a step or two now and then: a slow run goes on through as many normal
steps as resolve an open straggler (``clear_steps``). The long median holds a healthy rank's
slow seconds as well (another process landing on its CPU for a while), so on a noisy job a
slow run must last ``level_persist_s`` for each ``score_threshold`` the latest rank is
typically late by (a quiet job: ``persist_s``). A slow run counts from its first slow step
(the median lags it), and only from the end of the warm-up (``warmup_steps``).

Its evidence: the score (``1 − median/compute``), its compute and the median, the step time,
its lateness (ms the others wait for it a step), how many steps in a row it was slow, and its
process CPU against the other ranks' (a rank whose process gets less CPU than the others
shares its CPUs with something else).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.streams.detection._common import (
    nanmean,
    nanmedian,
    node_of,
    replace_findings,
    step_start,
)
from perfloop.streams.detection._persistence import Persistence
from perfloop.streams.detection.job_state import Finding, JobState

__all__ = ["straggler_detector"]


def straggler_detector(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    """Update the job's ``straggler:r<rank>`` findings from its latest complete steps."""
    excess, step_ms = d["excess"], d["step_ms"]
    n, w = excess.shape
    share = excess / np.where(step_ms > 0, step_ms, np.nan)[:, None]
    state = job.det.setdefault("straggler", {})
    pers = Persistence(
        state,
        width=w,
        persist_s=p.persist_s,
        max_persist_s=p.max_persist_s,
        persist_steps=p.persist_steps,
        clear_steps=p.clear_steps,
        warmup_steps=p.warmup_steps,
        scale=p.score_threshold,
        level_s=p.level_persist_s,
        bridge_steps=p.clear_steps,
    )
    if int(np.sum(~np.isnan(d["comp"][-1]))) < 2:
        pers.stop()
    else:
        rows = np.flatnonzero(new)
        k, thr = p.median_steps, p.score_threshold
        begun = win["end"][rows] - np.nan_to_num(win["st"][rows] * 1e6).astype(np.int64)
        past_share, past_begun = _history(state, w)
        shares = np.concatenate([past_share, share[rows]])
        begun = np.concatenate([past_begun, begun])
        for j, i in enumerate(rows):
            upto = len(past_share) + j + 1
            last = slice(max(0, upto - k), upto)
            slow = nanmedian(shares[last], 0) >= thr
            # a job's first steps are its noisiest: a slow run starts counting after them
            seen = pers.st["seen"]
            slow &= seen >= p.warmup_steps
            if seen == p.warmup_steps:
                state["warm_ns"] = int(np.max(begun[upto - 1]))
            start = _run_start(shares[last] >= thr, begun[last])
            start = np.maximum(start, state.get("warm_ns", 0))
            end = int(np.nanmax(win["end"][i]))
            spread = float(np.nanmax(share[i])) if np.isfinite(share[i]).any() else np.nan
            pers.update(slow, start=start, end=end, level=spread)
        keep = max(0, len(shares) - k + 1) if k > 1 else len(shares)
        state["history"], state["history_begun"] = shares[keep:], begun[keep:]
    active = pers.active
    if not active.any():
        replace_findings(job, "straggler:", {})
        return
    score, comp, med = d["score"], d["comp"], d["med"]
    steps = pers.st["steps"]
    found = {}
    for r in np.flatnonzero(active):
        k = int(min(n, 8))
        sc = float(nanmean(score[-k:, r]))
        late = float(nanmean(excess[-k:, r]))
        since = int(pers.since[r])
        onset = since if since > 0 else int(step_start(win, n - k, r))
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
    replace_findings(job, "straggler:", found)


def _history(state: dict[str, Any], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The shares and starts of the steps before this batch's (up to ``median_steps - 1``),
    per rank: a batch may bring more steps than the detectors' window holds before its first."""
    share, begun = state.get("history"), state.get("history_begun")
    if share is None or begun is None:
        return np.zeros((0, width)), np.zeros((0, width), dtype=np.int64)
    extra = ((0, 0), (0, max(0, width - share.shape[1])))
    share = np.pad(share, extra, constant_values=np.nan)
    return share[:, :width], np.pad(begun, extra)[:, :width]


def _run_start(slow: np.ndarray, begun: np.ndarray) -> np.ndarray:
    """Per rank, when its slow steps of ``slow`` (steps x ranks) began: the start of the first
    slow step from which on at least half the steps are slow (the median lags the onset).

    >>> slow = np.array([[1, 0, 0, 0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 0]], bool).T
    >>> _run_start(slow, np.arange(9)[:, None] * np.array([[10, 100]])).tolist()
    [50, 200]
    """
    n = len(slow)
    after = np.cumsum(slow[::-1], axis=0)[::-1]  # slow steps from each one on
    ok = slow & (2 * after >= np.arange(n, 0, -1)[:, None])
    return begun[np.argmax(ok, axis=0), np.arange(slow.shape[1])]


def _cpu_evidence(job: JobState, rank: int) -> dict[str, float]:
    """The rank's process CPU and its threads' wait for a CPU against the median of the
    others' (what the host sampler reports of them)."""
    out: dict[str, float] = {}
    for col, mine, theirs in (
        ("proc_cpu", "proc_cpu_pct", "others_proc_cpu_pct"),
        ("run_delay", "run_delay_pct", "others_run_delay_pct"),
    ):
        v = job.rank[col]
        if not (0 <= rank < len(v)) or v[rank] != v[rank] or len(v) < 2:
            continue
        others = np.delete(v, rank)
        others = others[~np.isnan(others)]
        if len(others):
            out[mine], out[theirs] = float(v[rank]), float(np.median(others))
    return out


def _cpu_note(job: JobState, rank: int) -> str:
    ev = _cpu_evidence(job, rank)
    if "proc_cpu_pct" in ev and ev["proc_cpu_pct"] < 0.8 * ev["others_proc_cpu_pct"]:
        return (
            f"; its process gets {ev['proc_cpu_pct']:.0f}% CPU against "
            f"{ev['others_proc_cpu_pct']:.0f}% for the others: something else runs on its CPUs"
        )
    if "run_delay_pct" in ev and ev["run_delay_pct"] >= ev["others_run_delay_pct"] + 20:
        return (
            f"; its threads wait for a CPU {ev['run_delay_pct']:.0f}% of a core against "
            f"{ev['others_run_delay_pct']:.0f}% for the others: something else runs on its CPUs"
        )
    return ""


# END
