"""Kafka-API clients (confluent-kafka) configured the same way for every perfloop service."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from perfloop.catalog import TOPICS
from perfloop.exceptions import BrokerError
from perfloop.settings import BaseServiceSettings

__all__ = ["consumer", "dlq_headers", "ensure_topics", "ping", "producer"]

_CLIENT_LOG = logging.getLogger("perfloop.kafka.client")


def _common(settings: BaseServiceSettings) -> dict[str, Any]:
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        "client.id": f"perfloop-{socket.gethostname()}",
        "log_level": 3,
        # librdkafka's own log lines go through Python logging (perfloop.kafka.client), so a
        # CLI command prints one clear line, and services log them with everything else.
        "logger": _CLIENT_LOG,
    }


def producer(settings: BaseServiceSettings, **overrides: Any) -> Producer:
    """An idempotent, acks=all, lz4-compressed producer with a short linger."""
    conf = _common(settings) | {
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "message.max.bytes": 8 << 20,
    }
    return Producer(conf | overrides)


def consumer(settings: BaseServiceSettings, group_id: str, **overrides: Any) -> Consumer:
    """A consumer that commits manually, after its output is safe (at-least-once)."""
    conf = _common(settings) | {
        "group.id": group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000,
        "fetch.queue.backoff.ms": 10,
        "fetch.wait.max.ms": 50,
    }
    return Consumer(conf | overrides)


def ping(settings: BaseServiceSettings, timeout_s: float = 3.0) -> int:
    """Return the number of topics the broker reports; raise `BrokerError` if unreachable."""
    admin = AdminClient(_common(settings))
    try:
        md = admin.list_topics(timeout=timeout_s)
    except KafkaException as e:
        raise BrokerError(
            f"Kafka broker at {settings.kafka_bootstrap} is unreachable: {e.args[0].str()}"
        ) from e
    return len(md.topics)


def ensure_topics(
    settings: BaseServiceSettings, topics: Iterable[str] = TOPICS, timeout_s: float = 10.0
) -> list[str]:
    """Create the topics that do not exist yet (idempotent); return the ones created."""
    admin = AdminClient(_common(settings))
    try:
        existing = set(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException as e:
        raise BrokerError(
            f"Kafka broker at {settings.kafka_bootstrap} is unreachable: {e.args[0].str()}"
        ) from e
    missing = [t for t in topics if t not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [NewTopic(t, settings.topic_partitions, 1) for t in missing], operation_timeout=timeout_s
    )
    created = []
    for topic, fut in futures.items():
        try:
            fut.result(timeout=timeout_s)
            created.append(topic)
        except KafkaException as e:
            if e.args[0].name() != "TOPIC_ALREADY_EXISTS":
                raise BrokerError(f"cannot create topic {topic}: {e.args[0].str()}") from e
    return created


def dlq_headers(reason: str, topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    """Headers of a dead letter on ``perfloop.dlq``: why it was rejected, where it came from."""
    return [
        ("perfloop.reason", reason[:1000].encode()),
        ("perfloop.source.topic", topic.encode()),
        ("perfloop.source.partition", str(partition).encode()),
        ("perfloop.source.offset", str(offset).encode()),
    ]
