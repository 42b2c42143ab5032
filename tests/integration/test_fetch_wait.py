"""The stream worker's consumer takes its fetch wait from the settings (Faust fixes it at
1.5 s), checked on a real aiokafka consumer against the embedded broker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from perfloop.catalog import Topics
from perfloop.settings import StackSettings
from perfloop.streams.app import set_fetch_wait

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
