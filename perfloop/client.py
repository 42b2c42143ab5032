"""Follow perfloop's topics from your own code, as typed events: `Follower`.

A `Follower` reads the topics the stream tier, the actuator and the training nodes publish
on, decodes every message with the project's codecs (`perfloop.schemas.decode_event`; a
telemetry batch with `perfloop.schemas.decode_batch`, one event per sample) and hands out
the `perfloop.schemas` events one by one, each with its ``KIND`` (``"diagnosis"``,
``"recommendation"``, …)::

    from perfloop.client import Follower
    from perfloop.settings import StackSettings, load_settings

    with Follower(load_settings(StackSettings), jobs=["my-job"], kinds=["diagnosis"]) as events:
        for ev in events:
            print(ev.KIND, ev.bottleneck, ev.state)

What it reads:

- ``kinds``: event kinds (`KINDS`; classes such as `perfloop.schemas.Diagnosis` work too).
  By default `DEFAULT_KINDS`: every single-event kind (diagnoses, predictions, phases,
  recommendations, approvals, commands, acks, the actuator's decisions, live config changes,
  job info, lifecycle, capability reports, rank progress, ground truth) but the producers'
  self-metrics (``producer``, every few seconds per producer). Telemetry samples
  (`TELEMETRY_KINDS`: ``step``, ``span``, ``gpu``, …) come only when asked for, one event per
  sample (many per message: they cost a pydantic object each). Closed windows
  (``perfloop.windows``) are not events; read them from the warehouse.
- ``jobs``: only these jobs' events (a config change counts for the jobs it applies to,
  ``*`` for every job). Messages are keyed by job, so the others are skipped undecoded.
- ``since``: from this point in time: a `datetime`, a `timedelta` (that long ago), Unix
  nanoseconds, or text for `parse_since` (``"10m"``, an ISO time). Default (None): from now.
  The point is the messages' Kafka timestamps (when they were produced), not the events'
  ``ts_ns`` (a job's own clock, a replayed trace's time).

Starting at once, with no consumer group: the follower assigns itself every partition of
its topics (no group join, which takes seconds: 3 s on the embedded broker, more on a
rebalance, and a consumer group starting at ``latest`` misses what is published meanwhile)
at the offset of ``since``, asked of the broker by timestamp (ListOffsets, `offsets_for_times`),
and skips, per partition, the messages stamped before ``since`` until the first one at or
after it. The embedded broker (tansu 0.6.0) answers a ListOffsets by timestamp with the
partition's first offset, whatever the time: there the follower reads each partition from
its start and skips the older messages by their timestamps (correct, and the more the broker
holds the longer the start). From now (the default), it starts at the partitions' ends
(ListOffsets for the latest offset, which the embedded broker does answer), looked up before
the constructor returns: everything published after that is handed out, and nothing stamped
more than a second before the start (the embedded broker may report an end inside the last
batch of messages).

Order: a job's events of one topic come in the order they were published (one partition);
events of different topics come as they are fetched (live: as published; from a past
``since``: topic by topic).

Group mode, for services that must handle every event at least once (``group="name"``):
the follower joins that consumer group (its partitions shared among the group's members)
and hands out the events after the group's committed positions, or, for a partition the
group never committed, from ``since`` (default: when the follower was created, so what is
published during the join is not missed). `Follower.commit` commits everything handed out
so far: call it once you have handled an event (and the ones before it). What was handed
out and not committed is handed out again after a restart or a rebalance (at least once,
maybe twice: deduplicate by ``event_id`` where that matters). Nothing is committed on
`Follower.close`. A telemetry message's events are committed together, with its last one.

A message that cannot be decoded is skipped with one warning line on the
``perfloop.client`` logger (`perfloop.bad_input`'s skip policy) and counted
(`Follower.skipped`); it never raises into the loop. Broker errors while following are
logged once per kind and retried by the client; only starting (broker unreachable, topics
missing) and `Follower.commit` raise, `BrokerError`, with one line. `Follower.stop` ends an
iteration (a flag: call it from a signal handler, rather than raising `KeyboardInterrupt`
through the Kafka client's poll), `Follower.close` releases the consumer.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from types import TracebackType

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from perfloop.bad_input import Failed, decide, skip_policy
from perfloop.exceptions import BrokerError, ConfigError
from perfloop.kafka import consumer, ping
from perfloop.schemas import (
    BATCH_KINDS,
    EVENT_KINDS,
    ConfigChange,
    Event,
    decode_batch,
    decode_event,
)
from perfloop.schemas.topics import KIND_TOPICS
from perfloop.settings import BaseServiceSettings

__all__ = [
    "DEFAULT_KINDS",
    "KINDS",
    "TELEMETRY_KINDS",
    "Follower",
    "Selection",
    "parse_since",
    "since_ns",
]

log = logging.getLogger("perfloop.client")

KINDS: dict[str, type[Event]] = {**EVENT_KINDS, **BATCH_KINDS}
"""Every kind a follower can hand out, and its event class."""
TELEMETRY_KINDS: tuple[str, ...] = tuple(BATCH_KINDS)
"""Telemetry sample kinds: batched per node on the wire, one event per sample here."""
DEFAULT_KINDS: tuple[str, ...] = tuple(k for k in EVENT_KINDS if k != "producer")
"""What a follower reads unless told: every single-event kind but producer self-metrics."""

_BATCH_TOPICS = frozenset(KIND_TOPICS[k] for k in BATCH_KINDS)
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([smhd])$")
_NS = 1_000_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SLACK_MS = 1000
"""From now: a message stamped up to this much before the start still counts (a producer's
clock a little behind), where the broker answers a partition's end too early."""


def parse_since(text: str, *, now_ns: int | None = None) -> int:
    """A point in time, as Unix nanoseconds, from a duration ago (``30s``, ``10m``, ``2h``,
    ``1d``), an ISO 8601 time (``2026-11-05T10:00:00Z``; without a zone, local time) or
    ``now``; `ConfigError` naming the text otherwise.

    >>> parse_since("10m", now_ns=3_600_000_000_000)
    3000000000000
    >>> parse_since("1970-01-01T00:00:01+00:00")
    1000000000
    >>> parse_since("yesterday")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: since 'yesterday' is neither a duration (30s, 10m, ...
    """
    now = time.time_ns() if now_ns is None else now_ns
    t = text.strip()
    if t.lower() == "now":
        return now
    m = _DURATION.match(t.lower())
    if m:
        return now - round(float(m.group(1)) * _UNITS_S[m.group(2)] * _NS)
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        raise ConfigError(
            f"since {text!r} is neither a duration (30s, 10m, 2h, 1d) nor an ISO time "
            "(2026-11-05T10:00:00Z)"
        ) from None
    return _datetime_ns(when)


def _datetime_ns(when: datetime) -> int:
    if when.tzinfo is None:
        when = when.astimezone()  # local time
    return (when - _EPOCH) // timedelta(microseconds=1) * 1000


def since_ns(
    since: datetime | timedelta | int | str | None, *, now_ns: int | None = None
) -> int | None:
    """``since`` (as `Follower` takes it) as Unix nanoseconds; None stays None (from now).

    >>> since_ns(timedelta(seconds=2), now_ns=5_000_000_000), since_ns(7), since_ns(None)
    (3000000000, 7, None)
    """
    now = time.time_ns() if now_ns is None else now_ns
    if since is None:
        return None
    if isinstance(since, bool):
        raise ConfigError(f"since must be a time, not {since!r}")
    if isinstance(since, int):
        if since < 0:
            raise ConfigError(f"since {since} is negative; give Unix nanoseconds")
        return since
    if isinstance(since, timedelta):
        return now - int(since / timedelta(microseconds=1)) * 1000
    if isinstance(since, datetime):
        return _datetime_ns(since)
    if isinstance(since, str):
        return parse_since(since, now_ns=now)
    raise ConfigError(
        f"since must be a datetime, a timedelta, Unix nanoseconds or text, not {since!r}"
    )


def _kinds(kinds: Iterable[str | type[Event]] | None) -> tuple[str, ...]:
    if kinds is None:
        return DEFAULT_KINDS
    out = []
    for k in kinds:
        name = k if isinstance(k, str) else getattr(k, "KIND", None)
        if name not in KINDS:
            raise ConfigError(f"unknown event kind {k!r}; valid: {', '.join(sorted(KINDS))}")
        out.append(name)
    if not out:
        raise ConfigError("no event kinds to follow; valid: " + ", ".join(sorted(KINDS)))
    return tuple(dict.fromkeys(out))


class Selection:
    """Which events a follower hands out: these ``kinds`` (None: `DEFAULT_KINDS`) of these
    ``jobs`` (None: every job); and the decoding of one message into them (`events`).

    >>> from perfloop.schemas import JobLifecycle, encode_event
    >>> sel = Selection(jobs=["j1"], kinds=["lifecycle"])
    >>> sel.topics, sel.wants_key(b"j2")
    (['perfloop.telemetry.job'], False)
    >>> ev = JobLifecycle(ts_ns=1, job_id="j1", node="n0", rank=-1, state="started")
    >>> sel.events("perfloop.telemetry.job", encode_event(ev)) == [ev]
    True
    """

    def __init__(
        self,
        jobs: Iterable[str] | None = None,
        kinds: Iterable[str | type[Event]] | None = None,
    ) -> None:
        self.kinds = _kinds(kinds)
        if isinstance(jobs, str):
            jobs = [jobs]
        self.jobs = frozenset(jobs) if jobs is not None else None
        if self.jobs is not None and not all(isinstance(j, str) and j for j in self.jobs):
            raise ConfigError(f"jobs must be non-empty job ids, got {sorted(map(repr, self.jobs))}")
        self.topics = sorted({KIND_TOPICS[k] for k in self.kinds})
        self._kinds = frozenset(self.kinds)
        self._keys = None if self.jobs is None else {j.encode() for j in self.jobs} | {b"*"}

    def wants_key(self, key: bytes | None) -> bool:
        """Whether a message with this key may hold a selected event (messages are keyed by
        job, a config change for every job by ``*``; an unkeyed one is decoded to know)."""
        return self._keys is None or key is None or key in self._keys

    def events(self, topic: str, value: bytes) -> list[Event]:
        """The selected events in one message of ``topic`` (none, one, or a telemetry batch's
        samples); `perfloop.schemas.SchemaError` if it cannot be decoded."""
        if topic in _BATCH_TOPICS:
            batch = decode_batch(value)
            if batch.kind not in self._kinds:
                return []
            if self.jobs is not None and batch.job_id not in self.jobs:
                return []
            return list(batch.events())
        ev = decode_event(value)
        if ev.KIND not in self._kinds or not self.concerns(ev):
            return []
        return [ev]

    def concerns(self, ev: Event) -> bool:
        """Whether ``ev`` is about a selected job (a config change: one it applies to)."""
        if self.jobs is None or ev.job_id in self.jobs:
            return True
        return isinstance(ev, ConfigChange) and (ev.applies_to == "*" or ev.applies_to in self.jobs)


class Follower:
    """An iterator of typed events from perfloop's topics; see the module's docstring.

    ``settings``: where the broker is (any settings class: `perfloop.settings.StackSettings`
    for the embedded stack or ``PERFLOOP_KAFKA_BOOTSTRAP``). ``jobs``, ``kinds``, ``since``:
    what to hand out. ``group``: a consumer group name for at-least-once handling with
    `commit` (None: no group, start at once). ``start_timeout_s``: how long to wait for the
    topics to exist (``perfloop up`` creates them). ``poll_s``: the longest a wait for the
    broker blocks (`close` from another thread takes effect within it).

    Iterate it (``for ev in follower``: until `stop` or `close`), or `poll` with a timeout.
    A follower is used from one thread; `stop` may come from any thread or a signal handler,
    `close` from any thread.
    """

    def __init__(
        self,
        settings: BaseServiceSettings,
        *,
        jobs: Iterable[str] | None = None,
        kinds: Iterable[str | type[Event]] | None = None,
        since: datetime | timedelta | int | str | None = None,
        group: str | None = None,
        start_timeout_s: float = 30.0,
        poll_s: float = 0.2,
    ) -> None:
        created_ns = time.time_ns()
        self.selection = Selection(jobs, kinds)
        self.kinds, self.jobs = self.selection.kinds, self.selection.jobs
        since_at = since_ns(since, now_ns=created_ns)
        if group is not None and not group.strip():
            raise ConfigError("group must be a non-empty consumer group name")
        self.group = group
        self.topics = self.selection.topics
        self.received = 0
        """Messages read (before any filter)."""
        self.skipped = 0
        """Messages that could not be decoded (each logged once)."""
        self.delivered = 0
        """Events handed out."""
        self._since_ms = (created_ns if since_at is None else since_at) // 1_000_000
        self._from_end = since_at is None and group is None
        self._poll_s = poll_s
        self._queue: deque[tuple[Event, tuple[str, int], int | None]] = deque()
        self._floors: dict[tuple[str, int], int] = {}  # ms: skip older until one is not
        self._done: dict[tuple[str, int], int] = {}  # next offset, all before it handed out
        self._committed: dict[tuple[str, int], int] = {}
        self._errors_seen: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer_closed = False
        ping(settings)
        self._c: Consumer = consumer(
            settings,
            group or f"perfloop-client-{uuid.uuid4().hex[:12]}",
            **{"enable.partition.eof": False, "error_cb": self._error},
        )
        try:
            partitions = self._partitions(start_timeout_s, settings.kafka_bootstrap)
            if group is None:
                self._c.assign(self._positions(partitions))
            else:
                self._c.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke)
        except BaseException:
            self._c.close()
            raise

    # -- starting --------------------------------------------------------------------------
    def _partitions(self, timeout_s: float, where: str) -> list[tuple[str, int]]:
        """Every partition of the topics, once they all exist."""
        deadline = time.monotonic() + timeout_s
        missing = self.topics
        while True:
            try:
                md = self._c.list_topics(timeout=min(5.0, max(timeout_s, 0.1)))
            except KafkaException as e:
                raise BrokerError(
                    f"Kafka broker at {where} is unreachable: {e.args[0].str()}"
                ) from e
            found = md.topics
            missing = [
                t for t in self.topics
                if t not in found or found[t].error is not None or not found[t].partitions
            ]  # fmt: skip
            if not missing:
                return [(t, p) for t in self.topics for p in sorted(found[t].partitions)]
            if time.monotonic() >= deadline:
                raise BrokerError(
                    f"topics {', '.join(missing)} do not exist on the broker at {where}; "
                    "`perfloop up` (or `perfloop migrate`) creates them"
                )
            time.sleep(0.5)

    def _positions(self, partitions: list[tuple[str, int]]) -> list[TopicPartition]:
        """Where each partition starts: its end (from now) or the offset of ``since``; the
        partitions' floors set, to skip what is older where the broker answered too early."""
        at = OFFSET_END if self._from_end else self._since_ms
        asked = [TopicPartition(t, p, at) for t, p in partitions]
        try:
            found = self._c.offsets_for_times(asked, timeout=10.0)
        except KafkaException as e:
            if self._from_end:
                raise BrokerError(f"cannot find the topics' ends: {e.args[0].str()}") from e
            log.debug("no offsets by time (%s): reading from the start", e)
            found = [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in partitions]
        out = []
        for tp in found:
            offset = tp.offset
            if tp.error is not None or offset < 0:  # no message at or after since: the end
                offset = OFFSET_END
                if tp.error is not None and not self._from_end:
                    offset = OFFSET_BEGINNING
            floor = self._since_ms - _SLACK_MS if self._from_end else self._since_ms
            self._floors[(tp.topic, tp.partition)] = floor
            out.append(TopicPartition(tp.topic, tp.partition, offset))
        return out

    def _on_assign(self, c: Consumer, partitions: list[TopicPartition]) -> None:
        """Group mode: a partition the group committed resumes there, any other starts at
        ``since``."""
        try:
            committed = c.committed(partitions, timeout=10.0)
        except KafkaException as e:
            log.warning("cannot read the group's committed offsets (%s): starting at since", e)
            committed = [TopicPartition(p.topic, p.partition) for p in partitions]
        fresh = [(p.topic, p.partition) for p in committed if p.offset < 0]
        starts = {(p.topic, p.partition): p.offset for p in committed if p.offset >= 0}
        for key, offset in starts.items():
            self._committed[key] = offset
            self._done[key] = offset
            self._floors.pop(key, None)
        positions = {(p.topic, p.partition): p for p in self._positions(fresh)} if fresh else {}
        c.assign(
            [
                positions.get((p.topic, p.partition))
                or TopicPartition(p.topic, p.partition, starts[(p.topic, p.partition)])
                for p in partitions
            ]
        )

    def _on_revoke(self, c: Consumer, partitions: list[TopicPartition]) -> None:
        """Group mode: what was handed out from a revoked partition and not committed goes to
        its next owner again (at least once)."""
        gone = {(p.topic, p.partition) for p in partitions}
        for key in gone:
            self._done.pop(key, None)
            self._committed.pop(key, None)
            self._floors.pop(key, None)
        self._queue = deque(e for e in self._queue if e[1] not in gone)

    # -- reading ---------------------------------------------------------------------------
    def poll(self, timeout_s: float | None = None) -> Event | None:
        """The next event, waiting at most ``timeout_s`` (None: until there is one or the
        follower is closed); None if none came in time or the follower is closed."""
        if self._stop.is_set():
            return None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._queue and not self._stop.is_set():
            left = self._poll_s if deadline is None else deadline - time.monotonic()
            with self._lock:
                if self._stop.is_set():
                    break
                msg = self._c.poll(max(0.0, min(self._poll_s, left)))
                if msg is not None:
                    self._take(msg)
            if deadline is not None and not self._queue and time.monotonic() >= deadline:
                return None
        try:
            event, key, next_offset = self._queue.popleft()
        except IndexError:  # closed meanwhile
            return None
        if next_offset is not None:
            self._done[key] = next_offset
        self.delivered += 1
        return event

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        event = self.poll(None)
        if event is None:
            raise StopIteration
        return event

    def _error(self, err: KafkaError) -> None:
        """A broker error (the broker away, a partition gone): logged once per kind, as the
        client retries by itself; never raised (it runs inside the consumer's poll)."""
        if err.code() not in self._errors_seen:
            self._errors_seen.add(err.code())
            log.warning("broker error: %s", err.str())

    def _take(self, msg: Message) -> None:
        """Decode one message into the queue (or skip it), called with the queue empty."""
        err = msg.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                self._error(err)
            return
        self.received += 1
        topic, partition, offset = msg.topic() or "", msg.partition() or 0, msg.offset() or 0
        key = (topic, partition)
        floor = self._floors.get(key)
        if floor is not None:
            ts_type, ts_ms = msg.timestamp()
            if ts_type != TIMESTAMP_NOT_AVAILABLE and ts_ms < floor:
                self._done[key] = offset + 1
                return
            del self._floors[key]
        k = msg.key()
        if not self.selection.wants_key(k):
            self._done[key] = offset + 1
            return
        value = msg.value() or b""
        try:
            events = self.selection.events(topic, value)
        except Exception as e:
            decide(skip_policy, e, Failed(topic, partition, offset, k, value), log)
            self.skipped += 1
            events = []
        if not events:
            self._done[key] = offset + 1
            return
        last = len(events) - 1
        self._queue.extend(
            (ev, key, offset + 1 if i == last else None) for i, ev in enumerate(events)
        )

    # -- group mode --------------------------------------------------------------------------
    def commit(self) -> int:
        """Group mode: commit every event handed out so far as handled (synchronously);
        return how many partitions moved. `BrokerError` if the broker refused."""
        if self.group is None:
            raise ConfigError("commit() needs a consumer group: Follower(..., group=NAME)")
        with self._lock:
            if self._consumer_closed:
                raise BrokerError("the follower is closed: nothing can be committed")
            moved = [
                TopicPartition(t, p, o)
                for (t, p), o in self._done.items()
                if o > self._committed.get((t, p), -1)
            ]
            if not moved:
                return 0
            try:
                self._c.commit(offsets=moved, asynchronous=False)
            except KafkaException as e:
                raise BrokerError(f"commit refused by the broker: {e.args[0].str()}") from e
            for tp in moved:
                self._committed[(tp.topic, tp.partition)] = tp.offset
            return len(moved)

    # -- closing -----------------------------------------------------------------------------
    def stop(self) -> None:
        """End the iteration: ``for ev in follower`` stops and `poll` returns None, within
        ``poll_s``. Only sets a flag: safe from a signal handler (Ctrl-C, SIGTERM), where
        raising `KeyboardInterrupt` through the Kafka client's poll is not (its log callbacks
        run inside it and may lose the exception). `close` still releases the consumer."""
        self._stop.set()

    def close(self) -> None:
        """Stop (`stop`) and close the consumer: it leaves its group, committing nothing.
        Safe to call twice, and from another thread (it waits for a poll in progress)."""
        self._stop.set()
        with self._lock:
            if self._consumer_closed:
                return
            self._consumer_closed = True
            self._queue.clear()
            with contextlib.suppress(RuntimeError):  # closed already
                self._c.close()

    @property
    def closed(self) -> bool:
        """Stopped or closed: nothing more is handed out."""
        return self._stop.is_set()

    def __enter__(self) -> Follower:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        jobs = "all" if self.jobs is None else ",".join(sorted(self.jobs))
        return (
            f"Follower(jobs={jobs}, kinds={len(self.kinds)}, group={self.group!r}, "
            f"delivered={self.delivered}, skipped={self.skipped})"
        )
