"""What the stream worker publishes, sent by a librdkafka producer off the event loop.

The worker's one event loop thread reads the input, runs the engine and closes windows; what
it publishes (closed windows, phase changes, diagnoses, predictions, recommendations, dead
letters) goes through `Output`, a confluent-kafka producer (`perfloop.kafka.producer`:
idempotent, acks=all, lz4). ``send`` only hands a message to librdkafka's queue, whose own
threads batch, compress and deliver it, so the loop never waits on the broker for it: with
the Faust app's own producer, a run of closed windows (messages of ~300 KB) waited for each
previous one's round trip to the broker, inside the saturated loop (close → sent p50 0.5-1 s
under the e2e bench's 220k samples/s).

Before a snapshot is written, and the input it covers acknowledged, `flush` waits in a worker
thread until everything sent so far is delivered and says whether all of it was
(`perfloop.streams.app`), so a snapshot never covers output still in librdkafka's queue.
librdkafka retries a message until ``message.timeout.ms`` (5 minutes); one it could not
deliver by then is counted (``failed``, in the worker's stats line) and logged, and that
snapshot is not taken: a worker restarted before the next one publishes it again from its
input, otherwise it is lost.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from confluent_kafka import KafkaError, Message

from perfloop.kafka import producer
from perfloop.settings import BaseServiceSettings

__all__ = ["Output"]

log = logging.getLogger("perfloop.streams")

FULL_WAIT_S = 0.05
"""How long `send` lets librdkafka deliver before trying again when its queue is full."""


class Output:
    """The stream worker's producer: ``send`` never blocks the loop on the broker."""

    def __init__(self, settings: BaseServiceSettings, **overrides: Any) -> None:
        self._producer = producer(settings, **overrides)
        self.sent = 0
        self.delivered = 0
        self.failed = 0
        self._failed_at_flush = 0
        self._last_error = ""
        self._lock = threading.Lock()  # reports come in the loop's poll and in flush's thread

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            if err is None:
                self.delivered += 1
                return
            self.failed += 1
            self._last_error = f"{msg.topic()}: {err.str()}"

    async def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        """Queue one message; wait (yielding the loop) only while librdkafka's queue is full."""
        while True:
            try:
                self._producer.produce(
                    topic, value, key, headers=headers, on_delivery=self._delivered
                )
                break
            except BufferError:
                self._producer.poll(0)
                await asyncio.sleep(FULL_WAIT_S)
        self.sent += 1

    def poll(self) -> None:
        """Serve delivery reports (cheap; the tick calls it)."""
        self._producer.poll(0)

    async def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (in a thread) until every message sent so far is delivered; True if all were,
        none failing since the last flush."""
        loop = asyncio.get_running_loop()
        left = await loop.run_in_executor(None, self._producer.flush, timeout_s)
        with self._lock:
            failed, self._failed_at_flush = self.failed - self._failed_at_flush, self.failed
        if failed:
            log.warning("%d messages could not be delivered (last: %s)", failed, self._last_error)
        return left == 0 and not failed

    def close(self, timeout_s: float = 10.0) -> None:
        left = self._producer.flush(timeout_s)
        if left:
            log.warning("%d messages not delivered when the stream worker stopped", left)
