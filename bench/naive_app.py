"""The naive baseline: one message per sample, a plain per-event Faust agent.

Each message is one step sample as a JSON object (orjson); the agent decodes it and does one
dict update, nothing else. It reports progress in a small JSON status file (path from
``PERFLOOP_BENCH_NAIVE_STATUS``) so that the bench can time it from outside the worker::

    python -m bench.naive_app worker -l warning

The broker comes from the usual settings (``PERFLOOP_KAFKA_PORT`` or
``PERFLOOP_KAFKA_BOOTSTRAP``); this module is an entry point, so it reads them here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import faust
import orjson

from perfloop.settings import BaseServiceSettings

TOPIC = "perfloop.bench.naive"
STATUS_EVERY = 1000

_settings = BaseServiceSettings()
_status = Path(os.environ.get("PERFLOOP_BENCH_NAIVE_STATUS", "naive-status.json"))

app = faust.App(
    "perfloop-bench-naive",
    broker=f"kafka://{_settings.kafka_bootstrap}",
    broker_session_timeout=6.0,
    broker_heartbeat_interval=1.0,
    topic_partitions=_settings.topic_partitions,
    topic_allow_declare=True,
    web_enabled=False,
    store="memory://",
    processing_guarantee="at_least_once",
    datadir=str(_settings.home_dir / "bench-naive"),
)
samples = app.topic(TOPIC, value_serializer="raw", key_serializer="raw")

latest: dict[tuple[str, int], float] = {}
progress: dict[str, Any] = {"count": 0, "first_wall_ns": None, "last_wall_ns": None}


def _write_status() -> None:
    tmp = _status.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(progress))
    tmp.replace(_status)


@app.agent(samples)
async def per_event(stream: Any) -> None:
    async for value in stream:
        doc = orjson.loads(value)
        latest[(doc["job_id"], doc["rank"])] = doc["step_time_ms"]
        now = time.time_ns()
        if progress["first_wall_ns"] is None:
            progress["first_wall_ns"] = now
        progress["last_wall_ns"] = now
        progress["count"] += 1
        if progress["count"] % STATUS_EVERY == 0:
            _write_status()


@app.timer(0.25)
async def report() -> None:
    _write_status()


if __name__ == "__main__":
    app.main()
