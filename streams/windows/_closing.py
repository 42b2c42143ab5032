"""The closing machinery behind `WindowSet` (`perfloop.streams.windows.window_set`).

State: the series registry; per source the batches not yet read; for all sources together
the samples waiting for their pane (``_pending``) and the depth-0 spans of unfinished steps
(``_spans``); and the block levels (1 s panes, then bigger blocks). `WindowCore._close` runs
once per `advance` that moves some job's closed-until time: it reads every due batch of every
source at once, reduces every closing pane in one pass, merges blocks level by level and
builds each spec's windows. Tumbling windows of a size that a hopping spec also has (60 s
beside 60 s every 10 s) are picked from the hopping ones instead of being merged again.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.streams.sketch import LogBuckets
from perfloop.streams.windows._aggregates import Agg, reduce_samples
from perfloop.streams.windows._block_levels import Level, build_blocks, hopping_windows
from perfloop.streams.windows._samples import (
    DEFAULT_METRICS,
    Samples,
    SpanRows,
    collective_samples,
    kernel_samples,
    needed_columns,
    span_rows,
    span_split,
    wide_samples,
)
from perfloop.streams.windows._series_registry import Job, Registry
from perfloop.streams.windows.specs import (
    NS,
    PANE_COLUMNS,
    WindowColumns,
    WindowSpec,
    empty_columns,
)

__all__ = ["WindowCore", "trim_batches"]

ALWAYS = np.iinfo(np.int64).min  # no "since": windows count from any start
Chunk = tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Pending samples: tmin, tmax, then the `Samples` arrays (ts_ns, source, rank, device, ...)."""


def _column(cols: dict[str, np.ndarray], name: str) -> np.ndarray:
    """A batch column; a missing one reads as NaN (not a sample)."""
    col = cols.get(name)
    return np.full(len(cols["ts_ns"]), np.nan) if col is None else col


def trim_batches(
    raw: list[tuple[str, int, int, dict[str, np.ndarray]]], metrics: dict[str, tuple[str, ...]]
) -> list[tuple[str, int, int, dict[str, np.ndarray]]]:
    """Waiting batches with only the columns their kind's metrics read (for snapshots)."""
    out = []
    for kind, tmin, tmax, cols in raw:
        if metrics.get(kind):
            keep = [c for c in needed_columns(kind, metrics[kind]) if c in cols]
            out.append((kind, tmin, tmax, {c: cols[c] for c in keep}))
    return out


class WindowCore:
    """State and closing of `WindowSet` (the public API lives there)."""

    def _init_state(self, pane_ns: int, alpha: float) -> None:
        self._pane_ns = pane_ns
        self._mapping = LogBuckets(alpha)
        self._empty = Agg.empty(self._mapping)
        self._reg = Registry()
        self._metrics: dict[str, tuple[str, ...]] = dict(DEFAULT_METRICS)
        self._specs: tuple[WindowSpec, ...] = ()
        self._subset_of: dict[tuple[int, int], tuple[int, int]] = {}
        self._levels: dict[int, Level] = {pane_ns: Level(pane_ns, 0)}
        self._pending: list[Chunk] = []
        self._spans: SpanRows | None = None
        self._next_forget = 0
        self._channels: dict[Any, list[Any]] = {}  # input → [held, since, newest read, group]
        self._reset_caches()
        self.late_samples = 0
        self.late_by_kind: dict[str, int] = {}
        """Late samples by telemetry kind ("derived": the step analysis's metrics)."""
        """Samples dropped because their pane had already closed."""
        self.last_panes: WindowColumns = empty_columns(PANE_COLUMNS)
        """The panes the last `advance` closed: count, mean, min, max and last value."""

    def _reset_caches(self) -> None:
        self._wide_mids: dict[str, np.ndarray] = {}
        self._phase_mids: dict[str, int] = {}
        self._op_mids: dict[str, int] = {}

    # -- specs and metrics ----------------------------------------------------------------
    def _set_specs(self, specs: tuple[WindowSpec, ...], since: bool = False) -> None:
        pane = self._pane_ns
        bad = [str(s) for s in specs if s.size_ns % pane or s.hop_ns % pane]
        if bad:
            raise ConfigError(
                f"window specs {bad} are not whole multiples of the {pane / NS:g} s pane"
            )
        reg = self._reg
        if since:  # a new spec starts clean: no window that began before now
            for job in reg.jobs.values():
                cu = int(reg.job_cu[job.idx])
                job.spec_since = {
                    s.key: job.spec_since.get(s.key, ALWAYS) if s in self._specs else cu
                    for s in specs
                }
        self._specs = specs
        self._subset_of = {}
        for t in specs:
            for h in specs:
                same = t.tumbling and not h.tumbling and h.size_ns == t.size_ns
                if same and t.size_ns % h.hop_ns == 0:
                    self._subset_of[t.key] = h.key
        built = [s for s in specs if s.key not in self._subset_of]
        levels = self._levels
        blocks = sorted({s.block_ns for s in built})
        for b in blocks:  # an existing level keeps its child, so its open blocks stay whole
            if b not in levels:
                levels[b] = Level(b, max(size for size in levels if size < b and b % size == 0))
        alive, todo = {pane}, list(blocks)
        while todo:
            b = todo.pop()
            if b not in alive:
                alive.add(b)
                todo.append(levels[b].child)
        for b in [b for b in levels if b not in alive]:
            del levels[b]
        for b, lvl in levels.items():
            users = [p for p, parent in levels.items() if parent.child == b and p != b]
            users += [s.size_ns for s in built if s.size_ns > b == s.block_ns]
            lvl.keep_ns = max(users, default=0)

    def _restart_families(self, families: list[str]) -> None:
        """New metrics start clean: no window of them that began before now."""
        if not families:
            return
        reg = self._reg
        fams = set(families)
        mids = [m for m, f in enumerate(reg.metric_family) if f in fams]
        n = reg.n_sids
        for job in reg.jobs.values():
            cu = int(reg.job_cu[job.idx])
            job.family_since.update(dict.fromkeys(families, cu))
            sel = (reg.sid_job[:n] == job.idx) & (reg.sid_src[:n] >= 0)
            sel &= np.isin(reg.sid_mid[:n], mids)
            reg.sid_since[:n][sel] = cu

    def _wide(self, kind: str) -> np.ndarray:
        mids = self._wide_mids.get(kind)
        if mids is None:
            names = self._metrics[kind]
            parts = [self._reg.mids([n], f"{kind}:{n}") for n in names]
            mids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            self._wide_mids[kind] = mids
        return mids

    # -- reading --------------------------------------------------------------------------
    def _push(self, s: Samples) -> None:
        ts = s[0]
        if len(ts):
            self._pending.append((int(ts.min()), int(ts.max()), *s))

    def _read(self, progressed: list[Job]) -> None:
        """Turn every due batch (one with a sample before its job's closed-until time) of
        the progressed jobs into samples, all sources and batches of a kind at once."""
        reg = self._reg
        by_kind: dict[str, list[tuple[int, dict[str, np.ndarray]]]] = {}
        for job in progressed:
            cu = int(reg.job_cu[job.idx])
            for src in job.sources:
                if not src.raw:
                    continue
                later = []
                for raw in src.raw:
                    if raw[1] < cu:
                        by_kind.setdefault(raw[0], []).append((src.idx, raw[3]))
                    else:
                        later.append(raw)
                src.raw = later
        for kind, chunks in by_kind.items():
            names = self._metrics.get(kind)
            if not names:
                continue
            need = [c for c in needed_columns(kind, names) if c != "_src"]
            try:
                columns = zip(*map(itemgetter(*need), (ch for _, ch in chunks)), strict=True)
                cols = {c: np.concatenate(arrays) for c, arrays in zip(need, columns, strict=True)}
            except KeyError:  # batches restored from a snapshot keep only the columns read then
                cols = {c: np.concatenate([_column(ch, c) for _, ch in chunks]) for c in need}
            lengths = [len(ch["ts_ns"]) for _, ch in chunks]
            cols["_src"] = np.repeat(np.array([i for i, _ in chunks], dtype=np.int64), lengths)
            if kind in ("gpu", "host", "step"):
                self._push(wide_samples(cols, names, self._wide(kind)))
            elif kind == "span":
                rows = span_rows(cols, self._phase_mids, self._reg.mids)
                if self._spans is not None:
                    rows = {k: np.concatenate([self._spans[k], v]) for k, v in rows.items()}
                self._spans = rows if len(rows["ts_ns"]) else None
            elif kind == "collective":
                self._push(collective_samples(cols, names, self._op_mids, self._reg.mids))
            elif kind == "kernel":
                mid = int(self._reg.mids(["gpu_busy_ms"], "kernel:busy_ms")[0])
                self._push(kernel_samples(cols, mid))
        if self._spans is not None:
            cu_src = reg.job_cu[reg.src_job[: reg.n_srcs]]
            samples, self._spans = span_split(self._spans, cu_src, self._metrics.get("span", ()))
            self._push(samples)

    def _take_closing(self) -> Samples | None:
        """Remove and return the pending samples older than their job's closed-until time."""
        reg = self._reg
        cu_src = reg.job_cu[reg.src_job[: reg.n_srcs]]
        cu_max = int(cu_src.max())
        take, keep = [], []
        for chunk in self._pending:
            if chunk[0] >= cu_max:
                keep.append(chunk)
                continue
            ts, src = chunk[2], chunk[3]
            m = ts < cu_src[src]
            if m.all():
                take.append(chunk[2:])
            elif m.any():
                ts, src, rank, dev, mid, v = chunk[2:]
                take.append((ts[m], src[m], rank[m], dev[m], mid[m], v[m]))
                r = ~m
                keep.append(
                    (int(ts[r].min()), chunk[1], ts[r], src[r], rank[r], dev[r], mid[r], v[r])
                )
            else:
                keep.append(chunk)
        self._pending = keep
        if not take:
            return None
        ts, src, rank, dev, mid, v = (np.concatenate(c) for c in zip(*take, strict=True))
        return ts, src, rank, dev, mid, v

    # -- closing --------------------------------------------------------------------------
    def _close(
        self, progressed: list[Job], old: np.ndarray, new: np.ndarray, wall_ns: int
    ) -> list[WindowColumns]:
        reg, pane = self._reg, self._pane_ns
        self._read(progressed)
        taken = self._take_closing()
        panes = self._empty
        if taken is not None:
            ts, src, rank, dev, mid, v = taken
            sid = reg.sids(src, rank, dev, mid)
            panes = reduce_samples(self._mapping, sid, ts, v, pane, reg.n_sids)
        sid_job = reg.sid_job
        fresh = {pane: panes}
        self._levels[pane].append(panes)
        for b in sorted(self._levels)[1:]:
            lvl = self._levels[b]
            parts = self._levels[lvl.child].gather(sid_job, old // b * b, new // b * b)
            fresh[b] = build_blocks(parts, b, reg.n_sids, self._empty)
            lvl.append(fresh[b])
        made: dict[tuple[int, int], Agg] = {}
        for spec in sorted(self._specs, key=lambda s: s.key in self._subset_of):
            if spec.key in self._subset_of:
                rows = made[self._subset_of[spec.key]]
                rows = rows.take(np.flatnonzero(rows.start % spec.size_ns == 0))
            elif spec.tumbling and spec.size_ns == spec.block_ns:
                rows = fresh[spec.size_ns]
            else:
                rows = hopping_windows(
                    self._levels[spec.block_ns],
                    spec.size_ns,
                    spec.hop_ns,
                    sid_job,
                    reg.n_sids,
                    old,
                    new,
                    self._empty,
                )
            made[spec.key] = rows
        out = [self._finish(made[s.key], s, wall_ns) for s in self._specs if len(made[s.key])]
        for lvl in self._levels.values():
            lvl.prune(sid_job, new)
        self.last_panes = self._pane_columns(panes)
        return [o for o in out if len(o["ts_ns"])]

    def _finish(self, rows: Agg, spec: WindowSpec, wall_ns: int) -> WindowColumns:
        reg = self._reg
        sid = rows.sid
        job = reg.sid_job[sid]
        spec_since = np.full(reg.n_jobs, ALWAYS, dtype=np.int64)
        for j in reg.jobs.values():
            spec_since[j.idx] = j.spec_since.get(spec.key, ALWAYS)
        keep = rows.start >= np.maximum(reg.sid_since[sid], spec_since[job])
        if not keep.all():
            rows = rows.take(np.flatnonzero(keep))
            sid, job = rows.sid, job[keep]
        n = len(rows)
        q = rows.quantiles()
        return {
            "ts_ns": rows.start,
            "window_end_ns": rows.start + spec.size_ns,
            "window_s": np.full(n, spec.size_s),
            "hop_s": np.full(n, float(spec.hop_s or spec.size_s)),
            "job_id": reg.job_name[job],
            "node": reg.src_node[reg.sid_src[sid]],
            "rank": reg.sid_rank[sid],
            "device": reg.sid_dev[sid],
            "metric": reg.metric_arr[reg.sid_mid[sid]],
            "count": rows.n,
            "mean": rows.mean,
            "min": rows.vmin,
            "max": rows.vmax,
            "p50": q[:, 0],
            "p95": q[:, 1],
            "p99": q[:, 2],
            "rate_per_s": rows.n / spec.size_s,
            "slope_per_s": rows.slope(),
            "closed_ns": np.full(n, wall_ns, dtype=np.int64),
            "_job": job,
        }

    def _pane_columns(self, p: Agg) -> WindowColumns:
        reg, sid = self._reg, p.sid
        return {
            "ts_ns": p.start,
            "job_id": reg.job_name[reg.sid_job[sid]],
            "node": reg.src_node[reg.sid_src[sid]],
            "rank": reg.sid_rank[sid],
            "device": reg.sid_dev[sid],
            "metric": reg.metric_arr[reg.sid_mid[sid]],
            "count": p.n,
            "mean": p.mean,
            "min": p.vmin,
            "max": p.vmax,
            "last": p.last,
        }

    def _forget(self, wall_ns: int, limit_ns: int) -> None:
        """Forget sources silent for ``limit_ns`` with nothing left open."""
        reg = self._reg
        stale = [s for s in reg.sources.values() if wall_ns - s.seen > limit_ns and not s.raw]
        if not stale:
            return
        busy = {int(i) for c in self._pending for i in np.unique(c[3])}
        if self._spans is not None:
            busy.update(np.unique(self._spans["src"]).tolist())
        stale = [s for s in stale if s.idx not in busy]
        if not stale:
            return
        freed = np.concatenate([reg.forget(s) for s in stale])
        dead = np.zeros(reg.n_sids, dtype=bool)
        dead[freed] = True
        closed = reg.job_cu[: reg.n_jobs]
        for lvl in self._levels.values():
            lvl.prune(reg.sid_job, closed, dead)
