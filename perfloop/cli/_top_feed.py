"""The live feed of `perfloop top`: perfloop's topics followed from their end, decoded.

`TopicFeed` reads in a thread of its own (`perfloop.kafka.follow`, no consumer group) and
keeps what it decoded until the view takes it (`drain`): the job events, diagnoses,
recommendations, commands and acks of every job, and the telemetry batches (steps, spans,
GPU and host readings) of the selected job only; of another job's telemetry it keeps one
`Seen` mark a second, so the picker knows the job is alive without decoding its samples.
Any object with ``start``, ``select``, ``drain`` and ``stop`` can stand in for it (a feed on
``perfloop.client`` once it lands).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

from perfloop.cli._top_lines import Seen
from perfloop.kafka import consumer, follow
from perfloop.schemas import SchemaError, decode_batch, decode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import BaseServiceSettings

__all__ = ["TopicFeed"]

log = logging.getLogger("perfloop.cli.top")

TELEMETRY = (Topics.STEP, Topics.SPAN, Topics.GPU, Topics.HOST)
EVENTS = (
    Topics.JOB,
    Topics.PHASES,
    Topics.DIAGNOSES,
    Topics.RECOMMENDATIONS,
    Topics.CONTROL,
    Topics.ACTUATIONS,
)
_SEEN_EVERY_NS = 1_000_000_000
_KEPT = 200_000  # items waiting for the view; the oldest go first past it


class TopicFeed:
    """Decoded items from the topics, for `perfloop top`'s view to `drain` once a second."""

    def __init__(self, settings: BaseServiceSettings, *, job: str | None = None) -> None:
        self.selected = job
        self.bad = 0  # messages that did not decode
        self._items: deque[Any] = deque(maxlen=_KEPT)
        self._seen: dict[str, int] = {}
        self._events: dict[str, None] = {}  # the latest events' ids, oldest first
        self._c = consumer(settings, f"perfloop-top-{os.getpid()}")
        self._stop, self._assigned = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._run, name="perfloop-top-feed", daemon=True)

    def start(self, timeout_s: float = 15.0) -> bool:
        """Start following; True once the topics are assigned (within ``timeout_s``)."""
        self._t.start()
        return self._assigned.wait(timeout_s)

    def select(self, job: str | None) -> None:
        """Decode this job's telemetry from now on (and no other's)."""
        self.selected = job

    def drain(self) -> list[Any]:
        """What was decoded since the last call, oldest first."""
        out = []
        while True:
            try:
                out.append(self._items.popleft())
            except IndexError:
                return out

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def _run(self) -> None:
        follow(self._c, [*TELEMETRY, *EVENTS], self._take, self._stop, self._assigned,
               what="perfloop top", log=log)  # fmt: skip

    def _take(self, msg: Any) -> None:
        key = msg.key()
        job = key.decode(errors="replace") if key else ""
        data = msg.value() or b""
        try:
            if msg.topic() in EVENTS:
                event = decode_event(data)
                # a stream setting for every job travels on every partition: show it once
                if event.event_id in self._events:
                    return
                self._events[event.event_id] = None
                if len(self._events) > 1000:
                    self._events.pop(next(iter(self._events)))
                self._items.append(event)
            elif job == self.selected or (not job and self.selected is not None):
                batch = decode_batch(data)
                if batch.job_id == self.selected:
                    self._items.append(batch)
            elif job:
                ts_ms = msg.timestamp()[1]
                now = ts_ms * 1_000_000 if ts_ms > 0 else time.time_ns()
                if now - self._seen.get(job, 0) >= _SEEN_EVERY_NS:
                    self._seen[job] = now
                    self._items.append(Seen(job, now))
        except SchemaError:
            self.bad += 1
