"""Per-step analysis: GPU busy and idle time, phase shares and stragglers, per job, step and rank.

`StepAnalysis` is a stream-tier component (no I/O, picklable state; public through
`perfloop.streams.steps`): it reads decoded step, span, kernel and collective batches and, once
a step of a job is complete, computes per rank:

- ``step_ms``: the `StepEvent`'s step time; ``end_ns`` its end (the event's time);
- ``busy_ms``: GPU busy time, the `KernelSummary` row with ``stream=-1, kernel_class="all"``
  (the union of the step's GPU intervals over all streams, overlaps once). When a job sends only
  per-stream rows, their sum is kept apart as ``busy_streams_sum_ms``: it is **not** a union
  (streams overlap, so it can exceed the step) and no idle time is derived from it;
- ``idle_ms = max(0, step_ms - busy_ms)`` and ``idle_share = idle_ms / step_ms``. Replayed traces
  count GPU work for the step that *launched* it, so busy can exceed the host step when the GPU
  runs behind; idle is then 0;
- ``phase_ms``: time per phase from depth-0 `PhaseSpan` rows (they tile the step), in the order
  of `PHASE_NAMES` (any phase not standard counts as ``user``), NaN without spans;
- ``collective_ms``: the sum of the step's `CollectiveOp` durations (a sum, not a union);
- straggler analysis across the ranks of the step: a rank's *arrival* is its step end minus the
  time it spent blocked in collectives (its ``comm`` span time: depth 0, and depth 1 nested in
  another phase, as DDP's all-reduce in backward; 0 without spans), so in a synchronous job,
  where every rank ends together, the rank the others waited for arrives last.
  ``lateness_ms`` = arrival − the median arrival of the step's ranks; the step's straggler score
  of a rank is ``clip(lateness / (straggler_full_share × median step time), 0, 1)`` and
  ``straggler_score`` is its mean over the rank's last ``straggler_window`` steps.

A step is complete when every expected rank (ranks that sent a step event within the last
``expect_s``) has its `StepEvent` and every kind that rank sends (spans, kernel summaries; known
once the rank sent a second step), or else once the step received nothing for ``settle_s``;
after ``timeout_s`` it completes with the ranks it has. Memory is bounded: ``max_open_steps`` open
steps per job (a newer step forces the oldest to complete), ``recent_steps`` completed steps
kept per job, and a job that ended or went quiet for ``forget_s`` is forgotten. Data for a step
already completed is late and counted in ``late_rows``.

`StepAnalysis.tick` returns the derived per-rank metrics (`DERIVED_METRICS`) as columns
(`METRIC_COLUMNS`), one row per (job, rank, step, metric), for the windows.

>>> from perfloop.schemas.codec import decode_batch, encode_batch
>>> sa = StepAnalysis(settle_s=0.5)
>>> cols = {"ts_ns": [10**9, 10**9 + 2_000_000], "rank": [0, 1], "step": [7, 7],
...         "step_time_ms": [100.0, 102.0]}
>>> sa.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n")), 0)
>>> k = {"ts_ns": [9 * 10**8] * 2, "rank": [0, 1], "step": [7, 7], "stream": [-1, -1],
...      "kernel_class": ["all", "all"], "count": [5, 5], "busy_ms": [60.0, 90.0]}
>>> sa.observe(decode_batch(encode_batch("kernel", k, job_id="j", node="n")), 0)
>>> out = sa.tick(10**9)
>>> [r.idle_ms.tolist() for r in sa.recent("j")], sa.recent("j")[0].slowest_rank
([[40.0, 12.0]], 1)
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.schemas import P2P_OPS
from perfloop.schemas.base import Event
from perfloop.schemas.codec import Batch
from perfloop.schemas.job import JobLifecycle
from perfloop.streams._batch_groups import group_batches, unique_ints
from perfloop.streams._spans import comm_inside_compute
from perfloop.streams.steps.records import (
    DERIVED_METRICS,
    METRIC_COLUMNS,
    PHASE_NAMES,
    StepRecord,
    median,
    metric_columns,
    nanmean0,
    record_state,
)

__all__ = [
    "DERIVED_METRICS",
    "METRIC_COLUMNS",
    "PHASE_NAMES",
    "StepAnalysis",
    "StepRecord",
]

NS = 1_000_000_000
_PH = {p: i for i, p in enumerate(PHASE_NAMES)}
_USER = _PH["user"]
_COMM = _PH["comm"]
_STEP, _SPAN, _UNION, _STREAMS, _COLL = 1, 2, 4, 8, 16
_RING = (
    "slot_step",
    "slot_done",
    "slot_first",
    "slot_last",
    "flags",
    "end_ns",
    "f",
    "phase",
    "incomm",
    "p2p",
)
_OPTIONAL = np.array([[_UNION], [_STREAMS], [_COLL]], np.uint8)  # rows 2-4 of _Job.f
_KIND_FLAG = {"step": _STEP, "span": _SPAN, "kernel": _UNION, "collective": 0}
_COLUMNS = {
    "step": ("rank", "step", "ts_ns", "step_time_ms", "data_wait_ms", "node"),
    "span": ("rank", "step", "phase", "name", "duration_ms", "depth", "ts_ns", "node"),
    "kernel": ("rank", "step", "stream", "kernel_class", "busy_ms", "node"),
    "collective": ("rank", "step", "duration_ms", "node"),
}
_KINDS = frozenset(_COLUMNS)
_ENDED = frozenset({"finished", "failed", "killed"})
_NO_METRICS = metric_columns([])

_PARAMS: dict[str, tuple[type, float, float]] = {
    "settle_s": (float, 0.0, 3600.0),
    "timeout_s": (float, 0.01, 86400.0),
    "expect_s": (float, 0.01, 86400.0),
    "forget_s": (float, 1.0, 86400.0),
    "straggler_window": (int, 1, 10000),
    "straggler_full_share": (float, 1e-6, 100.0),
    "max_open_steps": (int, 2, 4096),
    "recent_steps": (int, 1, 100000),
}


class _Job:
    """One job's open steps (a ring of ``cap`` slots × ranks) and recent results."""

    def __init__(self, job_id: str, cap: int, window: int, recent: int) -> None:
        self.job_id = job_id
        self.cap = cap
        self.ranks: list[int] = []
        self.col: dict[int, int] = {}
        self.lut = np.zeros(0, np.int64)  # rank → column, -1 for ranks not seen
        self.nodes: list[str] = []
        self.seen_wall = np.zeros(0, np.int64)
        self.kinds = np.zeros(0, np.uint8)  # kinds each rank sends (kernel: the union row)
        self.nsteps = np.zeros(0, np.int64)  # step events each rank sent
        self.resize(cap)
        self.hist = np.full((window, 0), np.nan)
        self.hist_i = 0
        self.max_done = -1
        self.completed = 0
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=recent)
        self.last_wall = 0
        self.ended_wall = 0

    def resize(self, cap: int, keep: dict[int, int] | None = None) -> None:
        """(Re)allocate the ring of open steps with ``cap`` slots; ``keep`` maps new slots to
        the old slots whose open steps move there."""
        r = len(self.ranks)
        old = {n: getattr(self, n) for n in _RING} if keep else {}
        self.cap = cap
        self.slot_step = np.full(cap, -1, np.int64)
        self.slot_done = np.zeros(cap, bool)
        self.slot_first = np.zeros(cap, np.int64)
        self.slot_last = np.zeros(cap, np.int64)
        self.flags = np.zeros((cap, r), np.uint8)
        self.end_ns = np.zeros((cap, r), np.int64)
        self.f = np.zeros((5, cap, r))  # step_ms, data_wait_ms, busy, streams sum, collective
        self.phase = np.zeros((cap, r, len(PHASE_NAMES)))
        self.incomm = np.zeros((cap, r))  # comm spans nested in a phase (DDP's all-reduce)
        self.p2p = np.zeros((cap, r))  # point-to-point comm spans (a pipeline's sends, receives)
        for to, frm in (keep or {}).items():
            for n in _RING:
                if n == "f":
                    self.f[:, to] = old["f"][:, frm]
                else:
                    getattr(self, n)[to] = old[n][frm]

    def columns(self, ranks: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Column of each rank, adding new ranks; ``nodes``: each row's node."""
        top = int(ranks.max())
        if top >= len(self.lut):
            self.lut = np.concatenate([self.lut, np.full(top + 1 - len(self.lut), -1)])
        cols = self.lut[ranks]
        if (cols < 0).any():
            new = cols < 0
            for r, node in dict(zip(ranks[new].tolist(), nodes[new], strict=True)).items():
                self.lut[r] = self.col[r] = len(self.ranks)
                self.ranks.append(r)
                self.nodes.append(node)
                self._grow()
            cols = self.lut[ranks]
        moved = np.asarray(self.nodes, dtype=object)[cols] != nodes
        for c, node in zip(cols[moved].tolist(), nodes[moved], strict=True):
            self.nodes[c] = node  # a rank that moved to another node
        return cols

    def _grow(self) -> None:
        def pad(a: np.ndarray, axis: int, fill: Any) -> np.ndarray:
            shape = list(a.shape)
            shape[axis] = 1
            return np.concatenate([a, np.full(shape, fill, a.dtype)], axis=axis)

        self.seen_wall = pad(self.seen_wall, 0, 0)
        self.kinds = pad(self.kinds, 0, 0)
        self.nsteps = pad(self.nsteps, 0, 0)
        self.flags = pad(self.flags, 1, 0)
        self.end_ns = pad(self.end_ns, 1, 0)
        self.f = pad(self.f, 2, np.nan)
        self.phase = pad(self.phase, 1, 0.0)
        self.incomm = pad(self.incomm, 1, 0.0)
        self.p2p = pad(self.p2p, 1, 0.0)
        self.hist = pad(self.hist, 1, np.nan)


class StepAnalysis:
    """Per (job, step, rank) busy, idle, phase and straggler figures; see the module docstring.

    Parameters are constructor arguments of the same names, changed live with
    ``configure("steps.<name>", value)``.
    """

    def __init__(
        self,
        *,
        settle_s: float = 1.0,
        timeout_s: float = 10.0,
        expect_s: float = 60.0,
        forget_s: float = 600.0,
        straggler_window: int = 20,
        straggler_full_share: float = 0.2,
        max_open_steps: int = 64,
        recent_steps: int = 64,
    ) -> None:
        self.settle_s = settle_s
        self.timeout_s = timeout_s
        self.expect_s = expect_s
        self.forget_s = forget_s
        self.straggler_window = straggler_window
        self.straggler_full_share = straggler_full_share
        self.max_open_steps = max_open_steps
        self.recent_steps = recent_steps
        for name in _PARAMS:
            self._check(name, getattr(self, name))
        self._jobs: dict[str, _Job] = {}
        self._pending: list[tuple[Batch, int]] = []
        self._done: list[StepRecord] = []
        self.last_done: list[StepRecord] = []
        """The steps the latest `tick` completed, in completion order (any job's)."""
        self._wall = 0
        self.late_rows = 0
        self.dropped_steps = 0

    # -- the component interface ---------------------------------------------------------------
    def observe(self, batch: Batch, wall_ns: int) -> None:
        """Take a decoded batch (kinds other than step, span, kernel, collective are ignored)."""
        if batch.kind in _KINDS:
            self._pending.append((batch, wall_ns))
            self._wall = wall_ns

    def observe_event(self, event: Event, wall_ns: int) -> None:
        """A job's end (`JobLifecycle` of rank -1) completes its open steps at the next tick."""
        if isinstance(event, JobLifecycle) and event.rank == -1 and event.state in _ENDED:
            self._apply()
            job = self._jobs.get(event.job_id)
            if job is not None:
                job.ended_wall = max(wall_ns, 1)

    def tick(self, wall_ns: int, jobs: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Apply what was observed, complete due steps; return their metrics (`METRIC_COLUMNS`).

        ``jobs``: only these jobs' steps are completed (the engine ticks each job at its own
        event time); None: every job's.
        """
        self._apply()
        for job_id in list(self._jobs) if jobs is None else [j for j in jobs if j in self._jobs]:
            job = self._jobs[job_id]
            self._complete_due(job, wall_ns)
            idle = wall_ns - job.last_wall > self.forget_s * NS
            ended = job.ended_wall and wall_ns - job.ended_wall > self.forget_s * NS
            if (idle or ended) and not (job.slot_step[~job.slot_done] >= 0).any():
                del self._jobs[job_id]
        done, self._done = self._done, []
        self.last_done = done
        return metric_columns(done) if done else _NO_METRICS

    def forget(self, job_id: str) -> None:
        """Drop the job: its open steps complete now (their metrics come with the next
        `tick`), then nothing of it is kept."""
        self._apply()
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self._complete_due(job, self._wall, force=True)

    def configure(self, key: str, value: Any) -> tuple[Any, Any]:
        """Change one parameter live (``steps.<name>``); return ``(old, new)``."""
        name = key.removeprefix("steps.")
        if not key.startswith("steps.") or name not in _PARAMS:
            raise ConfigError(
                f"unknown step analysis setting {key!r}; valid: "
                + ", ".join(f"steps.{n}" for n in _PARAMS)
            )
        new = self._check(name, value)
        old = getattr(self, name)
        setattr(self, name, new)
        if name == "straggler_window":
            for job in self._jobs.values():
                job.hist = np.full((new, len(job.ranks)), np.nan)
                job.hist_i = 0
        elif name == "recent_steps":
            for job in self._jobs.values():
                job.recent = collections.deque(job.recent, maxlen=new)
        elif name == "max_open_steps":
            self._apply()
            for job in self._jobs.values():
                open_ = np.flatnonzero((job.slot_step >= 0) & ~job.slot_done)
                open_ = open_[np.argsort(job.slot_step[open_])]
                keep: dict[int, int] = {}  # new slot → old slot, the newest step wins
                for slot in open_.tolist():
                    keep[int(job.slot_step[slot]) % new] = slot
                for slot in sorted(set(open_.tolist()) - set(keep.values())):
                    self._complete(job, slot, self._wall)  # no room left: done with what it has
                job.resize(new, keep)
        return old, new

    def snapshot(self) -> dict[str, Any]:
        """Durable state: builtins and numpy arrays (observed batches are applied first)."""
        self._apply()
        jobs = {}
        for job_id, job in self._jobs.items():
            d = {k: v for k, v in vars(job).items() if k != "recent"}
            d["recent"] = [record_state(r) for r in job.recent]
            jobs[job_id] = d
        return {
            "version": 1,
            "params": {n: getattr(self, n) for n in _PARAMS},
            "jobs": jobs,
            "done": [record_state(r) for r in self._done],
            "late_rows": self.late_rows,
            "dropped_steps": self.dropped_steps,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace this component's state with a `snapshot`."""
        if state.get("version") != 1:
            raise ConfigError(f"step analysis snapshot version {state.get('version')!r}; valid: 1")
        for n, v in state["params"].items():
            setattr(self, n, v)
        self._jobs = {}
        for job_id, d in state["jobs"].items():
            job = _Job(job_id, self.max_open_steps, self.straggler_window, self.recent_steps)
            for k, v in d.items():
                if k == "recent":
                    job.recent.extend(StepRecord(**r) for r in v)
                else:
                    setattr(job, k, v)
            for name in ("incomm", "p2p"):  # a snapshot from before these counted
                if name not in d:
                    setattr(job, name, np.zeros((job.cap, len(job.ranks))))
            self._jobs[job_id] = job
        self._done = [StepRecord(**r) for r in state["done"]]
        self._pending = []
        self.late_rows = state["late_rows"]
        self.dropped_steps = state["dropped_steps"]

    # -- queries -----------------------------------------------------------------------------
    def open_since(self, job_id: str) -> int | None:
        """The oldest end (event time) of a step event the job's open steps hold; None when
        they hold none. `tick` will return no metric of theirs older than that (a metric's
        time is its step event's)."""
        self._apply()
        job = self._jobs.get(job_id)
        if job is None:
            return None
        open_ = (job.slot_step >= 0) & ~job.slot_done
        if not open_.any():
            return None
        has = (job.flags[open_] & _STEP) != 0
        return int(job.end_ns[open_][has].min()) if has.any() else None

    def recent(self, job_id: str) -> list[StepRecord]:
        """The job's most recently completed steps, oldest first."""
        job = self._jobs.get(job_id)
        return list(job.recent) if job else []

    def scores(self, job_id: str) -> dict[int, float]:
        """Each rank's straggler score over its recent steps (ranks without one left out)."""
        job = self._jobs.get(job_id)
        if job is None or not len(job.ranks):
            return {}
        with np.errstate(all="ignore"):
            s = nanmean0(job.hist)
        return {r: float(s[c]) for r, c in job.col.items() if np.isfinite(s[c])}

    # -- internals ---------------------------------------------------------------------------
    def _check(self, name: str, value: Any) -> Any:
        kind, lo, hi = _PARAMS[name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and kind is int:
            ok = float(value).is_integer()
        if not ok or not (lo <= value <= hi) or not math.isfinite(value):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"steps.{name} must be {what} in [{lo:g}, {hi:g}], got {value!r}")
        return kind(value)

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(
                job_id, self.max_open_steps, self.straggler_window, self.recent_steps
            )
        return job

    def _apply(self) -> None:
        """Fold the observed batches into the jobs' step tables, at the wall time each came."""
        pending, self._pending = self._pending, []
        for job_id, _, kind, c, wall_ns in group_batches(pending, _COLUMNS):
            job = self._job(job_id)
            job.last_wall = wall_ns
            if kind == "span":
                keep = (c["depth"] == 0) | comm_inside_compute(c)
                if not keep.all():
                    if not keep.any():
                        continue
                    c = {k: v[keep] for k, v in c.items()}
            steps = c["step"]
            width = max(1, job.cap // 2)
            if len(steps) and int(steps.max()) - int(steps.min()) >= width:
                # more steps than the ring holds: fold them in slices of half the ring, so
                # the oldest complete with their data (a ring-full slot completes as it is)
                part = (steps - steps.min()) // width
                for k in np.unique(part).tolist():
                    sel = part == k
                    self._fold(job, kind, {n: v[sel] for n, v in c.items()}, wall_ns)
            else:
                self._fold(job, kind, c, wall_ns)

    def _fold(self, job: _Job, kind: str, c: dict[str, np.ndarray], wall_ns: int) -> None:
        """Fold one batch's rows (at most half the ring's steps) into the job's step table."""
        cols = job.columns(c["rank"], c["node"])
        slots = self._slots(job, c["step"], wall_ns, is_step=kind == "step")
        ok = slots >= 0
        if not ok.all():
            self.late_rows += int((~ok).sum())
            if not ok.any():
                return
            cols, slots = cols[ok], slots[ok]
            c = {k: v[ok] for k, v in c.items()}
        job.slot_last[slots] = wall_ns
        job.kinds[cols] |= _KIND_FLAG[kind]
        if kind == "step":
            job.end_ns[slots, cols] = c["ts_ns"]
            job.f[0, slots, cols] = c["step_time_ms"]
            job.f[1, slots, cols] = c["data_wait_ms"]
            new = (job.flags[slots, cols] & _STEP) == 0
            job.flags[slots, cols] |= _STEP
            job.seen_wall[cols] = wall_ns
            np.add.at(job.nsteps, cols[new], 1)
        elif kind == "span":
            first = (job.flags[slots, cols] & _SPAN) == 0
            job.phase[slots[first], cols[first]] = 0.0
            job.incomm[slots[first], cols[first]] = 0.0
            job.p2p[slots[first], cols[first]] = 0.0
            job.flags[slots, cols] |= _SPAN
            p2p = (c["phase"] == "comm") & np.isin(c["name"], P2P_OPS)
            if p2p.any():
                np.add.at(job.p2p, (slots[p2p], cols[p2p]), c["duration_ms"][p2p])
            inner = c["depth"] > 0
            if inner.any():
                np.add.at(job.incomm, (slots[inner], cols[inner]), c["duration_ms"][inner])
                slots, cols = slots[~inner], cols[~inner]
                c = {k: v[~inner] for k, v in c.items()}
            codes = np.fromiter(map(_PH.get, c["phase"], repeat(_USER)), np.int64, len(cols))
            np.add.at(job.phase, (slots, cols, codes), c["duration_ms"])
        elif kind == "kernel":
            every = c["kernel_class"] == "all"
            union = every & (c["stream"] == -1)
            job.f[2, slots[union], cols[union]] = c["busy_ms"][union]
            job.flags[slots[union], cols[union]] |= _UNION
            per = every & (c["stream"] >= 0)
            s, k = slots[per], cols[per]
            fresh = (job.flags[s, k] & _STREAMS) == 0
            job.f[3, s[fresh], k[fresh]] = 0.0
            np.add.at(job.f[3], (s, k), c["busy_ms"][per])
            job.flags[s, k] |= _STREAMS
        else:  # collective
            fresh = (job.flags[slots, cols] & _COLL) == 0
            job.f[4, slots[fresh], cols[fresh]] = 0.0
            np.add.at(job.f[4], (slots, cols), c["duration_ms"])
            job.flags[slots, cols] |= _COLL

    def _slots(self, job: _Job, steps: np.ndarray, wall_ns: int, *, is_step: bool) -> np.ndarray:
        """The ring slot of each row's step, claiming slots for new steps; -1 for late rows."""
        uniq, inv = unique_ints(steps)
        out = np.empty(len(uniq), np.int64)
        if is_step and len(uniq) and uniq[0] < job.max_done - 4 * job.cap:
            self._restart(job)  # step numbers went far back: the job restarted
        for i, s in enumerate(uniq.tolist()):
            slot = s % job.cap
            held = int(job.slot_step[slot])
            if held == s:
                out[i] = -1 if job.slot_done[slot] else slot
            elif held > s or s <= job.max_done - job.cap:
                out[i] = -1
            else:
                if held >= 0 and not job.slot_done[slot]:
                    self._complete(job, slot, wall_ns)  # the ring is full
                job.slot_step[slot] = s
                job.slot_done[slot] = False
                job.slot_first[slot] = job.slot_last[slot] = wall_ns
                job.flags[slot] = 0
                job.end_ns[slot] = 0
                job.f[:, slot] = np.nan
                job.phase[slot] = np.nan
                job.incomm[slot] = 0.0
                job.p2p[slot] = 0.0
                out[i] = slot
        return out[inv]

    def _restart(self, job: _Job) -> None:
        job.slot_step[:] = -1
        job.slot_done[:] = False
        job.max_done = -1

    def _complete_due(self, job: _Job, wall_ns: int, *, force: bool = False) -> None:
        open_ = np.flatnonzero((job.slot_step >= 0) & ~job.slot_done)
        if not len(open_):
            return
        open_ = open_[np.argsort(job.slot_step[open_])]  # completed in step order
        expected = job.seen_wall >= wall_ns - int(self.expect_s * NS)
        learned = job.kinds[expected]
        # A rank's kinds are known once it sent a second step (the first step's parts came
        # before the second's: a producer sends a step's spans and summaries with its event).
        known = bool((job.nsteps[expected] >= 2).all())
        # Every open slot at once (completing one changes nothing the others are judged by).
        f = job.flags[open_]
        present = (f & _STEP) != 0
        all_in = present[:, expected].all(axis=1) & bool(expected.any())
        full = all_in & ((f[:, expected] & learned) == learned).all(axis=1) & known
        settled = wall_ns - job.slot_last[open_] >= self.settle_s * NS
        timed = wall_ns - job.slot_first[open_] >= self.timeout_s * NS
        timed |= force or bool(job.ended_wall)
        anything = present.any(axis=1)
        due = (all_in & (full | settled)) | (timed & anything)
        for slot in open_[due].tolist():
            self._complete(job, slot, wall_ns)
        empty = timed & ~anything  # rows without any step event: nothing to relate them to
        if empty.any():
            job.slot_done[open_[empty]] = True
            self.dropped_steps += int(empty.sum())

    def _complete(self, job: _Job, slot: int, wall_ns: int) -> None:
        job.slot_done[slot] = True
        f = job.flags[slot]
        cols = np.flatnonzero(f & _STEP)
        if not len(cols):
            self.dropped_steps += 1
            return
        step = int(job.slot_step[slot])
        job.max_done = max(job.max_done, step)
        job.completed += 1
        fc = f[cols]
        vals = job.f[:, slot, cols]  # step, data wait, busy, streams sum, collective
        step_ms = vals[0]
        busy, ssum, coll = np.where((fc[None, :] & _OPTIONAL) != 0, vals[2:], np.nan)
        spans = (fc & _SPAN) != 0
        phase = np.where(spans[:, None], job.phase[slot, cols], np.nan)
        idle = np.maximum(step_ms - busy, 0.0)  # NaN where busy is unknown
        end = job.end_ns[slot, cols]
        # time blocked in collectives: comm spans, and those nested in a phase (DDP's
        # all-reduce inside backward), so the rank that waits is not the one that came last;
        # not in a pipeline's sends and receives (they wait out its bubble)
        blocked = job.phase[slot, cols, _COMM] + job.incomm[slot, cols] - job.p2p[slot, cols]
        comm = np.where(spans, blocked, 0.0)
        arrival = end - np.rint(comm * 1e6).astype(np.int64)
        row = job.hist_i % len(job.hist)
        job.hist[row] = np.nan
        job.hist_i += 1
        if len(cols) >= 2:
            lateness = (arrival - median(arrival)) / 1e6
            scale = self.straggler_full_share * median(step_ms)
            job.hist[row, cols] = np.clip(lateness / scale, 0.0, 1.0) if scale > 0 else 0.0
            score = nanmean0(job.hist[:, cols])
        else:
            lateness = score = np.full(len(cols), np.nan)
        lack = (job.seen_wall >= wall_ns - int(self.expect_s * NS)) & ((f & _STEP) == 0)
        missing = tuple(job.ranks[c] for c in np.flatnonzero(lack)) if lack.any() else ()
        rec = StepRecord(
            job_id=job.job_id,
            step=step,
            ranks=np.asarray(job.ranks, np.int64)[cols],
            nodes=tuple(job.nodes[c] for c in cols),
            end_ns=end.copy(),
            step_ms=step_ms.copy(),
            busy_ms=busy,
            busy_streams_sum_ms=ssum,
            idle_ms=idle,
            idle_share=idle / step_ms,
            phase_ms=phase,
            collective_ms=coll,
            lateness_ms=lateness,
            straggler_score=score,
            missing_ranks=missing,
        )
        job.recent.append(rec)
        self._done.append(rec)
