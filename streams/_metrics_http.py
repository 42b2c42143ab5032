"""The stream worker's ``/metrics``: its `StreamMetrics` served over HTTP by ``prometheus_client``.

`MetricsEndpoint` is fed on the worker's event loop (each message's send time and the
actuations it reads, each tick's outputs) and serves on ``metrics_host:metrics_port`` from
``prometheus_client``'s server threads. The state is only ever touched on the loop: a scrape
asks for a snapshot and the next tick takes it (at most `SCRAPE_WAIT_S` later; a loop blocked
longer answers with the last snapshot), so nothing is computed for series nobody scrapes, and
a tick pays only for taking in what it produced. A port that cannot be bound, or an update that
fails, is one line in the log: the worker runs on without metrics. Private to the stream tier
(`perfloop.streams.app` uses it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from perfloop.schemas import decode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings
from perfloop.streams.engine import TELEMETRY_TOPICS, Outputs, StreamEngine
from perfloop.streams.metrics import Family, StreamMetrics, prometheus_families, recent_window
from perfloop.streams.windows import parse_specs

__all__ = ["FRESH_S", "SCRAPE_WAIT_S", "MetricsEndpoint"]

log = logging.getLogger("perfloop.streams.metrics")

NS = 1_000_000_000
SCRAPE_WAIT_S = 2.0
"""How long a scrape waits for the event loop to take a fresh snapshot."""
FRESH_S = 1.0
"""A snapshot this recent answers a scrape at once (several Prometheus servers)."""


class MetricsEndpoint:
    """A stream worker's metrics and the HTTP server that serves them (see the module)."""

    def __init__(
        self,
        settings: StreamsSettings,
        engine: StreamEngine,
        app: Any = None,
        output: Any = None,
    ) -> None:
        self.settings = settings
        self.metrics = StreamMetrics(
            max_series=settings.metrics_max_series,
            grace_s=settings.metrics_grace_s,
            window_s=recent_window(parse_specs(settings.windows)),
            pending_ttl_s=settings.approval_ttl_s,
        )
        self._engine, self._app, self._output = engine, app, output
        self._cond = threading.Condition()
        self._asked = False
        self._families: list[Family] = []
        self._taken = -1e18  # time.monotonic() of the latest snapshot
        self._delay_s = 0.0
        self._failed: set[str] = set()
        self._server: Any = None
        self.url: str | None = None
        """Where it serves once started (None: it does not)."""

    # -- the HTTP side -----------------------------------------------------------------------
    def start(self) -> bool:
        """Serve on ``metrics_host:metrics_port``; False (one line in the log) if it is off
        (port 0) or the port cannot be bound."""
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        s = self.settings
        if s.metrics_port == 0:
            log.info("no metrics endpoint (PERFLOOP_METRICS_PORT=0)")
            return False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        ProcessCollector(registry=registry)
        try:
            self._server, _ = start_http_server(
                s.metrics_port, addr=s.metrics_host, registry=registry
            )
        except OSError as e:
            log.warning(
                "no metrics endpoint: cannot serve on %s:%d (%s); set PERFLOOP_METRICS_PORT "
                "(0: none) or PERFLOOP_METRICS_HOST",
                s.metrics_host, s.metrics_port, e.strerror or e,
            )  # fmt: skip
            return False
        host = f"[{s.metrics_host}]" if ":" in s.metrics_host else s.metrics_host
        self.url = f"http://{host}:{s.metrics_port}/metrics"
        log.info("metrics on %s", self.url)
        return True

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def collect(self) -> Any:
        """The families of a fresh snapshot (a ``prometheus_client`` collector; called from
        the server's threads)."""
        with self._cond:
            if time.monotonic() - self._taken > FRESH_S:
                asked = time.monotonic()
                self._asked = True
                self._cond.wait_for(lambda: self._taken >= asked, timeout=SCRAPE_WAIT_S)
            families = self._families
        return prometheus_families(families)

    # -- the event loop's side ---------------------------------------------------------------
    def message(self, topic: str, value: bytes, now_ns: int, sent_ns: int) -> None:
        """One message the engine took: its delay, and what an actuation says."""
        if sent_ns > 0:
            self._delay_s = max(0.0, (now_ns - sent_ns) / NS)
        if topic != Topics.ACTUATIONS:
            return
        try:  # (a few a minute: decoded again rather than asked of the engine)
            self.metrics.observe_event(decode_event(value), now_ns)
        except Exception as e:
            self._fail(e)

    def tick(self, out: Outputs, now_ns: int) -> None:
        """Take what a tick produced; take a snapshot if a scrape asked for one."""
        try:
            self.metrics.observe(out, now_ns)
            if self._asked:
                self._snapshot(now_ns)
        except Exception as e:
            self._fail(e)

    def _snapshot(self, now_ns: int) -> None:
        eng = self._engine
        self.metrics.worker(
            samples=eng.stats["samples"],
            messages=eng.stats["messages"],
            late_samples=eng.late_samples,
            dead_letters=dict(eng.rejected),
            lag_messages=self._lag(),
            ingest_delay_s=self._delay_s,
            publish_failures=getattr(self._output, "failed", 0),
        )
        families = self.metrics.snapshot(now_ns, recent=eng.recent)
        with self._cond:
            self._families, self._taken, self._asked = families, time.monotonic(), False
            self._cond.notify_all()

    def _lag(self) -> int:
        """Messages between the worker's position and each telemetry partition's end."""
        if self._app is None:
            return 0
        try:
            assigned = list(self._app.consumer.assignment())
        except Exception:  # no consumer yet
            return 0
        total = 0
        for tp in assigned:
            if tp.topic not in TELEMETRY_TOPICS:
                continue
            try:
                end = self._app.consumer.highwater(tp)
            except Exception:  # not assigned any more
                continue
            pos = self._engine.position(tp.topic, tp.partition)
            if end is not None and end >= 0 and pos is not None:
                total += max(0, int(end) - pos)
        return total

    def _fail(self, e: Exception) -> None:
        kind = type(e).__name__
        if kind not in self._failed:  # once per kind: a tick is no place for a line each time
            self._failed.add(kind)
            log.warning("metrics update failed (%s: %s); the worker goes on", kind, e)
