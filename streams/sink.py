"""The warehouse sink: every topic in `TABLES`, batched into its table, at least once.

Rows accumulate in memory per table and are inserted column by column every
``flush_interval_s`` (thousands of rows per insert under load), or at once when
``max_batch_rows`` rows or ``max_batch_bytes`` message bytes are waiting. Each insert carries
a deduplication token built from the ids of the messages it holds (batch, event or content
ids), so a retried insert lands once; offsets are committed only after every insert they
cover succeeded, and after the dead letters produced for them were delivered.

When the warehouse is down (unreachable, or answering with a transient error) the sink pauses
consumption of every assigned partition and retries the same inserts with backoff
(``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``); once they land it commits and resumes.
Nothing is lost, and memory stays bounded, during the outage and while the backlog drains
after it: while paused nothing is read, and otherwise the sink stops taking messages as soon
as the batch is full, inserts it, and reads the rest again (it seeks back to them). So the
rows held stay under ``max_batch_rows`` plus one message, and the message bytes under
``max_batch_bytes`` plus one message (at most 4 MiB); librdkafka's prefetch adds at most
``PREFETCH_KIB`` KiB (plus one fetch).

Bad input never stops the sink. A message that does not decode goes to ``perfloop.dlq`` with
the reason and the source in its headers and is committed past. A batch the warehouse refuses
as data (the server is up, the error is not transient) is split: each message is inserted on
its own, and a message still refused is dead-lettered with the warehouse's reason. Messages
of ``perfloop.dlq`` itself land in ``dead_letters``; one that cannot land is logged and
dropped, never dead-lettered again.

A message that arrives twice (a producer resending what a restarted broker lost) carries the
same id; the sink remembers the last ``dedup_window_messages`` ids and drops a repeat. The
memory is per sink process: after a sink restart, a repeat can land once more, and so can the
rows read since the last commit (at most about one flush interval of data).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from perfloop.catalog import TABLES, Topics
from perfloop.exceptions import PerfloopError
from perfloop.kafka import consumer, dlq_headers, producer
from perfloop.schemas import SchemaError
from perfloop.settings import SinkSettings
from perfloop.streams._sink_rows import Rows, rows_from_dead_letter, rows_from_message
from perfloop.warehouse import client

__all__ = ["Sink", "SinkStats", "rows_from_dead_letter", "rows_from_message"]

log = logging.getLogger("perfloop.sink")

CONSUME_MESSAGES = 500
"""Messages taken per `consume` call."""
PREFETCH_KIB = 4 << 10
"""librdkafka's bound on prefetched messages (``queued.max.messages.kbytes``)."""
MAX_BATCH_BYTES = 64 << 20
"""Default bound on the message bytes waiting for an insert."""
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
STATS_EVERY_S = 30.0

# ClickHouse error codes that say "not now" rather than "not this data": the insert is
# retried. Unknown table/database/column means the warehouse is not migrated yet: retried too.
_TRANSIENT_CODES = frozenset(
    {3, 16, 47, 60, 81, 159, 164, 202, 203, 209, 210, 236, 241, 242, 252, 319, 394, 425, 999}
)
# Raised by the client while encoding rows it cannot send (besides its DataError).
_ENCODING_ERRORS = (TypeError, ValueError, OverflowError, struct.error)


class _Rejected(Exception):
    """The warehouse (or the client encoding for it) refused the rows themselves."""


class _Unavailable(Exception):
    """The warehouse cannot take rows now; retry later."""


@dataclass
class SinkStats:
    """What the sink did since it started (the log prints it every ``STATS_EVERY_S``)."""

    inserts: int = 0
    inserted_rows: int = 0
    max_insert_rows: int = 0
    dead_letters: int = 0  # messages sent to perfloop.dlq
    dead_letters_dropped: int = 0  # dead letters that could not land in dead_letters
    rejected: int = 0  # messages the warehouse refused as data (dead-lettered)
    duplicates: int = 0
    pauses: int = 0
    paused_s: float = 0.0
    failed_inserts: int = 0
    max_pending_rows: int = 0
    max_pending_bytes: int = 0


@dataclass
class _Source:
    """Where one message's rows sit in a pending batch, and the message (to dead-letter it)."""

    start: int
    stop: int
    message_id: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass
class _Pending:
    """Rows waiting for one table's next insert, and the messages they came from."""

    columns: Rows = field(default_factory=dict)
    rows: int = 0
    bytes: int = 0
    sources: list[_Source] = field(default_factory=list)

    def extend(self, cols: Rows, source: _Source) -> None:
        # Every builder of one table yields the same columns (defaults are filled at decode).
        n = len(cols["ts"])
        for k, v in cols.items():
            self.columns.setdefault(k, []).extend(v)
        source.start, source.stop = self.rows, self.rows + n
        self.rows += n
        self.bytes += len(source.value)
        self.sources.append(source)

    def token(self, table: str) -> str:
        """The insert's deduplication token: a hash of the messages it holds, by their own ids.

        Offsets would not do: a broker that restarts empty numbers its log from 0 again, so a
        new insert could repeat an old token and be dropped by the warehouse as a retry.
        """
        ids = sorted(s.message_id for s in self.sources)
        return hashlib.sha256("\n".join([table, *ids]).encode()).hexdigest()[:32]

    def only(self, source: _Source) -> _Pending:
        """The rows of one message, as a batch of their own."""
        one = _Pending()
        one.extend({k: v[source.start : source.stop] for k, v in self.columns.items()}, source)
        return one


class _RecentIds:
    """The ids of the last ``capacity`` messages taken, to drop a message sent twice."""

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, key: str) -> bool:
        return key in self._ids

    def add(self, key: str) -> None:
        self._ids[key] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def discard(self, key: str) -> None:
        self._ids.pop(key, None)


def _libc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, where there is one."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class Sink:
    """Consumes the catalog's topics and inserts them into the warehouse.

    ``consumer_``, ``dlq_producer`` and ``warehouse`` replace the clients built from
    ``settings`` (tests and embedding); the sink closes whatever it holds when ``run`` ends.

    >>> from perfloop.settings import SinkSettings
    >>> sink = Sink(SinkSettings())  # doctest: +SKIP
    >>> sink.run()  # until sink.stop() (SIGTERM)  # doctest: +SKIP
    """

    def __init__(
        self,
        settings: SinkSettings,
        *,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        consumer_: Consumer | None = None,
        dlq_producer: Producer | None = None,
        warehouse: Client | None = None,
    ) -> None:
        self.settings = settings
        self.max_batch_bytes = max_batch_bytes
        self.stats = SinkStats()
        self._stop = threading.Event()
        self._consumer = consumer_ or consumer(
            settings,
            settings.group_id,
            **{
                "session.timeout.ms": settings.session_timeout_ms,
                "queued.max.messages.kbytes": PREFETCH_KIB,
                "fetch.max.bytes": PREFETCH_KIB << 10,
            },
        )
        self._dlq = dlq_producer or producer(settings)
        self._ch = warehouse or client(settings)
        self._pending: dict[str, _Pending] = {}
        self._offsets: dict[tuple[str, int], int] = {}
        self._seen = _RecentIds(settings.dedup_window_messages)
        self._paused_since: float | None = None
        self._retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        self._next_flush = 0.0
        self._stats_at = 0.0
        self._trim = _libc_trim()
        self._trimmed_at = 0.0

    @property
    def paused(self) -> bool:
        """True while the warehouse is down and consumption is paused."""
        return self._paused_since is not None

    @property
    def pending_rows(self) -> int:
        return sum(p.rows for p in self._pending.values())

    @property
    def pending_bytes(self) -> int:
        return sum(p.bytes for p in self._pending.values())

    # -- service ---------------------------------------------------------------------------

    def start(self) -> None:
        # Land and commit what was read from partitions before they move to another sink.
        self._consumer.subscribe(list(TABLES), on_revoke=self._on_revoke)
        now = time.monotonic()
        self._next_flush = now + self.settings.flush_interval_s
        self._stats_at = now + STATS_EVERY_S

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.start()
        try:
            while not self._stop.is_set():
                self.step()
            if not self._flush():  # once: a warehouse still down re-reads them next start
                log.warning("stopping with %d rows not inserted (read again)", self.pending_rows)
        finally:
            self._consumer.close()
            self._dlq.flush(5)
            self._ch.close()
            self._log_stats()

    def step(self) -> None:
        """One turn of the loop: read (unless paused), then insert what is due."""
        now = time.monotonic()
        if self.paused:
            # Polling a paused consumer reads nothing but keeps the group membership.
            self._consumer.pause(self._consumer.assignment())  # newly assigned ones too
            for msg in self._consumer.consume(1, min(0.2, self._until(now))):
                self._take(msg)
            if time.monotonic() >= self._retry_at:
                self._flush()
        else:
            timeout = max(0.01, min(0.2, self._next_flush - now))
            msgs = self._consumer.consume(CONSUME_MESSAGES, timeout)
            for i, msg in enumerate(msgs):
                if self._full():  # the rest is read again after the insert
                    self._rewind(msgs[i:])
                    break
                self._take(msg)
            rows, size = self.pending_rows, self.pending_bytes
            self.stats.max_pending_rows = max(self.stats.max_pending_rows, rows)
            self.stats.max_pending_bytes = max(self.stats.max_pending_bytes, size)
            now = time.monotonic()
            full = rows >= self.settings.max_batch_rows or size >= self.max_batch_bytes
            if full or (now >= self._next_flush and (rows or self._offsets)):
                self._flush()
                self._next_flush = time.monotonic() + self.settings.flush_interval_s
            elif now >= self._next_flush:
                self._next_flush = now + self.settings.flush_interval_s
        if time.monotonic() >= self._stats_at:
            self._log_stats()

    def _until(self, now: float) -> float:
        return max(0.01, self._retry_at - now)

    def _full(self) -> bool:
        return (
            self.pending_rows >= self.settings.max_batch_rows
            or self.pending_bytes >= self.max_batch_bytes
        )

    def _rewind(self, untaken: list[Message]) -> None:
        """Seek each partition back to its first message not taken (it is read again)."""
        first: dict[tuple[str, int], int] = {}
        for msg in untaken:
            if not msg.error():
                key = (msg.topic(), msg.partition())
                first[key] = min(first.get(key, msg.offset()), msg.offset())
        for (topic, part), off in first.items():
            self._consumer.seek(TopicPartition(topic, part, off))

    # -- reading ---------------------------------------------------------------------------

    def _take(self, msg: Message) -> None:
        err = msg.error()
        if err:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err)
            return
        topic, part, off = msg.topic(), msg.partition(), msg.offset()
        value = msg.value() or b""
        try:
            if topic == Topics.DLQ:
                _, ts_ms = msg.timestamp()
                table, cols, dedup = rows_from_dead_letter(
                    value, msg.key(), msg.headers(), timestamp_ms=ts_ms, partition=part, offset=off
                )
            else:
                table, cols, dedup = rows_from_message(topic, value)
        except SchemaError as e:
            self._dead_letter(str(e), topic, part, off, msg.key(), value)
        else:
            if dedup in self._seen:  # sent twice (a producer's resend): drop
                self.stats.duplicates += 1
            elif cols["ts"]:
                self._seen.add(dedup)
                source = _Source(0, 0, dedup, topic, part, off, msg.key(), value)
                self._pending.setdefault(table, _Pending()).extend(cols, source)
        self._offsets[(topic, part)] = off + 1

    def _dead_letter(
        self, reason: str, topic: str, part: int, off: int, key: bytes | None, value: bytes
    ) -> None:
        if topic == Topics.DLQ:  # never dead-letter a dead letter
            log.warning("dropping dead letter %s[%s]@%s: %s", topic, part, off, reason)
            self.stats.dead_letters_dropped += 1
            return
        log.warning("dead letter %s[%s]@%s: %s", topic, part, off, reason)
        self._dlq.produce(
            Topics.DLQ, key=key, value=value, headers=dlq_headers(reason, topic, part, off)
        )
        self._dlq.poll(0)
        self.stats.dead_letters += 1

    # -- writing ---------------------------------------------------------------------------

    def _insert(self, table: str, pending: _Pending) -> None:
        """Insert one batch; raise `_Unavailable` (retry later) or `_Rejected` (bad rows)."""
        try:
            self._ch.insert(
                table,
                list(pending.columns.values()),
                column_names=list(pending.columns),
                column_oriented=True,
                settings={
                    "insert_deduplication_token": pending.token(table),
                    # ... and in the rollups its materialized views feed (ClickHouse 24.8
                    # does not deduplicate them by default).
                    "deduplicate_blocks_in_dependent_materialized_views": 1,
                },
            )
        except (ClickHouseError, PerfloopError, OSError, *_ENCODING_ERRORS) as e:
            self.stats.failed_inserts += 1
            code = getattr(e, "code", None)
            if code:  # the server answered
                if code not in _TRANSIENT_CODES and self._reachable():
                    raise _Rejected(f"warehouse refused {table} rows: {_first_line(e)}") from e
            elif not isinstance(e, (OperationalError, OSError, PerfloopError)):
                # The client could not encode the rows (a value out of range, an unknown
                # column): the rows are at fault, wherever they are sent.
                raise _Rejected(f"cannot encode {table} rows: {_first_line(e)}") from e
            raise _Unavailable(f"insert into {table} failed: {_first_line(e)}") from e
        self.stats.inserts += 1
        self.stats.inserted_rows += pending.rows
        self.stats.max_insert_rows = max(self.stats.max_insert_rows, pending.rows)

    def _reachable(self) -> bool:
        try:
            return bool(self._ch.ping())
        except Exception:
            return False

    def _split(self, table: str, pending: _Pending, reason: str) -> None:
        """Insert a refused batch message by message; dead-letter the messages still refused."""
        log.warning("%s; inserting its %d messages one by one", reason, len(pending.sources))
        left = list(pending.sources)
        try:
            while left:
                source = left[0]
                try:
                    self._insert(table, pending.only(source))
                except _Rejected as e:
                    self.stats.rejected += 1
                    self._seen.discard(source.message_id)
                    self._dead_letter(
                        str(e),
                        source.topic,
                        source.partition,
                        source.offset,
                        source.key,
                        source.value,
                    )
                left.pop(0)
        finally:
            if left:  # the warehouse went away meanwhile: the rest waits as one batch
                rest = _Pending()
                for s in left:
                    rest.extend({k: v[s.start : s.stop] for k, v in pending.columns.items()}, s)
                self._pending[table] = rest
            else:
                del self._pending[table]

    def _flush(self) -> bool:
        """Insert every pending batch, then commit; pause and back off if the warehouse is down.

        Return True if everything read so far is in the warehouse and committed.
        """
        for table in list(self._pending):
            try:
                self._insert(table, self._pending[table])
                del self._pending[table]
            except _Rejected as e:
                try:
                    self._split(table, self._pending[table], str(e))
                except _Unavailable as down:
                    self._down(down)
                    return False
            except _Unavailable as e:
                self._down(e)
                return False
        self._release_memory()
        if self._offsets:
            if self._dlq.flush(5):
                log.warning("dead letters not yet delivered; offsets are committed later")
                self._up()
                return False
            try:
                self._consumer.commit(
                    offsets=[TopicPartition(t, p, o) for (t, p), o in self._offsets.items()],
                    asynchronous=False,
                )
            except KafkaException as e:  # e.g. a rebalance: the next flush commits again
                log.warning("offset commit failed, will retry: %s", e)
            else:
                self._offsets.clear()
        self._up()
        return not self._offsets

    def _release_memory(self) -> None:
        """Give the heap's free pages back to the system, at most once a second.

        Encoding an insert churns through many small native buffers, and glibc keeps what was
        freed: draining a backlog of 150k-600k rows left the sink ~85 MiB above where it
        started without this, ~20 MiB with it.
        """
        now = time.monotonic()
        if self._trim is not None and now - self._trimmed_at >= 1.0:
            self._trim(0)
            self._trimmed_at = now

    def _down(self, e: Exception) -> None:
        now = time.monotonic()
        if self._paused_since is None:
            self._paused_since = now
            self._retry_s = RETRY_FIRST_S
            self.stats.pauses += 1
            self._consumer.pause(self._consumer.assignment())
            log.warning(
                "warehouse unavailable, consumption paused with %d rows (%d bytes) pending: %s",
                self.pending_rows,
                self.pending_bytes,
                e,
            )
        else:
            self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)
            log.info("warehouse still unavailable, retrying in %.1f s: %s", self._retry_s, e)
        self._retry_at = now + self._retry_s

    def _up(self) -> None:
        if self._paused_since is None:
            return
        paused_s = time.monotonic() - self._paused_since
        self.stats.paused_s += paused_s
        self._paused_since = None
        self._consumer.resume(self._consumer.assignment())
        log.warning(
            "warehouse back after %.1f s: inserted, committed, consumption resumed", paused_s
        )

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._flush():
            return
        # The partitions go to another sink (or come back to this one) from their committed
        # offsets: forget what was read past them, or it would land twice or be skipped as
        # a duplicate when read again.
        for pending in self._pending.values():
            for s in pending.sources:
                self._seen.discard(s.message_id)
        log.warning("partitions revoked with %d rows not inserted (read again)", self.pending_rows)
        self._pending.clear()
        self._offsets.clear()

    def _log_stats(self) -> None:
        st = self.stats
        self._stats_at = time.monotonic() + STATS_EVERY_S
        log.info(
            "sink stats: %d inserts, %d rows (%.0f rows/insert, max %d), %d dead letters, "
            "%d refused, %d duplicates, paused %d times for %.1f s, max pending %d rows",
            st.inserts,
            st.inserted_rows,
            st.inserted_rows / st.inserts if st.inserts else 0.0,
            st.max_insert_rows,
            st.dead_letters,
            st.rejected,
            st.duplicates,
            st.pauses,
            st.paused_s,
            st.max_pending_rows,
        )
