"""Publisher wiring: one process's telemetry from publisher to `Recorder`, and its self-metrics.

A `Pipeline` makes (or takes) the publisher, puts an `Emitter` and a `Recorder` on it, and runs
one worker thread that publishes the recorder's rows off the training thread, flushes the
emitter and publishes `ProducerStats` (its own overhead, from an `OverheadMeter`). It also
publishes the job-level events (`JobLifecycle`, `JobInfo`). The explicit API
(`perfloop.producers.training.Monitor`) and the hooks (`perfloop.producers.hooks`) each run one.
The owner also tells the callbacks what only it knows: the boundary between two steps
(`Pipeline.step_boundary`, where the job agent acts) and that training ends (`Pipeline.ending`,
which `Pipeline.close` calls first if the owner has not). `close_publisher` flushes a
publisher for a bounded time and closes it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from perfloop.producers._training_callbacks import Callback, CallbackSet, StepRecord
from perfloop.producers._training_spans import ErrorCounter, Recorder
from perfloop.schemas import JobInfo, JobLifecycle, ProducerStats

__all__ = ["Pipeline", "close_publisher"]


class _Memory:
    """Reads memory cheaply: RSS from /proc/self/statm, CUDA allocator figures if CUDA is up."""

    def __init__(self) -> None:
        self._pid = 0
        self._fd = -1
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rss(self) -> int:
        pid = os.getpid()
        if pid != self._pid:  # a forked child must not read its parent's statm
            self._pid = pid
            try:
                self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            except OSError:
                self._fd = -1
        if self._fd >= 0:
            try:
                return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                return 0
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:
            return 0

    def read(self) -> dict[str, int]:
        out = {"rss_bytes": self.rss()}
        torch = sys.modules.get("torch")
        if torch is not None:
            cuda = torch.cuda
            if cuda.is_initialized():
                dev = cuda.current_device()
                out["mem_allocated_bytes"] = int(cuda.memory_allocated(dev))
                out["mem_reserved_bytes"] = int(cuda.memory_reserved(dev))
                out["mem_peak_bytes"] = int(cuda.max_memory_allocated(dev))
        return out


class Pipeline:
    """One process's telemetry: publisher → emitter → `Recorder`, lifecycle and self-metrics.

    Either pass a ``publisher`` (anything with ``publish(topic, key, value) -> bool``; its
    owner flushes and closes it) or ``settings`` (a `ProducerSettings`; a `Publisher` is made
    from it, flushed and closed by `close`).
    """

    def __init__(
        self,
        *,
        job_id: str,
        node: str,
        rank: int,
        settings: Any = None,
        publisher: Any = None,
        producer_id: str | None = None,
        contiguous: bool = True,
        callbacks: Callback | None = None,
        flush_interval_s: float | None = None,
        stats_interval_s: float | None = None,
    ) -> None:
        from perfloop.producers.emitter import Emitter

        self.errors = ErrorCounter()
        self_id = (producer_id or f"torch-{node}-{os.getpid()}")[:128]
        self.owns_publisher = publisher is None
        if publisher is None:
            if settings is None:
                from perfloop.settings import ProducerSettings

                settings = ProducerSettings()  # the explicit API's script is the entry point
            from perfloop.producers.publisher import Publisher

            publisher = Publisher(settings, producer_id=self_id)
        self.settings = settings
        self.publisher = publisher
        self.job_id, self.node = job_id, node
        self.producer_id = self_id
        if flush_interval_s is None:
            flush_interval_s = settings.publish_interval_ms / 1000 if settings is not None else None
        if stats_interval_s is None and settings is not None:
            stats_interval_s = settings.stats_interval_s
        # no flusher thread of the emitter's own: the worker below flushes it right after it
        # drained the recorder (one wake-up, one GIL hand-over per interval, and rows leave
        # as soon as they are handed over)
        self.flush_interval_s = flush_interval_s
        self.emitter = Emitter(publisher, job_id=job_id, node=node, producer_id=self.producer_id)
        if not isinstance(callbacks, CallbackSet):
            callbacks = CallbackSet([callbacks] if callbacks is not None else [])
        self.callbacks = callbacks
        self.overhead_ns = 0  # time spent in perfloop's own code on the training thread
        self.meter = _overhead_meter()
        # overhead ns (the hooks', and the publisher's CPU, which may predate us) and step
        # ms already given to the meter
        self._charged = (self._publisher_cpu_s(self._publisher_stats()) * 1e9, 0.0)
        self.recorder = Recorder(
            self.emitter,
            rank=rank,
            contiguous=contiguous,
            callbacks=self.callbacks,
            memory=_Memory().read,
            errors=self.errors,
        )
        self.t0_ns = time.perf_counter_ns()
        self._last_stats = (self.t0_ns, 0)
        self._closed = False
        self._ending = False
        self._stop = threading.Event()
        self.tick: Callable[[], None] | None = None
        """Called on the worker thread every drain interval (the hooks' progress reports)."""
        # one worker: publishes the recorder's rows off the training thread, and stats
        self.recorder.background = True
        self._thread = threading.Thread(
            target=self._work,
            args=(stats_interval_s or 0.0,),
            name="perfloop-pipeline",
            daemon=True,
        )
        self._thread.start()

    @property
    def rank(self) -> int:
        return self.recorder.rank

    def event(self, kind: type[Any], **fields: Any) -> bool:
        """Publish one job-level event now; count a failure instead of raising."""
        try:
            ev = kind(
                ts_ns=time.time_ns(),
                job_id=self.job_id,
                node=self.node,
                rank=fields.pop("rank", self.recorder.rank),
                **fields,
            )
            return bool(self.emitter.event(ev))
        except Exception as e:
            self.errors(f"publishing {getattr(kind, 'KIND', kind)}", e)
            return False

    def lifecycle(self, state: str, exit_code: int | None = None, message: str = "") -> None:
        self.event(JobLifecycle, state=state, exit_code=exit_code, message=message[:2000])

    def job_info(self, fields: dict[str, Any]) -> None:
        known = JobInfo.model_fields
        self.event(JobInfo, **{k: v for k, v in fields.items() if k in known})

    def step_boundary(self, record: StepRecord) -> None:
        """Between step ``record.step`` and the next (the owner calls it on the training thread
        once the step is recorded): the callbacks' ``on_step_boundary``; a failure is counted."""
        callbacks = self.callbacks
        if "on_step_boundary" in callbacks.wanted:
            try:
                callbacks.on_step_boundary(record)
            except Exception as e:
                self.errors("a callback (on_step_boundary)", e)

    def ending(self, state: str) -> None:
        """Training ends as ``state`` (the owner calls it once before `close`; later calls do
        nothing): the callbacks' ``on_close``; a failure is counted."""
        if self._ending:
            return
        self._ending = True
        try:
            self.callbacks.on_close(state)
        except Exception as e:
            self.errors("a callback (on_close)", e)

    def _feed_meter(self) -> None:
        """Give the `OverheadMeter` the hooks' time and the steps' time since last time."""
        meter = self.meter
        if meter is None:
            return
        # the training thread's time in hooks, plus the publisher thread's CPU time
        o = self.overhead_ns + self._publisher_cpu_s(self._publisher_stats()) * 1e9
        ms = self.recorder.step_ms_total
        o0, ms0 = self._charged
        self._charged = (o, ms)
        meter.charge((o - o0) / 1e9)
        meter.record_step((ms - ms0) / 1e3)

    def stats(self) -> None:
        """Publish `ProducerStats`: counts so far and the overhead over the last interval."""
        now = time.perf_counter_ns()
        last_t, last_o = self._last_stats
        self._last_stats = (now, self.overhead_ns)
        wall = max(now - last_t, 1)
        ps = self._publisher_stats()
        em = self.emitter

        def n(name: str) -> int:
            return max(int(getattr(ps, name, 0) or 0), 0)

        self.event(
            ProducerStats,
            producer_id=self.producer_id,
            samples=em.samples,
            messages=em.messages,
            published=n("published"),
            spooled=n("spooled"),
            replayed=n("replayed"),
            dropped=n("dropped"),
            dropped_samples=n("dropped_samples"),
            failed=n("failed") + self.errors.count,
            in_flight=n("in_flight"),
            spool_bytes=n("spool_bytes"),
            cpu_time_ms=self.overhead_ns / 1e6 + self._publisher_cpu_s(ps) * 1e3,
            overhead_pct=self.overhead_pct(last_o, wall),
        )

    def _publisher_stats(self) -> Any:
        try:
            return getattr(self.publisher, "stats", None)
        except Exception:
            return None

    @staticmethod
    def _publisher_cpu_s(ps: Any) -> float:
        v = getattr(ps, "cpu_time_s", 0.0) if ps is not None else 0.0
        return float(v) if isinstance(v, (int, float)) and v >= 0 else 0.0

    def overhead_pct(self, since_ns: int = 0, wall_ns: int = 0) -> float:
        """The training thread's time in perfloop code as a share of step time (the
        `OverheadMeter`'s window) or, without a meter, of wall time since ``since_ns``."""
        if self.meter is not None:
            with contextlib.suppress(Exception):
                self._feed_meter()
                return max(float(self.meter.overhead_pct()), 0.0)
        wall = wall_ns or max(time.perf_counter_ns() - self.t0_ns, 1)
        return 100.0 * max(self.overhead_ns - since_ns, 0) / wall

    def _work(self, stats_interval_s: float, drain_interval_s: float = 0.25) -> None:
        flush_s = self.flush_interval_s
        wait_s = min(drain_interval_s, flush_s) if flush_s else drain_interval_s
        next_stats = time.monotonic() + stats_interval_s
        next_flush = time.monotonic() + (flush_s or 0.0)
        while not self._stop.wait(wait_s):
            self.recorder.drain()
            tick = self.tick
            if tick is not None:
                try:
                    tick()
                except Exception as e:
                    self.errors("the pipeline's periodic check", e)
            if flush_s and time.monotonic() >= next_flush - wait_s / 2:
                next_flush = max(next_flush + flush_s, time.monotonic())
                try:
                    self.emitter.flush()
                except Exception as e:  # the batch taken is lost (counted); the next goes on
                    self.errors("publishing a telemetry batch", e)
            if stats_interval_s and time.monotonic() >= next_stats:
                next_stats = time.monotonic() + stats_interval_s
                self.stats()

    def close(
        self,
        state: str = "finished",
        exit_code: int | None = None,
        message: str = "",
        timeout_s: float = 3.0,
    ) -> None:
        """Tell the callbacks training ends (`ending`, if the owner has not), record what is
        pending, publish the final lifecycle and stats, flush (bounded)."""
        self.ending(state)
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.recorder.close()
            self.emitter.flush()
            self.lifecycle(state, exit_code, message)
            self.stats()
            self.emitter.close()
            if self.owns_publisher:  # else whoever made it flushes and closes it
                close_publisher(self.publisher, timeout_s)
        except Exception as e:
            self.errors("closing the publisher", e)
        with contextlib.suppress(Exception):
            self.callbacks.on_train_end(state)


def close_publisher(publisher: Any, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for delivery, then close (a spooling publisher keeps the
    rest on disk); return the messages not delivered yet."""
    left = 0
    flush = getattr(publisher, "flush", None)
    if callable(flush):
        left = int(flush(timeout_s) or 0)
    close = getattr(publisher, "close", None)
    if callable(close):
        try:
            close(timeout_s=0)
        except TypeError:
            close()
    return left


def _overhead_meter() -> Any:
    try:
        from perfloop.producers.adaptive import OverheadMeter
    except ImportError:  # pragma: no cover - shipped with the observation tier
        return None
    return OverheadMeter()
