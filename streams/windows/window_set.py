"""Multi-timescale event-time windows per (job, node, rank, device, metric), with numpy
(public through `perfloop.streams.windows`).

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

Time: each source — one kind of telemetry of one node of a job, (job, node, kind), as the kinds of a
node come from different producers with their own delays; `add` feeds the node's ``derived``
source — has an event-time watermark, the newest ``ts_ns`` it sent. A job's watermark is the
minimum over its sources active in the last ``source_idle_s`` of their *effective* times (a node
whose clock lags, or a kind published later, delays the job's windows instead of making its own
samples late). A source's effective time is its watermark moved on by how long it has been
silent past its usual gap between messages (a decaying maximum of the gaps by the producer's
clock, or by when they were read; before a second message, the event time the first spans, at
most `FIRST_GAP_MAX_S`: a producer that sends every 3 s is not silent 2 s after a message, and
its next one holds the 3 s since, while a first message of history — 30 s of it at once — does
not make the job wait 30 s), and silence is only counted when it is real:

* a source whose input (``channel``: the engine passes the topic partition) has been read to
  its end (`set_channel` ``caught_up=True``; the default for a source of unknown channel) moves
  on with the wall clock (``wall_ns``) from its last batch or from when its channel caught up,
  whichever is later — so windows close on time, with no new events, when a job stops;
* a source whose channel still has input to read (a backlog being drained, a restart, or just
  a busy input that always has more) moves on only by its silence in the input itself: how
  much later than its last message (by the time messages were sent, ``sent_ns``, the
  producer's clock) the newest message read on its channel was sent. Until then it does not
  move on at all: the input may still hold its next batch, however far other sources read on
  it have got in event time (a partition need not be in event-time order: a replay, a
  producer's spool). Draining a backlog at any speed therefore drops nothing as late, and a
  source that stopped while its channel stays busy with others still stops holding its job;
* a source whose time another component keeps (`set_clock`; the engine clocks the ``derived``
  sources with the step analysis's progress) has that time.

Sources not seen yet are covered too: a channel belongs to a ``group`` (the engine's topic). A
job with no source in a group waits while a channel of that group has input left to read (its
first batch there may be in it); and while any channel has input left, a group of ``groups``
(the groups expected) that nothing was read from yet holds every job at the oldest event time
read on the channels with input left, less ``input_skew_s`` (a backlog starts at about the
same time on every topic; the first read there then decides).

Panes up to the job's watermark minus ``lateness_s`` close; a sample older than a closed pane is
counted in `WindowSet.late_samples` and dropped (spans are stamped at their start, so the lateness
should cover the longest span).
Sources silent for ``forget_after_s`` are forgotten and their series ids reused, so finished
jobs free their memory. `WindowSet.snapshot` / `WindowSet.restore` carry everything, open
panes included, across a restart.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.schemas.codec import Batch
from perfloop.streams.windows._aggregates import Agg
from perfloop.streams.windows._block_levels import Level
from perfloop.streams.windows._closing import WindowCore, trim_batches
from perfloop.streams.windows._samples import AVAILABLE, DEFAULT_METRICS
from perfloop.streams.windows._series_registry import Job, Registry, Source
from perfloop.streams.windows.specs import (
    COLUMNS,
    DEFAULT_SPECS,
    NS,
    PANE_COLUMNS,
    WindowColumns,
    WindowSpec,
    empty_columns,
    parse_specs,
)

log = logging.getLogger("perfloop.streams")

GAP_DECAY, GAP_SCALE = 3, 4
"""A source's usual gap between messages decays by 3/4 a message (`WindowSet.observe`)."""
FIRST_GAP_MAX_S = 15.0
"""Before a source's second message, its usual gap is guessed from the event time its first one
spans, up to this: a first message holding more is history (a backfill, a replay, a test's
fixture), and its job should not wait that long for its windows. The first gap seen replaces
the guess. A source whose first two messages come more than this plus the lateness apart has
samples of its second come late; perfloop's producers publish every fraction of a second, and
`bench/e2e.py --rate 100000`'s replay sends a source's messages up to ~6.5 s apart (at 5 s,
4,367 of its samples came late; at 15 s, none)."""
_FIRST_GAP_MAX_NS = round(FIRST_GAP_MAX_S * NS)

__all__ = [
    "AVAILABLE_METRICS",
    "DEFAULT_METRICS",
    "FIRST_GAP_MAX_S",
    "WindowSet",
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
        input_skew_s: float = 2.0,
        groups: Iterable[Hashable] = (),
        alpha: float = 0.01,
        new_job_grace_s: float = 0.0,
    ) -> None:
        if not (math.isfinite(pane_s) and pane_s > 0):
            raise ConfigError(f"pane_s must be > 0 seconds, got {pane_s!r}")
        for name, v in (("source_idle_s", source_idle_s), ("forget_after_s", forget_after_s)):
            if not (v > 0):
                raise ConfigError(f"{name} must be > 0 seconds, got {v!r}")
        for name, v in (("input_skew_s", input_skew_s), ("new_job_grace_s", new_job_grace_s)):
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be >= 0 seconds, got {v!r}")
        self._grace_ns = round(new_job_grace_s * NS)
        self._init_state(round(pane_s * NS), alpha)
        self._skew_ns = round(input_skew_s * NS)
        self._groups = tuple(groups)
        self._idle_ns = round(source_idle_s * NS)
        self._forget_ns = round(forget_after_s * NS)
        self._lateness_ns = self._lateness(lateness_s)
        self._late_said_ns = -NS  # when late samples were last logged
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
    def observe(
        self, batch: Batch, wall_ns: int, channel: Hashable | None = None, sent_ns: int = -1
    ) -> None:
        """Add a decoded telemetry batch (any kind; kinds with no metrics only move time).

        ``channel`` names the input it came by (see `set_channel`), ``sent_ns`` when its
        message was sent (-1: unknown; see the module docstring). Cheap: the batch's columns
        wait (by reference) until a pane of theirs closes; then the due batches of every source
        are read at once.
        """
        cols = batch.columns
        ts = cols["ts_ns"]
        if not len(ts):
            return
        tmin, tmax = int(ts.min()), int(ts.max())
        src = self._reg.source(batch.job_id, batch.node, batch.kind)
        job = self._reg.jobs[batch.job_id]
        if job.born < 0:
            job.born = int(wall_ns)
        before = (src.wm, src.seen, src.sent)
        # The usual time between its messages, by the producer's clock where known: silence
        # counts only past it (see `_effective`). A decaying maximum of the gaps seen: up at
        # once, down slowly. Before its second message, a guess: the event time its first one
        # spans (a producer that batches a few seconds sends every few seconds), at most
        # FIRST_GAP_MAX_S (a first message may hold history: a backfill, a replay).
        if src.seen <= 0:
            src.gap = min(tmax - tmin, self._idle_ns, _FIRST_GAP_MAX_NS)
        else:
            if sent_ns >= 0 and src.sent >= 0:
                gap = int(sent_ns) - src.sent
            else:
                gap = int(wall_ns) - src.seen
            if src.measured:
                gap = max(gap, src.gap * GAP_DECAY // GAP_SCALE)
            src.gap, src.measured = min(max(gap, 0), self._idle_ns), True  # clocks step back
        src.wm = max(src.wm, tmax)
        src.seen = max(src.seen, int(wall_ns))
        src.sent = max(src.sent, int(sent_ns))
        if channel is not None:
            src.channel = channel
            ch = self._channels.setdefault(channel, [0, int(wall_ns), -1, None, -1])
            ch[2] = max(ch[2], tmin)
            ch[4] = max(ch[4], int(sent_ns))
        if not self._metrics.get(batch.kind):
            return
        cu = int(self._reg.job_cu[src.job])
        if tmin < cu:
            keep = ts >= cu
            late = len(ts) - int(keep.sum())
            self.late_samples += late
            self.late_by_kind[batch.kind] = self.late_by_kind.get(batch.kind, 0) + late
            self._say_late(batch, late, tmin, cu, wall_ns, channel, before, sent_ns)
            if not keep.any():
                return
            cols = {k: v[keep] for k, v in cols.items()}
            tmin = int(cols["ts_ns"].min())
        src.raw.append((batch.kind, tmin, tmax, cols))

    def _say_late(
        self,
        batch: Batch,
        late: int,
        tmin: int,
        cu: int,
        wall_ns: int,
        channel: Hashable,
        before: tuple[int, int, int],
        sent_ns: int,
    ) -> None:
        """Log late samples (at most once a second of wall time): which source, how late,
        and how its time had moved on before they came."""
        if wall_ns - self._late_said_ns < NS:
            return
        self._late_said_ns = wall_ns
        wm, seen, sent = before
        ch = self._channels.get(channel) if channel is not None else None
        if wm < 0:
            before_these = "the source's first"
        else:
            before_these = (
                f"the source's newest sample was {(cu - wm) / NS:.2f} s before they closed, "
                f"seen {(wall_ns - seen) / NS:.2f} s ago"
            )
            if sent >= 0 <= sent_ns:
                before_these += f", sent {(sent_ns - sent) / NS:.2f} s before these"
        log.warning(
            "%d %s samples of %s/%s came late (input %s, %s): from %.2f s before the job's "
            "windows closed; %s",
            late,
            batch.kind,
            batch.job_id,
            batch.node,
            channel,
            "?" if ch is None else ("read to its end" if ch[0] == 0 else "input left"),
            (cu - tmin) / NS,
            before_these,
        )

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
        late = int((ts < cu).sum())
        self.late_samples += late
        if late:
            self.late_by_kind["derived"] = self.late_by_kind.get("derived", 0) + late
        keep = (ts >= cu) & np.isfinite(v)
        n = int(keep.sum())
        sample = (ts[keep], np.full(n, src.idx), rank[keep], dev[keep], np.repeat(mid, n), v[keep])
        self._push(sample)

    # -- time -----------------------------------------------------------------------------
    def set_channel(
        self,
        channel: Hashable,
        *,
        caught_up: bool,
        wall_ns: int,
        group: Hashable = None,
        unsure: bool = False,
    ) -> None:
        """Say whether ``channel`` (an input: the engine's topic partition, in ``group``, its
        topic) has been read to its end. While it has not, its sources' silence is not counted
        in wall time (see the module docstring); once it has, their silence counts from now.

        ``unsure`` (with ``caught_up`` False): a channel read to its end may have new input
        the reader has not seen (it could not look for a while). Its sources' silence is held
        as for input left; once it is known read to its end again, everything that came in
        meanwhile has been read in order, so their silence counts from when it was first
        read to its end, not from now. Input left for real (``unsure`` False) overrides."""
        ch = self._channels.get(channel)
        if ch is None:
            self._channels[channel] = [int(not caught_up), int(wall_ns), -1, group, -1]
            return
        ch[3] = group if group is not None else ch[3]
        if caught_up:
            if ch[0] == 1:
                ch[1] = int(wall_ns)
            ch[0] = 0
        elif not unsure:
            ch[0] = 1
        elif ch[0] == 0:
            ch[0] = 2

    @property
    def held_channels(self) -> list[Hashable]:
        """The channels that have input left to read (their sources' silence is held)."""
        return [k for k, ch in self._channels.items() if ch[0]]

    def clock_source(self, job_id: str, node: str, kind: str, clock_ns: int, wall_ns: int) -> None:
        """Make (job, node, kind) a source whose effective time its producer keeps (the engine
        clocks the ``derived`` sources: no derived sample older than their clock will come),
        starting at ``clock_ns``; it stays active while this is called."""
        src = self._reg.source(job_id, node, kind)
        src.clock = int(clock_ns) if src.clock < 0 else src.clock
        src.seen = max(src.seen, int(wall_ns))

    def set_clock(self, job_id: str, kind: str, clock_ns: int) -> None:
        """Move on the clock of the job's clocked sources of ``kind`` (`clock_source`)."""
        job = self._reg.jobs.get(job_id)
        for src in job.sources if job is not None else ():
            if src.kind == kind and src.clock >= 0:
                src.clock = max(src.clock, int(clock_ns))

    def resume(self, wall_ns: int) -> None:
        """After a restart: the time the worker was down does not count as sources' silence
        (it would move their watermarks on and close panes before the backlog is read)."""
        for src in self._reg.sources.values():
            src.seen = max(src.seen, int(wall_ns))
        for ch in self._channels.values():
            ch[1] = max(ch[1], int(wall_ns))

    def _effective(self, src: Source, wall_ns: int) -> tuple[int, bool]:
        """A source's effective time at ``wall_ns`` and whether it is active."""
        if src.clock >= 0:
            return src.clock, wall_ns - src.seen <= self._idle_ns
        ch = self._channels.get(src.channel) if src.channel is not None else None
        if ch is not None and ch[0]:  # input left to read: silent only as far as read
            if 0 <= src.sent < ch[4]:  # read on past its last message
                idle = ch[4] - src.sent
                return src.wm + max(0, idle - src.gap), idle <= self._idle_ns
            return src.wm, True
        idle = max(0, wall_ns - max(src.seen, ch[1] if ch is not None else 0))
        return src.wm + max(0, idle - src.gap), idle <= self._idle_ns

    def watermark_ns(self, job_id: str, wall_ns: int, *, derived: bool = True) -> int | None:
        """The job's watermark at ``wall_ns`` (None for an unknown job); without ``derived``,
        over its telemetry sources only (None if it has none)."""
        job = self._reg.jobs.get(job_id)
        if job is None:
            return None
        effective, active = [], []
        for src in job.sources:
            if not derived and src.kind == "derived":
                continue
            t, on = self._effective(src, wall_ns)
            effective.append(t)
            if on:
                active.append(t)
        if not effective:
            return None
        if job.born >= 0 and wall_ns - job.born < self._grace_ns:
            return -1  # a new job: its other sources may not have shown up yet
        wm = min(active) if active else max(effective)
        return self._unseen_bound(job, wm)

    def _unseen_bound(self, job: Job, wm: int) -> int:
        """``wm`` held back for the job's sources not seen yet (see the module docstring)."""
        chans = self._channels
        held = [ch for ch in chans.values() if ch[0] and ch[3] is not None]
        if not held:
            return wm
        mine = {chans[s.channel][3] for s in job.sources if s.channel in chans}
        if any(ch[3] not in mine for ch in held):
            return min(wm, -1)  # its first batch there may still be unread: wait
        known = {ch[3] for ch in chans.values()}
        read = [ch[2] for ch in held if ch[2] >= 0]
        if read and any(g not in known for g in self._groups):  # not read from at all yet
            return min(wm, min(read) - self._skew_ns)
        return wm

    # -- closing --------------------------------------------------------------------------

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
                "skew_ns": self._skew_ns,
                "groups": list(self._groups),
                "forget_ns": self._forget_ns,
                "grace_ns": self._grace_ns,
                "alpha": self._mapping.alpha,
            },
            "registry": registry,
            "levels": {b: lvl.state() for b, lvl in self._levels.items()},
            "pending": list(self._pending),
            "spans": None if self._spans is None else dict(self._spans),
            "late_samples": self.late_samples,
            "next_forget": self._next_forget,
            "channels": {k: list(v) for k, v in self._channels.items()},
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
        self._skew_ns = cfg.get("skew_ns", 2 * NS)
        self._grace_ns = cfg.get("grace_ns", 0)
        self._groups = tuple(cfg.get("groups", ()))
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
        self._channels = {k: [*v, -1][:5] for k, v in state.get("channels", {}).items()}
