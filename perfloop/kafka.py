"""Kafka-API clients (confluent-kafka) configured the same way for every perfloop service."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from perfloop.exceptions import BrokerError
from perfloop.schemas.topics import TOPICS, Topics
from perfloop.settings import BaseServiceSettings, ProducerSettings

__all__ = [
    "admin",
    "cluster_id",
    "consumer",
    "dead_letter_counts",
    "dlq_headers",
    "ensure_topics",
    "follow",
    "ping",
    "producer",
    "reason_class",
    "security_config",
    "tail",
]

_CLIENT_LOG = logging.getLogger("perfloop.kafka.client")


def _common(settings: BaseServiceSettings) -> dict[str, Any]:
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        "client.id": f"perfloop-{socket.gethostname()}",
        "log_level": 3,
        # librdkafka's own log lines go through Python logging (perfloop.kafka.client), so a
        # CLI command prints one clear line, and services log them with everything else.
        "logger": _CLIENT_LOG,
    } | security_config(settings)


def security_config(settings: BaseServiceSettings) -> dict[str, Any]:
    """librdkafka's security properties from the settings (`BaseServiceSettings`: the
    protocol, the SASL user and password, the CA and the client's certificate and key). It
    holds secrets: never log it.

    >>> from perfloop.settings import StackSettings
    >>> security_config(StackSettings())
    {}
    >>> conf = security_config(StackSettings(kafka_security_protocol="SASL_SSL",
    ...     kafka_sasl_username="ann", kafka_sasl_password="pw", kafka_ssl_ca="/ca.pem"))
    >>> sorted(conf)  # doctest: +NORMALIZE_WHITESPACE
    ['sasl.mechanism', 'sasl.password', 'sasl.username', 'security.protocol',
     'ssl.ca.location']
    """
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    conf: dict[str, Any] = {"security.protocol": protocol}
    if protocol.startswith("SASL"):
        conf |= {
            "sasl.mechanism": settings.kafka_sasl_mechanism,
            "sasl.username": settings.kafka_sasl_username,
            "sasl.password": settings.kafka_sasl_password.get_secret_value(),
        }
    if protocol.endswith("SSL"):
        if settings.kafka_ssl_ca is not None:
            conf["ssl.ca.location"] = str(settings.kafka_ssl_ca)
        if settings.kafka_ssl_cert is not None and settings.kafka_ssl_key is not None:
            conf["ssl.certificate.location"] = str(settings.kafka_ssl_cert)
            conf["ssl.key.location"] = str(settings.kafka_ssl_key)
            if key_password := settings.kafka_ssl_key_password.get_secret_value():
                conf["ssl.key.password"] = key_password
    return conf


def admin(settings: BaseServiceSettings) -> AdminClient:
    """An admin client of the configured broker."""
    return AdminClient(_common(settings))


def producer(settings: BaseServiceSettings, **overrides: Any) -> Producer:
    """An acks=all, lz4-compressed producer with a short linger, idempotent where the broker
    keeps its log.

    The embedded broker does not: it restarts empty after a crash and is replaced by an empty
    one on purpose (`perfloop.stack._recycle`), and an idempotent producer stalls for good on
    the new one (its producer id and sequence numbers mean nothing there: measured, 100 of 100
    messages undelivered after 20 s, none failed). There a service's producer is plain, one
    request in flight so that order is kept, and the readers drop what a retry repeats by its
    id. A training node's `Publisher` asks for idempotence everywhere (``overrides``): it
    notices a broker that lost its log and replaces its producer itself.

    With `ProducerSettings` (a training node's producer), ``linger_ms``,
    ``queue_max_messages`` and ``message_timeout_ms`` tune the linger, the bound of the local
    queue and how long a message may wait for the broker; services get fixed defaults.
    ``overrides`` are librdkafka properties and win over both.
    """
    conf = _common(settings) | {
        "enable.idempotence": settings.keeps_log,
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 5,
        "batch.size": 1 << 20,
        "message.max.bytes": 8 << 20,
        # Reconnect within a second of a restarted broker instead of backing off to 10 s.
        "reconnect.backoff.max.ms": 1000,
    }
    if isinstance(settings, ProducerSettings):
        conf |= {
            "linger.ms": settings.linger_ms,
            "queue.buffering.max.messages": settings.queue_max_messages,
            "message.timeout.ms": settings.message_timeout_ms,
        }
    conf |= overrides
    if not conf["enable.idempotence"]:
        conf.setdefault("max.in.flight.requests.per.connection", 1)
    return Producer(conf)


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


def tail(c: Consumer, topics: list[str], stop: threading.Event, assigned: threading.Event) -> bool:
    """Assign every partition of ``topics`` to ``c`` at its end, with no consumer group: a
    group join takes seconds (half the session timeout on the embedded broker), and what is
    published meanwhile would be missed. Retries while the broker is away; sets ``assigned``
    and returns True once assigned, False if ``stop`` was set first."""
    while not stop.is_set():
        try:
            md = c.list_topics(timeout=2.0)
            parts = []
            for name in topics:
                t = md.topics.get(name)
                if t is None or t.error is not None or not t.partitions:
                    break
                parts += [TopicPartition(name, p, OFFSET_END) for p in t.partitions]
            else:
                c.assign(parts)
                assigned.set()
                return True
        except KafkaException as e:
            _CLIENT_LOG.debug("topics %s not reachable yet: %s", topics, e)
        stop.wait(1.0)
    return False


def follow(
    c: Consumer,
    topics: list[str],
    on_message: Callable[[Message], object],
    stop: threading.Event,
    assigned: threading.Event,
    *,
    key: Callable[[bytes | None], bool] | None = None,
    poll_s: float = 0.2,
    what: str = "consumer",
    log: logging.Logger | None = None,
) -> None:
    """Follow ``topics`` from their end (`tail`) and hand each message to ``on_message`` until
    ``stop`` is set; then close ``c``. The one loop of every reader that follows live topics
    (the control topic in a job, the demos' followers).

    ``key``, if given, picks the messages by their key (the others are skipped unread). A
    consumer error is logged once per kind (as ``"<what> error: …"``): the broker may be away
    long, and a job's stderr is no place for a line every poll. The end of a partition is no
    error.
    """
    log = log or _CLIENT_LOG
    seen: set[int] = set()
    try:
        tail(c, topics, stop, assigned)
        while not stop.is_set():
            msg = c.poll(poll_s)
            if msg is None:
                continue
            if msg.error():
                code = msg.error().code()
                if code != KafkaError._PARTITION_EOF and code not in seen:
                    seen.add(code)
                    log.warning("%s error: %s", what, msg.error())
                continue
            if key is None or key(msg.key()):
                on_message(msg)
    finally:
        c.close()


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


def cluster_id(settings: BaseServiceSettings, timeout_s: float = 5.0) -> str | None:
    """The id of the cluster the broker belongs to (None if unreachable or it reports none)."""
    admin = AdminClient(_common(settings))
    try:
        return admin.list_topics(timeout=timeout_s).cluster_id or None
    except KafkaException:
        return None


COMPACTED = {Topics.STREAM_STATE: {"cleanup.policy": "compact"}}
"""Topics whose records are kept by key, the latest of each (a broker that never compacts, the
embedded one, keeps them all; its readers read the latest)."""


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
        [NewTopic(t, settings.topic_partitions, 1, config=COMPACTED.get(t, {})) for t in missing],
        operation_timeout=timeout_s,
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


def reason_class(reason: str) -> str:
    """A dead letter's reason with its sample-specific values masked, for counting.

    >>> reason_class("span batch: column 'name' sample 12 = 'x' holds control characters")
    "span batch: column 'name' sample N = … holds control characters"
    """
    reason = re.sub(r" = .*? (is|holds) ", r" = … \1 ", reason)
    reason = re.sub(r"\(got .*\)$", "(got …)", reason)
    return re.sub(r"\d+", "N", reason)[:160]


def dead_letter_counts(
    settings: BaseServiceSettings, timeout_s: float = 10.0
) -> dict[tuple[str, str], int]:
    """Read ``perfloop.dlq`` from the start and count its messages by source topic and reason.

    Reasons are grouped with their numbers masked (``sample N``), so one kind of bad input is
    one line however many times it came. A source message dead-lettered more than once (by
    two services that read its topic, or again after a restart) counts once, under the
    reason it was first dead-lettered for.
    """
    from perfloop.schemas.topics import Topics

    ping(settings)
    c = consumer(
        settings,
        f"perfloop-dlq-reader-{uuid.uuid4().hex[:12]}",
        **{"enable.partition.eof": True},
    )
    counts: dict[tuple[str, str], int] = {}
    seen: set[tuple[str, str | None, str | None]] = set()  # source places counted
    try:
        md = c.list_topics(Topics.DLQ, timeout=timeout_s).topics.get(Topics.DLQ)
        parts = len(md.partitions) if md is not None and not md.error else 0
        if not parts:
            return counts
        c.subscribe([Topics.DLQ])
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < parts and time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    done.add(msg.partition())
                continue
            h = {k: v.decode(errors="replace") for k, v in msg.headers() or []}
            topic = h.get("perfloop.source.topic", "?")
            place = (topic, h.get("perfloop.source.partition"), h.get("perfloop.source.offset"))
            if None not in place:
                if place in seen:
                    continue
                seen.add(place)
            key = (topic, reason_class(h.get("perfloop.reason", "?")))
            counts[key] = counts.get(key, 0) + 1
    finally:
        c.close()
    return counts
