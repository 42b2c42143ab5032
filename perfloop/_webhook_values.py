"""What the webhook settings take (`perfloop.settings.NotifierSettings`): the URLs and the kinds
of event, each from a list, a JSON list or a comma-separated string, checked with one line
naming what is wrong. Private to `perfloop.settings`, which re-exports the constants."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from perfloop.schemas.knobs import name_list

__all__ = ["DEFAULT_WEBHOOK_KINDS", "WEBHOOK_EVENTS", "webhook_kinds", "webhook_urls"]

WEBHOOK_EVENTS = ("oom_warning", "rollback", "approval")
"""The webhook kinds that are no bottleneck: a time-to-OOM warning (a prediction), a change
rolled back, a recommendation waiting for approval (`perfloop.notify`)."""
DEFAULT_WEBHOOK_KINDS = (
    *("hang", "straggler", "memory_leak", "oom", "gpu_error"),
    *WEBHOOK_EVENTS,
)
"""What the notifier sends unless ``webhook_kinds`` says otherwise."""


def webhook_urls(value: Any) -> tuple[str, ...]:
    """Webhook URLs from a list, a JSON list or a comma-separated string, each checked to be
    an http(s) URL with a host; `ValueError` naming the first that is not.

    >>> webhook_urls("https://hooks.example.com/a, http://127.0.0.1:9/b")
    ('https://hooks.example.com/a', 'http://127.0.0.1:9/b')
    >>> webhook_urls("hooks.example.com/a")
    Traceback (most recent call last):
    ...
    ValueError: webhook URL 'hooks.example.com/a' is not an http:// or https:// URL with a host
    """
    urls = name_list(value, "webhook URLs")
    for url in urls:
        try:
            parts = urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port that is no number
            ok = False
        if not ok:
            raise ValueError(f"webhook URL {url!r} is not an http:// or https:// URL with a host")
    return tuple(urls)


def webhook_kinds(value: Any) -> tuple[str, ...]:
    """The kinds of event a webhook is sent for: bottlenecks (`BOTTLENECKS`) and
    `WEBHOOK_EVENTS`, or ``all``; `ValueError` naming the valid ones for an unknown kind.

    >>> webhook_kinds("hang, rollback")
    ('hang', 'rollback')
    >>> len(webhook_kinds("all")) > 10
    True
    """
    from perfloop.schemas.analysis import BOTTLENECKS  # (settings load without the schemas)

    valid = (*BOTTLENECKS, *WEBHOOK_EVENTS)
    kinds = name_list(value, "webhook kinds")
    if "all" in kinds:
        return valid
    for kind in kinds:
        if kind not in valid:
            raise ValueError(f"unknown webhook kind {kind!r}; valid: all, {', '.join(valid)}")
    if not kinds:
        raise ValueError(f"no webhook kinds; valid: all, {', '.join(valid)}")
    return tuple(kinds)
