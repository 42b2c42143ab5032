"""Per-series aggregates over aligned time blocks: reduce raw samples, merge blocks, finish.

An `Agg` holds ``R`` rows, one per (series id, block start): count, mean, min, max, the last
value, the sample times' mean (seconds from the block start) with their centred second moment
``m2t`` and the time–value co-moment ``ctv`` (so the least-squares slope is ``ctv / m2t``), and
one log-bucket sketch per row. Rows merge with Chan et al.'s parallel update — shifting each
row's mean time by its offset in the bigger block leaves ``m2t`` and ``ctv`` unchanged — so a
10 s block is an exact merge of ten 1 s panes and a 60 s hopping window of six 10 s blocks.
Means are taken relative to the group's minimum, so a constant series has exactly its value as
mean and exactly zero slope however it is split. Everything is vectorised over all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from perfloop.streams.sketch import LogBuckets, Sketches

__all__ = ["QUANTILES", "Agg", "reduce_samples"]

NS = 1_000_000_000
QUANTILES = (0.5, 0.95, 0.99)
_I64 = np.int64
_EXACT = 1 << 52  # below this, floor(x / pane) by float division is exact (1 ns ≫ rounding)


@dataclass(frozen=True, slots=True)
class Agg:
    """Rows of per-series block aggregates (see the module docstring)."""

    sid: np.ndarray  # int64 series id
    start: np.ndarray  # int64 block start, ns
    n: np.ndarray  # int64 sample count (≥ 1)
    mean: np.ndarray
    vmin: np.ndarray
    vmax: np.ndarray
    last: np.ndarray  # value of the newest sample (the largest on a tie)
    tmean: np.ndarray  # mean sample time, seconds from ``start``
    m2t: np.ndarray
    ctv: np.ndarray
    sk: Sketches

    def __len__(self) -> int:
        return len(self.sid)

    @classmethod
    def empty(cls, mapping: LogBuckets) -> Agg:
        i, f = np.zeros(0, dtype=_I64), np.zeros(0)
        return cls(i, i, i, f, f, f, f, f, f, f, Sketches.empty(mapping))

    def take(self, idx: np.ndarray) -> Agg:
        """Rows ``idx`` (indices), in that order."""
        cols = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "sk"}
        return Agg(**cols, sk=self.sk.take(idx))

    @staticmethod
    def concat(parts: Sequence[Agg]) -> Agg:
        if len(parts) == 1:
            return parts[0]
        cols = {
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in fields(Agg)
            if f.name != "sk"
        }
        return Agg(**cols, sk=Sketches.concat([p.sk for p in parts]))

    def to_state(self) -> dict[str, np.ndarray]:
        """Plain arrays (for snapshots)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sk"}
        d.update(sk_ptr=self.sk.ptr, sk_bucket=self.sk.bucket, sk_count=self.sk.count)
        return d

    @classmethod
    def from_state(cls, d: dict[str, np.ndarray], mapping: LogBuckets) -> Agg:
        cols = {k: v for k, v in d.items() if not k.startswith("sk_")}
        return cls(**cols, sk=Sketches(mapping, d["sk_ptr"], d["sk_bucket"], d["sk_count"]))

    def merge(self, gid: np.ndarray, n_groups: int, g_sid: np.ndarray, g_start: np.ndarray) -> Agg:
        """Merge row ``i`` into group ``gid[i]``; group ``g`` is series ``g_sid[g]`` over the
        block starting at ``g_start[g]`` (≤ the start of each of its rows)."""
        G = n_groups
        n = self.n.astype(np.float64)
        nn = np.bincount(gid, n, G)
        vmin = np.full(G, np.inf)
        np.minimum.at(vmin, gid, self.vmin)
        vmax = np.full(G, -np.inf)
        np.maximum.at(vmax, gid, self.vmax)
        tm = self.tmean + (self.start - g_start[gid]) / NS
        tmin = np.full(G, np.inf)
        np.minimum.at(tmin, gid, tm)
        big_t = tmin + np.bincount(gid, n * (tm - tmin[gid]), G) / nn
        mean = vmin + np.bincount(gid, n * (self.mean - vmin[gid]), G) / nn
        dt = tm - big_t[gid]
        dv = self.mean - mean[gid]
        m2t = np.bincount(gid, self.m2t + n * dt * dt, G)
        ctv = np.bincount(gid, self.ctv + n * dt * dv, G)
        newest = np.full(G, np.iinfo(_I64).min)
        np.maximum.at(newest, gid, self.start)
        last = np.empty(G)
        at = self.start == newest[gid]  # one row per group: a series has one row per block
        last[gid[at]] = self.last[at]
        return Agg(
            sid=g_sid,
            start=g_start,
            n=nn.astype(_I64),
            mean=mean,
            vmin=vmin,
            vmax=vmax,
            last=last,
            tmean=big_t,
            m2t=m2t,
            ctv=ctv,
            sk=self.sk.merge(gid, G),
        )

    def slope(self) -> np.ndarray:
        """Least-squares slope of value over time, units per second (0 with no time spread)."""
        ok = self.m2t > 0
        out = np.zeros(len(self))
        np.divide(self.ctv, self.m2t, out=out, where=ok)
        return out

    def quantiles(self, qs: Sequence[float] = QUANTILES) -> np.ndarray:
        return self.sk.quantiles(qs, self.vmin, self.vmax)


def _dense_groups(key: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted unique keys, group of each element, count per group) for keys in [0, span)."""
    if span <= max(4 * len(key), 1 << 16):
        counts = np.bincount(key, minlength=span)
        present = np.flatnonzero(counts)
        remap = np.empty(span, dtype=_I64)
        remap[present] = np.arange(len(present), dtype=_I64)
        return present, remap[key], counts[present]
    uniq, inv = np.unique(key, return_inverse=True)
    return uniq, inv, np.bincount(inv)


def reduce_samples(
    mapping: LogBuckets,
    sid: np.ndarray,
    ts: np.ndarray,
    v: np.ndarray,
    pane_ns: int,
    n_sids: int,
) -> Agg:
    """One row per (series, pane) of raw samples (``0 ≤ sid < n_sids``; finite values)."""
    if len(sid) == 0:
        return Agg.empty(mapping)
    p0 = int(ts.min()) // pane_ns
    x = ts - p0 * pane_ns
    # Float division vectorises (int64 division does not) and is exact below _EXACT.
    rel = np.floor(x / pane_ns).astype(_I64) if int(x.max()) < _EXACT else x // pane_ns
    span = (int(rel.max()) + 1) * n_sids
    keys, g, counts = _dense_groups(rel * n_sids + sid, span)
    G = len(keys)
    n = counts.astype(np.float64)
    t = (x - rel * pane_ns) / NS
    vmin = np.full(G, np.inf)
    np.minimum.at(vmin, g, v)
    vmax = np.full(G, -np.inf)
    np.maximum.at(vmax, g, v)
    tmin = np.full(G, np.inf)
    np.minimum.at(tmin, g, t)
    mean = vmin + np.bincount(g, v - vmin[g], G) / n
    big_t = tmin + np.bincount(g, t - tmin[g], G) / n
    dt = t - big_t[g]
    m2t = np.bincount(g, dt * dt, G)
    ctv = np.bincount(g, dt * (v - mean[g]), G)
    newest = np.full(G, np.iinfo(_I64).min)
    np.maximum.at(newest, g, ts)
    at = ts == newest[g]
    last = np.full(G, -np.inf)
    np.maximum.at(last, g[at], v[at])
    return Agg(
        sid=keys % n_sids,
        start=(keys // n_sids + p0) * pane_ns,
        n=counts.astype(_I64),
        mean=mean,
        vmin=vmin,
        vmax=vmax,
        last=last,
        tmean=big_t,
        m2t=m2t,
        ctv=ctv,
        sk=Sketches.from_values(mapping, g, v, G, vmin, vmax),
    )
