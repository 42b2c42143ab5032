"""Publishing from a training process: never blocks the caller, accounts for every message.

`Publisher.publish(topic, key, value) -> bool` appends the message to an in-memory queue and
returns (a few microseconds; it never raises, never waits on the network or the disk). One
background thread owns an idempotent, acks=all, lz4 confluent-kafka producer and does the rest:

- **Normal**: messages go to the producer in order (linger ``linger_ms``); the thread polls the
  delivery reports, and every message ends as *published* (acknowledged by the broker),
  *failed* (refused for good: too large, invalid, not authorised; one warning line, never
  retried) or *dropped* (lost on purpose to keep a bound, counted with its samples).
- **Spooling**: when the broker is unreachable (every broker connection lost, a delivery that
  timed out after ``message_timeout_ms``, a fatal idempotence error, or more backlog than the
  memory bound), the producer instance is replaced, every unacknowledged message goes to the
  on-disk `Spool` (``spool_dir``, default ``$PERFLOOP_HOME/spool/<producer_id>``, bounded by
  ``spool_max_bytes``: the oldest segment is dropped and counted) and so do new messages, in
  order, until the spool has been replayed and acknowledged. A new `Publisher` on the same
  spool directory (a restarted process) replays what was left.
- **Broker data loss**: the last ``resend_window_s`` of acknowledged messages (bounded in
  bytes) is kept. After the connection to the broker was lost, the oldest kept message of each
  partition is sent again first, as a probe; if its new offset is not past the offset the
  partition had reached, the broker lost its log (the embedded memory broker restarted), and
  the whole kept tail is resent in order, before anything newer. A new offset behind the
  partition's last one at any other time triggers the same resend. The sink drops repeats by
  batch or event id.

Self-metrics: `Publisher.stats` (a `PublisherStats` snapshot), `Publisher.stats_event` (a
`ProducerStats` event for the caller to publish) and `Publisher.start_stats` (the background
thread publishes one every ``stats_interval_s``). `flush` waits for outstanding messages,
`close` flushes for a while and spools the rest (also run at interpreter exit).

>>> import tempfile
>>> from perfloop.settings import ProducerSettings
>>> s = ProducerSettings(home=tempfile.mkdtemp(), kafka_port=9, message_timeout_ms=1000)
>>> pub = Publisher(s, producer_id="doc")
>>> pub.publish("perfloop.telemetry.step", "job-1", b"{}")
True
>>> pub.publish("perfloop.telemetry.step", "job-1", b"x" * (64 << 20))  # over the limit
False
>>> pub.close(timeout_s=0)
>>> st = pub.stats
>>> st.accepted, st.failed, st.published + st.in_flight + st.spool_messages
(1, 1, 1)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from perfloop.exceptions import ConfigError
from perfloop.kafka import producer
from perfloop.producers.spool import Position, Spool, SpoolError, SpoolLocked, SpoolRecord
from perfloop.schemas import ProducerStats, encode_event
from perfloop.schemas.arrow_batch import arrow_rows, is_arrow
from perfloop.schemas.topics import KIND_TOPICS
from perfloop.settings import BaseServiceSettings, ProducerSettings

__all__ = ["Publisher", "PublisherStats", "count_samples"]

log = logging.getLogger("perfloop.producers")

_NEW, _REPLAY, _RESEND, _PROBE = 0, 1, 2, 3
_NORMAL, _SPOOLING = "normal", "spooling"

# Refused by the client or the broker for good: retrying cannot help.
_BAD = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_TIMESTAMP,
        KafkaError.INVALID_REQUIRED_ACKS,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError._INVALID_ARG,
        KafkaError._INVALID_TYPE,
    }
)
# The topic does not exist (yet: a restarted broker gets its topics back in a moment).
_TOPIC = frozenset({KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART})
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
_TOPIC_ATTEMPTS = 5  # replays of one message to a missing topic before it counts as failed
_WARN_EVERY_S = 10.0
_ACK_WAIT_S = 0.25  # how long a thread that only awaits acks sleeps unless a message comes
_MIN_LOOK_S = 0.05  # but a steady stream of messages wakes it at most 20 times a second
_BYTES = (bytes, bytearray, memoryview)
_FRAMING_BYTES = 1024  # record batch overhead on top of a message's key and value


@dataclass
class PublisherStats:
    """Self-metrics, cumulative since the publisher started (a snapshot).

    ``accepted`` messages were taken by `Publisher.publish` (it returned True), ``refused``
    ones were not (it returned False: counted in ``failed`` or, at the memory bound, in
    ``dropped``). Every message offered, and each of the ``restored`` ones found in the spool
    at start, is at any time exactly one of: ``published`` (acknowledged by the broker;
    ``replayed`` of them came out of the spool), ``failed`` (refused for good, never
    retried), ``dropped`` (lost on purpose to keep a bound: spool full, oldest first),
    ``corrupt`` (an unreadable spool record), in memory (``in_flight``) or in the spool
    (``spool_messages``)::

        accepted + refused + restored == published + failed + dropped + corrupt
                                         + in_flight + spool_messages

    ``spooled`` counts writes to the spool; ``resent`` counts messages sent again after the
    broker lost them (and probes), which are not counted in ``published`` a second time.
    """

    accepted: int = 0
    refused: int = 0
    restored: int = 0
    published: int = 0
    replayed: int = 0
    spooled: int = 0
    resent: int = 0
    failed: int = 0
    dropped: int = 0
    dropped_samples: int = 0
    corrupt: int = 0
    in_flight: int = 0
    in_flight_bytes: int = 0
    spool_messages: int = 0
    spool_bytes: int = 0
    spool_bytes_peak: int = 0
    broker_losses: int = 0  # times the broker was found to have lost its log
    recycles: int = 0  # producer instances replaced (connection lost, timeouts, fatal errors)
    cpu_time_s: float = 0.0  # the background thread's CPU time + time inside publish()

    @property
    def delivered(self) -> int:
        """Alias of ``published`` (messages acknowledged by the broker)."""
        return self.published

    @property
    def queued(self) -> int:
        """Alias of ``accepted``."""
        return self.accepted


class _Rec:
    __slots__ = ("key", "pos", "samples", "seq", "topic", "value")

    def __init__(self, seq: int, topic: str, key: bytes, value: bytes) -> None:
        self.seq, self.topic, self.key, self.value = seq, topic, key, value
        self.samples = -1  # counted only when needed (spooling, dropping)
        self.pos: Position | None = None  # replayed: the spool position just after it

    def sample_count(self) -> int:
        if self.samples < 0:
            self.samples = count_samples(self.value)
        return self.samples


@dataclass(slots=True)
class _Kept:  # an acknowledged message kept to resend if the broker loses it
    rec: _Rec
    partition: int
    offset: int
    incarnation: int
    at: float


@dataclass(slots=True)
class _Sent:  # one message handed to the producer, and why
    rec: _Rec
    kind: int
    kept: _Kept | None = None  # a resent one: its entry in the kept tail


def count_samples(value: bytes) -> int:
    """Samples in a message: the rows of a batch (Arrow, or the length of a JSON batch's
    ``ts_ns`` column), else 1."""
    if is_arrow(value):
        return arrow_rows(value)
    i = value.find(b'"ts_ns":[')
    if i < 0:
        return 1
    start = i + 9
    end = value.find(b"]", start)
    if end <= start:
        return 0 if end == start else 1
    return value.count(b",", start, end) + 1


def _defaults() -> dict[str, Any]:
    return {name: f.default for name, f in ProducerSettings.model_fields.items()}


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class Publisher:
    """Non-blocking, loss-accounting publisher (see the module docstring for the contract).

    ``settings`` is any service settings object; a `ProducerSettings` also sets the linger,
    the queue and message-timeout bounds, the spool and the resend window (other settings get
    `ProducerSettings`' defaults). ``producer_id`` names the spool directory (two processes
    cannot share one: the second gets ``<producer_id>-<pid>``); ``max_buffer_bytes`` bounds
    the messages held in memory (about 1.5× this with the client's own copies);
    ``resend_max_bytes`` bounds the kept tail; ``overrides`` are librdkafka properties.
    """

    def __init__(
        self,
        settings: BaseServiceSettings,
        *,
        producer_id: str = "default",
        spool_dir: str | os.PathLike[str] | None = None,
        max_buffer_bytes: int = 64 << 20,
        resend_max_bytes: int = 32 << 20,
        **overrides: Any,
    ) -> None:
        t = _defaults()
        if isinstance(settings, ProducerSettings):
            t |= settings.model_dump()
        self.settings = settings
        self.producer_id = producer_id
        self._queue_max = int(t["queue_max_messages"])
        self._spool_max = int(t["spool_max_bytes"])
        self._segment_bytes = int(t["spool_segment_bytes"])
        self._window_s = float(t["resend_window_s"])
        self._stats_every_s = float(t["stats_interval_s"])
        self._max_buffer = max_buffer_bytes
        self._resend_max = resend_max_bytes
        base = spool_dir or t.get("spool_dir")
        self.spool_dir = (
            Path(base) if base else settings.home_dir / "spool" / _SAFE.sub("_", producer_id)
        )
        self._conf = {
            "queue.buffering.max.kbytes": max(1, max_buffer_bytes // 2048),
            "allow.auto.create.topics": False,  # the stack creates topics with their partitions
            # Connection failures reach us through error_cb and are said once, as a spooling
            # warning, instead of a client log line per reconnect attempt.
            "log_level": 2,
        } | overrides
        self._max_message = int(self._conf.get("message.max.bytes", 8 << 20)) - _FRAMING_BYTES
        self._gen = 0
        try:
            first = producer(settings, **self._conf_for(0))
        except KafkaException as e:
            raise ConfigError(f"invalid producer configuration: {e.args[0].str()}") from e
        # -- shared with publish() (under _lock) ---------------------------------------------
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._dozing = True  # the background thread waits long: publish() wakes it
        self._inbox: deque[_Rec] = deque()
        self._mem_bytes = 0  # inbox + held + unacked new messages
        self._seq = 0
        self._publish_ns = 0
        self._st = PublisherStats()  # publish()'s own counts: accepted, failed, dropped
        self._snap = PublisherStats()  # the background thread's counts at its last step
        self._taken = 0  # taken from the inbox since that step
        self._closing = False
        self._closed = False
        self._close_deadline = 0.0
        self._steps = 0
        self._outstanding = 0
        self._warned: dict[str, float] = {}
        # -- owned by the background thread -------------------------------------------------
        self._producer: Producer = first
        self._up = False  # the current producer had a delivery acknowledged
        self._lost = False  # every broker connection of an up producer went down
        self._down = False  # every broker connection is down now (no wait at close)
        self._fatal = ""
        self._failed_delivery = ""
        self._mode = _NORMAL
        self._held: deque[_Rec] = deque()
        self._held_bytes = 0
        self._unacked: dict[int, _Sent] = {}  # send id -> what was sent, in send order
        self._send_id = 0
        self._new_unacked = 0
        self._spool: Spool | None = None
        self._spool_broken = False
        self._replay_next: deque[_Rec] = deque()  # read from the spool, not yet produced
        self._replay: dict[Position, bool] = {}  # produced from the spool: acked?
        self._acked_pos: set[Position] = set()
        self._topic_fail: dict[Position, int] = {}
        self._kept: deque[_Kept] = deque()
        self._kept_bytes = 0
        self._incarnation = 0
        self._last_offset: dict[tuple[str, int], int] = {}
        self._probe_needed = False
        self._probes: set[int] = set()  # send ids of probes in flight
        self._backoff = 0.0
        self._pause_until = 0.0
        self._p = PublisherStats()  # the background thread's counts (its own, no lock)
        self._cpu0 = 0.0
        self._cpu = 0.0
        self._stats_job: dict[str, Any] | None = None
        self._stats_at = 0.0
        self._last_event: tuple[float, float, PublisherStats] | None = None
        self._thread = threading.Thread(target=self._run, name="perfloop-publisher", daemon=True)
        self._thread.start()
        atexit.register(self._atexit)

    # -- the caller's side ---------------------------------------------------------------------
    def publish(self, topic: str, key: str | bytes, value: bytes) -> bool:
        """Hand one message over; return False (counted, one warning line) if it is refused.

        Never blocks and never raises. Refused: a value that is not bytes, a message larger
        than the client's ``message.max.bytes`` (counted ``failed``), a publisher that is
        closed (``failed``), or the in-memory bound reached because the background thread
        cannot keep up (``dropped``).
        """
        t0 = time.perf_counter_ns()
        try:
            if not isinstance(value, _BYTES) or not topic:
                return self._refuse("bad", f"cannot publish a {type(value).__name__} to {topic!r}")
            size = len(value)
            if size + len(key) > self._max_message:
                return self._refuse(
                    "size",
                    f"a {size}-byte message to {topic} is over the {self._max_message}-byte "
                    "limit (message.max.bytes); not sent",
                )
            k = key.encode() if isinstance(key, str) else bytes(key)
            with self._lock:
                if self._closed or self._closing:
                    return self._refuse("closed", "publish after close(); not sent", locked=True)
                if self._mem_bytes + size > self._max_buffer or len(self._inbox) > (
                    2 * self._queue_max
                ):
                    self._st.dropped += 1
                    self._st.dropped_samples += count_samples(bytes(value))
                    self._st.refused += 1
                    self._warn("full", "publisher memory bound reached; dropped a new message")
                    return False
                self._seq += 1
                self._inbox.append(_Rec(self._seq, topic, k, bytes(value)))
                self._mem_bytes += size
                self._st.accepted += 1
            if self._dozing:  # a busy background thread looks again within 10 ms anyway
                self._wake.set()
            return True
        except Exception as e:  # never into the training loop
            return self._refuse("bad", f"cannot publish to {topic!r}: {type(e).__name__}: {e}")
        finally:
            self._publish_ns += time.perf_counter_ns() - t0

    def _refuse(self, reason: str, msg: str, locked: bool = False) -> bool:
        if locked:
            self._st.failed += 1
            self._st.refused += 1
        else:
            with self._lock:
                self._st.failed += 1
                self._st.refused += 1
        self._warn(reason, msg)
        return False

    def _warn(self, reason: str, msg: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(reason, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[reason] = now
            log.warning("%s (repeats are counted, not logged, for %.0f s)", msg, _WARN_EVERY_S)

    @property
    def stats(self) -> PublisherStats:
        """A snapshot of the self-metrics; the accounting identity holds in every snapshot."""
        with self._lock:
            st = replace(self._snap)
            st.accepted = self._st.accepted
            st.refused = self._st.refused
            st.failed += self._st.failed
            st.dropped += self._st.dropped
            st.dropped_samples += self._st.dropped_samples
            st.in_flight += len(self._inbox) + self._taken
            st.in_flight_bytes = self._mem_bytes
            st.cpu_time_s = self._cpu + self._publish_ns / 1e9
        return st

    def pending_bytes(self) -> int:
        """Bytes of accepted messages held in memory, not yet acknowledged or spooled (for a
        caller that may wait, such as a replay tool or a benchmark; a training loop never
        needs to)."""
        return self._mem_bytes

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait up to ``timeout_s`` for every accepted (and spooled) message to be resolved;
        return how many are still outstanding (in memory or in the spool)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        self._wake.set()
        with self._cond:
            start = self._steps
            while True:
                left = len(self._inbox) + self._outstanding
                fresh = self._steps > start + 1
                if (fresh and left == 0) or not self._thread.is_alive():
                    return left
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return left
                self._cond.wait(min(remaining, 0.05))
                self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver for up to ``timeout_s`` (not at all while no broker answers), spool what
        is left (a restart replays it) and stop."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._close_deadline = time.monotonic() + max(0.0, timeout_s)
        self._wake.set()
        self._thread.join(max(0.0, timeout_s) + 10.0)  # a stuck disk must not hang the caller
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        self.close(timeout_s=2.0)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- self-metrics as an event -------------------------------------------------------------
    def stats_event(
        self,
        job_id: str,
        node: str,
        rank: int = -1,
        producer_id: str | None = None,
        *,
        samples: int = 0,
    ) -> ProducerStats:
        """A `ProducerStats` event of the metrics now; rates and ``overhead_pct`` cover the
        time since the previous call. ``samples`` is what the caller handed over (e.g.
        `Emitter.samples`). Unreadable spool records count as ``failed``."""
        st = self.stats
        now = time.monotonic()
        prev = self._last_event or (now, 0.0, PublisherStats())
        self._last_event = (now, st.cpu_time_s, st)
        dt = now - prev[0]
        rates: dict[str, float] = {}
        overhead = 0.0
        if dt > 0:
            overhead = max(0.0, (st.cpu_time_s - prev[1]) / dt * 100)
            for name in ("accepted", "published", "spooled", "dropped"):
                rates[name] = round((getattr(st, name) - getattr(prev[2], name)) / dt, 3)
        return ProducerStats(
            ts_ns=time.time_ns(),
            job_id=job_id,
            node=node,
            rank=rank,
            producer_id=producer_id or self.producer_id,
            samples=samples,
            messages=st.accepted,
            published=st.published,
            spooled=st.spooled,
            replayed=st.replayed,
            dropped=st.dropped,
            dropped_samples=st.dropped_samples,
            failed=st.failed + st.corrupt,
            resent=st.resent,
            refused=st.refused,
            in_flight=st.in_flight,
            spool_bytes=st.spool_bytes,
            cpu_time_ms=st.cpu_time_s * 1000,
            overhead_pct=overhead,
            rates_hz=rates,
        )

    def start_stats(
        self,
        job_id: str,
        node: str,
        rank: int = -1,
        *,
        samples: Any = None,
        interval_s: float | None = None,
    ) -> None:
        """Publish a `ProducerStats` event every ``interval_s`` (default ``stats_interval_s``)
        from the background thread; ``samples`` is an optional callable returning the samples
        handed over so far (e.g. ``lambda: emitter.samples``)."""
        self._stats_job = {
            "job_id": job_id,
            "node": node,
            "rank": rank,
            "samples": samples,
            "every": interval_s or self._stats_every_s,
        }
        self._stats_at = time.monotonic()

    # -- the background thread ----------------------------------------------------------------
    def _run(self) -> None:
        self._cpu0 = time.thread_time()
        try:
            self._open_leftover_spool()
            while True:
                self._step()
                looked = time.monotonic()
                with self._cond:
                    self._steps += 1
                    self._cpu = time.thread_time() - self._cpu0
                    self._cond.notify_all()
                    closing, deadline = self._closing, self._close_deadline
                if closing and (self._idle() or self._down or time.monotonic() >= deadline):
                    break  # no broker to wait for: what is left goes to the spool
                urgent = self._replay_next or self._held or closing
                self._dozing = not urgent
                # awaiting acks only: they are read at the next wake-up, which the next
                # message brings (a training process publishes every publish interval) or
                # within a quarter second; the thread's every wake takes the GIL from the
                # training loop, so it does not wake just to read acks
                self._wake.wait(0.01 if urgent else _ACK_WAIT_S if self._unacked else 0.5)
                rest = _MIN_LOOK_S - (time.monotonic() - looked)
                if rest > 0 and not urgent and not self._closing:
                    time.sleep(rest)  # woken soon after the last look: let the burst gather
                self._dozing = True
                self._wake.clear()
        except Exception:  # a bug here must not take the training job down: say it, go on
            log.exception("publisher thread failed; messages still in memory are spooled")
        finally:
            self._shutdown()

    def _idle(self) -> bool:
        return not (self._inbox or self._held or self._unacked or self._replay_next) and not (
            self._spool is not None and self._spool.records
        )

    def _step(self) -> None:
        self._producer.poll(0)
        if self._fatal or self._failed_delivery or self._lost:
            why = self._fatal or self._failed_delivery or "connection to every broker lost"
            self._recover(why)
        with self._lock:
            batch, self._inbox = self._inbox, deque()
            self._taken += len(batch)
        if self._mode == _NORMAL:
            self._held.extend(batch)
            self._held_bytes += sum(len(r.value) for r in batch)
            self._send_held()
        else:
            self._to_spool(batch, new=True)
            self._drive_spool()
        self._trim_kept()
        if (
            self._stats_job is not None
            and time.monotonic() - self._stats_at >= self._stats_job["every"]
        ):
            self._emit_stats()
        if self._spool is not None:
            self._spool.sync()
        self._snapshot()

    def _snapshot(self) -> None:
        p, sp = self._p, self._spool
        if sp is not None:
            p.spool_messages = sp.records
            p.spool_bytes = sp.bytes
            p.spool_bytes_peak = max(p.spool_bytes_peak, p.spool_bytes)
            p.corrupt = sp.corrupt
        p.in_flight = len(self._held) + self._new_unacked
        snap = replace(p)
        if sp is not None:
            snap.dropped += sp.dropped
            snap.dropped_samples += sp.dropped_samples
        with self._lock:
            self._snap = snap
            self._taken = 0
            self._outstanding = p.in_flight + p.spool_messages

    # -- normal mode ----------------------------------------------------------------------------
    def _produce(self, rec: _Rec, kind: int, kept: _Kept | None = None) -> bool | None:
        """Hand one message to the producer: True if taken, False if refused for good,
        None if it cannot be taken now (queue full, or the producer needs replacing)."""
        self._send_id += 1
        sid = self._send_id
        try:
            self._producer.produce(
                rec.topic,
                rec.value,
                rec.key,
                on_delivery=functools.partial(self._delivered, self._gen, sid, kind, rec),
            )
        except BufferError:
            return None
        except KafkaException as e:
            err = e.args[0]
            if err.fatal():
                self._fatal = f"fatal producer error: {err.str()}"
                return None
            if err.code() in _TOPIC and not self._topic_gives_up(rec, err):
                self._failed_delivery = f"topic {rec.topic}: {err.str()}"
                return None
            self._bad(rec, err.str(), kind)
            return False
        except Exception as e:  # e.g. a TypeError: a bug in what was handed to us
            self._bad(rec, f"{type(e).__name__}: {e}", kind)
            return False
        self._unacked[sid] = _Sent(rec, kind, kept)
        if kind == _NEW:
            self._new_unacked += 1
        return True

    def _send_held(self) -> None:
        while self._held:
            rec = self._held[0]
            ok = self._produce(rec, _NEW)
            if ok is None:
                break
            self._held.popleft()
            self._held_bytes -= len(rec.value)
        if self._held and (self._fatal or self._failed_delivery):
            return  # recovered next step
        if self._held and (
            len(self._held) > self._queue_max or self._held_bytes > self._max_buffer // 4
        ):
            # The broker takes less than we are given: keep the backlog on disk, in order.
            self._mode = _SPOOLING
            self._to_spool(self._take_held(), new=True)

    def _take_held(self) -> list[_Rec]:
        held, self._held, self._held_bytes = list(self._held), deque(), 0
        return held

    def _topic_gives_up(self, rec: _Rec, err: KafkaError) -> bool:
        """A spooled message to a missing topic is replayed a few times, then refused."""
        if rec.pos is None:
            return False
        n = self._topic_fail.get(rec.pos, 0) + 1
        self._topic_fail[rec.pos] = n
        return n >= _TOPIC_ATTEMPTS

    def _bad(self, rec: _Rec, why: str, kind: int) -> None:
        self._warn("refused", f"message to {rec.topic} refused for good: {why}")
        if kind in (_RESEND, _PROBE):
            return  # it was acknowledged once already
        self._p.failed += 1
        if kind == _NEW:
            with self._lock:
                self._mem_bytes -= len(rec.value)
        if kind == _REPLAY and rec.pos is not None:  # skip past it in the spool
            self._replay[rec.pos] = True
            self._commit_replay()

    def _delivered(
        self, gen: int, sid: int, kind: int, rec: _Rec, err: KafkaError | None, msg: Message
    ) -> None:
        if gen != self._gen or sid not in self._unacked:
            return  # a replaced producer's report: what it carried was moved elsewhere
        if err is not None:
            code = err.code()
            if code in _PURGED:
                return  # purged by a fatal error: recovered with everything unacknowledged
            if code in _BAD or (code in _TOPIC and self._topic_gives_up(rec, err)):
                del self._unacked[sid]
                if kind == _NEW:
                    self._new_unacked -= 1
                self._probes.discard(sid)
                self._bad(rec, err.str(), kind)
                return
            if not self._failed_delivery:
                self._failed_delivery = f"delivery to {rec.topic} failed: {err.str()}"
            return
        del self._unacked[sid]
        self._up = True
        self._down = False
        self._backoff = 0.0
        part, off = msg.partition(), msg.offset()
        part = -1 if part is None else part
        off = -1 if off is None else off
        lost = self._check_offset(rec.topic, part, off)
        p = self._p
        if kind == _NEW:
            self._new_unacked -= 1
            with self._lock:
                self._mem_bytes -= len(rec.value)
            p.published += 1
        elif kind == _REPLAY:
            assert rec.pos is not None
            self._replay[rec.pos] = True
            if rec.pos not in self._acked_pos:
                p.published += 1
                p.replayed += 1
                self._acked_pos.add(rec.pos)
        else:
            p.resent += 1
        if kind == _REPLAY:
            self._commit_replay()
        if kind == _PROBE:
            self._probes.discard(sid)
            self._kept = deque(k for k in self._kept if k.rec is not rec)
            self._kept_bytes = sum(len(k.rec.value) for k in self._kept)
        if lost:
            self._broker_lost(rec.topic, part)
        if self._window_s > 0:
            self._keep(rec, part, off)

    def _check_offset(self, topic: str, part: int, off: int) -> bool:
        if off < 0 or part < 0:
            return False
        tp = (topic, part)
        last = self._last_offset.get(tp)
        self._last_offset[tp] = off if last is None else max(last, off)
        return last is not None and off <= last

    def _broker_lost(self, topic: str, part: int) -> None:
        log.warning(
            "the broker lost acknowledged messages (%s[%d] went back in offsets); resending "
            "the last %.0f s of them",
            topic,
            part,
            self._window_s,
        )
        self._incarnation += 1
        self._last_offset = {}
        self._p.broker_losses += 1
        if self._mode == _NORMAL:
            # Newer messages are already in the producer: resend right away (order within
            # the tail holds; the sink drops repeats).
            self._resend_tail()

    # -- the kept tail ---------------------------------------------------------------------------
    def _keep(self, rec: _Rec, part: int, off: int) -> None:
        self._kept.append(_Kept(rec, part, off, self._incarnation, time.monotonic()))
        self._kept_bytes += len(rec.value)
        self._trim_kept()

    def _trim_kept(self) -> None:
        old = time.monotonic() - self._window_s
        while self._kept and (self._kept[0].at < old or self._kept_bytes > self._resend_max):
            self._kept_bytes -= len(self._kept.popleft().rec.value)

    def _resend_tail(self) -> int:
        stale = sorted(
            (k for k in self._kept if k.incarnation < self._incarnation), key=lambda k: k.rec.seq
        )
        if not stale:
            return 0
        ids = {id(k) for k in stale}
        self._kept = deque(k for k in self._kept if id(k) not in ids)
        self._kept_bytes = sum(len(k.rec.value) for k in self._kept)
        for k in stale:
            self._produce(k.rec, _RESEND, k)
        return len(stale)

    def _send_probes(self) -> None:
        # The oldest kept message of each partition: if the broker lost its log, it is the
        # first of the tail to resend anyway, so the order holds.
        oldest: dict[tuple[str, int], _Kept] = {}
        for k in self._kept:
            if k.incarnation == self._incarnation:
                oldest.setdefault((k.rec.topic, k.partition), k)
        for k in oldest.values():
            if self._produce(k.rec, _PROBE):
                self._probes.add(self._send_id)

    # -- recovery and the spool ------------------------------------------------------------------
    def _recover(self, why: str) -> None:
        """Replace the producer; every unacknowledged message goes to the spool, in order."""
        self._warn("recover", f"broker unreachable or lost ({why}); spooling to {self.spool_dir}")
        self._fatal = self._failed_delivery = ""
        self._lost = False
        old = self._producer
        with contextlib.suppress(Exception):
            old.purge(in_queue=True, in_flight=True, blocking=False)
        self._gen += 1
        self._producer = producer(self.settings, **self._conf_for(self._gen))
        del old  # its reports are void: everything it held is accounted for below
        self._up = self._down = False
        now = time.monotonic()
        self._backoff = min(5.0, max(0.25, self._backoff * 2))
        self._pause_until = now + self._backoff
        self._p.recycles += 1
        sent = [s for _, s in sorted(self._unacked.items())]
        self._unacked = {}
        self._probes.clear()
        new = [s.rec for s in sent if s.kind == _NEW]
        self._new_unacked = 0
        # Resends go back to the kept tail, still due; replays are still in the spool.
        back = [s.kept for s in sent if s.kind == _RESEND and s.kept is not None]
        if back:
            self._kept = deque(sorted([*self._kept, *back], key=lambda k: k.at))
            self._kept_bytes = sum(len(k.rec.value) for k in self._kept)
        self._replay_next.clear()
        self._replay = {}
        if self._spool is not None:
            self._count_lost(self._spool.rewind())
        if self._kept:
            self._probe_needed = True
        if self._mode == _NORMAL:
            self._mode = _SPOOLING
            self._to_spool(new + self._take_held(), new=True)
        else:
            self._to_spool(new, new=True, front=True)

    def _conf_for(self, gen: int) -> dict[str, Any]:
        return self._conf | {"error_cb": functools.partial(self._on_error, gen)}

    def _on_error(self, gen: int, err: KafkaError) -> None:
        if gen != self._gen:
            return
        if err.fatal():
            self._fatal = f"fatal producer error: {err.str()}"
        elif err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._down = True
            self._lost = self._lost or self._up

    def _count_lost(self, lost: tuple[int, int]) -> None:
        self._p.dropped += lost[0]
        self._p.dropped_samples += lost[1]

    def _open_spool(self) -> Spool | None:
        if self._spool is not None or self._spool_broken:
            return self._spool
        for d in (self.spool_dir, self.spool_dir.with_name(f"{self.spool_dir.name}-{os.getpid()}")):
            try:
                self._spool = Spool(d, max_bytes=self._spool_max, segment_bytes=self._segment_bytes)
            except SpoolLocked:
                continue
            except (SpoolError, OSError) as e:
                log.warning("cannot open the spool %s: %s; unsent messages will be lost", d, e)
                break
            if d != self.spool_dir:
                log.warning("spool %s is in use by another process; using %s", self.spool_dir, d)
            return self._spool
        self._spool_broken = True
        return None

    def _open_leftover_spool(self) -> None:
        if not any(self.spool_dir.glob("*.seg")):
            return
        sp = self._open_spool()
        if sp is not None and sp.records:
            self._mode = _SPOOLING
            self._p.restored = sp.records

    def _to_spool(self, recs: list[_Rec] | deque[_Rec], *, new: bool, front: bool = False) -> None:
        if not recs:
            return
        sp = self._open_spool()
        size = sum(len(r.value) for r in recs)
        if sp is None:
            self._p.failed += len(recs)
            if new:
                with self._lock:
                    self._mem_bytes -= size
            return
        items = [SpoolRecord(r.topic, r.key, r.value, r.sample_count()) for r in recs]
        failed = 0
        if front:
            sp.prepend(items)
        else:
            for item in items:
                try:
                    sp.append(item)
                except SpoolError as e:
                    failed += 1
                    self._warn("spool", f"message not spooled: {e}")
        self._p.spooled += len(items) - failed
        self._p.failed += failed
        if new:
            with self._lock:
                self._mem_bytes -= size

    def _drive_spool(self) -> None:
        if self._new_unacked:
            return  # older messages still with the producer: they go first
        if time.monotonic() < self._pause_until:
            return  # a replaced producer: give the broker a moment
        if self._probe_needed:
            self._probe_needed = False
            self._send_probes()
        if self._probes:
            return  # wait: did the broker keep its log?
        if self._incarnation and any(k.incarnation < self._incarnation for k in self._kept):
            self._resend_tail()
        sp = self._spool
        if sp is None:
            self._mode = _NORMAL
            return
        window = 256 if self._up else 1  # one message until the broker answers
        while len(self._replay) < window:
            if not self._replay_next:
                got = sp.read(min(32, window - len(self._replay)), 8 << 20)
                if not got:
                    break
                for item, pos in got:
                    r = _Rec(0, item.topic, item.key, item.value)
                    r.samples, r.pos = item.samples, pos
                    self._replay_next.append(r)
            rec = self._replay_next[0]
            ok = self._produce(rec, _REPLAY)
            if ok is None:
                return
            self._replay_next.popleft()
            if ok:
                assert rec.pos is not None
                self._replay[rec.pos] = False
        if not self._replay and not self._replay_next and sp.records == 0:
            self._mode = _NORMAL
            self._acked_pos.clear()
            self._topic_fail.clear()
            log.info("spool %s replayed; publishing directly again", sp.dir)

    def _commit_replay(self) -> None:
        last: Position | None = None
        for pos in list(self._replay):  # in read order
            if not self._replay[pos]:
                break
            del self._replay[pos]
            last = pos
        if last is not None and self._spool is not None:
            self._spool.commit(last)
            self._acked_pos = {p for p in self._acked_pos if p > last}

    def _emit_stats(self) -> None:
        job = self._stats_job
        assert job is not None
        self._stats_at = time.monotonic()
        try:
            samples = int(job["samples"]()) if job["samples"] is not None else 0
            ev = self.stats_event(job["job_id"], job["node"], job["rank"], samples=samples)
            self.publish(KIND_TOPICS[ev.KIND], job["job_id"], encode_event(ev))
        except Exception as e:
            self._warn("stats", f"cannot publish producer stats: {type(e).__name__}: {e}")

    def _shutdown(self) -> None:
        """Spool whatever is still in memory (a restart replays it) and release everything."""
        with self._lock:
            self._closed = True
            batch, self._inbox = list(self._inbox), deque()
        try:
            pending = [s.rec for _, s in sorted(self._unacked.items()) if s.kind == _NEW]
            rest = pending + self._take_held() + batch
            front = self._mode == _SPOOLING  # older than what is spooled already
            self._unacked.clear()
            self._new_unacked = 0
            self._replay.clear()
            self._replay_next.clear()
            if rest:
                self._to_spool(rest, new=True, front=front)
            with contextlib.suppress(Exception):
                self._producer.purge(in_queue=True, in_flight=True, blocking=False)
            if self._spool is not None:
                self._count_lost(self._spool.rewind())
                self._snapshot()
                self._spool.close()
            else:
                self._snapshot()
        finally:
            with self._cond:
                self._cond.notify_all()
