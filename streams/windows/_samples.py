"""Telemetry batches → long-form samples ``(ts_ns, source, rank, device, metric id, value)``.

Batches of many sources are read at once: their columns are concatenated with a ``_src``
column (the source index of each row); device -1 means not a device series. Wide kinds
(gpu, host, step) yield one sample per row and configured column or derived figure; spans,
collectives and kernels yield metrics named after their phase or op:

- span (depth-0 spans only): ``phase.<phase>_ms`` (duration, at the span's start) and
  ``phase.<phase>_share`` (duration / the rank's step, the sum of the depth-0 spans of that
  (rank, step), at the step's end). Spans of one step may arrive in several batches, so the
  spans of each rank's newest step wait until it is over (`span_split`).
- collective: ``comm.<op>_ms`` and ``comm.<op>_busbw_gbps`` (bus bandwidth, NCCL's
  convention: algorithm bandwidth × 2(n-1)/n for all_reduce, × (n-1)/n for all_gather,
  reduce_scatter and all_to_all); ops outside `COLLECTIVE_OPS` count as ``other``.
- kernel: ``gpu_busy_ms`` from the stream -1 / class ``all`` rows (the step's GPU busy time).

Values that are not finite (a null ``loss``) are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from perfloop.schemas.codec import BATCH_KINDS
from perfloop.schemas.telemetry import COLLECTIVE_OPS

__all__ = [
    "AVAILABLE",
    "DEFAULT_METRICS",
    "Samples",
    "SpanRows",
    "collective_samples",
    "kernel_samples",
    "needed_columns",
    "span_rows",
    "span_split",
    "wide_samples",
]

Samples = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""ts_ns, source index, rank, device (-1: not a device series), metric id, value."""
MidsOf = Callable[[Sequence[str], str], np.ndarray]  # (names, family) -> metric ids

_STEP_BITS = 42
_NOT_METRICS = {"ts_ns", "rank", "device", "step", "pid", "epoch", "throttle_reasons", "last_xid"}


_ENVELOPE = {"schema_version", "event_id", "job_id", "node"}


def _numeric(kind: str) -> tuple[str, ...]:
    """Number columns of a batch kind that are quantities (not ids, codes or bitmasks)."""
    fields = BATCH_KINDS[kind].model_fields
    return tuple(
        name
        for name, f in fields.items()
        if f.annotation in (int, float, float | None)
        and name not in _NOT_METRICS
        and name not in _ENVELOPE
    )


_DERIVED: dict[str, Callable[[dict[str, np.ndarray]], np.ndarray]] = {
    "data_wait_share": lambda c: np.minimum(c["data_wait_ms"] / c["step_time_ms"], 1.0),
    # Throughput only where the job reports it (0 = not reported): NaN is dropped.
    "tokens_per_s": lambda c: np.where(
        c["tokens"] > 0, 1e3 * c["tokens"] / c["step_time_ms"], np.nan
    ),
    "samples_per_s": lambda c: np.where(
        c["samples"] > 0, 1e3 * c["samples"] / c["step_time_ms"], np.nan
    ),
}

AVAILABLE: dict[str, tuple[str, ...]] = {
    "gpu": _numeric("gpu"),
    "host": _numeric("host"),
    "step": (*_numeric("step"), *_DERIVED),
    "span": ("duration_ms", "share"),
    "collective": ("duration_ms", "busbw_gbps"),
    "kernel": ("busy_ms",),
}
"""Metric names each batch kind can window (``windows.metrics.<kind>`` picks among them)."""

DEFAULT_METRICS: dict[str, tuple[str, ...]] = {
    # Lean by default: every metric costs one window row per rank (or device), per window,
    # which at 1 s is as many rows as samples for a rich set. `windows.metrics.<kind>` adds
    # any of `AVAILABLE` live.
    "gpu": ("sm_util_pct", "mem_used_bytes", "power_w", "sm_clock_mhz"),
    "host": ("proc_cpu_pct", "loader_cpu_pct"),
    "step": ("step_time_ms", "data_wait_share"),
    "span": ("share",),
    "collective": ("duration_ms",),
    "kernel": ("busy_ms",),
}
"""The metrics windowed unless configured otherwise."""

_INPUTS = {
    "data_wait_share": ("data_wait_ms", "step_time_ms"),
    "tokens_per_s": ("tokens", "step_time_ms"),
    "samples_per_s": ("samples", "step_time_ms"),
}
_FIXED = {
    "gpu": ("ts_ns", "rank", "device"),
    "host": ("ts_ns", "rank"),
    "step": ("ts_ns", "rank"),
    "span": ("ts_ns", "rank", "step", "phase", "duration_ms", "depth"),
    "collective": ("ts_ns", "rank", "op", "size_bytes", "group_size", "duration_ms"),
    "kernel": ("ts_ns", "rank", "stream", "kernel_class", "busy_ms"),
}


def needed_columns(kind: str, names: Sequence[str]) -> tuple[str, ...]:
    """The batch columns the extraction of ``names`` of ``kind`` reads."""
    cols = dict.fromkeys((*_FIXED[kind], "_src"))
    if kind in ("gpu", "host", "step"):
        for n in names:
            cols.update(dict.fromkeys(_INPUTS.get(n, (n,))))
    return tuple(cols)


_BUS_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
_KNOWN_OPS = frozenset(COLLECTIVE_OPS)


def _finite(s: Samples) -> Samples:
    ok = np.isfinite(s[5])
    if ok.all():
        return s
    return tuple(a[ok] for a in s)  # type: ignore[return-value]


def wide_samples(cols: dict[str, np.ndarray], names: Sequence[str], mids: np.ndarray) -> Samples:
    """One sample per row and metric of a gpu, host or step batch."""
    ts = cols["ts_ns"]
    n, m = len(ts), len(names)
    dev = np.tile(cols["device"], m) if "device" in cols else np.full(n * m, -1)
    values = [_DERIVED[m](cols) if m in _DERIVED else cols[m] for m in names]
    v = np.concatenate(values).astype(np.float64, copy=False)
    src, rank = np.tile(cols["_src"], m), np.tile(cols["rank"], m)
    return _finite((np.tile(ts, m), src, rank, dev, np.repeat(mids, n), v))


def _lookup(strings: np.ndarray, table: dict[str, int], make: Callable[[str], int]) -> np.ndarray:
    """Map each string to its id via ``table`` (``make`` registers the unseen)."""
    try:
        return np.fromiter(map(table.__getitem__, strings), dtype=np.int64, count=len(strings))
    except KeyError:
        for s in set(strings.tolist()) - table.keys():
            table[s] = make(s)
        return np.fromiter(map(table.__getitem__, strings), dtype=np.int64, count=len(strings))


SpanRows = dict[str, np.ndarray]  # ts_ns, src, rank, step, duration_ms, mids, done


def span_rows(cols: dict[str, np.ndarray], phase_mids: dict[str, int], mid_of: MidsOf) -> SpanRows:
    """The depth-0 spans of a batch as buffer rows (``mids`` packs the two metric ids)."""
    d0 = cols["depth"] == 0
    if not d0.all():
        cols = {k: cols[k][d0] for k in (*_FIXED["span"], "_src")}

    def make(phase: str) -> int:
        ms = mid_of([f"phase.{phase}_ms"], "span:duration_ms")[0]
        share = mid_of([f"phase.{phase}_share"], "span:share")[0]
        return int(ms) | (int(share) << 32)

    return {
        "ts_ns": cols["ts_ns"],
        "src": cols["_src"],
        "rank": cols["rank"],
        "step": cols["step"],
        "duration_ms": cols["duration_ms"],
        "mids": _lookup(cols["phase"], phase_mids, make),
        "done": np.zeros(len(cols["ts_ns"]), dtype=bool),  # duration sample emitted
    }


def _step_groups(
    src: np.ndarray, rank: np.ndarray, step: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Groups of rows by (source, rank, step), sorted: (each group's (source, rank) key, the
    group of each row)."""
    primary = (src << 21) + rank + 1
    lo = int(step.min())
    if int(step.max()) - lo < (1 << 24) and int(primary.max()) < (1 << 39):
        uniq, inv = np.unique((primary << 24) | (step - lo), return_inverse=True)
        return uniq >> 24, inv
    order = np.lexsort((step, primary))
    p, s = primary[order], step[order]
    new = np.r_[True, (p[1:] != p[:-1]) | (s[1:] != s[:-1])]
    inv = np.empty(len(order), dtype=np.int64)
    inv[order] = np.cumsum(new) - 1
    return p[new], inv


def span_split(
    buf: SpanRows, cu: np.ndarray, names: Sequence[str]
) -> tuple[Samples, SpanRows | None]:
    """Samples of buffered spans and the rows still needed (``cu``: each source's closed-until
    time, indexed by source).

    Every span's duration is emitted once (at its start). A step is over when a later step of
    its rank is in the buffer (spans of a rank arrive in order) or when it ends before its
    job's closed-until time (a span of it still to come would be late anyway): then its shares
    are emitted, stamped at the step's end. The rows of unfinished steps stay.
    """
    ts, src, dur, mids = buf["ts_ns"], buf["src"], buf["duration_ms"], buf["mids"]
    rank = buf["rank"]
    dev = np.full(len(ts), -1)
    parts = []
    if "duration_ms" in names and not buf["done"].all():
        new = ~buf["done"]
        parts.append((ts[new], src[new], rank[new], dev[new], mids[new] & 0xFFFFFFFF, dur[new]))
    key, inv = _step_groups(src, rank, buf["step"])
    end = np.full(len(key), np.iinfo(np.int64).min)
    np.maximum.at(end, inv, ts + (dur * 1e6).astype(np.int64))
    cu_g = np.empty(len(key), dtype=np.int64)
    cu_g[inv] = cu[src]
    over_g = np.r_[key[1:] == key[:-1], False] | (end < cu_g)  # a later step, or ended
    over = over_g[inv]
    if "share" in names and over.any():
        total = np.bincount(inv, dur)[inv]
        ok = over & (total > 0)
        share = dur[ok] / total[ok]
        parts.append((end[inv][ok], src[ok], rank[ok], dev[ok], mids[ok] >> 32, share))
    left = None
    if not over.all():
        keep = ~over
        left = {k: v[keep] for k, v in buf.items()}
        left["done"][:] = True
    return _concat(parts), left


def collective_samples(
    cols: dict[str, np.ndarray],
    names: Sequence[str],
    op_mids: dict[str, int],
    mid_of: MidsOf,
) -> Samples:
    ts, dur = cols["ts_ns"], cols["duration_ms"]
    ops = cols["op"]
    if not _KNOWN_OPS.issuperset(set(ops.tolist())):
        ops = np.array([o if o in _KNOWN_OPS else "other" for o in ops.tolist()], dtype=object)

    def make(op: str) -> int:
        ms = mid_of([f"comm.{op}_ms"], "collective:duration_ms")[0]
        bw = mid_of([f"comm.{op}_busbw_gbps"], "collective:busbw_gbps")[0]
        return int(ms) | (int(bw) << 32)

    packed = _lookup(ops, op_mids, make)
    src, rank, dev = cols["_src"], cols["rank"], np.full(len(ts), -1)
    parts = []
    if "duration_ms" in names:
        parts.append((ts, src, rank, dev, packed & 0xFFFFFFFF, dur))
    if "busbw_gbps" in names:
        n = cols["group_size"].astype(np.float64)
        factor = np.array([_BUS_FACTOR.get(o, 0.0) for o in ops.tolist()], dtype=np.float64)
        factor = np.where(factor > 0, factor * np.maximum(n - 1, 0) / np.maximum(n, 1), 1.0)
        ok = (dur > 0) & (cols["size_bytes"] > 0)
        algbw = cols["size_bytes"][ok] / dur[ok] * 1e-6  # bytes/ms → GB/s
        bw = algbw * factor[ok]
        parts.append((ts[ok], src[ok], rank[ok], dev[ok], packed[ok] >> 32, bw))
    return _concat(parts)


def kernel_samples(cols: dict[str, np.ndarray], mid: int) -> Samples:
    sel = (cols["stream"] == -1) & (cols["kernel_class"] == "all")
    ts = cols["ts_ns"][sel]
    n = len(ts)
    return (
        ts,
        cols["_src"][sel],
        cols["rank"][sel],
        np.full(n, -1),
        np.full(n, mid),
        cols["busy_ms"][sel],
    )


def _concat(parts: list[Samples]) -> Samples:
    if not parts:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e, e, np.zeros(0)
    if len(parts) == 1:
        return _finite(parts[0])
    ts, src, rank, dev, mid, v = (np.concatenate(c) for c in zip(*parts, strict=True))
    return _finite((ts, src, rank, dev, mid, v))
