"""The stream worker's consumer takes its fetch wait from the settings (Faust fixes it at
1.5 s) and paces its fetches, checked on a real aiokafka consumer against the embedded
broker."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from perfloop.kafka import ensure_topics
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.streams.app import pace_fetches, set_fetch_wait

pytestmark = pytest.mark.integration


def test_the_fetch_wait_reaches_the_fetch_requests(stack: StackSettings) -> None:
    async def run() -> tuple[bool, bool, list[int]]:
        c = AIOKafkaConsumer(bootstrap_servers=stack.kafka_bootstrap, enable_auto_commit=False)
        app: Any = SimpleNamespace(consumer=SimpleNamespace(_thread=SimpleNamespace(
            _ensure_consumer=lambda: c)))  # fmt: skip
        before_start = set_fetch_wait(app, 250)
        await c.start()
        try:
            waits: list[int] = []
            fetcher = c._fetcher
            send = fetcher._proc_fetch_request

            async def spy(assignment: Any, node_id: int, request: Any) -> Any:
                waits.append(request._max_wait_ms)
                return await send(assignment, node_id, request)

            fetcher._proc_fetch_request = spy
            applied = set_fetch_wait(app, 250)
            tp = TopicPartition(Topics.CONTROL, 0)
            c.assign([tp])
            await c.seek_to_end(tp)
            await c.getmany(timeout_ms=1500)
            return before_start, applied, waits
        finally:
            await c.stop()

    before_start, applied, waits = asyncio.run(run())
    assert not before_start, "no fetcher before the consumer starts: nothing to set"
    assert applied
    assert waits and set(waits) == {250}


@pytest.mark.parametrize("interval_ms", [0, 300])
def test_fetches_are_paced_and_every_record_still_arrives(
    stack: StackSettings, interval_ms: int
) -> None:
    """A message arrives every ~20 ms and fetches wait at most 100 ms: unpaced, the consumer
    fetches about every 100 ms or sooner (each fetch that finds new records costs the
    embedded broker a listing of the partition); paced, at most one fetch per interval,
    each bringing several messages."""
    topic = f"perfloop.test.pace-{interval_ms}"
    ensure_topics(stack, [topic])

    async def run() -> tuple[int, int, int]:
        c = AIOKafkaConsumer(
            bootstrap_servers=stack.kafka_bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100
        )
        p = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, linger_ms=0)
        app: Any = SimpleNamespace(consumer=SimpleNamespace(_thread=SimpleNamespace(
            _ensure_consumer=lambda: c)))  # fmt: skip
        await c.start()
        await p.start()
        try:
            pace = pace_fetches(app, interval_ms)
            assert pace is not None and pace_fetches(app, interval_ms) is pace  # wrapped once
            tp = TopicPartition(topic, 0)
            c.assign([tp])
            await c.seek_to_end(tp)
            await c.getmany(timeout_ms=300)
            before, sent, got = pace["fetches"], 0, 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0:
                await p.send_and_wait(topic, b"x", partition=0)
                sent += 1
                got += sum(len(v) for v in (await c.getmany(timeout_ms=20)).values())
            while got < sent and time.monotonic() - t0 < 10.0:
                got += sum(len(v) for v in (await c.getmany(timeout_ms=200)).values())
            return pace["fetches"] - before, sent, got
        finally:
            await p.stop()
            await c.stop()

    fetches, sent, got = asyncio.run(run())
    assert got == sent > 40
    if interval_ms:
        assert fetches <= 2.0 / 0.3 + 3  # the 2 s of sending, and the drain after it
    else:
        assert fetches > 12


def test_the_pacing_tells_when_a_partition_end_was_last_fetched(stack: StackSettings) -> None:
    """`answered` holds, per partition, when the latest fetch that gave its end was sent: a
    mark taken now is passed only by a fetch sent after it (the worker's hold after a blocked
    loop ends there), which on an idle partition takes about a fetch's wait."""
    topic = "perfloop.test.pace-answered"
    ensure_topics(stack, [topic])

    async def run() -> tuple[float, float, float]:
        c = AIOKafkaConsumer(
            bootstrap_servers=stack.kafka_bootstrap, enable_auto_commit=False, fetch_max_wait_ms=100
        )
        app: Any = SimpleNamespace(consumer=SimpleNamespace(_thread=SimpleNamespace(
            _ensure_consumer=lambda: c)))  # fmt: skip
        await c.start()
        try:
            pace = pace_fetches(app, 200)
            assert pace is not None
            tp = TopicPartition(topic, 0)
            c.assign([tp])
            await c.seek_to_end(tp)
            await c.getmany(timeout_ms=500)
            key = (topic, 0)
            first = pace["answered"][key]
            mark = time.monotonic()
            assert pace["answered"][key] < mark
            while pace["answered"].get(key, -1.0) < mark and time.monotonic() - mark < 5.0:
                await c.getmany(timeout_ms=20)
            return first, mark, pace["answered"][key] - mark
        finally:
            await c.stop()

    first, mark, after = asyncio.run(run())
    assert first < mark
    assert 0 <= after < 1.0  # a fetch sent after the mark answered (interval 0.2 s, wait 0.1 s)
