"""Window math under hypothesis: every sample counted once, stats agree with numpy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.streams.windows import NS, TumblingWindows, WindowRow, summarize

# Enough examples to find edge cases, few enough to keep the suite fast.
FAST = settings(max_examples=60, deadline=None)

window_s = st.sampled_from([0.5, 1.0, 2.0, 10.0])
values = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def series(draw: st.DrawFn) -> tuple[float, np.ndarray, np.ndarray]:
    """A window size and samples of one series spread over a few windows, in any order."""
    w = draw(window_s)
    n = draw(st.integers(1, 60))
    ts = draw(st.lists(st.integers(0, int(5 * w * NS)), min_size=n, max_size=n))
    vs = draw(st.lists(values, min_size=n, max_size=n))
    return w, np.array(ts, dtype=np.int64), np.array(vs, dtype=np.float64)


def _close_all(w: TumblingWindows, ts: np.ndarray) -> list[WindowRow]:
    return w.advance(int(ts.max()) + w.window_ns + w.lateness_ns + 1)


def _key(r: WindowRow) -> tuple[str, str, int, str, int]:
    return (r.job_id, r.node, r.rank, r.metric, r.ts_ns)


@FAST
@given(series(), st.floats(0, 5))
def test_every_sample_lands_in_exactly_one_window(
    s: tuple[float, np.ndarray, np.ndarray], lateness_s: float
) -> None:
    w_s, ts, vs = s
    w = TumblingWindows(window_s=w_s, lateness_s=lateness_s)
    w.add("j", "n", 0, "m", ts, vs)
    rows = _close_all(w, ts)
    assert sum(r.count for r in rows) == len(ts)
    assert w.late_samples == 0
    assert w.open_windows == 0
    starts = [r.ts_ns for r in rows]
    assert len(set(starts)) == len(starts)
    for r in rows:
        inside = (ts >= r.ts_ns) & (ts < r.window_end_ns)
        assert r.count == int(inside.sum())


@FAST
@given(series())
def test_window_boundaries_are_multiples_of_the_window(
    s: tuple[float, np.ndarray, np.ndarray],
) -> None:
    w_s, ts, vs = s
    w = TumblingWindows(window_s=w_s)
    w.add("j", "n", 0, "m", ts, vs)
    for r in _close_all(w, ts):
        assert r.ts_ns % w.window_ns == 0
        assert r.window_end_ns - r.ts_ns == w.window_ns
        assert r.window_s == w_s


@FAST
@given(series())
def test_window_stats_agree_with_numpy(s: tuple[float, np.ndarray, np.ndarray]) -> None:
    w_s, ts, vs = s
    w = TumblingWindows(window_s=w_s)
    w.add("j", "n", 0, "m", ts, vs)
    for r in _close_all(w, ts):
        inside = (ts >= r.ts_ns) & (ts < r.window_end_ns)
        mine = vs[inside]
        tol = 1e-9 * max(1.0, float(np.abs(mine).max()))
        assert abs(r.mean - float(np.mean(mine))) <= tol
        assert r.min == float(np.min(mine))
        assert r.max == float(np.max(mine))
        assert abs(r.p50 - float(np.median(mine))) <= tol
        assert abs(r.p95 - float(np.percentile(mine, 95))) <= tol
        assert abs(r.p99 - float(np.percentile(mine, 99))) <= tol
        assert r.min <= r.p50 <= r.p95 <= r.p99 <= r.max
        assert abs(r.rate_per_s - len(mine) / w_s) <= 1e-9


@FAST
@given(series(), st.randoms(use_true_random=False), st.integers(1, 8))
def test_batch_split_and_order_do_not_change_the_windows(
    s: tuple[float, np.ndarray, np.ndarray], rnd: object, parts: int
) -> None:
    w_s, ts, vs = s
    whole = TumblingWindows(window_s=w_s)
    whole.add("j", "n", 0, "m", ts, vs)

    order = np.arange(len(ts))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    split = TumblingWindows(window_s=w_s)
    for chunk in np.array_split(order, parts):
        split.add("j", "n", 0, "m", ts[chunk], vs[chunk])

    a = sorted(_close_all(whole, ts), key=_key)
    b = sorted(_close_all(split, ts), key=_key)
    assert [(_key(r), r.count, r.min, r.max) for r in a] == [
        (_key(r), r.count, r.min, r.max) for r in b
    ]
    for ra, rb in zip(a, b, strict=True):
        scale = max(1.0, abs(ra.max), abs(ra.min))
        for stat in ("mean", "p50", "p95", "p99"):
            assert abs(getattr(ra, stat) - getattr(rb, stat)) <= 1e-9 * scale
        assert abs(ra.slope_per_s - rb.slope_per_s) <= 1e-6 * max(1.0, abs(ra.slope_per_s)) * scale


@FAST
@given(series(), st.integers(1, 20))
def test_late_samples_are_counted_not_silently_dropped(
    s: tuple[float, np.ndarray, np.ndarray], n_late: int
) -> None:
    w_s, ts, vs = s
    w = TumblingWindows(window_s=w_s)
    w.add("j", "n", 0, "m", ts, vs)
    closed = _close_all(w, ts)
    first_start = min(r.ts_ns for r in closed)
    # Samples for windows that have closed arrive now.
    late_ts = np.full(n_late, first_start, dtype=np.int64)
    w.add("j", "n", 0, "m", late_ts, np.ones(n_late))
    assert w.late_samples == n_late
    assert sum(r.count for r in closed) + w.late_samples == len(ts) + n_late
    assert w.advance() == []


@FAST
@given(series(), series())
def test_series_are_windowed_independently(
    a: tuple[float, np.ndarray, np.ndarray], b: tuple[float, np.ndarray, np.ndarray]
) -> None:
    _, ts_a, vs_a = a
    _, ts_b, vs_b = b
    w = TumblingWindows(window_s=1.0)
    w.add("j", "n", 0, "m", ts_a, vs_a)
    w.add("j", "n", 1, "m", ts_b, vs_b)
    rows = w.advance(int(max(ts_a.max(), ts_b.max())) + 2 * NS)
    assert sum(r.count for r in rows if r.rank == 0) == len(ts_a)
    assert sum(r.count for r in rows if r.rank == 1) == len(ts_b)


@FAST
@given(
    st.lists(st.integers(0, 100 * NS), min_size=2, max_size=50, unique=True),
    st.data(),
)
def test_summarize_slope_equals_polyfit(ts_list: list[int], data: st.DataObject) -> None:
    ts = np.array(ts_list, dtype=np.int64)
    vs = np.array(
        data.draw(
            st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=len(ts), max_size=len(ts))
        )
    )
    slope = summarize(ts, vs, 100.0)["slope_per_s"]
    expected = np.polyfit(ts / NS, vs, 1)[0]
    span = float(ts.max() - ts.min()) / NS
    # The slope is in value units per second; compare at the scale of the data.
    tol = 1e-6 * max(1.0, float(np.abs(vs).max())) / max(span, 1e-9) + 1e-9 * abs(expected)
    assert abs(slope - expected) <= tol


@FAST
@given(st.integers(0, 10**12), st.integers(2, 20), st.floats(-1e3, 1e3, allow_nan=False))
def test_summarize_slope_of_a_constant_series_is_zero(t0: int, n: int, c: float) -> None:
    ts = t0 + np.arange(n, dtype=np.int64) * NS
    assert summarize(ts, np.full(n, c), 10.0)["slope_per_s"] == 0.0
