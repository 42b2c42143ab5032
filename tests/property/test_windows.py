"""Window math under hypothesis: stats equal a direct numpy computation over the same
samples, quantiles are within alpha, merging pane aggregates is associative and commutative,
and how samples are split into batches (or delivered within the lateness) changes nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.streams.sketch import LogBuckets
from perfloop.streams.windows import COLUMNS, NS, WindowSet, parse_specs
from perfloop.streams.windows._aggregates import Agg, reduce_samples

FAST = settings(max_examples=60, deadline=None)
T0 = 1_700_000_040 * NS
SPAN_MS = 40_000  # samples fall in 40 s of event time

specs = st.sampled_from(["1", "10", "4/2", "6/3", "10/5", "1,10,20/10", "60/10"])
values = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 5.0, -3.0]),
)


@st.composite
def series(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Samples of up to three ranks (times to the millisecond, in any order)."""
    n = draw(st.integers(1, 80))
    ts = draw(st.lists(st.integers(0, SPAN_MS), min_size=n, max_size=n))
    rk = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    vs = draw(st.lists(values, min_size=n, max_size=n))
    return T0 + np.array(ts, dtype=np.int64) * 1_000_000, np.array(rk), np.array(vs)


def _feed(ws: WindowSet, ts: np.ndarray, rk: np.ndarray, vs: np.ndarray, wall: int) -> None:
    for r in np.unique(rk):
        m = rk == r
        ws.add("j", "n0", int(r), -1, ts[m], "m", vs[m], wall_ns=wall)


def _close_all(ws: WindowSet) -> dict[str, np.ndarray]:
    return ws.advance(T0 + 200 * NS)  # past every window; short of forgetting the job


def _rows(cols: dict[str, np.ndarray]) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for i in range(len(cols["ts_ns"])):
        r = {k: cols[k][i] for k in COLUMNS}
        out[(r["rank"], r["window_s"], r["hop_s"], r["ts_ns"])] = r
    return out


def _slope(t: np.ndarray, v: np.ndarray) -> float:
    if np.ptp(t) == 0:  # one instant: no slope (t - t.mean() would not be exactly 0)
        return 0.0
    tc = t - t.mean()
    d = float(tc @ tc)
    return 0.0 if d == 0 else float(tc @ (v - v.mean())) / d


@FAST
@given(series(), specs)
def test_window_stats_equal_numpy_over_the_same_samples(
    s: tuple[np.ndarray, np.ndarray, np.ndarray], spec: str
) -> None:
    ts, rk, vs = s
    ws = WindowSet(spec, lateness_s=0)
    _feed(ws, ts, rk, vs, wall=T0)
    got = _rows(_close_all(ws))
    expected = 0
    for sp in parse_specs(spec):
        size, hop = sp.size_ns, sp.hop_ns
        for r in np.unique(rk):
            t, v = ts[rk == r], vs[rk == r]
            for k in range((int(t.min()) - size) // hop, int(t.max()) // hop + 1):
                inside = (t >= k * hop) & (t < k * hop + size)
                if not inside.any():
                    continue
                expected += 1
                row = got[(r, sp.size_s, sp.hop_s, k * hop)]
                x, tx = v[inside], (t[inside] - k * hop) / NS
                scale = max(1.0, float(np.abs(x).max()))
                assert row["count"] == len(x)
                assert row["min"] == x.min() and row["max"] == x.max()
                assert abs(row["mean"] - x.mean()) <= 1e-9 * scale
                assert row["rate_per_s"] == len(x) / sp.size_s
                assert row["window_end_ns"] - row["ts_ns"] == size
                span = float(np.ptp(tx))
                tol = 1e-6 * scale / max(span, 1e-3) ** 2 + 1e-9 * abs(_slope(tx, x))
                assert abs(row["slope_per_s"] - _slope(tx, x)) <= tol
                for q, col in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
                    true = float(np.quantile(x, q, method="lower"))
                    assert abs(row[col] - true) <= 0.01 * abs(true) * (1 + 1e-9) + 1e-9
    assert len(got) == expected, "no window without samples, none missing"


@FAST
@given(st.integers(1, 50), values, st.integers(0, 10**6))
def test_a_constant_series_has_exactly_its_value_as_mean_and_zero_slope(
    n: int, c: float, seed: int
) -> None:
    ts = T0 + np.sort(np.random.default_rng(seed).integers(0, 30 * NS, n))
    ws = WindowSet("1,10,60/10", lateness_s=0)
    ws.add("j", "n0", 0, -1, ts, "m", np.full(n, c), wall_ns=T0)
    cols = _close_all(ws)
    assert len(cols["ts_ns"]) > 0
    assert (cols["mean"] == c).all() and (cols["slope_per_s"] == 0.0).all()


@FAST
@given(series(), specs, st.integers(1, 8), st.randoms(use_true_random=False))
def test_any_batch_split_and_order_gives_the_same_windows(
    s: tuple[np.ndarray, np.ndarray, np.ndarray], spec: str, parts: int, rnd: Any
) -> None:
    ts, rk, vs = s
    whole = WindowSet(spec, lateness_s=0)
    _feed(whole, ts, rk, vs, wall=T0)
    order = np.arange(len(ts))
    rnd.shuffle(order)
    split = WindowSet(spec, lateness_s=0)
    for chunk in np.array_split(order, parts):
        if len(chunk):
            _feed(split, ts[chunk], rk[chunk], vs[chunk], wall=T0)
    a, b = _rows(_close_all(whole)), _rows(_close_all(split))
    assert a.keys() == b.keys()
    for key, ra in a.items():
        rb = b[key]
        for c in ("count", "min", "max", "p50", "p95", "p99", "rate_per_s"):
            assert ra[c] == rb[c], c
        scale = max(1.0, abs(ra["max"]), abs(ra["min"]))
        assert abs(ra["mean"] - rb["mean"]) <= 1e-9 * scale
        assert abs(ra["slope_per_s"] - rb["slope_per_s"]) <= 1e-6 * (abs(ra["slope_per_s"]) + scale)


@FAST
@given(series(), specs, st.integers(2, 6))
def test_advancing_between_batches_within_the_lateness_changes_nothing(
    s: tuple[np.ndarray, np.ndarray, np.ndarray], spec: str, parts: int
) -> None:
    ts, rk, vs = s
    whole = WindowSet(spec, lateness_s=45)
    _feed(whole, ts, rk, vs, wall=T0)
    stepped = WindowSet(spec, lateness_s=45)  # disorder within 45 s: no sample is late
    out = []
    for chunk in np.array_split(np.arange(len(ts)), parts):
        if len(chunk):
            wall = int(ts[chunk].max())
            _feed(stepped, ts[chunk], rk[chunk], vs[chunk], wall=wall)
            out.append(_rows(stepped.advance(wall)))
    out.append(_rows(_close_all(stepped)))
    merged = {k: v for o in out for k, v in o.items()}
    assert sum(map(len, out)) == len(merged), "each window is emitted once"
    a = _rows(_close_all(whole))
    assert a.keys() == merged.keys() and stepped.late_samples == 0
    for key, ra in a.items():
        rb = merged[key]
        for c in ("count", "min", "max", "p50", "p99"):
            assert ra[c] == rb[c], c
        assert abs(ra["mean"] - rb["mean"]) <= 1e-9 * max(1.0, abs(ra["max"]), abs(ra["min"]))


@FAST
@given(series(), st.integers(1, 10))
def test_late_samples_are_counted_not_silently_dropped(
    s: tuple[np.ndarray, np.ndarray, np.ndarray], n_late: int
) -> None:
    ts, rk, vs = s
    ws = WindowSet("1", lateness_s=0)
    _feed(ws, ts, rk, vs, wall=T0)
    closed = _close_all(ws)
    ws.add("j", "n0", 0, -1, np.full(n_late, int(ts.min())), "m", np.ones(n_late), wall_ns=T0)
    assert ws.late_samples == n_late
    assert int(closed["count"].sum()) + ws.late_samples == len(ts) + n_late
    assert len(ws.advance(T0 + 300 * NS)["ts_ns"]) == 0


def _blocks(rows: Agg, size: int, n_sids: int) -> Agg:
    """Merge rows into aligned blocks of ``size`` ns per series (as the levels do)."""
    block = rows.start // size
    uniq, gid = np.unique(block * n_sids + rows.sid, return_inverse=True)
    return rows.merge(gid, len(uniq), uniq % n_sids, uniq // n_sids * size)


@FAST
@given(series(), st.sampled_from([2, 5, 10, 20]), st.randoms(use_true_random=False))
def test_merging_pane_aggregates_is_associative_and_commutative(
    s: tuple[np.ndarray, np.ndarray, np.ndarray], block_s: int, rnd: Any
) -> None:
    ts, rk, vs = s
    panes = reduce_samples(LogBuckets(), rk.astype(np.int64), ts, vs, NS, 3)
    order = np.arange(len(panes))
    rnd.shuffle(order)
    shuffled = panes.take(order)  # row order must not matter
    direct = _blocks(panes, 60 * NS, 3)
    via = _blocks(_blocks(shuffled, block_s * NS, 3), 60 * NS, 3)  # ((a + b) + c) + ...
    raw = _blocks(reduce_samples(LogBuckets(), rk.astype(np.int64), ts, vs, 60 * NS, 3), 60 * NS, 3)
    scale = max(1.0, float(np.abs(vs).max()))
    for other in (via, raw):
        assert other.sid.tolist() == direct.sid.tolist()
        assert other.start.tolist() == direct.start.tolist()
        for f in ("n", "vmin", "vmax", "last"):
            assert getattr(other, f).tolist() == getattr(direct, f).tolist(), f
        assert other.sk.count.tolist() == direct.sk.count.tolist()
        assert other.sk.bucket.tolist() == direct.sk.bucket.tolist()
        assert np.allclose(other.mean, direct.mean, rtol=0, atol=1e-9 * scale)
        assert np.allclose(other.slope(), direct.slope(), rtol=1e-6, atol=1e-3 * scale)
    for i, (sid, start) in enumerate(zip(direct.sid, direct.start, strict=True)):
        m = (rk == sid) & (ts >= start) & (ts < start + 60 * NS)
        assert direct.n[i] == m.sum() and abs(direct.mean[i] - vs[m].mean()) <= 1e-9 * scale
        assert direct.last[i] == vs[m][ts[m] == ts[m].max()].max()
