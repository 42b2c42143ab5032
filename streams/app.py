"""The Faust stream app: step batches → 10 s windows per job and rank → the data-wait rule.

Processing is at-least-once: Faust commits an offset after the agent has handled the event,
and everything the agent emits is idempotent downstream (windows and recommendations carry
deterministic keys; the sink deduplicates by insert token). Window state lives in memory.
Bad input never stops the agent: it goes to ``perfloop.dlq`` with the reason and the source
in its headers.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import faust
import orjson

from perfloop.catalog import Topics
from perfloop.kafka import dlq_headers
from perfloop.schemas import SchemaError, decode_batch, encode_event
from perfloop.settings import StreamsSettings
from perfloop.streams.rules import DataWaitRule
from perfloop.streams.windows import NS, TumblingWindows, WindowRow

__all__ = ["StreamsService", "WindowEngine", "create_app"]

log = logging.getLogger("perfloop.streams")

# About 300 bytes a row: a message stays far below the 1 MiB default request size.
WINDOW_ROWS_PER_MESSAGE = 1000


class WindowEngine:
    """The app's pure core: step batches in, closed windows and recommendations out.

    Kept free of Faust so that it can be tested, benchmarked and hosted elsewhere.
    """

    METRICS = ("step_time_ms", "data_wait_share")

    def __init__(self, settings: StreamsSettings) -> None:
        self.windows = TumblingWindows(
            window_s=settings.window_s, lateness_s=settings.allowed_lateness_s
        )
        self.rule = DataWaitRule(
            threshold=settings.data_wait_share_threshold,
            cooldown_s=settings.recommendation_cooldown_s,
            max_workers=max(2, 2 * (os.cpu_count() or 2)),
        )
        self.max_skew_ns = int(settings.max_skew_s * NS)
        self.samples = 0

    def add_step_batch(self, data: bytes) -> None:
        """Decode one step batch and add it to the windows; raise `SchemaError` if bad."""
        batch = decode_batch(data)
        if batch.kind != "step":
            raise SchemaError(f"expected a step batch on {Topics.STEP}, got {batch.kind!r}")
        cols = batch.columns
        ts = cols["ts_ns"]
        skew = ts.max() - time.time_ns()
        if skew > self.max_skew_ns:
            raise SchemaError(
                f"step batch event time is {skew / NS:.0f} s in the future "
                f"(limit {self.max_skew_ns / NS:.0f} s); check the producer's clock"
            )
        share = cols["data_wait_ms"] / cols["step_time_ms"]
        ranks = cols["rank"]
        wall = time.time_ns()
        for rank in set(ranks.tolist()):
            sel = ranks == rank
            for metric, values in (
                ("step_time_ms", cols["step_time_ms"]),
                ("data_wait_share", share),
            ):
                self.windows.add(
                    batch.job_id, batch.node, rank, metric, ts[sel], values[sel], wall_ns=wall
                )
        self.rule.observe_workers(batch.job_id, int(cols["num_workers"][-1]))
        self.samples += len(batch)

    def tick(self) -> tuple[list[WindowRow], list[Any]]:
        """Close due windows; a series with no new events advances with the wall clock."""
        rows = self.windows.advance(wall_ns=time.time_ns())
        return rows, self.rule.evaluate(rows)


def create_app(settings: StreamsSettings) -> faust.App:
    """Build the Faust app and its agents for the given settings."""
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        broker_session_timeout=settings.broker_session_timeout_s,
        broker_heartbeat_interval=1.0,
        topic_partitions=settings.topic_partitions,
        topic_allow_declare=True,
        web_enabled=False,
        store="memory://",
        processing_guarantee="at_least_once",
        datadir=str(settings.home_dir / "streams"),
    )
    steps = app.topic(Topics.STEP, value_serializer="raw", key_serializer="raw")
    windows_out = app.topic(Topics.WINDOWS, value_serializer="raw", key_serializer="raw")
    recs_out = app.topic(Topics.RECOMMENDATIONS, value_serializer="raw", key_serializer="raw")
    dlq = app.topic(Topics.DLQ, value_serializer="raw", key_serializer="raw")
    engine = WindowEngine(settings)

    async def emit(rows: list[WindowRow], recs: list[Any]) -> None:
        by_job: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_job.setdefault(r.job_id, []).append(r.as_dict())
        for job_id, job_rows in by_job.items():
            # A backlog can close thousands of windows at once: keep each message small.
            for i in range(0, len(job_rows), WINDOW_ROWS_PER_MESSAGE):
                chunk = job_rows[i : i + WINDOW_ROWS_PER_MESSAGE]
                await windows_out.send(
                    key=job_id.encode(), value=orjson.dumps({"kind": "windows", "rows": chunk})
                )
        for rec in recs:
            log.info(
                "recommendation for %s: %s %s -> %s",
                rec.job_id,
                rec.knob,
                rec.from_value,
                rec.to_value,
            )
            await recs_out.send(key=rec.job_id.encode(), value=encode_event(rec))

    @app.agent(steps)
    async def step_windows(stream: Any) -> None:
        async for events in stream.take_events(2000, within=0.2):
            for event in events:
                msg = event.message
                try:
                    engine.add_step_batch(event.value)
                except SchemaError as e:
                    log.warning(
                        "rejected step batch %s[%s]@%s: %s", msg.topic, msg.partition, msg.offset, e
                    )
                    await dlq.send(
                        key=msg.key,
                        value=event.value if isinstance(event.value, bytes) else b"",
                        headers=dlq_headers(str(e), msg.topic, msg.partition, msg.offset),
                    )
            await emit(*engine.tick())

    @app.timer(1.0)
    async def close_windows() -> None:
        await emit(*engine.tick())

    app.perfloop_engine = engine  # type: ignore[attr-defined]
    return app


class StreamsService:
    """Runs the stream app as a Faust worker; SIGTERM stops it."""

    def __init__(self, settings: StreamsSettings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self._worker: faust.Worker | None = None

    def start(self) -> None:
        self._worker = faust.Worker(self.app, loglevel="INFO", quiet=True)

    def run(self) -> None:
        self.start()
        assert self._worker is not None
        self._worker.execute_from_commandline()

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.stop_and_shutdown()
