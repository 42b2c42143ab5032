"""Tumbling windows: when a window closes, what lateness allows, and what counts as late."""

from __future__ import annotations

import numpy as np
import pytest

from perfloop.streams.windows import NS, TumblingWindows


def _add(w: TumblingWindows, seconds: list[float], values: list[float], rank: int = 0) -> None:
    ts = (np.array(seconds) * NS).astype(np.int64)
    w.add("j", "n0", rank, "step_time_ms", ts, np.array(values, dtype=np.float64))


@pytest.mark.parametrize(("window_s", "lateness_s"), [(0, 0), (-1, 0), (10, -1)])
def test_invalid_parameters_raise(window_s: float, lateness_s: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        TumblingWindows(window_s=window_s, lateness_s=lateness_s)


def test_window_stays_open_until_the_watermark_passes_its_end() -> None:
    w = TumblingWindows(window_s=10)
    _add(w, [1, 2], [100, 110])
    assert w.advance() == []
    assert w.advance(9 * NS) == []
    (row,) = w.advance(10 * NS)
    assert (row.ts_ns, row.window_end_ns, row.count, row.mean) == (0, 10 * NS, 2, 105.0)
    assert w.open_windows == 0
    assert w.advance(100 * NS) == [], "a window is emitted once"


def test_newer_event_time_closes_older_windows() -> None:
    w = TumblingWindows(window_s=10)
    _add(w, [1, 2], [1, 2])
    _add(w, [25], [3])
    rows = w.advance()
    assert [r.ts_ns for r in rows] == [0]
    assert w.open_windows == 1


def test_lateness_keeps_a_window_open_for_stragglers() -> None:
    w = TumblingWindows(window_s=10, lateness_s=2)
    _add(w, [5], [1.0])
    _add(w, [11], [5.0])  # watermark 11 s: window [0, 10) may still receive until 12 s
    assert w.advance() == []
    _add(w, [9], [3.0])  # a straggler, within the allowed lateness
    assert w.late_samples == 0
    (row,) = w.advance(12 * NS)
    assert (row.ts_ns, row.count, row.mean) == (0, 2, 2.0)


def test_sample_for_a_closed_window_is_counted_late_and_not_reopened() -> None:
    w = TumblingWindows(window_s=10)
    _add(w, [1, 15], [1.0, 2.0])
    (closed,) = w.advance()
    assert closed.ts_ns == 0
    _add(w, [3, 4, 16], [9.0, 9.0, 4.0])
    assert w.late_samples == 2
    (row,) = w.advance(20 * NS)
    assert (row.ts_ns, row.count, row.mean) == (10 * NS, 2, 3.0)


def test_lateness_is_tracked_per_series() -> None:
    w = TumblingWindows(window_s=10)
    _add(w, [1, 15], [1.0, 1.0], rank=0)
    w.advance()
    _add(w, [2], [7.0], rank=1)  # rank 1 has no closed window yet: not late
    assert w.late_samples == 0
    rows = [r for r in w.advance(30 * NS) if r.rank == 1]
    assert [(r.ts_ns, r.count, r.mean) for r in rows] == [(0, 1, 7.0)]


def test_rows_carry_their_series_and_are_ordered_by_time() -> None:
    w = TumblingWindows(window_s=1)
    _add(w, [2.5, 0.5], [1.0, 2.0], rank=1)
    _add(w, [1.5], [3.0], rank=0)
    rows = w.advance(10 * NS)
    assert [(r.ts_ns, r.rank) for r in rows] == [(0, 1), (NS, 0), (2 * NS, 1)]
    assert rows[0].as_dict()["metric"] == "step_time_ms"
    assert rows[0].as_dict()["job_id"] == "j"
    assert rows[0].rate_per_s == 1.0


def test_a_lagging_series_is_not_made_late_by_a_faster_one() -> None:
    # One watermark per series: a node whose clock or publishing lags loses nothing.
    w = TumblingWindows(window_s=10, lateness_s=2)
    _add(w, [100, 130], [1.0, 1.0], rank=0)
    _add(w, [5], [7.0], rank=1)
    rows = w.advance()
    assert [r.rank for r in rows] == [0], "rank 1's window waits for rank 1's own time"
    _add(w, [8], [9.0], rank=1)
    assert w.late_samples == 0
    _add(w, [13], [1.0], rank=1)
    (row,) = w.advance()
    assert (row.rank, row.ts_ns, row.count, row.mean) == (1, 0, 2, 8.0)


def test_an_idle_series_closes_its_windows_with_the_wall_clock() -> None:
    w = TumblingWindows(window_s=10, lateness_s=2)
    w.add("j", "n", 0, "m", np.array([3 * NS]), np.array([1.0]), wall_ns=1000 * NS)
    assert w.advance(wall_ns=1008 * NS) == []  # event time 3 + 8 idle = 11 < 10 + 2
    (row,) = w.advance(wall_ns=1009 * NS)  # 3 + 9 = 12: the window is due
    assert (row.ts_ns, row.count) == (0, 1)


def test_state_of_long_idle_series_is_forgotten() -> None:
    w = TumblingWindows(window_s=1)
    w.add("j", "n", 0, "m", np.array([NS]), np.array([1.0]), wall_ns=0)
    assert len(w.advance(wall_ns=5 * NS)) == 1 and w.watermark_ns == NS
    w.advance(wall_ns=10_000 * NS)
    assert w.watermark_ns == 0 and w.open_windows == 0
