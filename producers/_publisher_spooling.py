"""Recovery and the spool of `perfloop.producers.publisher.Publisher` (a mixin, private to
it): replacing a producer that lost the broker and moving every unacknowledged message to the
on-disk `Spool` in order, writing to it (what cannot be written counts as failed, what it
drops as dropped), replaying it once the broker answers again and committing what was
acknowledged, and spooling what is left in memory at shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

from confluent_kafka import Producer

from perfloop.kafka import producer
from perfloop.producers._publisher_messages import (
    NEW,
    NORMAL,
    REPLAY,
    RESEND,
    SPOOLING,
    Kept,
    Rec,
    Sent,
)
from perfloop.producers._publisher_stats import PublisherStats
from perfloop.producers.spool import Position, Spool, SpoolError, SpoolLocked, SpoolRecord
from perfloop.settings import BaseServiceSettings

__all__ = ["Spooling"]

log = logging.getLogger("perfloop.producers")


class Spooling:
    """The background thread's spooling side of `Publisher`, which holds the state below; it
    calls the publisher's ``_warn``, `Delivery`'s ``_conf_for``, ``_produce``, ``_take_held``,
    ``_send_probes`` and ``_resend_tail``, and `StatsReporting`'s ``_snapshot``."""

    settings: BaseServiceSettings
    spool_dir: Path
    _spool_max: int
    _segment_bytes: int
    _lock: threading.Lock
    _cond: threading.Condition
    _inbox: deque[Rec]
    _closed: bool
    _mem_bytes: int
    _gen: int
    _producer: Producer
    _up: bool
    _lost: bool
    _down: bool
    _fatal: str
    _failed_delivery: str
    _mode: str
    _unacked: dict[int, Sent]
    _new_unacked: int
    _kept: deque[Kept]
    _kept_bytes: int
    _incarnation: int
    _probe_needed: bool
    _probes: set[int]
    _backoff: float
    _pause_until: float
    _spool: Spool | None
    _spool_broken: bool
    _replay_next: deque[Rec]
    _replay: dict[Position, bool]
    _acked_pos: set[Position]
    _topic_fail: dict[Position, int]
    _p: PublisherStats

    # -- recovery ------------------------------------------------------------------------------
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
        new = [s.rec for s in sent if s.kind == NEW]
        self._new_unacked = 0
        # Resends go back to the kept tail, still due; replays are still in the spool.
        back = [s.kept for s in sent if s.kind == RESEND and s.kept is not None]
        if back:
            self._kept = deque(sorted([*self._kept, *back], key=lambda k: k.at))
            self._kept_bytes = sum(len(k.rec.value) for k in self._kept)
        self._replay_next.clear()
        self._replay = {}
        if self._spool is not None:
            self._count_lost(self._spool.rewind())
        if self._kept:
            self._probe_needed = True
        if self._mode == NORMAL:
            self._mode = SPOOLING
            self._to_spool(new + self._take_held(), new=True)
        else:
            self._to_spool(new, new=True, front=True)

    def _count_lost(self, lost: tuple[int, int]) -> None:
        self._p.dropped += lost[0]
        self._p.dropped_samples += lost[1]

    # -- the spool -----------------------------------------------------------------------------
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
            self._mode = SPOOLING
            self._p.restored = sp.records

    def _to_spool(self, recs: list[Rec] | deque[Rec], *, new: bool, front: bool = False) -> None:
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
            self._mode = NORMAL
            return
        window = 256 if self._up else 1  # one message until the broker answers
        while len(self._replay) < window:
            if not self._replay_next:
                got = sp.read(min(32, window - len(self._replay)), 8 << 20)
                if not got:
                    break
                for item, pos in got:
                    r = Rec(0, item.topic, item.key, item.value)
                    r.samples, r.pos = item.samples, pos
                    self._replay_next.append(r)
            rec = self._replay_next[0]
            ok = self._produce(rec, REPLAY)
            if ok is None:
                return
            self._replay_next.popleft()
            if ok:
                assert rec.pos is not None
                self._replay[rec.pos] = False
        if not self._replay and not self._replay_next and sp.records == 0:
            self._mode = NORMAL
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

    # -- shutdown ------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Spool whatever is still in memory (a restart replays it) and release everything."""
        with self._lock:
            self._closed = True
            batch, self._inbox = list(self._inbox), deque()
        try:
            pending = [s.rec for _, s in sorted(self._unacked.items()) if s.kind == NEW]
            rest = pending + self._take_held() + batch
            front = self._mode == SPOOLING  # older than what is spooled already
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
