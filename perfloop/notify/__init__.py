"""Alerting: webhooks that perfloop sends itself when the loop finds or does something.

Contract: `NotifierService` (``perfloop service notifier``; ``perfloop up`` starts it when
``PERFLOOP_WEBHOOK_URLS`` is set) reads the diagnoses, actuations and predictions topics and, for
each event of the kinds asked for (``PERFLOOP_WEBHOOK_KINDS``: a hang, a straggler, a memory
leak, an OOM or its warning, …, a rollback, a recommendation pending approval), POSTs one JSON
notification to each URL, in Slack's or Alertmanager's format, with retries, never blocking on a
failing endpoint. It depends only on the topics and their events, not on the stream worker.
docs/alerts.md shows the settings and the payloads; the Prometheus metrics and alert rules are
the stream worker's (`perfloop.streams.metrics`, docker/prometheus).

Modules: ``notices`` (events → `Notice`, what is news), ``payloads`` (a notice's JSON, both
formats), ``delivery`` (`Webhook`: a URL's queue, thread and retries), ``service`` (the Kafka
loop).
"""

from perfloop.notify.delivery import Webhook
from perfloop.notify.notices import Notice, Notices, alertname
from perfloop.notify.payloads import FORMATS, alertmanager_payload, body, slack_payload
from perfloop.notify.service import NotifierService

__all__ = [
    "FORMATS",
    "Notice",
    "Notices",
    "NotifierService",
    "Webhook",
    "alertmanager_payload",
    "alertname",
    "body",
    "slack_payload",
]
