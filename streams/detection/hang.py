"""The hang watchdog: no step progress past an adaptive timeout learned from the job's steps.

Where the training hooks report it (`perfloop.schemas.RankProgress`: where each rank is
inside a step that has gone on for long, every few seconds), the reports decide:

* a rank saving a checkpoint or evaluating is not hanging: while a fresh report says so, and
  for at most ``max_pause_s`` of that episode, there is no hang (the ranks waiting for it at
  the next collective are expected);
* ranks blocked in a collective (phase ``comm``) wait for the others: once the stall passes
  ``max(progress_floor_s, k × p99 step time)`` the job hangs, and the culprits are the ranks
  that are *not* in the collective — those reporting another phase (stopped before it) and
  those that report nothing any more (a frozen or dead process);
* ranks reporting other phases only (every rank loading data, say) hang after the long
  timeout below, the job as a whole.

A report is fresh when it was made after the job's last completed step and at most
``fresh_s`` ago. Without reports (older producers, or GPU jobs between them), a job hangs when
no step completes for ``max(floor_s, k × p99 step time)`` while its GPUs spin (the median SM
utilisation of the samples since the last step is at least ``spin_util_pct``: ranks blocked in
a collective keep an NCCL kernel resident), or for the longer ``max(slow_floor_s, slow_k ×
p99)`` without that evidence (a checkpoint or an evaluation pause idles every GPU; a job that
sends nothing at all is judged by its event-time clock, which then moves on with the receive
clock less its usual transport lag, `JobState.now`). The p99 is over the job's recent complete
steps, so the timeout adapts to each job. The culprit is then the rank whose GPU idles
(``idle_util_pct``) while the others spin, else the rank(s) whose progress stopped first; the
diagnosis resolves when a step completes.

Public through `perfloop.streams.detection` (`hang_detector`): the funnel runs it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from perfloop.schemas.job import PROGRESS_PHASES
from perfloop.streams.detection._common import nanmean, replace_findings
from perfloop.streams.detection.job_state import NS, Finding, JobState

if TYPE_CHECKING:
    from perfloop.streams.detection.config import DetectConfig

__all__ = ["hang_detector"]

_COMM = PROGRESS_PHASES.index("comm")
_PAUSES = (PROGRESS_PHASES.index("checkpoint"), PROGRESS_PHASES.index("eval"))


def hang_detector(job: JobState, cfg: DetectConfig, now_ns: int) -> None:
    """The watchdog: called every tick with the job's event-time clock (`JobState.now`): it
    needs time to pass, not new data."""
    h = cfg.hang
    st = job.det.setdefault("hang", {"active": False, "at_ns": 0})
    if job.ended or not h.enabled:
        st["active"] = False
        replace_findings(job, "hang", {})
        return
    if st["active"] and job.last_step_ns > st["at_ns"]:  # progress again
        st["active"] = False
    p99 = job.det.get("p99_ms", 0.0)
    if job.det.get("steps_seen", 0) < h.min_steps or p99 <= 0:
        replace_findings(job, "hang", {})
        return
    gap_s = (now_ns - job.last_step_ns) / NS
    fast_s = max(h.floor_s, h.k * p99 / 1000)
    slow_s = max(h.slow_floor_s, h.slow_k * p99 / 1000)
    said = _reports(job, h, now_ns)
    if said is not None:
        _from_reports(job, h, st, said, gap_s=gap_s, fast_s=fast_s, slow_s=slow_s, p99=p99)
        return
    if not st["active"] and gap_s < min(fast_s, slow_s):  # no timeout can have passed
        replace_findings(job, "hang", {})
        return
    dev = job.dev
    recent = dev["ts"] > job.last_step_ns
    util = dev["util"][recent]
    med = float(np.median(util)) if len(util) else np.nan
    spin = med >= h.spin_util_pct
    timeout = fast_s if spin else slow_s
    if not st["active"] and gap_s >= timeout:
        st.update(active=True, at_ns=job.last_step_ns)
    if not st["active"]:
        replace_findings(job, "hang", {})
        return
    idle = recent & (dev["util"] <= h.idle_util_pct) & (dev["rank"] >= 0) & spin
    culprits = sorted({int(x) for x in dev["rank"][idle]})
    if not culprits:
        last = job.rank["last_step"]
        reporting = last >= 0
        if reporting.any() and last[reporting].min() < last[reporting].max():
            culprits = [int(x) for x in np.flatnonzero(reporting & (last == last[reporting].min()))]
    ev = {"stall_s": round(gap_s, 3), "timeout_s": round(timeout, 3), "p99_step_ms": p99}
    if med == med:
        ev["gpu_util_median_pct"] = med
    if culprits:
        ev["culprit_gpu_util_pct"] = float(nanmean(dev["util"][np.isin(dev["rank"], culprits)]))
    summary = f"no step completed for {gap_s:.1f} s (timeout {timeout:.1f} s)" + (
        f"; rank(s) {culprits} stopped while the others wait" if culprits else ""
    )
    conf = 0.9 if spin and culprits else (0.75 if spin else 0.6)
    _found(job, st, culprits, ev, summary, conf)


def _reports(job: JobState, h: Any, now_ns: int) -> dict[str, np.ndarray] | None:
    """The fresh progress reports of the job's ranks (None: no rank has one)."""
    rk = job.rank
    if not len(rk["p_ts"]):
        return None
    fresh = (rk["p_ts"] > job.last_step_ns) & (now_ns - rk["p_ts"] <= h.fresh_s * NS)
    if not fresh.any():
        return None
    phase = rk["p_phase"]
    pause = fresh & np.isin(phase, _PAUSES)
    return {
        "known": rk["last_step"] >= 0,
        "fresh": fresh,
        "waiting": fresh & (phase == _COMM),
        "pause": pause & (now_ns - rk["p_since"] <= h.max_pause_s * NS),
        "long_pause": pause & (now_ns - rk["p_since"] > h.max_pause_s * NS),
    }


def _from_reports(
    job: JobState,
    h: Any,
    st: dict[str, Any],
    said: dict[str, np.ndarray],
    *,
    gap_s: float,
    fast_s: float,
    slow_s: float,
    p99: float,
) -> None:
    """Decide from the ranks' own word (see the module docstring)."""
    if said["pause"].any():  # a checkpoint or an evaluation: the others wait for it
        st["active"] = False
        replace_findings(job, "hang", {})
        return
    known, waiting = said["known"] | said["fresh"], said["waiting"]
    if said["long_pause"].any():
        culprits, timeout = np.flatnonzero(said["long_pause"]), 0.0
        why = f"in a checkpoint or evaluation for more than {h.max_pause_s:.0f} s"
    elif waiting.any():
        culprits = np.flatnonzero(known & ~waiting)
        timeout = max(h.progress_floor_s, fast_s)
        why = "stopped before the collective the others wait in"
    else:
        culprits, timeout = np.zeros(0, dtype=np.int64), slow_s
        why = ""
    if not st["active"] and gap_s >= timeout:
        st.update(active=True, at_ns=job.last_step_ns)
    if not st["active"]:
        replace_findings(job, "hang", {})
        return
    ranks = [int(r) for r in culprits]
    phase = job.rank["p_phase"]
    where = ", ".join(
        f"rank {r} {_phase_name(int(phase[r])) if said['fresh'][r] else 'silent'}" for r in ranks
    )
    ev = {
        "stall_s": round(gap_s, 3),
        "timeout_s": round(timeout, 3),
        "p99_step_ms": p99,
        "ranks_waiting": float(waiting.sum()),
        "ranks_reporting": float(said["fresh"].sum()),
    }
    summary = f"no step completed for {gap_s:.1f} s (timeout {timeout:.1f} s)"
    if ranks:
        summary += f"; {where}: {why}, while {int(waiting.sum())} rank(s) wait in a collective"
    elif waiting.any():
        summary += "; every rank waits in a collective"
    _found(job, st, ranks, ev, summary, 0.95 if ranks and waiting.any() else 0.7)


def _phase_name(code: int) -> str:
    return f"in {PROGRESS_PHASES[code]}" if 0 <= code < len(PROGRESS_PHASES) else "in a step"


def _found(
    job: JobState,
    st: dict[str, Any],
    culprits: list[int],
    ev: dict[str, float],
    summary: str,
    confidence: float,
) -> None:
    expected = job.det.get("median_step_ms", 0.0) * 1e6
    replace_findings(
        job,
        "hang",
        {
            "hang": Finding(
                key="hang",
                bottleneck="hang",
                onset_ns=int(st["at_ns"] + (expected if math.isfinite(expected) else 0.0)),
                step_share=1.0,
                confidence=confidence,
                ranks=culprits,
                rank=culprits[0] if len(culprits) == 1 else -1,
                step=int(job.newest_step),
                evidence=ev,
                summary=summary,
            )
        },
    )
