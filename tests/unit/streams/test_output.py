"""The stream worker's producer (`Output`): sending never raises on a full queue, and a message
the broker never took makes `flush` say so, so the snapshot that would cover it is not taken.

These talk to a closed port through the real librdkafka client (nothing is mocked): delivery
fails after ``message.timeout.ms`` as it would with the broker down.
"""

from __future__ import annotations

import asyncio
import socket

from perfloop.settings import StreamsSettings
from perfloop.streams._publisher import Output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def _output(**overrides: object) -> Output:
    settings = StreamsSettings(kafka_bootstrap_override=f"127.0.0.1:{_closed_port()}")
    return Output(settings, **({"message.timeout.ms": 300} | overrides))


def test_an_undelivered_message_fails_the_flush() -> None:
    out = _output()

    async def run() -> bool:
        await out.send("perfloop.windows", b"job", b"rows", headers=[("h", b"v")])
        return await out.flush(10)

    assert asyncio.run(run()) is False
    assert (out.sent, out.delivered, out.failed) == (1, 0, 1)
    # The failure was reported once: a later flush with nothing new failing succeeds.
    assert asyncio.run(out.flush(1)) is True


def test_a_full_queue_makes_send_wait_not_raise() -> None:
    out = _output(**{"queue.buffering.max.messages": 1})

    async def run() -> None:
        await out.send("perfloop.windows", b"job", b"first")
        # The queue holds one message: this one waits (yielding the loop) until the first
        # leaves it — here, by timing out — instead of raising BufferError.
        await out.send("perfloop.windows", b"job", b"second")
        await out.flush(10)

    asyncio.run(run())
    assert out.sent == 2
    assert out.failed == 2
