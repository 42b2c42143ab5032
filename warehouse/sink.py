"""The warehouse sink: every topic in `TABLES`, batched into its table, at least once.

Rows accumulate in memory per table (`perfloop.warehouse._sink_rows`: Arrow columns for
telemetry and windows, lists for events) and are inserted every ``flush_interval_s``
(thousands of rows per insert under load), or at once when half of ``max_batch_rows`` rows or
of ``max_batch_bytes`` message bytes are waiting. Inserts run in a thread of their own while
the next batch is read and decoded (one round of inserts — a *flight* — in the air at a time,
so batches land in the order they were read; rows someone waits for, such as closed windows,
may join the flight in the air rather than wait for it to land). Each insert carries a
deduplication token built from the ids of the messages it holds (batch, event or content ids),
so a retried insert lands once; offsets are committed only after every insert they cover
succeeded, and after the dead letters produced for them were delivered.

When the warehouse is down (unreachable, or answering with a transient error) the sink pauses
consumption of every assigned partition and retries the same inserts with backoff
(``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``); once they land it commits and resumes.
Nothing is lost, and memory stays bounded, during the outage and while the backlog drains
after it: while paused nothing is read, and otherwise the sink stops taking messages as soon
as the batch being filled is full, waits for the flight in the air, launches the batch, and
only then takes the rest of what it had read. So the rows held — the batch in the air and the
one being filled — stay under ``max_batch_rows`` plus two messages, and the message bytes
under ``max_batch_bytes`` plus two messages (at most 4 MiB each); the messages read and not
yet taken, and librdkafka's prefetch, add at most twice ``PREFETCH_KIB`` KiB (plus one
fetch).

With ``telemetry_in_rounds`` (the default, see `SinkSettings`), telemetry is read in
rounds, one per flush: its partitions are resumed shortly before the flush and each is
paused again once read to its end, so a partition is fetched about once a flush instead of
several times a second. Each fetch of a partition with new records costs the embedded broker
time in proportion to what the partition holds (its memory storage lists every stored
batch), so this keeps the broker's CPU from growing several times faster than its log. A
partition still behind is not paused: a backlog is read at full speed. The topics in
`FAST_TOPICS` are always read. Only a partition a message was taken from since its latest
assignment is paused, and only at exactly its end: librdkafka resumes a partition at the
last position taken, so a position from before a rebalance, or from a log the broker lost
when it restarted empty, must never be the one resumed. A held partition being revoked is
resumed first (a pause outlives the assignment).

Bad input never stops the sink (`perfloop.bad_input` decides what becomes of it). A message
that does not decode, or whose rows a bug kept from being built, goes to ``perfloop.dlq`` with
the reason and the source in its headers and is committed past. A batch the warehouse refuses
as data (the server is up, the error is not transient) is split: each message is inserted on
its own, and a message still refused is dead-lettered with the warehouse's reason. Messages
of ``perfloop.dlq`` itself land in ``dead_letters``; one that cannot land is logged and
dropped, never dead-lettered again.

A message that arrives twice (a producer resending what a restarted broker lost) carries the
same id; the sink remembers the last ``dedup_window_messages`` ids and drops a repeat. A sink
that starts takes the ids of the rows that landed in the last ``dedup_seed_s`` seconds of event
time from the warehouse (`perfloop.warehouse._sink_seed`) before it reads: after a restart,
the rows it had inserted but not committed, and a producer's resends, land once too.
"""

from __future__ import annotations

import logging
import threading
import time

from clickhouse_connect.driver.client import Client
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from perfloop.bad_input import Failed, OnError, dead_letter_policy, decide
from perfloop.kafka import consumer, dlq_headers, producer
from perfloop.schemas.arrow_batch import warm_up
from perfloop.schemas.topics import Topics
from perfloop.service_heap import libc_trim
from perfloop.settings import SinkSettings
from perfloop.warehouse import client
from perfloop.warehouse._sink_batch import Flight, Pending, RecentIds, Source
from perfloop.warehouse._sink_insert import Rejected, SinkStats, Unavailable, insert
from perfloop.warehouse._sink_rounds import ROUND_IDLE_S, Rounds
from perfloop.warehouse._sink_rows import part_rows, rows_from_dead_letter, rows_from_message
from perfloop.warehouse._sink_seed import seed_ids
from perfloop.warehouse.tables import TABLES

__all__ = ["Sink", "SinkStats", "rows_from_dead_letter", "rows_from_message"]

log = logging.getLogger("perfloop.sink")

CONSUME_MESSAGES = 500
"""Messages taken per `consume` call."""
PREFETCH_KIB = 4 << 10
"""librdkafka's bound on prefetched messages (``queued.max.messages.kbytes``)."""
FAST_TOPICS = frozenset(TABLES) - {
    Topics.GPU,
    Topics.HOST,
    Topics.STEP,
    Topics.SPAN,
    Topics.JOB,
    Topics.DLQ,
}
"""Topics whose rows someone waits for (closed windows, diagnoses, phases, recommendations,
commands, acks): they go first in every flight, and after ``fast_flush_interval_s`` they go on
their own when no flight is in the air, or join the flight in the air (inserted after the table
it is inserting), instead of waiting for the telemetry's ``flush_interval_s``."""
FAST_TABLES = frozenset(t for topic in FAST_TOPICS for t in TABLES[topic])
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
STATS_EVERY_S = 10.0


class Sink:
    """Consumes the catalog's topics and inserts them into the warehouse.

    ``consumer_``, ``dlq_producer`` and ``warehouse`` replace the clients built from
    ``settings`` (tests and embedding); the sink closes whatever it holds when ``run`` ends.
    ``on_error`` decides what becomes of a message that cannot land (`perfloop.bad_input`;
    by default it goes to ``perfloop.dlq``, a dead letter that cannot land is dropped).
    The warehouse client is used by one thread at a time: the insert thread while a flight is
    in the air, the reading thread otherwise.

    >>> from perfloop.settings import SinkSettings
    >>> sink = Sink(SinkSettings())  # doctest: +SKIP
    >>> sink.run()  # until sink.stop() (SIGTERM)  # doctest: +SKIP
    """

    def __init__(
        self,
        settings: SinkSettings,
        *,
        consumer_: Consumer | None = None,
        dlq_producer: Producer | None = None,
        warehouse: Client | None = None,
        on_error: OnError = dead_letter_policy,
    ) -> None:
        self.settings = settings
        self.on_error = on_error
        """What to do with a message that cannot land (`perfloop.bad_input`)."""
        self.max_batch_bytes = settings.max_batch_bytes
        self.stats = SinkStats()
        self._stop = threading.Event()
        self._consumer = consumer_ or consumer(
            settings,
            settings.group_id,
            **{
                "session.timeout.ms": settings.session_timeout_ms,
                "queued.max.messages.kbytes": PREFETCH_KIB,
                "fetch.max.bytes": PREFETCH_KIB << 10,
                "fetch.min.bytes": settings.fetch_min_bytes,
                "fetch.wait.max.ms": settings.fetch_max_wait_ms,
                # a round's partition is paused at its end (`Rounds`)
                "enable.partition.eof": settings.telemetry_in_rounds,
            },
        )
        self._dlq = dlq_producer or producer(settings)
        self._ch = warehouse or client(settings)
        self._pending: dict[str, Pending] = {}  # the batch being filled, by table
        self._offsets: dict[tuple[str, int], int] = {}  # ... and the offsets it completes
        self._flight: Flight | None = None  # the batch in the air (or failed, while paused)
        self._uncommitted: dict[tuple[str, int], int] = {}  # landed, commit still to do
        self._carry: list[Message] = []  # read after the batch was full: taken next
        self._seen = RecentIds(settings.dedup_window_messages)
        self._paused_since: float | None = None
        self._retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        self._next_flush = 0.0
        self._fast_since: float | None = None  # when the oldest fast row waiting was read
        self._stats_at = 0.0
        self._trim = libc_trim()
        self._trimmed_at = 0.0
        self._rounds = Rounds(
            self._consumer,
            FAST_TOPICS,
            min(
                ROUND_IDLE_S + 2 * settings.fetch_max_wait_ms / 1000,
                0.8 * settings.flush_interval_s,
            ),
            self.stats,
        )

    @property
    def paused(self) -> bool:
        """True while the warehouse is down and consumption is paused."""
        return self._paused_since is not None

    @property
    def pending_rows(self) -> int:
        """Rows held: the batch being filled and the one in the air."""
        flying = self._flight.rows if self._flight is not None else 0
        return flying + sum(p.rows for p in self._pending.values())

    @property
    def pending_bytes(self) -> int:
        flying = self._flight.bytes if self._flight is not None else 0
        return flying + sum(p.bytes for p in self._pending.values())

    # -- service ---------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        seeded = seed_ids(self._ch, self.settings.dedup_seed_s, self.settings.dedup_window_messages)
        for message_id in seeded:
            self._seen.add(message_id)
        if seeded:
            log.info("remembering %d message ids already in the warehouse (read in %.2f s)",
                     len(seeded), time.monotonic() - t0)  # fmt: skip
        # Land and commit what was read from partitions before they move to another sink.
        self._consumer.subscribe(list(TABLES), on_assign=self._on_assign, on_revoke=self._on_revoke)
        now = time.monotonic()
        self._next_flush = now + self.settings.flush_interval_s
        self._stats_at = now + STATS_EVERY_S

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        warm_up()  # before the first job's input, not with it
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
                self._retry()
        else:
            if self.settings.telemetry_in_rounds:
                self._rounds.pace(now, self._next_flush, reading=not self._carry)
            self._read(now)
            self._land(wait=False)
            now = time.monotonic()
            full = self._full()
            if full or (now >= self._next_flush and (self._pending or self._offsets)):
                if full or self._flight is None:  # a full batch waits for the one in the air
                    self._land(wait=True)
                if self._flight is None and not self.paused:
                    self._launch()
                    self._next_flush = time.monotonic() + self.settings.flush_interval_s
                elif self._fast_due(now):  # the flush waits for the flight: they need not
                    self._join()
            elif self._fast_due(now) and self._flight is None:
                self._launch(fast_only=True)
            elif self._fast_due(now):
                self._join()
            elif now >= self._next_flush:
                self._next_flush = now + self.settings.flush_interval_s
        if time.monotonic() >= self._stats_at:
            self._log_stats()

    def _fast_due(self, now: float) -> bool:
        since = self._fast_since
        return since is not None and now - since >= self.settings.fast_flush_interval_s

    def _until(self, now: float) -> float:
        return max(0.01, self._retry_at - now)

    def _full(self) -> bool:
        """The batch being filled holds half the rows or bytes the sink may hold."""
        return (
            sum(p.rows for p in self._pending.values()) >= self.settings.max_batch_rows / 2
            or sum(p.bytes for p in self._pending.values()) >= self.max_batch_bytes / 2
        )

    # -- reading ---------------------------------------------------------------------------

    def _read(self, now: float) -> None:
        due = self._next_flush
        if self._fast_since is not None:
            due = min(due, self._fast_since + self.settings.fast_flush_interval_s)
        timeout = max(0.01, min(0.2, due - now))
        # What is there now, else wait for the first message only: `consume` waits its whole
        # timeout for a full count, which throttled the sink to one prefetch per timeout.
        msgs = self._carry or (
            self._consumer.consume(CONSUME_MESSAGES, 0) or self._consumer.consume(1, timeout)
        )
        self._carry = []
        t = time.perf_counter()
        self.stats.read_s += time.monotonic() - now
        for i, msg in enumerate(msgs):
            if self._full():  # the rest waits for the next batch (read, not taken)
                self._carry = msgs[i:]
                break
            self._take(msg)
        self.stats.decode_s += time.perf_counter() - t
        self.stats.max_pending_rows = max(self.stats.max_pending_rows, self.pending_rows)
        self.stats.max_pending_bytes = max(self.stats.max_pending_bytes, self.pending_bytes)

    def _take(self, msg: Message) -> None:
        err = msg.error()
        if err:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", err)
            elif self.settings.telemetry_in_rounds and msg.topic() not in FAST_TOPICS:
                tp = TopicPartition(msg.topic(), msg.partition())
                if not self.paused and self._rounds.at_end(
                    self._consumer.position([tp])[0], msg.offset()
                ):
                    self._rounds.hold([tp])
            return
        topic, partition, off = msg.topic(), msg.partition(), msg.offset()
        value = msg.value() or b""
        self._rounds.taken.add((topic, partition))
        try:
            if topic == Topics.DLQ:
                _, ts_ms = msg.timestamp()
                table, part, dedup = rows_from_dead_letter(
                    value,
                    msg.key(),
                    msg.headers(),
                    timestamp_ms=ts_ms,
                    partition=partition,
                    offset=off,
                )
            else:
                table, part, dedup = rows_from_message(topic, value)
        except Exception as e:  # bad input, or a bug in a row builder: never stops the sink
            self._failed(e, Failed(topic, partition, off, msg.key(), value))
        else:
            if dedup in self._seen:  # sent twice (a producer's resend): drop
                self.stats.duplicates += 1
            elif part_rows(part):
                self._seen.add(dedup)
                source = Source(dedup, topic, partition, off, msg.key(), value)
                self._pending.setdefault(table, Pending()).extend(part, source)
                if self._fast_since is None and topic in FAST_TOPICS:
                    self._fast_since = time.monotonic()
        self._offsets[(topic, partition)] = off + 1

    def _failed(self, exc: BaseException, message: Failed) -> None:
        """What `on_error` says for a message that cannot land: to ``perfloop.dlq``, or
        dropped (a dead letter is never dead-lettered again)."""
        action, why = decide(self.on_error, exc, message, log)
        if action != "dead_letter":
            self.stats.dead_letters_dropped += 1
            return
        self._dlq.produce(
            Topics.DLQ,
            key=message.key,
            value=message.value,
            headers=dlq_headers(why, message.topic, message.partition, message.offset),
        )
        self._dlq.poll(0)
        self.stats.dead_letters += 1

    # -- flights: inserting in the insert thread, landing in the reading thread ---------------

    def _launch(self, *, fast_only: bool = False) -> None:
        """Seal the batch being filled (or only its `FAST_TOPICS` rows) into a flight, fast
        tables first, and insert it in the insert thread."""
        if fast_only:
            batches = {t: self._pending.pop(t) for t in list(self._pending) if t in FAST_TABLES}
            offsets = {tp: self._offsets.pop(tp) for tp in list(self._offsets)
                       if tp[0] in FAST_TOPICS}  # fmt: skip
        else:
            batches, offsets = self._pending, self._offsets
            self._pending, self._offsets = {}, {}
        self._fast_since = None
        order = sorted(batches, key=lambda t: t not in FAST_TABLES)  # stable: fast ones first
        flight = Flight({t: batches[t] for t in order}, offsets)
        self._flight = flight
        if flight.batches:
            threading.Thread(
                target=self._fly, args=(flight,), name="perfloop-sink-insert", daemon=True
            ).start()
        else:  # only offsets to commit (duplicates, dead letters)
            flight.done.set()

    def _join(self) -> None:
        """Rows someone waits for, due while a flight is in the air: into that flight, inserted
        after the table being inserted now (the telemetry of a flight can take a second under
        load), and committed when it lands. If the flight is about to land, or is inserting
        one of their tables, they wait for the next turn."""
        flight = self._flight
        batches = {t: p for t, p in self._pending.items() if t in FAST_TABLES}
        if flight is None or flight.done.is_set() or not batches:
            return
        offsets = {tp: o for tp, o in self._offsets.items() if tp[0] in FAST_TOPICS}
        if flight.join(batches, offsets, FAST_TABLES):
            for t in batches:
                del self._pending[t]
            for tp in offsets:
                del self._offsets[tp]
            self._fast_since = None
            self.stats.joined += 1

    def _fly(self, flight: Flight) -> None:
        """Insert every batch of a flight (the insert thread; never raises)."""
        t0 = time.perf_counter()
        try:
            while (table := flight.next_table()) is not None:
                try:
                    insert(self._ch, table, flight.batches[table], self.stats)
                    del flight.batches[table]
                except Rejected as e:
                    self._split(flight, table, str(e))
        except Unavailable as e:
            flight.error = e
        except Exception as e:  # a defect: keep the rows, retry as if the warehouse were down
            log.exception("unexpected error inserting a batch")
            flight.error = e
        finally:
            flight.close()
            self.stats.insert_s += time.perf_counter() - t0
            flight.done.set()

    def _land(self, *, wait: bool) -> bool:
        """Take the flight in the air when it is done (waiting for it if ``wait``); commit
        what it completes. Return True if no flight is left (none, or it landed)."""
        flight = self._flight
        if flight is None:
            return True
        t0 = time.perf_counter()
        if not flight.done.wait(None if wait else 0):
            return False
        self.stats.wait_s += time.perf_counter() - t0
        for message_id in flight.rejected:  # dead-lettered: the same id may come back fixed
            self._seen.discard(message_id)
        flight.rejected.clear()
        if flight.error is not None:
            self._down(flight.error)  # it stays, to be retried as it is
            return False
        self._flight = None
        self._uncommitted.update(flight.offsets)
        self._release_memory()
        self._commit()
        self._up()
        return True

    def _retry(self) -> None:
        """While paused: insert the flight that failed again, here, then resume."""
        flight = self._flight
        if flight is None:  # nothing failed (paused by a revoke that forgot its rows)
            self._up()
            return
        flight.error = None
        flight.done.clear()
        flight.reopen()
        self._fly(flight)
        self._land(wait=True)

    def _flush(self) -> bool:
        """Insert and commit everything read so far, here and now (stop, revoke).

        Return True if it is all in the warehouse and committed.
        """
        if self.paused:
            self._retry()
        if not self._land(wait=True):
            return False
        if self._pending or self._offsets:
            self._launch()
            if not self._land(wait=True):
                return False
        return not self._uncommitted

    def _commit(self) -> None:
        """Commit the offsets of what landed, once the dead letters made for it are sent."""
        if not self._uncommitted:
            return
        t0 = time.perf_counter()
        try:
            if self._dlq.flush(5):
                log.warning("dead letters not yet delivered; offsets are committed later")
                return
            self._consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in self._uncommitted.items()],
                asynchronous=False,
            )
        except KafkaException as e:  # e.g. a rebalance: the next landing commits again
            log.warning("offset commit failed, will retry: %s", e)
        else:
            self._uncommitted.clear()
        finally:
            self.stats.commit_s += time.perf_counter() - t0

    # -- writing (the insert thread) ---------------------------------------------------------

    def _split(self, flight: Flight, table: str, reason: str) -> None:
        """Insert a refused batch message by message; dead-letter the messages still refused."""
        pending = flight.batches[table]
        log.warning("%s; inserting its %d messages one by one", reason, len(pending.sources))
        left = list(range(len(pending.sources)))
        try:
            while left:
                source = pending.sources[left[0]]
                try:
                    insert(self._ch, table, pending.only(left[0]), self.stats)
                except Rejected as e:
                    self.stats.rejected += 1
                    flight.rejected.append(source.message_id)
                    self._failed(
                        e,
                        Failed(source.topic, source.partition, source.offset, source.key,
                               source.value),
                    )  # fmt: skip
                left.pop(0)
        finally:
            if left:  # the warehouse went away meanwhile: the rest waits as one batch
                rest = Pending()
                for i in left:
                    rest.extend(pending.parts[i], pending.sources[i])
                flight.batches[table] = rest
            else:
                del flight.batches[table]

    # -- pausing -------------------------------------------------------------------------------

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
        self._rounds.held.clear()  # every partition is read again, telemetry until its end
        log.warning(
            "warehouse back after %.1f s: inserted, committed, consumption resumed", paused_s
        )

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions (re)assigned are read from their committed offsets: none counts as
        taken from until a message of the new assignment is."""
        self._rounds.taken -= {(tp.topic, tp.partition) for tp in partitions}

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # A pause outlives the assignment in librdkafka: resume the held ones while they are
        # still assigned, or one assigned again would never be read.
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self._rounds.revoke(keys, resume=not self.paused)
        self._carry = []  # not taken: read again from the committed offsets
        if self._flush():
            return
        # The partitions go to another sink (or come back to this one) from their committed
        # offsets: forget what was read past them, or it would land twice or be skipped as
        # a duplicate when read again.
        batches = list(self._pending.values())
        if self._flight is not None:
            batches += self._flight.batches.values()
        for pending in batches:
            for s in pending.sources:
                self._seen.discard(s.message_id)
        log.warning("partitions revoked with %d rows not inserted (read again)", self.pending_rows)
        self._pending.clear()
        self._offsets.clear()
        self._flight = None
        self._uncommitted.clear()

    def _log_stats(self) -> None:
        self._stats_at = time.monotonic() + STATS_EVERY_S
        log.info("%s", self.stats.line(len(self._rounds.held)))
