"""Mergeable quantile sketches for many series at once: log buckets with relative accuracy.

A DDSketch-style mapping (`LogBuckets`) puts a value ``x`` with ``|x| >= min_value`` in bucket
``k = ceil(log_gamma |x|)`` with ``gamma = (1 + alpha) / (1 - alpha)``: bucket ``k`` holds the
values in ``(gamma**(k-1), gamma**k]`` and its representative ``2 gamma**k / (gamma + 1)`` is
within relative error ``alpha`` of every one of them. Negative values use the mirrored buckets,
values with ``|x| < min_value`` share one zero bucket (represented by 0), and magnitudes above
``max_value`` share the top bucket (they lose the guarantee; the returned quantiles are still
clamped to the exact min and max when those are given). Bucket numbers are ordered like the
values they hold.

`Sketches` holds the sketches of ``n_rows`` series (or series × time blocks) in one flat
structure, vectorised with numpy: per row a run of ``(bucket, count)`` entries sorted by
bucket (CSR: ``ptr`` of length ``n_rows + 1``). Build it from ``(rows, values)`` arrays in one
sort, merge rows into groups (a concatenation and a sort-reduce, so merging is associative and
commutative: only counts add up), and read quantiles of every row at once.

Guarantee: for a row holding the values ``x`` and a quantile ``q``, `Sketches.quantiles`
returns a value within relative error ``alpha`` of ``np.quantile(x, q, method="lower")`` (the
sample of rank ``floor(q (n - 1))``), or within ``min_value`` of it in the zero bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LogBuckets", "Sketches"]

_I64 = np.int64
_I32 = np.int32  # bucket numbers and counts are stored narrow: half the memory


@dataclass(frozen=True, slots=True)
class LogBuckets:
    """The value → bucket mapping with relative accuracy ``alpha``.

    >>> m = LogBuckets(alpha=0.01)
    >>> b = m.bucket(np.array([-2.0, 0.0, 1e-12, 3.0]))
    >>> bool(np.all(np.diff(b) >= 0)), m.value(b[1]).item(), m.value(b[2]).item()
    (True, 0.0, 0.0)
    >>> bool(abs(m.value(b[3]) - 3.0) <= 0.01 * 3.0)
    True
    """

    alpha: float = 0.01
    min_value: float = 1e-9
    max_value: float = 1e18

    def __post_init__(self) -> None:
        if not (0.0 < self.alpha < 0.5):
            raise ValueError(f"alpha must be in (0, 0.5), got {self.alpha!r}")
        if not (0.0 < self.min_value < self.max_value < math.inf):
            raise ValueError(
                f"need 0 < min_value < max_value < inf, got {self.min_value!r}, {self.max_value!r}"
            )

    @property
    def gamma(self) -> float:
        return (1.0 + self.alpha) / (1.0 - self.alpha)

    @property
    def _inv_log_gamma(self) -> float:
        return 1.0 / math.log(self.gamma)

    @property
    def _kmin(self) -> int:
        return math.ceil(math.log(self.min_value) * self._inv_log_gamma)

    @property
    def _half(self) -> int:
        """Buckets on each side of zero."""
        return math.ceil(math.log(self.max_value) * self._inv_log_gamma) - self._kmin + 1

    @property
    def n_buckets(self) -> int:
        """Bucket numbers run from 0 (most negative) to ``n_buckets - 1``; zero is the middle."""
        return 2 * self._half + 1

    @property
    def key_bits(self) -> int:
        """Bits of a bucket number: a (row, bucket) key is ``row << key_bits | bucket``."""
        return (2 * self._half).bit_length()

    def bucket(self, values: np.ndarray) -> np.ndarray:
        """Bucket number of each value (int64, ordered like the values)."""
        v = np.asarray(values, dtype=np.float64)
        a = np.abs(v)
        k = np.ceil(np.log(np.maximum(a, self.min_value)) * self._inv_log_gamma)
        half = self._half
        code = np.clip(k - (self._kmin - 1), 1, half).astype(_I64)
        code[a < self.min_value] = 0
        np.negative(code, out=code, where=v < 0)
        code += half
        return np.asarray(code)

    def value(self, buckets: np.ndarray | int) -> np.ndarray:
        """The representative value of each bucket number."""
        code = np.asarray(buckets, dtype=_I64) - self._half
        k = np.abs(code) - 1 + self._kmin
        g = self.gamma
        rep = np.exp(k * math.log(g)) * (2.0 / (g + 1.0))
        return np.where(code == 0, 0.0, np.copysign(rep, code))


DENSE_SLOTS_PER_ENTRY = 4
"""`_dense_sum` counts in one array as long as it needs at most this many slots per entry
(plus `_DENSE_MIN_SLOTS`); wider bucket ranges are sorted instead."""
_DENSE_MIN_SLOTS = 4096


def _dense_sum(
    groups: np.ndarray,
    buckets: np.ndarray,
    counts: np.ndarray | None,
    lo: np.ndarray,
    hi: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Counts summed by (group, bucket), without a sort: each group's bucket range
    ``[lo[g], hi[g]]`` gets a run of slots in one array and a ``bincount`` adds the counts
    into them (``counts`` None: one each). Returns the CSR ``(ptr, buckets, counts)`` over
    ``len(lo)`` groups, entries in (group, bucket) order, or None when the ranges would need
    more than `DENSE_SLOTS_PER_ENTRY` slots per entry. A series' values in a window span few
    buckets (a 1 % bucket is 2 % wide), so its range is narrow and this is far cheaper than
    sorting the entries."""
    span = np.maximum(hi - lo + 1, 0)
    total = int(span.sum())
    if total > DENSE_SLOTS_PER_ENTRY * len(buckets) + _DENSE_MIN_SLOTS:
        return None
    base = np.zeros(len(lo) + 1, dtype=_I64)
    np.cumsum(span, out=base[1:])
    slot = base[groups] + (buckets - lo[groups])
    summed = np.bincount(slot, weights=counts, minlength=total)
    at = np.flatnonzero(summed)
    group = np.searchsorted(base, at, side="right") - 1
    ptr = np.zeros(len(lo) + 1, dtype=_I64)
    np.cumsum(np.bincount(group, minlength=len(lo)), out=ptr[1:])
    return ptr, at - base[group] + lo[group], summed[at].astype(_I64)


def _sum_by_key(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique keys and the summed counts of each (keys ≥ 0, counts ≥ 1)."""
    if len(keys) == 0:
        return keys.astype(_I64), counts.astype(_I64)
    cbits = max(1, int(counts.max()).bit_length())
    if int(keys.max()) < (1 << (62 - cbits)):
        # Pack each count under its key: one plain sort instead of an argsort and two gathers.
        packed = (keys << cbits) | counts
        packed.sort()
        skeys = packed >> cbits
        scounts = packed & ((1 << cbits) - 1)
    else:
        order = np.argsort(keys, kind="stable")
        skeys, scounts = keys[order], counts[order]
    starts = np.flatnonzero(np.r_[True, skeys[1:] != skeys[:-1]])
    return skeys[starts], np.add.reduceat(scounts, starts)


@dataclass(frozen=True, slots=True)
class Sketches:
    """The sketches of ``n_rows`` rows: entries sorted by (row, bucket), CSR by row.

    >>> m = LogBuckets(0.01)
    >>> sk = Sketches.from_values(m, np.array([0, 0, 0, 1]), np.array([1.0, 2.0, 3.0, 7.0]), 2)
    >>> sk.totals().tolist()
    [3, 1]
    >>> both = sk.merge(np.array([0, 0]), 1)
    >>> [round(float(x), 1) for x in both.quantiles([0.0, 0.5, 1.0])[0]]
    [1.0, 2.0, 7.0]
    """

    mapping: LogBuckets
    ptr: np.ndarray  # int64[n_rows + 1]
    bucket: np.ndarray  # int32[n_entries]
    count: np.ndarray  # int32[n_entries]

    @property
    def n_rows(self) -> int:
        return len(self.ptr) - 1

    @classmethod
    def empty(cls, mapping: LogBuckets, n_rows: int = 0) -> Sketches:
        z = np.zeros(0, dtype=_I32)
        return cls(mapping, np.zeros(n_rows + 1, dtype=_I64), z, z)

    @classmethod
    def _from_keys(
        cls, mapping: LogBuckets, keys: np.ndarray, counts: np.ndarray, n_rows: int
    ) -> Sketches:
        bits = mapping.key_bits
        ptr = np.zeros(n_rows + 1, dtype=_I64)
        np.cumsum(np.bincount(keys >> bits, minlength=n_rows), out=ptr[1:])
        return cls(mapping, ptr, (keys & ((1 << bits) - 1)).astype(_I32), counts.astype(_I32))

    @classmethod
    def from_values(
        cls,
        mapping: LogBuckets,
        rows: np.ndarray,
        values: np.ndarray,
        n_rows: int,
        lo: np.ndarray | None = None,
        hi: np.ndarray | None = None,
    ) -> Sketches:
        """Sketch each row's values; ``rows[i]`` (0 ≤ row < ``n_rows``) owns ``values[i]``.

        ``lo``/``hi``: each row's smallest and largest value (finite), when known; they only
        make it faster (the buckets between them are counted without a sort)."""
        rows = np.asarray(rows, dtype=_I64)
        buckets = mapping.bucket(values)
        if lo is not None and hi is not None and len(buckets):
            dense = _dense_sum(rows, buckets, None, mapping.bucket(lo), mapping.bucket(hi))
            if dense is not None:
                ptr, bucket, count = dense
                return cls(mapping, ptr, bucket.astype(_I32), count.astype(_I32))
        keys = (rows << mapping.key_bits) | buckets
        keys.sort()
        if len(keys) == 0:
            return cls.empty(mapping, n_rows)
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        counts = np.diff(np.r_[starts, len(keys)])
        return cls._from_keys(mapping, keys[starts], counts, n_rows)

    def lengths(self) -> np.ndarray:
        """Entries per row."""
        return np.diff(self.ptr)

    def totals(self) -> np.ndarray:
        """Values per row."""
        csum = np.r_[0, np.cumsum(self.count, dtype=_I64)]
        return np.asarray(csum[self.ptr[1:]] - csum[self.ptr[:-1]])

    def take(self, rows: np.ndarray) -> Sketches:
        """The sketches of ``rows`` (indices, in that order; a row may repeat)."""
        rows = np.asarray(rows, dtype=_I64)
        lens = self.lengths()[rows]
        ptr = np.zeros(len(rows) + 1, dtype=_I64)
        np.cumsum(lens, out=ptr[1:])
        # Entry j of output row i is input entry ptr_in[rows[i]] + (j - ptr[i]).
        idx = np.arange(ptr[-1], dtype=_I64) + np.repeat(self.ptr[rows] - ptr[:-1], lens)
        return Sketches(self.mapping, ptr, self.bucket[idx], self.count[idx])

    def merge(self, groups: np.ndarray, n_groups: int) -> Sketches:
        """Merge row ``i`` into group ``groups[i]``: counts of equal buckets add up."""
        groups = np.asarray(groups, dtype=_I64)
        lengths = self.lengths()
        egroup = np.repeat(groups, lengths)
        if len(self.bucket):
            # A row's entries are sorted by bucket: its first and last are its range.
            full = lengths > 0
            g = groups[full]
            lo = np.full(n_groups, np.iinfo(_I64).max, dtype=_I64)
            np.minimum.at(lo, g, self.bucket[self.ptr[:-1][full]])
            hi = np.full(n_groups, -1, dtype=_I64)
            np.maximum.at(hi, g, self.bucket[self.ptr[1:][full] - 1])
            dense = _dense_sum(egroup, self.bucket, self.count, lo, hi)
            if dense is not None:
                ptr, bucket, count = dense
                return Sketches(self.mapping, ptr, bucket.astype(_I32), count.astype(_I32))
        keys = (egroup << self.mapping.key_bits) | self.bucket
        keys, counts = _sum_by_key(keys, self.count.astype(_I64))
        return Sketches._from_keys(self.mapping, keys, counts, n_groups)

    @staticmethod
    def concat(parts: Sequence[Sketches]) -> Sketches:
        """Rows of ``parts`` one after the other (all must share one mapping)."""
        if len(parts) == 1:
            return parts[0]
        mapping = parts[0].mapping
        if any(p.mapping != mapping for p in parts):
            raise ValueError("cannot concatenate sketches with different mappings")
        offsets = np.cumsum([0] + [int(p.ptr[-1]) for p in parts[:-1]])
        ptr = np.concatenate([[0]] + [p.ptr[1:] + o for p, o in zip(parts, offsets, strict=True)])
        return Sketches(
            mapping,
            ptr.astype(_I64),
            np.concatenate([p.bucket for p in parts]),
            np.concatenate([p.count for p in parts]),
        )

    def quantiles(
        self,
        qs: Sequence[float],
        lo: np.ndarray | None = None,
        hi: np.ndarray | None = None,
    ) -> np.ndarray:
        """float64[n_rows, len(qs)]: each row's quantiles (NaN for an empty row).

        ``lo``/``hi`` (the rows' exact min and max) clamp the estimates, which only brings
        them closer to the true quantiles.
        """
        n = self.n_rows
        out = np.full((n, len(qs)), np.nan)
        if n == 0 or len(self.count) == 0:
            return out
        csum = np.cumsum(self.count, dtype=_I64)
        base = np.r_[0, csum][self.ptr[:-1]]
        total = np.r_[0, csum][self.ptr[1:]] - base
        ok = total > 0
        q = np.asarray(qs, dtype=np.float64)[None, :]
        rank = np.floor((total[ok, None] - 1) * q).astype(_I64)
        e = np.searchsorted(csum, base[ok, None] + rank + 1, side="left")
        out[ok] = self.mapping.value(self.bucket[e])
        if lo is not None:
            np.maximum(out, np.asarray(lo, dtype=np.float64)[:, None], out=out)
        if hi is not None:
            np.minimum(out, np.asarray(hi, dtype=np.float64)[:, None], out=out)
        return out
