"""The hang watchdog: no step progress past an adaptive timeout learned from the job's steps.

A job hangs when no step completes for ``max(floor_s, k × p99 step time)`` while its GPUs spin
(the median SM utilisation of the samples since the last step is at least ``spin_util_pct``:
ranks blocked in a collective keep an NCCL kernel resident), or for the longer
``max(slow_floor_s, slow_k × p99)`` without that evidence (a checkpoint or an evaluation
pause idles every GPU; a job that sends nothing at all is judged by its event-time clock,
which then moves on with the receive clock less its usual transport lag, `JobState.now`).
The p99 is over the job's recent complete steps, so the timeout adapts to each job. The
culprit is the rank whose GPU idles (``idle_util_pct``) while the others spin, else the
rank(s) whose progress stopped first; the diagnosis resolves when a step completes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from perfloop.streams._detect_state import NS, Finding, JobState
from perfloop.streams._detect_steps import _replace, nanmean

if TYPE_CHECKING:
    from perfloop.streams._detect_config import DetectConfig

__all__ = ["hang_detector"]


def hang_detector(job: JobState, cfg: DetectConfig, now_ns: int) -> None:
    """The watchdog: called every tick with the job's event-time clock (`JobState.now`): it
    needs time to pass, not new data."""
    h = cfg.hang
    st = job.det.setdefault("hang", {"active": False, "at_ns": 0})
    if job.ended or not h.enabled:
        st["active"] = False
        _replace(job, "hang", {})
        return
    if st["active"] and job.last_step_ns > st["at_ns"]:  # progress again
        st["active"] = False
    p99 = job.det.get("p99_ms", 0.0)
    if job.det.get("steps_seen", 0) < h.min_steps or p99 <= 0:
        _replace(job, "hang", {})
        return
    gap_s = (now_ns - job.last_step_ns) / NS
    fast_s = max(h.floor_s, h.k * p99 / 1000)
    slow_s = max(h.slow_floor_s, h.slow_k * p99 / 1000)
    if not st["active"] and gap_s < min(fast_s, slow_s):  # no timeout can have passed
        _replace(job, "hang", {})
        return
    dev = job.dev
    recent = dev["ts"] > job.last_step_ns
    util = dev["util"][recent]
    med = float(np.median(util)) if len(util) else np.nan
    spin = med >= h.spin_util_pct
    timeout = fast_s if spin else slow_s
    if not st["active"] and gap_s >= timeout:
        st.update(active=True, at_ns=job.last_step_ns)
    found = {}
    if st["active"]:
        idle = recent & (dev["util"] <= h.idle_util_pct) & (dev["rank"] >= 0) & spin
        culprits = sorted({int(x) for x in dev["rank"][idle]})
        if not culprits:
            last = job.rank["last_step"]
            reporting = last >= 0
            if reporting.any() and last[reporting].min() < last[reporting].max():
                culprits = [
                    int(x) for x in np.flatnonzero(reporting & (last == last[reporting].min()))
                ]
        ev = {"stall_s": round(gap_s, 3), "timeout_s": round(timeout, 3), "p99_step_ms": p99}
        if med == med:
            ev["gpu_util_median_pct"] = med
        if culprits:
            ev["culprit_gpu_util_pct"] = float(nanmean(dev["util"][np.isin(dev["rank"], culprits)]))
        expected = job.det.get("median_step_ms", 0.0) * 1e6
        found["hang"] = Finding(
            key="hang",
            bottleneck="hang",
            onset_ns=int(st["at_ns"] + (expected if math.isfinite(expected) else 0.0)),
            step_share=1.0,
            confidence=0.9 if spin and culprits else (0.75 if spin else 0.6),
            ranks=culprits,
            rank=culprits[0] if len(culprits) == 1 else -1,
            step=int(job.newest_step),
            evidence=ev,
            summary=f"no step completed for {gap_s:.1f} s (timeout {timeout:.1f} s)"
            + (f"; rank(s) {culprits} stopped while the others wait" if culprits else ""),
        )
    _replace(job, "hang", found)
