"""The self-metrics of `perfloop.producers.publisher.Publisher` (private to it; the public
names are re-exported there): the `PublisherStats` snapshot and its accounting identity, and
the mixin that keeps the counts, takes snapshots of them, and turns them into `ProducerStats`
events, on request or every ``stats_interval_s`` from the background thread."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from perfloop.schemas import ProducerStats, encode_event
from perfloop.schemas.topics import KIND_TOPICS

if TYPE_CHECKING:
    from perfloop.producers._publisher_messages import Rec
    from perfloop.producers.spool import Spool

__all__ = ["PublisherStats", "StatsReporting"]


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


class StatsReporting:
    """Self-metrics of `Publisher`, which holds the state below; ``_emit_stats`` calls the
    publisher's ``publish`` and ``_warn``."""

    producer_id: str
    _stats_every_s: float
    _lock: threading.Lock
    _st: PublisherStats  # publish()'s own counts: accepted, failed, dropped
    _snap: PublisherStats  # the background thread's counts at its last step
    _p: PublisherStats  # the background thread's counts (its own, no lock)
    _inbox: deque[Rec]
    _taken: int
    _mem_bytes: int
    _publish_ns: int
    _cpu: float
    _outstanding: int
    _held: deque[Rec]
    _new_unacked: int
    _spool: Spool | None
    _stats_job: dict[str, Any] | None
    _stats_at: float
    _last_event: tuple[float, float, PublisherStats] | None

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

    # -- self-metrics as an event --------------------------------------------------------------
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

    # -- the background thread's counts --------------------------------------------------------
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
