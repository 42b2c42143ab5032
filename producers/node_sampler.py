"""The node sampler service: GPU and host samplers on their own threads, feeding an `Emitter`.

`NodeSampler` is a plain service (``start()`` / ``stop()`` / ``run()``). It runs up to three
daemon threads: ``perfloop-gpu-sampler`` (a `GpuBackend`, NVML by default; opened on that thread
so ``start()`` returns at once), ``perfloop-host-sampler`` (`HostSampler`) and
``perfloop-sampler-control`` (overhead budget, self-metrics, and flushing the emitter when
asked to). What it publishes through the emitter:

- ``gpu`` samples, one row per device per round, ``rank`` = the sampler's rank; ``host``
  samples, one row per watched process (its rank) or one node-level row (rank -1);
- a `CapabilityReport` per component (``nvml``, ``host``) at start and whenever it changes
  (a GPU lost, a signal dropped). Without a GPU or driver the ``nvml`` report says
  ``available=False`` with the reason, the log says it once, and host sampling carries on;
- a `ProducerStats` every ``settings.stats_interval_s`` and at stop: its samples, its CPU time,
  ``overhead_pct`` (from its `OverheadMeter`) and ``rates_hz`` per signal.

Each GPU signal (`GPU_SIGNALS`) has its own interval, between ``settings.gpu_min_interval_ms``
and ``gpu_max_interval_ms`` (starting at ``settings.gpu_interval_ms``), set by an
`AdaptiveController` from the signal's variance and the overhead budget
(``settings.overhead_budget_pct``); fields not read in a round repeat their last value. Host
sampling runs every ``settings.host_interval_ms``, stretched (up to ``host_max_factor`` times)
only when over budget. With ``settings.adaptive_sampling`` off, every interval is fixed.

``configure(key, value)`` changes one of those settings live, from any thread (`SAMPLING_KEYS`:
``sampling.gpu_interval_ms``, ``sampling.host_interval_ms``, ``sampling.adaptive``,
``sampling.overhead_budget_pct``), with the effect a restart with that setting would have;
the sampler threads follow within half a second. ``perfloop sample`` applies the
`ConfigChange` events (target "producers") addressed to its job or to every job from
``perfloop.control`` this way (`perfloop.actuators.agent.ConfigListener`).

Constructing it inside a training process (``perfloop run``)::

    sampler = NodeSampler(settings, emitter, rank=rank, pids={os.getpid(): rank},
                          gpu_devices=[nvml_index], meter=meter)   # meter: shared with hooks
    sampler.start()
    ...
    sampler.stop()            # joins its threads, publishes final stats; never raises

``pids`` are the training processes to watch (a mapping pid → rank, or pids whose rank is read
from their environment); ``enable_gpu=False`` skips NVML (its report then says "disabled");
``gpu_devices`` restricts GPU sampling to those NVML indices (one rank, one GPU);
``flush=True`` makes the control thread flush the emitter every ``publish_interval_ms`` and
count that in the overhead (leave it off when the emitter has its own flusher).
``perfloop sample`` is `perfloop.cli.sample`.

This module is the public one: the service, its threads and what it publishes. Beside it, in
private modules: each signal's interval (`GPU_TOLERANCES`, `CONTROL_WINDOW_S`, the controller
built from the settings and a live setting applied to it) in ``_sampler_intervals``; making a
backend's rows schema-valid before the emitter sees them in ``_sampler_rows``. The host's
readings themselves are `perfloop.producers.host`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from perfloop.producers._priority import lower_this_thread
from perfloop.producers._sampler_intervals import (
    CONTROL_WINDOW_S,
    GPU_TOLERANCES,
    apply_setting,
    sampling_controller,
)
from perfloop.producers._sampler_rows import GPU_BOUNDS, HOST_BOUNDS, clean, columns
from perfloop.producers.adaptive import SAMPLING_KEYS, OverheadMeter, sampling_value
from perfloop.producers.gpu import GPU_SIGNALS, GpuBackend, GpuCapability, NvmlBackend
from perfloop.producers.host import HOST_SIGNALS, HostSampler
from perfloop.schemas.base import Event
from perfloop.schemas.job import CapabilityReport, ProducerStats
from perfloop.settings import ProducerSettings

__all__ = ["CONTROL_WINDOW_S", "GPU_TOLERANCES", "NodeSampler", "config_listener"]

log = logging.getLogger("perfloop.producers.node_sampler")


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]


class _Once:
    """Log a message once per key (a failing sampler must not flood the training job's log)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True


class NodeSampler:
    """GPU and host sampling for one job on one node, within an overhead budget.

    ``emitter`` is an `Emitter` (or anything with its ``add``, ``extend`` and ``event``).

    >>> from perfloop.settings import ProducerSettings
    >>> from perfloop.testing import FakeGpuBackend
    >>> class Collect:
    ...     def __init__(self): self.samples, self.events = [], []
    ...     def add(self, kind, **values): self.samples.append(kind)
    ...     def extend(self, kind, **columns): self.samples.append(kind)
    ...     def event(self, event): self.events.append(event); return True
    >>> out = Collect()
    >>> s = NodeSampler(ProducerSettings(host_interval_ms=50), out, job_id="j1", node="n0",
    ...                 gpu_backend=FakeGpuBackend(devices=2))
    >>> s.run(duration_s=0.3)
    >>> {"gpu", "host"} <= set(out.samples)
    True
    >>> sorted(e.component for e in out.events if e.KIND == "capability")
    ['fake', 'host']
    """

    def __init__(
        self,
        settings: ProducerSettings,
        emitter: Any,
        *,
        job_id: str | None = None,
        node: str | None = None,
        rank: int = -1,
        pids: Mapping[int, int] | Iterable[int] = (),
        enable_gpu: bool = True,
        gpu_devices: Sequence[int] | None = None,
        gpu_backend: GpuBackend | None = None,
        meter: OverheadMeter | None = None,
        flush: bool = False,
        producer_id: str | None = None,
        gpu_max_interval_ms: float | None = None,
        host_max_factor: float | None = None,
        stop_when_pids_exit: bool = False,
    ) -> None:
        self.settings = settings
        self.emitter = emitter
        self.job_id = job_id or emitter.job_id
        self.node = node or emitter.node
        self.rank = rank
        self.producer_id = producer_id or f"sampler-{self.node}-{rank}"
        self.enable_gpu = enable_gpu
        self.backend: GpuBackend = gpu_backend or NvmlBackend(gpu_devices)
        self.host = HostSampler(pids)
        self.meter = meter or OverheadMeter()
        self.flush = flush
        self.stop_when_pids_exit = stop_when_pids_exit
        self.gpu_samples = self.host_samples = 0
        self.capabilities: dict[str, CapabilityReport] = {}
        """The last capability report published per component."""
        if gpu_max_interval_ms is None:
            gpu_max_interval_ms = settings.gpu_max_interval_ms
        self._gpu_max_s = gpu_max_interval_ms / 1000.0
        self._host_max_factor = (
            settings.host_max_interval_factor if host_max_factor is None else host_max_factor
        )
        self.controller = sampling_controller(
            settings, {}, gpu_max_s=self._gpu_max_s, host_max_factor=self._host_max_factor
        )
        self._config_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = self._finished = self._in_run = False
        self._finish_lock = threading.Lock()
        self._once = _Once()
        self._gpu_generation = -1

    # -- configuration ---------------------------------------------------------------------

    def configure(self, key: str, value: Any) -> tuple[Any, Any]:
        """Change one sampling setting live (thread-safe); return ``(old, new)``.

        ``key`` is one of `SAMPLING_KEYS`; a bad key or value raises `ConfigError` and
        changes nothing. ``settings`` then reads the new value.
        """
        new = sampling_value(key, value)
        name = SAMPLING_KEYS[key]
        with self._config_lock:
            old = getattr(self.settings, name)
            self.settings = self.settings.model_copy(update={name: new})
            apply_setting(
                self.controller,
                name,
                new,
                gpu_max_s=self._gpu_max_s,
                host_max_factor=self._host_max_factor,
            )
        log.info("sampling setting %s: %r -> %r", key, old, new)
        return old, new

    # -- service ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sampler threads and return at once."""
        if self._started:
            return
        self._started = True
        self._publish_host_capability()
        targets: list[tuple[str, Callable[[], None]]] = [
            ("perfloop-host-sampler", self._host_loop),
            ("perfloop-sampler-control", self._control_loop),
        ]
        if self.enable_gpu:
            targets.insert(0, ("perfloop-gpu-sampler", self._gpu_loop))
        else:
            self._publish(
                self._capability(
                    component=self.backend.name,
                    available=False,
                    missing=["gpu"],
                    reason="GPU sampling disabled",
                )
            )
        for name, target in targets:
            t = threading.Thread(target=self._guard(name, target), name=name, daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        """Stop sampling; join the threads, publish final stats. Safe from a signal handler."""
        self._stop.set()
        if not self._in_run:
            self._finish()

    def run(self, duration_s: float | None = None) -> None:
        """Sample until `stop()`, for ``duration_s`` seconds, or (when asked) the pids exit."""
        self._in_run = True
        try:
            self.start()
            deadline = None if duration_s is None else time.monotonic() + duration_s
            while not self._stop.is_set():
                wait = 0.25
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = min(wait, left)
                self._stop.wait(wait)
        finally:
            self._stop.set()
            self._in_run = False
            self._finish()

    def _finish(self) -> None:
        with self._finish_lock:
            if self._finished or not self._started:
                return
            self._finished = True
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5.0)
        try:
            self.backend.close()
        except Exception as e:  # never raise out of stop()
            log.debug("closing the GPU backend failed: %s", e)
        self._publish_stats()
        if self.flush:
            self._flush()

    @property
    def samples(self) -> int:
        """GPU and host samples handed to the emitter so far."""
        return self.gpu_samples + self.host_samples

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _guard(self, name: str, target: Callable[[], None]) -> Callable[[], None]:
        nice = int(getattr(self.settings, "background_nice", 0) or 0)

        def run() -> None:
            lower_this_thread(nice)  # the training job's threads come first
            try:
                target()
            except Exception as e:  # a sampler bug must not reach the training job
                log.error("%s stopped: %s: %s", name, type(e).__name__, e)

        return run

    # -- publishing ------------------------------------------------------------------------

    def _publish(self, event: Event) -> None:
        try:
            self.emitter.event(event)
        except Exception as e:
            if self._once(f"event:{type(e).__name__}"):
                log.warning("cannot publish %s event: %s", event.KIND, e)
            return
        if isinstance(event, CapabilityReport):
            self.capabilities[event.component] = event

    def _capability(self, **fields: Any) -> CapabilityReport:
        """A capability report of this sampler's job, node and rank, stamped now."""
        return CapabilityReport(
            ts_ns=time.time_ns(), job_id=self.job_id, node=self.node, rank=self.rank, **fields
        )

    def _publish_gpu_capability(self, cap: GpuCapability) -> None:
        self._gpu_generation = cap.generation
        self._publish(
            self._capability(
                component=self.backend.name,
                available=cap.available,
                devices=cap.devices,
                signals=list(cap.signals),
                missing=list(cap.missing),
                reason=cap.reason[:2000],
                details={k: str(v)[:256] for k, v in cap.details.items()},
            )
        )

    def _publish_host_capability(self) -> None:
        missing = self.host.missing
        self._publish(
            self._capability(
                component="host",
                available=True,
                devices=0,
                signals=[s for s in HOST_SIGNALS if s not in missing],
                missing=list(missing),
                details={**missing, "pids": ",".join(map(str, self.host.pids))[:256]},
            )
        )

    def _publish_stats(self) -> None:
        stats = getattr(getattr(self.emitter, "publisher", None), "stats", None)
        rates = self.controller.rates_hz()
        if not self.enable_gpu or not self.backend.capability().available:
            rates = {k: v for k, v in rates.items() if not k.startswith("gpu.")}
        self._publish(
            ProducerStats(
                ts_ns=time.time_ns(),
                job_id=self.job_id,
                node=self.node,
                rank=self.rank,
                producer_id=self.producer_id,
                samples=self.samples,
                messages=int(getattr(self.emitter, "messages", 0)),
                published=int(getattr(stats, "delivered", 0)),
                dropped=int(getattr(stats, "dropped", 0)),
                failed=int(getattr(stats, "failed", 0)),
                cpu_time_ms=self.meter.total_s * 1000.0,
                overhead_pct=self.meter.overhead_pct(),
                rates_hz={k: round(v, 3) for k, v in rates.items()},
            )
        )

    def _flush(self) -> None:
        try:
            with self.meter.cpu():
                self.emitter.flush()
        except Exception as e:
            if self._once(f"flush:{type(e).__name__}"):
                log.warning("emitter flush failed: %s", e)

    # -- threads ---------------------------------------------------------------------------

    def _gpu_loop(self) -> None:
        try:
            cap = self.backend.open()
        except Exception as e:  # a backend that breaks its contract: degrade all the same
            cap = GpuCapability(available=False, missing=("gpu",), reason=_why(e))
        self._publish_gpu_capability(cap)
        if not cap.available:
            log.warning("GPU telemetry off: %s; host sampling continues", cap.reason)
            return
        try:
            self._gpu_rounds()
        except Exception as e:  # a sampler bug ends GPU telemetry, never the job
            reason = f"GPU sampler failed: {_why(e)}"
            self._publish_gpu_capability(
                GpuCapability(
                    available=False,
                    missing=("gpu",),
                    reason=reason,
                    generation=self._gpu_generation + 1,
                )
            )
            log.warning("GPU telemetry off: %s; host sampling continues", reason)

    def _gpu_rounds(self) -> None:
        for name, floor in self.backend.min_interval_s().items():
            if name in GPU_SIGNALS:
                self.controller.set_min_interval(f"gpu.{name}", floor)
        gpu_signals = [f"gpu.{s}" for s in GPU_SIGNALS]
        while not self._stop.is_set():
            now = time.monotonic()
            due = self.controller.due(now, gpu_signals)
            if due:
                with self.meter.cpu():
                    self._gpu_round(due, now)
                cap = self.backend.capability()
                if cap.generation != self._gpu_generation:
                    self._publish_gpu_capability(cap)
                    if not cap.available:
                        log.warning("GPU telemetry off: %s; host sampling continues", cap.reason)
                        return
            wait = self.controller.next_due_in(time.monotonic(), gpu_signals)
            self._stop.wait(min(max(wait, 0.0005), 0.5))

    def _gpu_round(self, due: Sequence[str], now: float) -> None:
        signals = {s[4:] for s in due}
        pids: set[int] = set()
        if self.host.pids:
            pids = set(self.host.pids) | self.host.children
        rows = self.backend.sample(signals, pids)
        if rows:
            n = len(rows)
            self.emitter.extend(
                "gpu",
                ts_ns=[time.time_ns()] * n,
                rank=[self.rank] * n,
                device=[int(r["device"]) for r in rows],
                **columns(rows, GPU_BOUNDS),
            )
            self.gpu_samples += n
        for s in due:
            fields = GPU_SIGNALS[s[4:]]
            if rows:
                self.controller.observe(
                    s, [float(r.get(f, 0.0)) for r in rows for f in fields], now
                )
            else:
                self.controller.skip(s, now)

    def _host_loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            if self.controller.due(now, ("host",)):
                try:
                    with self.meter.cpu():
                        rows = self.host.sample()
                        ts = time.time_ns()
                        for row in rows:
                            self.emitter.add(
                                "host",
                                ts_ns=ts,
                                rank=int(row["rank"]),
                                **clean(row, HOST_BOUNDS),
                            )
                    self.host_samples += len(rows)
                except Exception as e:  # skip this round; say it once per kind of failure
                    if self._once(f"host:{type(e).__name__}"):
                        log.warning("host sampling failed (%s); it keeps trying", _why(e))
                self.controller.observe("host", (), now)
                if self.stop_when_pids_exit and not self.host.alive:
                    log.info("every watched process has exited; sampling stops")
                    self._stop.set()
                    return
            wait = self.controller.next_due_in(time.monotonic(), ("host",))
            self._stop.wait(min(max(wait, 0.001), 0.5))

    def _control_loop(self) -> None:
        tick = min(0.25, self.settings.publish_interval_ms / 1000.0)
        next_flush = next_stats = time.monotonic()
        next_stats += self.settings.stats_interval_s
        while not self._stop.wait(tick):
            now = time.monotonic()
            if self.flush and now >= next_flush:
                self._flush()
                next_flush = now + self.settings.publish_interval_ms / 1000.0
            self.controller.update_budget(self.meter.overhead_pct(CONTROL_WINDOW_S), now)
            if self.controller.saturated and self._once("saturated"):
                log.warning(
                    "sampler overhead %.2f%% is over the %.2f%% budget at the slowest intervals",
                    self.meter.overhead_pct(),
                    self.settings.overhead_budget_pct,
                )
            if now >= next_stats:
                self._publish_stats()
                next_stats = now + self.settings.stats_interval_s


def config_listener(settings: ProducerSettings, job_id: str, sampler: NodeSampler) -> Any:
    """A started `ConfigListener` applying live sampling changes for ``job_id`` from
    ``perfloop.control`` to ``sampler``; ``stop()`` it after the sampler. None (and one
    warning) if it cannot be made: sampling goes on with its settings as they are."""
    try:
        from perfloop.actuators.agent import ConfigListener

        listener = ConfigListener(settings, job_id=job_id, on_config=sampler.configure)
        listener.start()
    except Exception as e:  # live control is an extra: never stop sampling for it
        log.warning("live sampling changes are off: %s", _why(e))
        return None
    return listener
