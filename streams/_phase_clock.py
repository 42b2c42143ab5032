"""Each job's event-time clock and the input queued for the analyses (private to the engine).

The stream engine (`perfloop.streams.engine`) hands a job's batches and job events to the
analyses (`StepAnalysis`, `PhaseMachine`, `Funnel`) in event-time order, once the job's clock
has passed them, and ticks the analyses at each boundary of that clock. A `JobClock` holds
what that needs: the queue (a heap by event time, ties by kind, node and arrival), the clock
and the wall time it was set at, the newest event time queued and handed over, the next
analysis tick, and the oldest sample of the step batches still queued (the step analysis's
derived metrics will not be older). Its state is builtins, batches and events (`state`).
"""

from __future__ import annotations

import copy
import heapq
from typing import Any

from perfloop.schemas import Batch
from perfloop.schemas.base import Event

__all__ = ["JobClock", "QueueEntry"]

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
