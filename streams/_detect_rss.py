"""A CPU job's memory leak, from its processes' resident memory (RSS).

A CPU job has no CUDA allocator figures; its step events carry the process's RSS, which the
sampler reads now and then (RSS moves in chunks: the allocator maps memory by the megabyte).
So RSS is judged over time, not step by step: each rank's RSS is kept once a second (the
newest complete step of that second, `HISTORY` points), and a rank leaks when, over its last
``rss_points`` points (all taken after the job's ``warmup_steps`` steps, in which a process's
RSS grows anyway), it rose in at least ``rss_up_share`` of the intervals by at least
``rss_min_growth_bytes_per_s`` on average. It resolves once RSS stops rising (less than a
quarter of that rate over the last ``rss_points`` points). Time to OOM is against the host's
memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.streams._detect_base import NS, Finding
from perfloop.streams._detect_state import JobState
from perfloop.streams._detect_steps import _replace, node_of

__all__ = ["HISTORY", "rss_leak_detector"]

HISTORY = 32
"""One-second RSS points kept per rank."""


def rss_leak_detector(job: JobState, p: Any, win: dict) -> None:
    """Update the job's ``memory_leak:r<rank>`` findings from its ranks' RSS over time."""
    st = job.det.setdefault("rss", {})
    w = win["mem"].shape[1]
    t_hist, m_hist = _history(st, w)
    end, mem = win["end"][-1, :w], win["mem"][-1, :w]
    fresh = (end > 0) & ~np.isnan(mem) & (end - t_hist[:, -1] >= NS) & win["need"][:w]
    if fresh.any():  # one point a second per rank: roll the ranks that have a new one
        t_hist[fresh] = np.roll(t_hist[fresh], -1, axis=1)
        m_hist[fresh] = np.roll(m_hist[fresh], -1, axis=1)
        t_hist[fresh, -1], m_hist[fresh, -1] = end[fresh], mem[fresh]
    active = st.setdefault("active", np.zeros(0, dtype=bool))
    if len(active) < w:
        active = st["active"] = np.concatenate([active, np.zeros(w - len(active), bool)])
    if job.det.get("steps_seen", 0) <= p.warmup_steps:
        return
    warm = st.setdefault("warm_ns", int(np.max(end)))  # points from here on only
    k = p.rss_points
    t, m = t_hist[:, -k:], m_hist[:, -k:]
    known = (t[:, 0] >= warm) & ~np.isnan(m).any(axis=1)
    span_s = np.where(known, (t[:, -1] - t[:, 0]) / NS, np.nan)
    with np.errstate(all="ignore"):
        rate = (m[:, -1] - m[:, 0]) / span_s  # bytes a second
        up = (np.diff(m, axis=1) > 0).mean(axis=1)
    leaks = known & (up >= p.rss_up_share) & (rate >= p.rss_min_growth_bytes_per_s)
    stops = known & ~(rate >= 0.25 * p.rss_min_growth_bytes_per_s)
    active[:w] = (active[:w] | leaks) & ~stops
    found = {}
    for r in np.flatnonzero(active[:w]):
        total = _host_total(job, int(r))
        headroom = max(0.0, total - float(m[r, -1])) if total > 0 else np.nan
        tto = headroom / rate[r] if rate[r] > 0 and headroom == headroom else np.nan
        ev = {
            "growth_bytes_per_s": round(float(rate[r]), 1),
            "rss_bytes": float(m[r, -1]),
            "rising_share": round(float(up[r]), 3),
            "seconds": round(float(span_s[r]), 2),
        }
        if tto == tto:
            ev.update(headroom_bytes=float(headroom), time_to_oom_s=round(float(tto), 2))
        key = f"memory_leak:r{r}"
        old = job.findings.get(key)
        found[key] = Finding(
            key=key,
            bottleneck="memory_leak",
            onset_ns=old.onset_ns if old else int(t[r, np.argmax(np.diff(m[r]) > 0)]),
            step_share=0.0,
            confidence=float(min(1.0, 0.5 + 0.5 * up[r])),
            ranks=[int(r)],
            nodes=node_of(job, int(r)),
            rank=int(r),
            step=int(win["step"][-1]),
            evidence=ev,
            summary=f"rank {r}'s memory (RSS) grows {rate[r] / 2**20:.1f} MiB a second"
            + (f"; out of the host's memory in about {tto:.0f} s" if tto == tto else ""),
        )
    _replace(job, "memory_leak:", found)


def _history(st: dict[str, Any], w: int) -> tuple[np.ndarray, np.ndarray]:
    t, m = st.get("t"), st.get("m")
    if t is None or len(t) < w:
        n = 0 if t is None else len(t)
        t = np.concatenate([t if t is not None else np.zeros((0, HISTORY), np.int64),
                            np.zeros((w - n, HISTORY), np.int64)])  # fmt: skip
        m = np.concatenate([m if m is not None else np.zeros((0, HISTORY)),
                            np.full((w - n, HISTORY), np.nan)])  # fmt: skip
        st["t"], st["m"] = t, m
    return st["t"], st["m"]


def _host_total(job: JobState, rank: int) -> float:
    n = int(job.rank["node"][rank]) if rank < len(job.rank["node"]) else -1
    total = float(job.node["mem_total"][n]) if 0 <= n < len(job.node["mem_total"]) else 0.0
    return total if total == total else 0.0
