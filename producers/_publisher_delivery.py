"""Sending and delivery reports of `perfloop.producers.publisher.Publisher` (a mixin, private
to it): handing a message to the producer, the outcome of each delivery report (published,
refused for good, or a failure the spool recovers from), a partition's offsets going back
(the broker lost its log), and the kept tail of acknowledged messages that is resent then,
after a probe of the oldest one of each partition."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from perfloop.producers._publisher_messages import (
    NEW,
    NO_TOPIC,
    NORMAL,
    PROBE,
    PURGED,
    REFUSED,
    REPLAY,
    RESEND,
    SPOOLING,
    TOPIC_ATTEMPTS,
    Kept,
    Rec,
    Sent,
)
from perfloop.producers._publisher_stats import PublisherStats
from perfloop.producers.spool import Position

__all__ = ["Delivery"]

log = logging.getLogger("perfloop.producers")


class Delivery:
    """The background thread's sending side of `Publisher`, which holds the state below; it
    calls the publisher's ``_warn`` and `Spooling`'s ``_to_spool`` and ``_commit_replay``."""

    _conf: dict[str, Any]
    _gen: int
    _producer: Producer
    _lock: threading.Lock
    _mem_bytes: int
    _queue_max: int
    _max_buffer: int
    _up: bool
    _lost: bool
    _down: bool
    _fatal: str
    _failed_delivery: str
    _mode: str
    _held: deque[Rec]
    _held_bytes: int
    _unacked: dict[int, Sent]
    _send_id: int
    _new_unacked: int
    _replay: dict[Position, bool]
    _acked_pos: set[Position]
    _topic_fail: dict[Position, int]
    _window_s: float
    _resend_max: int
    _kept: deque[Kept]
    _kept_bytes: int
    _incarnation: int
    _last_offset: dict[tuple[str, int], int]
    _probes: set[int]
    _backoff: float
    _p: PublisherStats

    # -- the producer and its errors -----------------------------------------------------------
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

    # -- normal mode ---------------------------------------------------------------------------
    def _produce(self, rec: Rec, kind: int, kept: Kept | None = None) -> bool | None:
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
            if err.code() in NO_TOPIC and not self._topic_gives_up(rec, err):
                self._failed_delivery = f"topic {rec.topic}: {err.str()}"
                return None
            self._bad(rec, err.str(), kind)
            return False
        except Exception as e:  # e.g. a TypeError: a bug in what was handed to us
            self._bad(rec, f"{type(e).__name__}: {e}", kind)
            return False
        self._unacked[sid] = Sent(rec, kind, kept)
        if kind == NEW:
            self._new_unacked += 1
        return True

    def _send_held(self) -> None:
        while self._held:
            rec = self._held[0]
            ok = self._produce(rec, NEW)
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
            self._mode = SPOOLING
            self._to_spool(self._take_held(), new=True)

    def _take_held(self) -> list[Rec]:
        held, self._held, self._held_bytes = list(self._held), deque(), 0
        return held

    def _topic_gives_up(self, rec: Rec, err: KafkaError) -> bool:
        """A spooled message to a missing topic is replayed a few times, then refused."""
        if rec.pos is None:
            return False
        n = self._topic_fail.get(rec.pos, 0) + 1
        self._topic_fail[rec.pos] = n
        return n >= TOPIC_ATTEMPTS

    def _bad(self, rec: Rec, why: str, kind: int) -> None:
        self._warn("refused", f"message to {rec.topic} refused for good: {why}")
        if kind in (RESEND, PROBE):
            return  # it was acknowledged once already
        self._p.failed += 1
        if kind == NEW:
            with self._lock:
                self._mem_bytes -= len(rec.value)
        if kind == REPLAY and rec.pos is not None:  # skip past it in the spool
            self._replay[rec.pos] = True
            self._commit_replay()

    def _delivered(
        self, gen: int, sid: int, kind: int, rec: Rec, err: KafkaError | None, msg: Message
    ) -> None:
        if gen != self._gen or sid not in self._unacked:
            return  # a replaced producer's report: what it carried was moved elsewhere
        if err is not None:
            code = err.code()
            if code in PURGED:
                return  # purged by a fatal error: recovered with everything unacknowledged
            if code in REFUSED or (code in NO_TOPIC and self._topic_gives_up(rec, err)):
                del self._unacked[sid]
                if kind == NEW:
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
        if kind == NEW:
            self._new_unacked -= 1
            with self._lock:
                self._mem_bytes -= len(rec.value)
            p.published += 1
        elif kind == REPLAY:
            assert rec.pos is not None
            self._replay[rec.pos] = True
            if rec.pos not in self._acked_pos:
                p.published += 1
                p.replayed += 1
                self._acked_pos.add(rec.pos)
        else:
            p.resent += 1
        if kind == REPLAY:
            self._commit_replay()
        if kind == PROBE:
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
        if self._mode == NORMAL:
            # Newer messages are already in the producer: resend right away (order within
            # the tail holds; the sink drops repeats).
            self._resend_tail()

    # -- the kept tail -------------------------------------------------------------------------
    def _keep(self, rec: Rec, part: int, off: int) -> None:
        self._kept.append(Kept(rec, part, off, self._incarnation, time.monotonic()))
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
            self._produce(k.rec, RESEND, k)
        return len(stale)

    def _send_probes(self) -> None:
        # The oldest kept message of each partition: if the broker lost its log, it is the
        # first of the tail to resend anyway, so the order holds.
        oldest: dict[tuple[str, int], Kept] = {}
        for k in self._kept:
            if k.incarnation == self._incarnation:
                oldest.setdefault((k.rec.topic, k.partition), k)
        for k in oldest.values():
            if self._produce(k.rec, PROBE):
                self._probes.add(self._send_id)
