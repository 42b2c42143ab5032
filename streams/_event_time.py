"""The analyses on each job's event-time clock: the clock, the input queued for them, and how
the engine hands it over and ticks them (private to the engine).

The stream engine (`perfloop.streams.engine`) hands a job's batches and job events to the
analyses (`StepAnalysis`, `PhaseMachine`, `Funnel`, `PredictionHost` and the rules) in
event-time order, once the job's clock has passed them, and ticks the analyses at each
boundary of that clock. A `JobClock` holds what that needs: the queue (a heap by event time,
ties by kind, node and arrival), the clock and the wall time it was set at, the newest event
time queued and handed over, the next analysis tick, and the oldest sample of the step batches
still queued (the step analysis's derived metrics will not be older). Its state is builtins,
batches and events (`state`).

`EventTime` is the part of `StreamEngine` that does it (a base class of the engine, whose
components and counters it uses): queue an item on its job's clock, move the clock on, release
what it passed to the analyses, tick them, feed the windows their derived metrics, and let an
ended or forgotten job go.
"""

from __future__ import annotations

import copy
import heapq
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from perfloop.schemas import Batch, JobInfo, JobLifecycle
from perfloop.schemas.base import Event
from perfloop.streams.windows import NS

if TYPE_CHECKING:
    from perfloop.streams.funnel import Funnel
    from perfloop.streams.outcomes import Outcomes
    from perfloop.streams.phases import PhaseMachine
    from perfloop.streams.predict import PredictionHost
    from perfloop.streams.rules import DataWaitRule, StragglerRule, ThreadRule
    from perfloop.streams.steps import StepAnalysis
    from perfloop.streams.windows import WindowSet

__all__ = ["EventTime", "JobClock", "QueueEntry"]

_MAX_GAP_NS = 120 * NS  # a job's clock leaping further skips the analysis ticks in between
_FORGET_MARGIN_NS = 60 * NS

QueueEntry = tuple[int, str, str, int, Batch | Event]
"""Event time (a batch's newest sample, an event's ``ts_ns``), kind, node, arrival, the item."""


class JobClock:
    """One job's event-time clock and its input queued for the analyses (see the docstring)."""

    __slots__ = ("at_wall", "clock", "evt", "gone", "newest", "next_tick", "queue", "step_mins")

    def __init__(self, next_tick: int) -> None:
        self.queue: list[QueueEntry] = []  # a heap by event time
        self.step_mins: list[tuple[int, int]] = []  # queued step batches: (oldest ts, seq) heap
        self.gone: set[int] = set()  # step batches released but still in step_mins
        self.clock = 0  # event time up to which the job's input has been read
        self.at_wall = 0  # the wall time the clock was last set at
        self.newest = 0  # newest event time queued
        self.evt = 0  # newest event time handed to the analyses
        self.next_tick = next_tick  # the next analysis tick (event time)

    def queued_steps_since(self) -> int | None:
        """The oldest event time of the step batches still queued (None: none)."""
        while self.step_mins and self.step_mins[0][1] in self.gone:
            self.gone.discard(heapq.heappop(self.step_mins)[1])
        return self.step_mins[0][0] if self.step_mins else None

    def state(self) -> dict[str, Any]:
        return {k: copy.copy(getattr(self, k)) for k in self.__slots__}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> JobClock:
        jt = cls(d["next_tick"])
        for k in cls.__slots__:
            setattr(jt, k, copy.copy(d[k]))
        return jt


class EventTime:
    """How `StreamEngine` runs its analyses on each job's event-time clock (see the docstring);
    the engine sets the attributes below."""

    windows: WindowSet
    steps: StepAnalysis
    phases: PhaseMachine
    funnel: Funnel
    predict: PredictionHost
    outcomes: Outcomes
    rule: DataWaitRule
    threads: ThreadRule
    stragglers: StragglerRule
    derived_metrics: tuple[str, ...]
    _tick_ns: int
    _time: dict[str, JobClock]
    _ended: dict[str, int]  # job → event time it ended (-1: its state freed)
    _seq: int
    _out: Any  # the engine's `Outputs` since its last tick

    def _queue(self, job: str, t: int, kind: str, node: str, item: Batch | Event) -> None:
        jt = self._time.get(job)
        if jt is None:
            jt = self._time[job] = JobClock((t // self._tick_ns + 1) * self._tick_ns)
        heapq.heappush(jt.queue, (t, kind, node, self._seq, item))
        self._seq += 1
        jt.newest = max(jt.newest, t)

    def _advance(self, job: str, wall_ns: int) -> None:
        """Move the job's clock on; hand the analyses what it passed, ticking them at each
        ``tick_interval_s`` boundary (the input up to a boundary first)."""
        jt = self._time[job]
        clock = self.windows.watermark_ns(job, wall_ns, derived=False)
        if clock is None:  # no telemetry (yet, or any more): its events' time, then the wall's
            clock = max(jt.newest, jt.clock + max(0, wall_ns - jt.at_wall) if jt.clock else 0)
        jt.clock, jt.at_wall = max(jt.clock, clock), wall_ns
        q, step = jt.queue, self._tick_ns
        while True:  # strictly before the clock: all of that time's input has been read
            if q and q[0][0] <= jt.next_tick and q[0][0] < jt.clock:
                self._release(jt, heapq.heappop(q))
                continue
            if jt.next_tick >= jt.clock:
                return
            gap = (min(jt.clock, q[0][0]) if q else jt.clock) - jt.next_tick
            if gap > _MAX_GAP_NS:  # nothing came for long: tick its last _MAX_GAP_NS only
                jt.next_tick += (gap - _MAX_GAP_NS) // step * step
            self._analyse(job, jt.next_tick, wall_ns)
            jt.next_tick += step

    def _release(self, jt: JobClock, entry: QueueEntry) -> None:
        jt.evt = max(jt.evt, entry[0])
        item = entry[4]
        job = item.job_id
        if isinstance(item, Batch) and item.kind == "step":
            jt.gone.add(entry[3])
        if job in self._ended:
            if not (isinstance(item, JobLifecycle) and item.state == "started"):
                return  # late input of an ended job: windows only (they took it at ingest)
            del self._ended[job]  # the job runs again
        if isinstance(item, Batch):
            self.steps.observe(item, jt.evt)
            self.phases.observe(item, jt.evt)
            self.funnel.observe(item, jt.evt)
            self.predict.observe(item, jt.evt)
            if item.kind == "step":
                cols = item.columns
                workers = int(cols["num_workers"][-1])
                self.rule.observe_workers(item.job_id, workers, int(cols["ts_ns"][-1]))
                self.threads.observe_steps(
                    item.job_id,
                    steps=len(cols["step_time_ms"]),
                    step_ms=float(cols["step_time_ms"].sum()),
                    wait_ms=float(cols["data_wait_ms"].sum()),
                    workers=workers,
                )
        else:
            if isinstance(item, JobInfo):
                self.rule.observe_info(item)
                self.threads.observe_info(item)
                self.outcomes.observe_info(item)
            self.steps.observe_event(item, jt.evt)
            self.phases.observe_event(item, jt.evt)
            self.funnel.observe_event(item, jt.evt)
            self.predict.observe_event(item, jt.evt)
            if isinstance(item, JobLifecycle) and self.funnel.has_ended(job):
                self._ended[job] = jt.evt

    def _analyse(self, job: str, now: int, wall_ns: int) -> None:
        """Tick the analyses for one job at event time ``now``."""
        jobs = (job,)
        derived = self.steps.tick(now, jobs)
        if derived is not None and len(derived["ts_ns"]):
            self._add_derived(derived, wall_ns)
        # the derived metrics still to come are of open steps and of step batches queued
        pending = [self.steps.open_since(job), self._time[job].queued_steps_since()]
        self.windows.set_clock(job, "derived", min([now, *(t for t in pending if t is not None)]))
        phases = self.phases.tick(now, jobs)
        self._out.phases.extend(phases)
        diagnoses = self.funnel.tick(now, jobs)
        self._out.diagnoses.extend(diagnoses)
        if job in self._ended:  # what ends with it was said above (resolved, finished)
            self._free(job)
            return
        self._out.recommendations.extend(self.rule.evaluate(diagnoses, now_ns=now, job=job))
        self._out.recommendations.extend(self.stragglers.evaluate(diagnoses))
        for note in self.rule.drain_notes():  # why it stops: on the diagnosis, next tick
            self.funnel.annotate(*note)
        planned = self.rule.workers(job, now)  # the threads fit the workers asked for
        self._out.recommendations.extend(
            self.threads.evaluate(job, now, workers=planned, diagnoses=diagnoses)
        )
        if self.predict.enabled:
            self.predict.steps(self.steps.last_done)
            self.predict.phases(phases)
            self._out.predictions.extend(self.predict.tick(now, jobs))

    def _free(self, job: str) -> None:
        """The job ended: nothing more is diagnosed, predicted or recommended for it, and what
        every component keeps of it goes (once; its windows close as they are due)."""
        if self._ended.get(job, 0) < 0:
            return
        self.steps.forget(job)
        self.phases.forget(job)
        self.rule.forget(job)
        self.threads.forget(job)
        self.stragglers.forget(job)
        self.outcomes.forget(job)
        self.predict.forget(job)
        self._out.predictions.extend(self.predict.drain())
        self._ended[job] = -1  # freed

    def _forget_time(self, job: str, wall_ns: int) -> bool:
        """Whether the job's clock can go: the windows forgot it and every analysis has had
        the time to (their forget settings, in its event time)."""
        jt = self._time[job]
        horizon = max(
            self.funnel.config.funnel.idle_job_s, self.steps.forget_s, self.phases.forget_s
        )
        return (
            not jt.queue
            and self.windows.watermark_ns(job, wall_ns) is None
            and jt.clock - jt.evt > int(horizon * NS) + _FORGET_MARGIN_NS
        )

    def _add_derived(self, d: dict[str, Any], wall_ns: int) -> None:
        """Feed the chosen `StepAnalysis` metrics (idle, straggler score, …) to the windows."""
        metrics = np.asarray(d["metric"], dtype=object)
        keep = np.flatnonzero(np.isin(metrics, self.derived_metrics))
        if not len(keep):
            return
        jobs = np.asarray(d["job_id"], dtype=object)[keep]
        nodes = np.asarray(d["node"], dtype=object)[keep]
        ranks = np.asarray(d["rank"], dtype=np.int64)[keep]
        ts = np.asarray(d["ts_ns"], dtype=np.int64)[keep]
        values = np.asarray(d["value"], dtype=np.float64)[keep]
        groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)
        keys = zip(jobs.tolist(), nodes.tolist(), metrics[keep].tolist(), strict=True)
        for i, key in enumerate(keys):
            groups[key].append(i)
        for (job, node, metric), idx in groups.items():
            sel = np.asarray(idx)
            devices = np.full(len(sel), -1)
            self.windows.add(job, node, ranks[sel], devices, ts[sel], metric, values[sel], wall_ns)
