"""Transitional: the old single-timescale tumbling windows, until their last users move to
`perfloop.streams.windows.WindowSet` (then this module goes).

Tumbling event-time windows over batches of samples, computed with numpy.

State lives in memory: per (job, node, rank, metric) and window start, the values and their
times. Each series has its own watermark — the newest event time seen in that series — so a
node whose clock lags, or a producer that publishes less often, never makes another series'
samples late. A window closes when its series' watermark minus the allowed lateness passes its
end; when a series receives nothing, its watermark moves on with the wall clock (pass
``wall_ns``), so windows close on time even when no new event arrives. A sample older than an
already closed window of its series is counted as late and dropped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["TumblingWindows", "WindowKey", "WindowRow", "summarize"]

NS = 1_000_000_000

WindowKey = tuple[str, str, int, str]  # job_id, node, rank, metric

# A series silent for this long (wall time) is forgotten, so finished jobs free their state.
FORGET_AFTER_S = 600
FORGET_AFTER_WINDOWS = 10


@dataclass(frozen=True, slots=True)
class WindowRow:
    """One closed window of one metric of one rank (the `windows` table row)."""

    job_id: str
    node: str
    rank: int
    metric: str
    ts_ns: int  # window start
    window_end_ns: int
    window_s: float
    count: int
    mean: float
    min: float
    max: float
    p50: float
    p95: float
    p99: float
    rate_per_s: float
    slope_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def summarize(ts_ns: np.ndarray, values: np.ndarray, window_s: float) -> dict[str, float]:
    """count, mean, min, max, p50/p95/p99, rate and least-squares slope (units per second).

    >>> r = summarize(np.array([0, NS, 2 * NS]), np.array([1.0, 2.0, 3.0]), 10.0)
    >>> r["mean"], r["p50"], r["rate_per_s"], r["slope_per_s"]
    (2.0, 2.0, 0.3, 1.0)
    """
    n = len(values)
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    slope = 0.0
    if n >= 2:
        t = (ts_ns - ts_ns.min()) / NS
        tc = t - t.mean()
        denom = float(tc @ tc)
        if denom > 0:
            slope = float(tc @ (values - values.mean())) / denom
    return {
        "count": n,
        "mean": float(values.mean()),
        "min": float(values.min()),
        "max": float(values.max()),
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "rate_per_s": n / window_s,
        "slope_per_s": slope,
    }


@dataclass
class _Pending:
    ts: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)


class TumblingWindows:
    """Tumbling windows of ``window_s`` seconds with ``lateness_s`` of allowed lateness.

    >>> w = TumblingWindows(window_s=10, lateness_s=0)
    >>> w.add("j", "n", 0, "step_time_ms", np.array([1 * NS, 2 * NS]), np.array([100.0, 110.0]))
    >>> [r.mean for r in w.advance(11 * NS)]
    [105.0]
    """

    def __init__(self, *, window_s: float, lateness_s: float = 0.0) -> None:
        if window_s <= 0 or lateness_s < 0:
            raise ValueError(
                f"window_s must be > 0 and lateness_s >= 0, got {window_s}, {lateness_s}"
            )
        self.window_s = float(window_s)
        self.window_ns = int(window_s * NS)
        self.lateness_ns = int(lateness_s * NS)
        self._open: dict[tuple[WindowKey, int], _Pending] = defaultdict(_Pending)
        self._closed_before: dict[WindowKey, int] = {}
        self._watermark: dict[WindowKey, int] = {}
        self._seen_wall: dict[WindowKey, int] = {}
        self.late_samples = 0

    def add(
        self,
        job_id: str,
        node: str,
        rank: int,
        metric: str,
        ts_ns: np.ndarray,
        values: np.ndarray,
        *,
        wall_ns: int = 0,
    ) -> None:
        """Add samples of one series (received at wall time ``wall_ns``), vectorised."""
        key: WindowKey = (job_id, node, rank, metric)
        floor = self._closed_before.get(key, 0)
        starts = ts_ns - ts_ns % self.window_ns
        late = starts < floor
        if late.any():
            self.late_samples += int(late.sum())
            keep = ~late
            ts_ns, values, starts = ts_ns[keep], values[keep], starts[keep]
        if len(ts_ns) == 0:
            return
        self._watermark[key] = max(self._watermark.get(key, 0), int(ts_ns.max()))
        self._seen_wall[key] = wall_ns
        for start in np.unique(starts):
            sel = starts == start
            pending = self._open[(key, int(start))]
            pending.ts.append(ts_ns[sel])
            pending.values.append(values[sel])

    def advance(self, now_ns: int | None = None, *, wall_ns: int | None = None) -> list[WindowRow]:
        """Close every window whose end plus lateness is at or before its series' watermark.

        ``now_ns`` moves every series' event time to at least ``now_ns``; ``wall_ns`` moves a
        series on by the wall time elapsed since it last received a sample.
        """
        if now_ns is not None:
            for key in self._watermark:
                self._watermark[key] = max(self._watermark[key], now_ns)
        horizon: dict[WindowKey, int] = {}
        for key, wm in self._watermark.items():
            idle = max(0, wall_ns - self._seen_wall[key]) if wall_ns is not None else 0
            horizon[key] = wm + idle - self.lateness_ns
        rows = []
        due = [k for k in self._open if k[1] + self.window_ns <= horizon[k[0]]]
        for key, start in due:
            pending = self._open.pop((key, start))
            ts = np.concatenate(pending.ts)
            vals = np.concatenate(pending.values)
            self._closed_before[key] = max(self._closed_before.get(key, 0), start + self.window_ns)
            job_id, node, rank, metric = key
            rows.append(
                WindowRow(
                    job_id=job_id,
                    node=node,
                    rank=rank,
                    metric=metric,
                    ts_ns=start,
                    window_end_ns=start + self.window_ns,
                    window_s=self.window_s,
                    **summarize(ts, vals, self.window_s),
                )
            )
        rows.sort(key=lambda r: (r.ts_ns, r.job_id, r.rank, r.metric))
        if wall_ns is not None:
            self._forget_idle(wall_ns)
        return rows

    def _forget_idle(self, wall_ns: int) -> None:
        """Drop the state of series idle for `FORGET_AFTER_WINDOWS` windows (finished jobs)."""
        limit = max(FORGET_AFTER_S * NS, FORGET_AFTER_WINDOWS * self.window_ns)
        open_keys = {k for k, _ in self._open}
        for key in [k for k, seen in self._seen_wall.items() if wall_ns - seen > limit]:
            if key not in open_keys:
                del self._seen_wall[key], self._watermark[key]
                self._closed_before.pop(key, None)

    @property
    def open_windows(self) -> int:
        return len(self._open)

    @property
    def watermark_ns(self) -> int:
        """The newest event time of any series (0 before the first sample)."""
        return max(self._watermark.values(), default=0)
