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

This module holds the caller's side and the background thread's loop; the rest lives in
private modules of this package: the messages, why each is sent and which Kafka errors are
final (`_publisher_messages`, with `count_samples`), sending, delivery reports and the kept
tail (`_publisher_delivery`), recovery, the spool and its replay (`_publisher_spooling`), and
the self-metrics (`_publisher_stats`, with `PublisherStats`).

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
import logging
import os
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException, Producer

from perfloop.exceptions import ConfigError
from perfloop.kafka import producer
from perfloop.producers._publisher_delivery import Delivery
from perfloop.producers._publisher_messages import NORMAL, Kept, Rec, Sent, count_samples
from perfloop.producers._publisher_spooling import Spooling
from perfloop.producers._publisher_stats import PublisherStats, StatsReporting
from perfloop.producers.spool import Position, Spool
from perfloop.settings import BaseServiceSettings, ProducerSettings

__all__ = ["Publisher", "PublisherStats", "count_samples"]

log = logging.getLogger("perfloop.producers")

_WARN_EVERY_S = 10.0
_ACK_WAIT_S = 0.25  # how long a thread that only awaits acks sleeps unless a message comes
_MIN_LOOK_S = 0.05  # but a steady stream of messages wakes it at most 20 times a second
_BYTES = (bytes, bytearray, memoryview)
_FRAMING_BYTES = 1024  # record batch overhead on top of a message's key and value


def _defaults() -> dict[str, Any]:
    return {name: f.default for name, f in ProducerSettings.model_fields.items()}


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class Publisher(Delivery, Spooling, StatsReporting):
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
            # idempotent on every broker: a broker that lost its log is noticed and the
            # producer replaced (`_publisher_spooling`), which a plain service producer is not
            "enable.idempotence": True,
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
        self._inbox: deque[Rec] = deque()
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
        self._mode = NORMAL
        self._held: deque[Rec] = deque()
        self._held_bytes = 0
        self._unacked: dict[int, Sent] = {}  # send id -> what was sent, in send order
        self._send_id = 0
        self._new_unacked = 0
        self._spool: Spool | None = None
        self._spool_broken = False
        self._replay_next: deque[Rec] = deque()  # read from the spool, not yet produced
        self._replay: dict[Position, bool] = {}  # produced from the spool: acked?
        self._acked_pos: set[Position] = set()
        self._topic_fail: dict[Position, int] = {}
        self._kept: deque[Kept] = deque()
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
                self._inbox.append(Rec(self._seq, topic, k, bytes(value)))
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

    # -- the background thread -----------------------------------------------------------------
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
        try:
            self._producer.poll(0)
        except KafkaException as e:
            # librdkafka's fatal errors (an idempotent producer's UNKNOWN_PRODUCER_ID after a
            # broker lost its log) come out of poll() as an exception, never to error_cb:
            # the producer is replaced, as for every other loss
            err = e.args[0] if e.args else None
            self._fatal = f"fatal producer error: {err.str() if err is not None else e}"
        if self._fatal or self._failed_delivery or self._lost:
            why = self._fatal or self._failed_delivery or "connection to every broker lost"
            self._recover(why)
        with self._lock:
            batch, self._inbox = self._inbox, deque()
            self._taken += len(batch)
        if self._mode == NORMAL:
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
