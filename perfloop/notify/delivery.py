"""Sending webhooks: one `Webhook` per URL, a bounded queue and a thread that POSTs with retries.

A POST that times out, cannot connect, or is answered 429 or 5xx is tried again after
``backoff_s``, doubled before each next try (a ``Retry-After`` is honoured up to 10 times
``backoff_s``), ``tries`` times in all; any other answer than 2xx is final (the URL or the
payload is wrong: trying again would not help). Then the notification is dropped and
counted. Nothing here blocks the caller: `Webhook.send` queues (dropping the oldest when
``queue_max`` wait) and returns; a dead endpoint costs its own thread's time only, never the
service's or another URL's. Each kind of failure of a URL is one line in the log the first
time, then only counted; a URL that delivers again after failing says so once. URLs are
logged without their path (a Slack webhook's path is its secret).
"""

from __future__ import annotations

import collections
import http.client
import logging
import threading
import urllib.error
import urllib.request
from collections import Counter
from urllib.parse import urlsplit

__all__ = ["Webhook", "redact"]

log = logging.getLogger("perfloop.notify")

USER_AGENT = "perfloop-notifier"


def redact(url: str) -> str:
    """A URL as logged: scheme, host and port only.

    >>> redact("https://hooks.slack.com/services/T0/B0/secret")
    'https://hooks.slack.com/…'
    """
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/…"


class Webhook:
    """One URL's deliveries (see the module docstring): `start`, `send`, `stop`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        tries: int = 3,
        backoff_s: float = 1.0,
        queue_max: int = 1000,
    ) -> None:
        self.url = url
        self.timeout_s, self.tries, self.backoff_s = timeout_s, tries, backoff_s
        self.queue_max = queue_max
        self.sent = 0  # notifications delivered
        self.failed = 0  # ... given up on
        self.dropped = 0  # ... dropped unsent, the queue full
        self.retried = 0  # POSTs tried again
        self.failures: Counter[str] = Counter()  # failed POSTs by kind
        self._queue: collections.deque[bytes] = collections.deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def name(self) -> str:
        return redact(self.url)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"perfloop-webhook {self.name}", daemon=True
            )
            self._thread.start()

    def send(self, body: bytes) -> None:
        """Queue one notification's body; never blocks."""
        with self._cond:
            if len(self._queue) >= self.queue_max:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("webhook %s: %d notifications waiting, dropping the oldest "
                                "(counted from now on)", self.name, self.queue_max)  # fmt: skip
            self._queue.append(body)
            self._cond.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until everything queued was delivered or given up on."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def stop(self, drain_s: float = 5.0) -> None:
        """Deliver what is queued for up to ``drain_s``, then stop (what is left is dropped)."""
        if self._thread is not None:
            self.wait_idle(drain_s)
        self._stop.set()
        with self._cond:
            self.dropped += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop.is_set())
                if self._stop.is_set():
                    return
                body = self._queue.popleft()
                self._busy = True
            try:
                self.deliver(body)
            except Exception as e:  # a bug here must not end deliveries
                log.error("webhook %s: delivery failed: %r", self.name, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def deliver(self, body: bytes) -> bool:
        """POST ``body``, trying again as the module docstring says; True once delivered."""
        wait = self.backoff_s
        for attempt in range(1, self.tries + 1):
            kind, retry_after = self._post(body)
            if kind is None:
                self.sent += 1
                if self._failing:
                    self._failing = False
                    log.info("webhook %s delivers again", self.name)
                return True
            self.failures[kind] += 1
            self._failing = True
            if self.failures[kind] == 1:
                log.warning("webhook %s failed: %s (tried %d times at most; further %s "
                            "failures are counted, not logged)", self.name, kind, self.tries,
                            kind)  # fmt: skip
            retryable = kind in ("timeout", "connection", "HTTP 429") or kind.startswith("HTTP 5")
            if not retryable or attempt == self.tries:
                break
            self.retried += 1
            delay = (
                wait if retry_after is None else min(max(retry_after, wait), 10 * self.backoff_s)
            )
            if self._stop.wait(delay):
                break
            wait *= 2
        self.failed += 1
        return False

    def _post(self, body: bytes) -> tuple[str | None, float | None]:
        """One POST: (None, None) when answered 2xx, else (the kind of failure, Retry-After)."""
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": USER_AGENT},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                r.read(65536)
                return (None, None) if 200 <= r.status < 300 else (f"HTTP {r.status}", None)
        except urllib.error.HTTPError as e:
            after = _seconds(e.headers.get("Retry-After") if e.headers else None)
            e.close()
            return f"HTTP {e.code}", after
        except TimeoutError:
            return "timeout", None
        except urllib.error.URLError as e:
            return ("timeout" if isinstance(e.reason, TimeoutError) else "connection"), None
        except OSError:  # reset, refused mid-way, …
            return "connection", None
        except http.client.HTTPException:  # not HTTP that came back
            return "bad response", None


def _seconds(value: str | None) -> float | None:
    """A Retry-After of seconds (an HTTP date is not honoured: None)."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
