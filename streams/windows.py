"""Multi-timescale event-time windows per (job, node, rank, device, metric), with numpy.

`WindowSet` keeps, per 1 s pane (``pane_s``) and series, count, mean, min, max, the last
value, the moments of a least-squares slope and a mergeable log-bucket sketch
(`perfloop.streams.sketch`). Batches wait by reference until a pane of theirs closes; then the
due batches of every source are read and every closing pane of every job is reduced in one
vectorised pass. Bigger blocks (10 s) are merges of panes, a hopping window is a merge of its
blocks, and a tumbling window a hopping spec covers (60 s beside 60 s every 10 s) is taken
from it. Sizes and hops are whole numbers of panes, windows start at multiples of their hop
since the epoch (`WindowSpec`; default tumbling 1, 10, 60 s and 60 s every 10 s). What each
batch kind yields is configurable (`AVAILABLE_METRICS`, `DEFAULT_METRICS`; derived figures such
as ``data_wait_share``, per-phase times and per-step shares, per-op bus bandwidth), and
`WindowSet.add` takes metrics computed elsewhere. Closed windows come out columnar, grouped by
job (`WindowColumns`, the columns of the ``windows`` message): count, mean, min, max,
p50/p95/p99 (each within ``alpha`` relative error of ``np.quantile(x, q, method="lower")``),
rate (count / window size) and slope (least squares, units per second).

Time: each source — one kind of telemetry of one node, (job, node, kind), as the kinds of a
node come from different producers with their own delays; `add` feeds the node's ``derived``
source — has an event-time watermark, the newest ``ts_ns`` it sent; a source that sends
nothing moves on with the wall clock (``wall_ns``), so windows close on time with no new
events. A job's watermark is the minimum over its sources active in the last
``source_idle_s`` (a node whose clock lags, or a kind published later, delays the job's
windows instead of making its own samples late). Panes up to the job's watermark minus
``lateness_s`` close; a sample older than a closed pane is counted in `WindowSet.late_samples`
and dropped (spans are stamped at their start, so the lateness should cover the longest span).
Sources silent for ``forget_after_s`` are forgotten and their series ids reused, so finished
jobs free their memory. `WindowSet.snapshot` / `WindowSet.restore` carry everything, open
panes included, across a restart.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.schemas.codec import Batch
from perfloop.streams._aggregates import Agg
from perfloop.streams._extract import AVAILABLE, DEFAULT_METRICS
from perfloop.streams._levels import Level
from perfloop.streams._series import Registry
from perfloop.streams._wincore import (
    COLUMNS,
    DEFAULT_SPECS,
    NS,
    PANE_COLUMNS,
    WindowColumns,
    WindowCore,
    WindowSpec,
    empty_columns,
    parse_specs,
    trim_batches,
)

__all__ = [
    "AVAILABLE_METRICS",
    "COLUMNS",
    "DEFAULT_METRICS",
    "DEFAULT_SPECS",
    "NS",
    "PANE_COLUMNS",
    "WindowColumns",
    "WindowSet",
    "WindowSpec",
    "parse_specs",
    "split_by_job",
]

AVAILABLE_METRICS = AVAILABLE
"""Metric names each batch kind can window (``windows.metrics.<kind>`` picks among them)."""
_SNAPSHOT_VERSION = 1


def split_by_job(cols: WindowColumns) -> dict[str, WindowColumns]:
    """The rows of each job (`WindowSet.advance` returns them grouped by job)."""
    jobs = cols["job_id"]
    if not len(jobs):
        return {}
    cut = np.flatnonzero(jobs[1:] != jobs[:-1]) + 1
    bounds = [0, *cut.tolist(), len(jobs)]
    return {
        str(jobs[a]): {k: v[a:b] for k, v in cols.items()} for a, b in itertools.pairwise(bounds)
    }


class WindowSet(WindowCore):
    """Windows of every spec over every series; `advance` returns those that closed.

    >>> ws = WindowSet("1,10", lateness_s=0)
    >>> ws.add("j", "n0", 0, -1, np.array([1, 2, 3]) * NS, "loss", np.array([3.0, 2.0, 1.0]),
    ...        wall_ns=100 * NS)
    >>> cols = ws.advance(wall_ns=100 * NS)  # watermark 3 s: panes [1, 2) and [2, 3) close
    >>> cols["ts_ns"].tolist(), cols["mean"].tolist(), cols["window_s"].tolist()
    ([1000000000, 2000000000], [3.0, 2.0], [1.0, 1.0])
    >>> cols = ws.advance(wall_ns=108 * NS)  # no new samples: the wall clock closes the rest
    >>> cols["window_s"].tolist(), cols["count"].tolist(), cols["slope_per_s"].tolist()
    ([1.0, 10.0], [1, 3], [0.0, -1.0])
    """

    def __init__(
        self,
        specs: str | Iterable[str | float | WindowSpec] = DEFAULT_SPECS,
        *,
        lateness_s: float = 2.0,
        metrics: Mapping[str, str | Sequence[str]] | None = None,
        pane_s: float = 1.0,
        source_idle_s: float = 30.0,
        forget_after_s: float = 600.0,
        alpha: float = 0.01,
    ) -> None:
        if not (math.isfinite(pane_s) and pane_s > 0):
            raise ConfigError(f"pane_s must be > 0 seconds, got {pane_s!r}")
        for name, v in (("source_idle_s", source_idle_s), ("forget_after_s", forget_after_s)):
            if not (v > 0):
                raise ConfigError(f"{name} must be > 0 seconds, got {v!r}")
        self._init_state(round(pane_s * NS), alpha)
        self._idle_ns = round(source_idle_s * NS)
        self._forget_ns = round(forget_after_s * NS)
        self._lateness_ns = self._lateness(lateness_s)
        for kind, names in (metrics or {}).items():
            self._metrics[kind] = self._metric_names(kind, names)
        self._set_specs(parse_specs(specs))

    # -- settings -------------------------------------------------------------------------
    @property
    def specs(self) -> tuple[WindowSpec, ...]:
        return self._specs

    @property
    def lateness_s(self) -> float:
        return self._lateness_ns / NS

    @property
    def metrics(self) -> dict[str, tuple[str, ...]]:
        return dict(self._metrics)

    @staticmethod
    def _lateness(v: Any) -> int:
        try:
            s = float(v)
        except (TypeError, ValueError):
            s = math.nan
        if not (math.isfinite(s) and s >= 0):
            raise ConfigError(f"windows.lateness_s must be a number of seconds >= 0, got {v!r}")
        return round(s * NS)

    @staticmethod
    def _metric_names(kind: str, names: str | Sequence[str]) -> tuple[str, ...]:
        if kind not in AVAILABLE:
            raise ConfigError(f"unknown batch kind {kind!r}; valid: {', '.join(AVAILABLE)}")
        items = names.split(",") if isinstance(names, str) else list(names)
        out = tuple(dict.fromkeys(str(n).strip() for n in items if str(n).strip()))
        bad = [n for n in out if n not in AVAILABLE[kind]]
        if bad:
            raise ConfigError(f"unknown {kind} metrics {bad}; valid: {', '.join(AVAILABLE[kind])}")
        return out

    def configure(self, key: str, value: Any) -> tuple[Any, Any]:
        """Change a setting live; returns (old, new). Changed windows start clean.

        Keys: ``windows.specs`` ("1,10,60,60/10" or a list), ``windows.lateness_s``,
        ``windows.metrics.<kind>`` (comma list of `AVAILABLE_METRICS` [kind]).
        """
        if key == "windows.specs":
            old = ",".join(map(str, self._specs))
            self._set_specs(parse_specs(value), since=True)
            return old, ",".join(map(str, self._specs))
        if key == "windows.lateness_s":
            old_s = self.lateness_s
            self._lateness_ns = self._lateness(value)
            return old_s, self.lateness_s
        if key.startswith("windows.metrics."):
            kind = key.removeprefix("windows.metrics.")
            new = self._metric_names(kind, value)
            old_m = self._metrics.get(kind, ())
            self._restart_families([f"{kind}:{n}" for n in new if n not in old_m])
            self._metrics[kind] = new
            self._wide_mids.pop(kind, None)
            return ",".join(old_m), ",".join(new)
        raise ConfigError(
            f"unknown windows setting {key!r}; valid: windows.specs, windows.lateness_s, "
            f"windows.metrics.<kind> with kind in {', '.join(AVAILABLE)}"
        )

    # -- input ----------------------------------------------------------------------------
    def observe(self, batch: Batch, wall_ns: int) -> None:
        """Add a decoded telemetry batch (any kind; kinds with no metrics only move time).

        Cheap: the batch's columns wait (by reference) until a pane of theirs closes; then
        the due batches of every source are read at once.
        """
        cols = batch.columns
        ts = cols["ts_ns"]
        if not len(ts):
            return
        tmin, tmax = int(ts.min()), int(ts.max())
        src = self._reg.source(batch.job_id, batch.node, batch.kind)
        src.wm = max(src.wm, tmax)
        src.seen = max(src.seen, int(wall_ns))
        if not self._metrics.get(batch.kind):
            return
        cu = int(self._reg.job_cu[src.job])
        if tmin < cu:
            keep = ts >= cu
            self.late_samples += len(ts) - int(keep.sum())
            if not keep.any():
                return
            cols = {k: v[keep] for k, v in cols.items()}
            tmin = int(cols["ts_ns"].min())
        src.raw.append((batch.kind, tmin, tmax, cols))

    def add(
        self,
        job_id: str,
        node: str,
        ranks: np.ndarray | int,
        devices: np.ndarray | int,
        ts_ns: np.ndarray,
        metric: str,
        values: np.ndarray,
        wall_ns: int,
    ) -> None:
        """Add samples of a metric computed elsewhere (device -1: not a device series)."""
        ts = np.array(ts_ns, dtype=np.int64, copy=True).reshape(-1)
        v = np.array(values, dtype=np.float64, copy=True).reshape(-1)
        if len(ts) != len(v):
            raise ValueError(f"{len(ts)} times for {len(v)} values of {metric!r}")
        if not len(ts):
            return
        src = self._reg.source(job_id, node, "derived")
        src.wm = max(src.wm, int(ts.max()))
        src.seen = max(src.seen, int(wall_ns))
        cu = int(self._reg.job_cu[src.job])
        rank = np.broadcast_to(np.asarray(ranks, dtype=np.int64), ts.shape)
        dev = np.broadcast_to(np.asarray(devices, dtype=np.int64), ts.shape)
        mid = self._reg.mids([metric], f"add:{metric}")
        self.late_samples += int((ts < cu).sum())
        keep = (ts >= cu) & np.isfinite(v)
        n = int(keep.sum())
        sample = (ts[keep], np.full(n, src.idx), rank[keep], dev[keep], np.repeat(mid, n), v[keep])
        self._push(sample)

    # -- closing --------------------------------------------------------------------------
    def resume(self, wall_ns: int) -> None:
        """After a restart: the time the worker was down does not count as sources' silence
        (it would move their watermarks on and close panes before the backlog is read)."""
        for src in self._reg.sources.values():
            src.seen = max(src.seen, int(wall_ns))

    def watermark_ns(self, job_id: str, wall_ns: int) -> int | None:
        """The job's watermark at ``wall_ns`` (None for an unknown job)."""
        job = self._reg.jobs.get(job_id)
        if job is None:
            return None
        effective, active = [], []
        for src in job.sources:
            idle = wall_ns - src.seen
            effective.append(src.wm + max(0, idle))
            if idle <= self._idle_ns:
                active.append(effective[-1])
        return min(active) if active else max(effective)

    def closed_until_ns(self, job_id: str) -> int | None:
        """Panes of the job that end at or before this time have closed."""
        job = self._reg.jobs.get(job_id)
        return None if job is None else int(self._reg.job_cu[job.idx])

    def advance(self, wall_ns: int) -> WindowColumns:
        """Close what is due at ``wall_ns``; every closed window of every spec, grouped by job."""
        reg, pane = self._reg, self._pane_ns
        old = reg.job_cu[: reg.n_jobs].copy()
        progressed = []
        for job in reg.jobs.values():
            wm = self.watermark_ns(job.name, wall_ns)
            assert wm is not None
            cu = (wm - self._lateness_ns) // pane * pane
            if cu > old[job.idx]:
                reg.job_cu[job.idx] = cu
                progressed.append(job)
        self.last_panes = empty_columns(PANE_COLUMNS)
        out: list[WindowColumns] = []
        if progressed:
            out = self._close(progressed, old, reg.job_cu[: reg.n_jobs].copy(), wall_ns)
        if wall_ns >= self._next_forget:
            limit = max(self._forget_ns, max(s.size_ns for s in self._specs) + self._lateness_ns)
            self._forget(wall_ns, limit)
            self._next_forget = wall_ns + NS
        if not out:
            return empty_columns(COLUMNS)
        order = np.argsort(np.concatenate([o["_job"] for o in out]), kind="stable")
        return {c: np.concatenate([o[c] for o in out])[order] for c in COLUMNS}

    def tick(self, wall_ns: int) -> list[WindowColumns]:
        """`advance`, one `WindowColumns` per job (the component's ``tick``)."""
        return list(split_by_job(self.advance(wall_ns)).values())

    # -- state ----------------------------------------------------------------------------
    @property
    def series(self) -> int:
        """Series with state (known and not forgotten)."""
        return int((self._reg.sid_src[: self._reg.n_sids] >= 0).sum())

    @property
    def pending_samples(self) -> int:
        """Rows and samples waiting for their pane (or their step) to close."""
        raw = sum(len(r[3]["ts_ns"]) for s in self._reg.sources.values() for r in s.raw)
        spans = 0 if self._spans is None else len(self._spans["ts_ns"])
        return raw + spans + sum(len(c[2]) for c in self._pending)

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to resume (open panes included): builtins and numpy arrays."""
        registry = self._reg.state()
        for src in registry["sources"]:
            src["raw"] = trim_batches(src["raw"], self._metrics)
        return {
            "version": _SNAPSHOT_VERSION,
            "config": {
                "specs": [str(s) for s in self._specs],
                "lateness_ns": self._lateness_ns,
                "metrics": {k: list(v) for k, v in self._metrics.items()},
                "pane_ns": self._pane_ns,
                "idle_ns": self._idle_ns,
                "forget_ns": self._forget_ns,
                "alpha": self._mapping.alpha,
            },
            "registry": registry,
            "levels": {b: lvl.state() for b, lvl in self._levels.items()},
            "pending": list(self._pending),
            "spans": None if self._spans is None else dict(self._spans),
            "late_samples": self.late_samples,
            "next_forget": self._next_forget,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from a `snapshot` (its settings replace this set's)."""
        if state.get("version") != _SNAPSHOT_VERSION:
            raise ConfigError(
                f"windows snapshot version {state.get('version')!r}; supported: {_SNAPSHOT_VERSION}"
            )
        cfg = state["config"]
        self._init_state(cfg["pane_ns"], cfg["alpha"])
        self._idle_ns, self._forget_ns = cfg["idle_ns"], cfg["forget_ns"]
        self._lateness_ns = cfg["lateness_ns"]
        self._metrics = {k: tuple(v) for k, v in cfg["metrics"].items()}
        self._reg = Registry.from_state(state["registry"])
        self._set_specs(parse_specs(cfg["specs"]))
        self._levels = {}
        for b, d in state["levels"].items():
            lvl = self._levels[b] = Level(b, d["child"])
            lvl.keep_ns = d["keep_ns"]
            lvl.segments = [
                (Agg.from_state(rows, self._mapping), a, z) for rows, a, z in d["segments"]
            ]
        self._pending = list(state["pending"])
        self._spans = None if state["spans"] is None else dict(state["spans"])
        self.late_samples = state["late_samples"]
        self._next_forget = state["next_forget"]
