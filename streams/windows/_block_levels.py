"""Block levels of the windows: closed blocks of one size, built from a smaller level.

A `Level` keeps closed blocks (`Agg` rows) in segments, one per `advance` that closed some,
for as long as a bigger level or a hopping window still needs them (``keep_ns``). Closing is
per job: ``old``/``new`` are each job's closed-until time (ns) before and after this advance,
indexed by job index; a block or window closes when its end passes into ``(old, new]``.
"""

from __future__ import annotations

import numpy as np

from perfloop.streams.windows._aggregates import Agg

__all__ = ["Level", "build_blocks", "hopping_windows"]

_I64 = np.int64


class Level:
    """Closed blocks of ``size_ns``, built from level ``child`` (0: raw samples)."""

    __slots__ = ("child", "keep_ns", "segments", "size_ns")

    def __init__(self, size_ns: int, child: int) -> None:
        self.size_ns, self.child, self.keep_ns = size_ns, child, 0
        self.segments: list[tuple[Agg, int, int]] = []  # rows, min start, max start

    def append(self, rows: Agg) -> None:
        if len(rows) and self.keep_ns > 0:
            self.segments.append((rows, int(rows.start.min()), int(rows.start.max())))

    def gather(self, sid_job: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[Agg]:
        """Rows whose start is in ``[lo[job], hi[job])`` of their series' job."""
        live = hi > lo
        if not live.any():
            return []
        lo_min, hi_max = int(lo[live].min()), int(hi[live].max())
        parts = []
        for rows, smin, smax in self.segments:
            if smax < lo_min or smin >= hi_max:
                continue
            job = sid_job[rows.sid]
            m = (rows.start >= lo[job]) & (rows.start < hi[job])
            if m.all():
                parts.append(rows)
            elif m.any():
                parts.append(rows.take(np.flatnonzero(m)))
        return parts

    def prune(
        self, sid_job: np.ndarray, closed: np.ndarray, dead: np.ndarray | None = None
    ) -> None:
        """Drop rows no consumer needs (start ≤ closed − keep) and rows of ``dead`` sids."""
        if self.keep_ns <= 0:
            self.segments.clear()
            return
        thr = closed - self.keep_ns
        thr_max = int(thr.max()) if len(thr) else 0
        kept = []
        for rows, smin, smax in self.segments:
            if smin > thr_max and dead is None:
                kept.append((rows, smin, smax))
                continue
            alive = rows.start > thr[sid_job[rows.sid]]
            if dead is not None:
                alive &= ~dead[rows.sid]
            if alive.all():
                kept.append((rows, smin, smax))
            elif alive.any():
                part = rows.take(np.flatnonzero(alive))
                kept.append((part, int(part.start.min()), int(part.start.max())))
        self.segments = kept

    def state(self) -> dict[str, object]:
        return {
            "child": self.child,
            "keep_ns": self.keep_ns,
            "segments": [(rows.to_state(), a, b) for rows, a, b in self.segments],
        }


def _group(rows: Agg, block: np.ndarray, n_sids: int, width: int) -> Agg:
    """Merge rows into (block index, sid) groups; a group starts at ``block * width``."""
    b0 = int(block.min())
    uniq, gid = np.unique((block - b0) * n_sids + rows.sid, return_inverse=True)
    return rows.merge(gid, len(uniq), uniq % n_sids, (uniq // n_sids + b0) * width)


def build_blocks(child_rows: list[Agg], size_ns: int, n_sids: int, empty: Agg) -> Agg:
    """Blocks of ``size_ns`` merged from the child rows that fall in them."""
    if not child_rows:
        return empty
    rows = Agg.concat(child_rows)
    return _group(rows, rows.start // size_ns, n_sids, size_ns)


def hopping_windows(
    level: Level,
    size_ns: int,
    hop_ns: int,
    sid_job: np.ndarray,
    n_sids: int,
    old: np.ndarray,
    new: np.ndarray,
    empty: Agg,
) -> Agg:
    """Windows ``[k hop, k hop + size)`` ending in ``(old, new]``, merged from the level's
    blocks (``level.size_ns`` divides both ``size_ns`` and ``hop_ns``)."""
    k_lo = (old - size_ns) // hop_ns + 1
    k_hi = (new - size_ns) // hop_ns
    live = k_hi >= k_lo
    lo = np.where(live, k_lo * hop_ns, 0)
    hi = np.where(live, k_hi * hop_ns + size_ns, 0)
    parts = level.gather(sid_job, lo, hi)
    if not parts:
        return empty
    rows = Agg.concat(parts)
    s = rows.start
    job = sid_job[rows.sid]
    first = np.maximum(-((size_ns - level.size_ns - s) // hop_ns), k_lo[job])  # ceil division
    last = np.minimum(s // hop_ns, k_hi[job])
    reps = np.maximum(last - first + 1, 0)
    idx = np.repeat(np.arange(len(rows), dtype=_I64), reps)
    k = first[idx] + np.arange(len(idx), dtype=_I64) - np.repeat(np.cumsum(reps) - reps, reps)
    return _group(rows.take(idx), k, n_sids, hop_ns)
