"""The JSON a webhook receives for a `Notice`: Slack's or Alertmanager's (pure).

- **slack**: ``{"text": …, "blocks": […]}``, what a Slack incoming webhook takes (and Mattermost,
  Rocket.Chat, Teams' Slack-compatible connectors): the text is the notification and the
  fallback; the blocks show the details and the labels.
- **alertmanager**: the payload Alertmanager's webhook receiver sends (``version`` "4"): one
  alert in ``alerts`` with ``labels``, ``annotations`` (``summary``, ``description``),
  ``startsAt``, ``endsAt`` (RFC 3339; ``0001-01-01T00:00:00Z`` while it is on and its end
  unknown) and a ``fingerprint`` of its labels; ``groupLabels`` are ``alertname`` and
  ``job_id``. Anything built to receive Alertmanager's webhooks takes it.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import orjson

from perfloop.notify.notices import Notice, alertname

__all__ = ["FORMATS", "alertmanager_payload", "body", "rfc3339", "slack_payload"]

FORMATS = ("slack", "alertmanager")
NS = 1_000_000_000
ZERO_TIME = "0001-01-01T00:00:00Z"
RECEIVER = "perfloop"
_ICONS = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}


def rfc3339(ns: int) -> str:
    """Unix nanoseconds as RFC 3339 in UTC, to the nanosecond (trailing zeros trimmed, as
    Alertmanager writes them); 0 is Alertmanager's zero time.

    >>> rfc3339(1_700_000_000_123_456_789), rfc3339(1_700_000_000 * 10**9), rfc3339(0)
    ('2023-11-14T22:13:20.123456789Z', '2023-11-14T22:13:20Z', '0001-01-01T00:00:00Z')
    """
    if ns <= 0:
        return ZERO_TIME
    seconds, frac = divmod(ns, NS)
    stamp = datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return stamp + (f".{frac:09d}".rstrip("0") if frac else "") + "Z"


def slack_payload(n: Notice) -> dict[str, Any]:
    """A Slack incoming-webhook message for ``n``.

    >>> from perfloop.notify.notices import Notice
    >>> p = slack_payload(Notice("hang", "firing", "llm-7", "hang in job llm-7: rank 3",
    ...                          "no step for 95 s", 1))
    >>> p["text"]
    ':rotating_light: hang in job llm-7: rank 3'
    """
    icon = ":white_check_mark:" if n.status == "resolved" else _ICONS.get(n.severity, "")
    text = _escape(f"{icon} {n.title}".strip())
    labels = "  ".join(f"{k}={v}" for k, v in n.all_labels().items() if k != "alertname")
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": f"*{text}*"}},
    ]
    if n.text:
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": _escape(n.text)}})
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": _escape(labels)}]})
    return {"text": text, "blocks": blocks}


def alertmanager_payload(n: Notice) -> dict[str, Any]:
    """Alertmanager's webhook payload (version 4) holding ``n`` as its one alert.

    >>> from perfloop.notify.notices import Notice
    >>> p = alertmanager_payload(Notice("straggler", "resolved", "j", "resolved: straggler",
    ...                                 "", 10**18, 10**18 + 60 * 10**9))
    >>> p["version"], p["status"], p["groupKey"], p["alerts"][0]["endsAt"]
    ('4', 'resolved', '{}:{alertname="PerfloopStraggler", job_id="j"}', '2001-09-09T01:47:40Z')
    """
    labels = n.all_labels()
    annotations = {"summary": n.title, "description": n.text or n.title}
    group = {"alertname": alertname(n.kind), "job_id": n.job_id}
    fingerprint = hashlib.sha256(
        "\0".join(f"{k}\0{v}" for k, v in sorted(labels.items())).encode()
    ).hexdigest()[:16]
    alert = {
        "status": n.status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(n.starts_ns),
        "endsAt": rfc3339(n.ends_ns),
        "generatorURL": "",
        "fingerprint": fingerprint,
    }
    return {
        "version": "4",
        "groupKey": "{}:{" + ", ".join(f'{k}="{v}"' for k, v in group.items()) + "}",
        "truncatedAlerts": 0,
        "status": n.status,
        "receiver": RECEIVER,
        "groupLabels": group,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "",
        "alerts": [alert],
    }


def body(fmt: str, n: Notice) -> bytes:
    """The request body for ``n`` in format ``fmt`` (one of `FORMATS`)."""
    if fmt == "slack":
        return orjson.dumps(slack_payload(n))
    if fmt == "alertmanager":
        return orjson.dumps(alertmanager_payload(n))
    raise ValueError(f"unknown webhook format {fmt!r}; valid: {', '.join(FORMATS)}")


def _escape(text: str) -> str:
    """Text for Slack's mrkdwn: ``&``, ``<`` and ``>`` escaped, as Slack asks."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
