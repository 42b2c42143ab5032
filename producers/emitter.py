"""The emitter: one producer's samples, batched per kind and published as few messages.

Samplers, training hooks, trace replay and the simulator all publish through an `Emitter`:
`add` / `extend` append samples to the pending batch of their kind (cheap, no encoding),
`event` publishes a job-level event at once, and `flush` encodes each pending batch as one
message (split so no message passes ``max_samples``) and hands it to the publisher. With
``flush_interval_s`` set, a daemon thread flushes on that period, so the caller's thread only
ever appends to lists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from perfloop.schemas import BatchBuilder, Event, encode_batch, encode_event
from perfloop.schemas.topics import KIND_TOPICS

__all__ = ["Emitter", "Sends"]

log = logging.getLogger("perfloop.producers")


class Sends(Protocol):
    """What an emitter needs from a publisher: a non-blocking ``publish``."""

    def publish(self, topic: str, key: str, value: bytes) -> bool: ...


class Emitter:
    """Batches samples of one producer (one job, one node) and publishes them.

    >>> class Collect:
    ...     def __init__(self): self.sent = []
    ...     def publish(self, topic, key, value): self.sent.append(topic); return True
    >>> pub = Collect()
    >>> em = Emitter(pub, job_id="j1", node="n0", producer_id="doc")
    >>> em.add("step", ts_ns=1, rank=0, step=0, step_time_ms=100.0)
    >>> em.extend("gpu", ts_ns=[1, 2], rank=[0, 0], device=[0, 0])
    >>> em.flush(), pub.sent
    (2, ['perfloop.telemetry.gpu', 'perfloop.telemetry.step'])
    >>> em.samples
    3
    """

    def __init__(
        self,
        publisher: Sends,
        *,
        job_id: str,
        node: str,
        producer_id: str,
        max_samples: int = 20_000,
        flush_interval_s: float | None = None,
    ) -> None:
        self.publisher = publisher
        self.job_id, self.node, self.producer_id = job_id, node, producer_id
        self.max_samples = max_samples
        self.samples = 0  # samples handed to the publisher
        self.messages = 0
        self._builders: dict[str, BatchBuilder] = {}
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one flush at a time: batches leave in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if flush_interval_s is not None:
            self._thread = threading.Thread(
                target=self._loop, args=(flush_interval_s,), name="perfloop-emitter", daemon=True
            )
            self._thread.start()

    def _builder(self, kind: str) -> BatchBuilder:
        b = self._builders.get(kind)
        if b is None:
            b = BatchBuilder(kind, job_id=self.job_id, node=self.node, producer_id=self.producer_id)
            self._builders[kind] = b
        return b

    def add(self, kind: str, **values: Any) -> None:
        """Append one sample of a telemetry ``kind``; raise `SchemaError` if a field is missing."""
        with self._lock:
            self._builder(kind).add(**values)

    def extend(self, kind: str, **columns: Sequence[Any] | np.ndarray) -> None:
        """Append many samples of ``kind`` column by column."""
        with self._lock:
            self._builder(kind).extend(**columns)

    def pending(self) -> int:
        """Samples appended and not yet flushed."""
        with self._lock:
            return sum(len(b) for b in self._builders.values())

    def event(self, event: Event) -> bool:
        """Publish one job-level or control event now (they are rare and unbatched)."""
        ok = self.publisher.publish(KIND_TOPICS[event.KIND], self.job_id, encode_event(event))
        self.messages += 1
        return ok

    def flush(self) -> int:
        """Publish every pending batch; return the number of messages handed over.

        Flushes run one at a time (the flusher thread's and an explicit one), so batches of
        one kind leave in the order their rows came and their sequence numbers increase."""
        with self._flushing:
            return self._flush()

    def _flush(self) -> int:
        with self._lock:  # take the rows under the lock; encode outside it
            taken = {k: b.take() for k, b in self._builders.items() if len(b)}
        encoded: list[tuple[str, bytes, int]] = []
        error: Exception | None = None
        for kind in sorted(taken):
            rows = taken[kind]
            n = len(rows["ts_ns"])
            try:
                for lo in range(0, n, self.max_samples):
                    part = {c: v[lo : lo + self.max_samples] for c, v in rows.items()}
                    self._seq[kind] = self._seq.get(kind, 0) + 1  # a gap marks a lost batch
                    data = encode_batch(
                        kind,
                        part,
                        job_id=self.job_id,
                        node=self.node,
                        producer_id=self.producer_id,
                        seq=self._seq[kind],
                    )
                    encoded.append((KIND_TOPICS[kind], data, len(part["ts_ns"])))
            except Exception as e:  # this kind's rows are lost; the other kinds still leave
                error = error or e
        # handed over together, after the encoding: the publisher's thread, woken by the
        # first, finds the others already queued (one wake-up per flush, not one per kind)
        for topic, data, samples in encoded:
            self.publisher.publish(topic, self.job_id, data)
            self.samples += samples
        self.messages += len(encoded)
        if error is not None:
            raise error
        return len(encoded)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.flush()
            except Exception:  # never let a bad sample end the flusher; say it once per batch
                log.exception("emitter flush failed; the pending batch was dropped")

    def close(self) -> None:
        """Stop the flusher thread (if any) and publish what is pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
