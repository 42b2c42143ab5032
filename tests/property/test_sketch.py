"""Log-bucket sketches under hypothesis: quantiles within alpha of a true sample quantile,
and merging is exact (associative, commutative, equal to sketching everything at once)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.streams.sketch import (
    DENSE_SLOTS_PER_ENTRY,
    LogBuckets,
    Sketches,
    _dense_sum,
    _sum_by_key,
)

FAST = settings(max_examples=80, deadline=None)
QS = (0.0, 0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 1.0)

alphas = st.sampled_from([0.001, 0.01, 0.05])
# Magnitudes across the whole range a metric takes: utilisations, milliseconds, bytes, zeros.
values = st.one_of(
    st.floats(-1e12, 1e12, allow_nan=False, allow_infinity=False),
    st.floats(-1e-6, 1e-6, allow_nan=False),
    st.sampled_from([0.0, 1.0, -1.0, 1e-9, 100.0]),
)
samples = st.lists(values, min_size=1, max_size=200).map(lambda v: np.array(v, dtype=np.float64))


def _within(estimate: float, true: float, m: LogBuckets) -> bool:
    # Relative error alpha (plus float rounding of the log); the zero bucket: min_value absolute.
    return abs(estimate - true) <= m.alpha * abs(true) * (1 + 1e-9) + m.min_value


@FAST
@given(samples, alphas)
def test_each_quantile_is_within_alpha_of_the_sample_of_that_rank(x: np.ndarray, a: float) -> None:
    m = LogBuckets(alpha=a)
    sk = Sketches.from_values(m, np.zeros(len(x), dtype=np.int64), x, 1)
    est = sk.quantiles(QS)[0]
    clamped = sk.quantiles(QS, lo=np.array([x.min()]), hi=np.array([x.max()]))[0]
    for q, e, c in zip(QS, est, clamped, strict=True):
        true = float(np.quantile(x, q, method="lower"))
        assert _within(float(e), true, m), (q, e, true)
        assert _within(float(c), true, m) and x.min() <= c <= x.max()
    assert np.all(np.diff(est) >= 0), "quantiles are ordered"


@FAST
@given(st.lists(samples, min_size=1, max_size=6), alphas)
def test_rows_are_sketched_independently(parts: list[np.ndarray], a: float) -> None:
    m = LogBuckets(alpha=a)
    rows = np.concatenate([np.full(len(p), i) for i, p in enumerate(parts)])
    sk = Sketches.from_values(m, rows, np.concatenate(parts), len(parts))
    assert sk.totals().tolist() == [len(p) for p in parts]
    med = sk.quantiles([0.5])[:, 0]
    for p, e in zip(parts, med, strict=True):
        assert _within(float(e), float(np.quantile(p, 0.5, method="lower")), m)


@FAST
@given(st.lists(samples, min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_merging_equals_sketching_everything_at_once_in_any_grouping(
    parts: list[np.ndarray], rnd: object
) -> None:
    m = LogBuckets()
    whole = Sketches.from_values(
        m, np.zeros(sum(map(len, parts)), dtype=np.int64), np.concatenate(parts), 1
    )
    each = Sketches.from_values(
        m,
        np.concatenate([np.full(len(p), i) for i, p in enumerate(parts)]),
        np.concatenate(parts),
        len(parts),
    )
    order = list(range(len(parts)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    shuffled = each.take(np.array(order))
    at_once = shuffled.merge(np.zeros(len(parts), dtype=np.int64), 1)
    # ((a + b) + c) + ... built pairwise in a random tree: counts are integers, so exact.
    tree = shuffled
    while tree.n_rows > 1:
        groups = np.arange(tree.n_rows) // 2
        tree = tree.merge(groups, int(groups[-1]) + 1)
    for got in (at_once, tree):
        assert got.ptr.tolist() == whole.ptr.tolist()
        assert got.bucket.tolist() == whole.bucket.tolist()
        assert got.count.tolist() == whole.count.tolist()


@FAST
@given(st.lists(samples, min_size=1, max_size=5), st.lists(st.integers(0, 4), max_size=10))
def test_take_and_concat_keep_each_rows_sketch(parts: list[np.ndarray], pick: list[int]) -> None:
    m = LogBuckets()
    sk = [Sketches.from_values(m, np.zeros(len(p), dtype=np.int64), p, 1) for p in parts]
    both = Sketches.concat(sk)
    assert both.totals().tolist() == [len(p) for p in parts]
    idx = np.array([i % len(parts) for i in pick], dtype=np.int64)
    taken = both.take(idx)
    for j, i in enumerate(idx.tolist()):
        lo, hi = taken.ptr[j], taken.ptr[j + 1]
        assert taken.bucket[lo:hi].tolist() == sk[i].bucket.tolist()
        assert taken.count[lo:hi].tolist() == sk[i].count.tolist()


@FAST
@given(samples, alphas)
def test_buckets_are_ordered_like_values_and_representatives_within_alpha(
    x: np.ndarray, a: float
) -> None:
    m = LogBuckets(alpha=a)
    xs = np.sort(x)
    b = m.bucket(xs)
    assert np.all(np.diff(b) >= 0)
    assert np.all((b >= 0) & (b < m.n_buckets))
    rep = m.value(b)
    ok = np.abs(rep - xs) <= m.alpha * np.abs(xs) * (1 + 1e-9) + m.min_value
    assert ok.all(), xs[~ok]


def _sorted_path(rows: np.ndarray, buckets: np.ndarray, counts: np.ndarray) -> tuple:
    keys, summed = _sum_by_key((rows << 20) | buckets, counts)
    return keys >> 20, keys & ((1 << 20) - 1), summed


@FAST
@given(st.lists(samples, min_size=1, max_size=8), alphas, st.randoms(use_true_random=False))
def test_counting_in_bucket_ranges_equals_sorting(
    parts: list[np.ndarray], a: float, rnd: object
) -> None:
    # Both ways of summing counts by (row, bucket): the dense one (narrow ranges, the usual
    # case) and the sort (any ranges) give the same entries in the same order.
    m = LogBuckets(alpha=a)
    rows = np.concatenate([np.full(len(p), i, dtype=np.int64) for i, p in enumerate(parts)])
    x = np.concatenate(parts)
    perm = np.arange(len(x))
    rnd.shuffle(perm)  # type: ignore[attr-defined]
    rows, x = rows[perm], x[perm]
    buckets = m.bucket(x)
    lo = m.bucket(np.array([p.min() for p in parts]))
    hi = m.bucket(np.array([p.max() for p in parts]))
    ones = np.ones(len(x), dtype=np.int64)
    dense = _dense_sum(rows, buckets, None, lo, hi)
    want_rows, want_buckets, want_counts = _sorted_path(rows, buckets, ones)
    if dense is None:  # too wide to count densely: only a range this wide may say so
        assert int((hi - lo + 1).sum()) > DENSE_SLOTS_PER_ENTRY * len(x)
        return
    ptr, got_buckets, got_counts = dense
    got_rows = np.repeat(np.arange(len(parts)), np.diff(ptr))
    assert got_rows.tolist() == want_rows.tolist()
    assert got_buckets.tolist() == want_buckets.tolist()
    assert got_counts.tolist() == want_counts.tolist()
    # ... and so do the sketches built with and without the rows' ranges.
    fast = Sketches.from_values(m, rows, x, len(parts), np.array([p.min() for p in parts]),
                                np.array([p.max() for p in parts]))  # fmt: skip
    slow = Sketches.from_values(m, rows, x, len(parts))
    assert fast.ptr.tolist() == slow.ptr.tolist()
    assert fast.bucket.tolist() == slow.bucket.tolist()
    assert fast.count.tolist() == slow.count.tolist()


narrow = st.lists(st.floats(50.0, 60.0), min_size=1, max_size=50).map(
    lambda v: np.array(v, dtype=np.float64)
)


@FAST
@given(st.lists(narrow, min_size=2, max_size=8))
def test_merging_narrow_rows_takes_the_dense_path_and_stays_exact(parts: list[np.ndarray]) -> None:
    # A utilisation between 50 and 60 % spans ~10 buckets: merged by counting, not sorting.
    m = LogBuckets()
    rows = np.concatenate([np.full(len(p), i) for i, p in enumerate(parts)])
    each = Sketches.from_values(m, rows, np.concatenate(parts), len(parts))
    groups = np.arange(len(parts)) % 2
    lo, hi = m.bucket(np.full(2, 50.0)), m.bucket(np.full(2, 60.0))
    assert _dense_sum(np.repeat(groups, each.lengths()), each.bucket, each.count, lo, hi)
    merged = each.merge(groups, 2)
    for g in (0, 1):
        vals = np.concatenate([p for i, p in enumerate(parts) if i % 2 == g])
        one = Sketches.from_values(m, np.zeros(len(vals), dtype=np.int64), vals, 1)
        lo_, hi_ = merged.ptr[g], merged.ptr[g + 1]
        assert merged.bucket[lo_:hi_].tolist() == one.bucket.tolist()
        assert merged.count[lo_:hi_].tolist() == one.count.tolist()
