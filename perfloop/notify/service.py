"""The notifier service (`perfloop service notifier`): the loop's topics in, webhooks out.

It reads, in its own consumer group (``notifier_group_id``), the topics its kinds need:
``perfloop.diagnoses`` (a bottleneck named in ``webhook_kinds``), ``perfloop.actuations``
(``rollback``, ``approval``: the agents' verdicts and the actuator's decisions) and
``perfloop.predictions`` (``oom_warning``). `Notices` says what is news; each notice is
formatted once (``webhook_format``: `perfloop.notify.payloads`) and queued for every URL
(``webhook_urls``), whose `Webhook` sends it with retries on a thread of its own: a slow or dead
endpoint never holds up the reading, another URL, or any other service (the notifier is a
process of its own; the stream worker does not wait for it).

Where it starts reading: a new group starts at the topics' end (no flood of old news on a first
start); a restarted one where it stopped, so what came meanwhile is told (a notice queued but
not yet sent when it stops is lost after ``drain_s``). Offsets are committed about once a
second. A message that does not decode is skipped with one line (the sink dead-letters it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaError

from perfloop.bad_input import Failed, OnError, decide, skip_policy
from perfloop.exceptions import ConfigError
from perfloop.kafka import consumer
from perfloop.notify.delivery import Webhook
from perfloop.notify.notices import Notice, Notices
from perfloop.notify.payloads import body
from perfloop.schemas import SchemaError, decode_event
from perfloop.schemas.analysis import BOTTLENECKS
from perfloop.schemas.topics import Topics
from perfloop.settings import NotifierSettings

__all__ = ["COMMIT_EVERY_S", "NotifierService", "topics_for"]

log = logging.getLogger("perfloop.notify")

COMMIT_EVERY_S = 1.0
STATS_EVERY_S = 60.0


def topics_for(kinds: tuple[str, ...] | frozenset[str]) -> list[str]:
    """The topics the notifier reads for ``kinds``.

    >>> topics_for(("hang", "rollback"))
    ['perfloop.diagnoses', 'perfloop.actuations']
    """
    out = []
    if any(k in BOTTLENECKS for k in kinds):
        out.append(Topics.DIAGNOSES)
    if "rollback" in kinds or "approval" in kinds:
        out.append(Topics.ACTUATIONS)
    if "oom_warning" in kinds:
        out.append(Topics.PREDICTIONS)
    return out


class NotifierService:
    """Reads the topics, sends a webhook per notice and URL (see the module docstring)."""

    def __init__(
        self, settings: NotifierSettings, *, on_error: OnError = skip_policy, drain_s: float = 5.0
    ) -> None:
        if not settings.webhook_urls:
            raise ConfigError(
                "the notifier has no webhook URL: set PERFLOOP_WEBHOOK_URLS (docs/alerts.md)"
            )
        self.settings = settings
        self.on_error = on_error
        self.drain_s = drain_s
        self.notices = Notices(settings.webhook_kinds)
        self.hooks = [
            Webhook(
                url,
                timeout_s=settings.webhook_timeout_s,
                tries=settings.webhook_tries,
                backoff_s=settings.webhook_backoff_s,
                queue_max=settings.webhook_queue,
            )
            for url in settings.webhook_urls
        ]
        self.topics = topics_for(settings.webhook_kinds)
        self.told = 0  # notices queued
        self.ready = threading.Event()
        """Set once the consumer has its partitions: what is published after is read."""
        self._stop = threading.Event()
        self._consumer: Any = None

    def start(self) -> None:
        self._consumer = consumer(
            self.settings,
            self.settings.notifier_group_id,
            **{"auto.offset.reset": "latest", "fetch.wait.max.ms": 500},
        )
        self._consumer.subscribe(self.topics, on_assign=lambda c, parts: self.ready.set())
        for hook in self.hooks:
            hook.start()
        names = ", ".join(h.name for h in self.hooks)
        log.info("notifier: %s of %s to %s (%s)", ", ".join(self.settings.webhook_kinds),
                 ", ".join(self.topics), names, self.settings.webhook_format)  # fmt: skip

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.start()
        last_commit = last_stats = time.monotonic()
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(0.2)
                now = time.monotonic()
                if now - last_commit >= COMMIT_EVERY_S:
                    self._commit()
                    last_commit = now
                if now - last_stats >= STATS_EVERY_S:
                    self._stats()
                    last_stats = now
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("consumer error: %s", msg.error())
                    continue
                self.handle(msg.value() or b"", msg.topic(), partition=msg.partition(),
                            offset=msg.offset(), key=msg.key())  # fmt: skip
        finally:
            self._commit()
            self._consumer.close()
            for hook in self.hooks:
                hook.stop(self.drain_s)
            self._stats()

    def handle(
        self,
        data: bytes,
        topic: str = Topics.DIAGNOSES,
        *,
        partition: int = -1,
        offset: int = -1,
        key: bytes | None = None,
    ) -> Notice | None:
        """One message: the notice it makes, queued for every URL (None: no news)."""
        try:
            event = decode_event(data)
        except SchemaError as e:
            decide(self.on_error, e, Failed(topic, partition, offset, key, data), log)
            return None
        notice = self.notices.notice(event)
        if notice is None:
            return None
        payload = body(self.settings.webhook_format, notice)
        for hook in self.hooks:
            hook.send(payload)
        self.told += 1
        log.info("notice %s: %s", notice.status, notice.title)
        return notice

    def _commit(self) -> None:
        with contextlib.suppress(Exception):  # nothing read yet, or the broker away
            self._consumer.commit(asynchronous=True)

    def _stats(self) -> None:
        for h in self.hooks:
            if h.sent or h.failed or h.dropped:
                log.info("webhook %s: %d sent, %d given up, %d dropped, %d retried; failures %s",
                         h.name, h.sent, h.failed, h.dropped, h.retried,
                         dict(h.failures) or "none")  # fmt: skip
