"""The stream worker's ingest on the real stack: each kind of bad input goes to the DLQ with its
reason and source, once (the stream worker leaves to the sink what both refuse alike), the
worker lives on and keeps windowing good input, and a live config change is applied and
recorded."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import orjson
import pytest
from confluent_kafka import Producer

from perfloop.kafka import consumer
from perfloop.schemas import BatchBuilder, ConfigChange, encode_batch, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.stack import status
from perfloop.warehouse import client

from .conftest import wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000


def _steps(job: str, t0: int, n: int = 40) -> BatchBuilder:
    b = BatchBuilder("step", job_id=job, node="n0", producer_id="it")
    for i in range(n):
        b.add(ts_ns=t0 + i * 100_000_000, rank=0, step=i, step_time_ms=100.0, num_workers=2)
    return b


def test_bad_input_is_dead_lettered_and_the_worker_lives_on(stack: StackSettings) -> None:
    job = f"it-ingest-{uuid.uuid4().hex[:8]}"
    key = job.encode()
    now = time.time_ns()
    good = _steps(job, now - 20 * NS).encode()
    doc = orjson.loads(  # JSON, to take apart: a producer in any language may send it
        encode_batch("step", _steps(job, now - 20 * NS).take(), job_id=job, node="n0", wire="json")
    )
    bad: dict[str, tuple[str, bytes]] = {
        "malformed": (Topics.STEP, b"\x00not json"),
        "future version": (Topics.STEP, orjson.dumps({**doc, "schema_version": 99})),
        "wrong kind": (Topics.GPU, good),
        "clock ahead": (Topics.STEP, _steps(job, now + 3600 * NS).encode()),
        "missing column": (
            Topics.STEP,
            orjson.dumps(
                {**doc, "columns": {k: v for k, v in doc["columns"].items() if k != "rank"}}
            ),
        ),
        "bad config": (
            Topics.CONTROL,
            encode_event(
                ConfigChange(
                    ts_ns=now,
                    job_id=job,
                    node="it",
                    rank=-1,
                    target="streams",
                    key="windows.no_such_setting",
                    value=1,
                )
            ),
        ),
    }
    before = status(stack)["services"]["streams"]
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    for topic, value in bad.values():
        p.produce(topic, key=key, value=value)
    p.produce(Topics.STEP, key=key, value=good)
    assert p.flush(10) == 0

    c = consumer(stack, f"it-ingest-dlq-{job}")
    c.subscribe([Topics.DLQ])
    reasons: list[tuple[str, str]] = []
    places: Counter[tuple[str, ...]] = Counter()
    deadline, settled = time.monotonic() + 40, None
    try:
        # the stream worker and the sink both read these topics: each bad message must still
        # be one dead letter, so after the last one came, wait a while for a second copy
        while time.monotonic() < (settled or deadline):
            msg = c.poll(0.5)
            if msg is None or msg.error() or msg.key() != key:
                continue
            h = {k: v.decode() for k, v in msg.headers() or []}
            reasons.append((h["perfloop.source.topic"], h["perfloop.reason"]))
            places[
                (
                    h["perfloop.source.topic"],
                    h["perfloop.source.partition"],
                    h["perfloop.source.offset"],
                )
            ] += 1
            if len(places) == len(bad) and settled is None:
                settled = time.monotonic() + 8
    finally:
        c.close()
    assert len(places) == len(bad), f"{len(places)} of {len(bad)} bad messages dead-lettered"
    assert set(places.values()) == {1}, f"dead letters per bad message: {places}"
    text = "\n".join(r for _, r in reasons)
    assert "not valid JSON" in text
    assert "schema_version 99" in text or "99" in text
    assert "does not belong on perfloop.telemetry.gpu" in text
    assert "ahead of this worker's clock" in text
    assert "'rank'" in text
    assert "windows.no_such_setting" in text and "refused" in text

    ch = client(stack)
    try:
        wait_for(
            lambda: (
                ch.query(
                    "SELECT count() FROM windows WHERE job_id = {j:String} AND window_s = 1 "
                    "AND metric = 'step_time_ms'",
                    parameters={"j": job},
                ).result_rows[0][0]
                >= 4
            ),
            30,
            "windows of the good batch",
        )
    finally:
        ch.close()
    after = status(stack)["services"]["streams"]
    assert after["pid"] == before["pid"] and after["restarts"] == before["restarts"]
