"""Publishing from a training process: never blocks the caller, accounts for every message."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Message

from perfloop.kafka import producer
from perfloop.settings import BaseServiceSettings

__all__ = ["Publisher", "PublisherStats"]

log = logging.getLogger("perfloop.producers")


@dataclass
class PublisherStats:
    """Self-metrics: messages handed over, acknowledged by the broker, failed, dropped."""

    queued: int = 0
    delivered: int = 0
    failed: int = 0
    dropped: int = 0


class Publisher:
    """Non-blocking publisher over an idempotent confluent-kafka producer.

    `publish` returns at once; when the client's local queue is full the message is dropped
    and counted (the spool that keeps such messages comes with the observation tier).
    """

    def __init__(self, settings: BaseServiceSettings, **overrides: object) -> None:
        self._producer = producer(settings, **overrides)
        self.stats = PublisherStats()
        self._lock = threading.Lock()

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        try:
            self._producer.produce(topic, key=key.encode(), value=value, on_delivery=self._done)
        except BufferError:
            with self._lock:
                self.stats.dropped += 1
            self._producer.poll(0)
            return False
        except KafkaException as e:
            log.warning("cannot publish to %s: %s", topic, e)
            with self._lock:
                self.stats.failed += 1
            return False
        with self._lock:
            self.stats.queued += 1
        self._producer.poll(0)
        return True

    def _done(self, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            if err is None:
                self.stats.delivered += 1
            else:
                self.stats.failed += 1
                log.warning("delivery to %s failed: %s", msg.topic(), err)

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait for outstanding deliveries; return how many are still outstanding."""
        return int(self._producer.flush(timeout_s))
