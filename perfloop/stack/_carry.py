"""The telemetry a recycled broker holds that is not read yet, carried to its replacement.

A recycle (`perfloop.stack._recycle`) replaces the embedded broker once the telemetry has been
read up to where it ended a few seconds before. What came after is not lost with the old
broker only if its producer notices the loss and resends it, and a producer that closed (a job
that just ended), or that has nothing more to send, never does: the end of a job's telemetry
would be missing. So the recycler reads every telemetry partition from where its slowest
reader is (the sink's committed offset, the stream workers' positions) to its end, and
produces that into the new broker before anyone reads it. A record that a producer also
resends, or that a reader had read already, arrives twice: the readers drop it by its id.

>>> read = {("t", 0): 9, ("t", 1): 4}  # a stream worker's positions
>>> start_of_unread({("t", 0): 10, ("t", 1): 4, ("t", 2): 3}, {("t", 0): 7, ("t", 1): 4},
...                 [{"cluster": "c", "at": 5.0, "offsets": read}], cluster="c")
{('t', 0): 7, ('t', 2): 0}
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, TopicPartition

from perfloop.kafka import consumer, producer
from perfloop.settings import StackSettings

__all__ = ["CARRY_MAX_BYTES", "Carried", "CarryError", "read_unread", "start_of_unread", "write"]

CARRY_MAX_BYTES = 128 << 20
"""The most a recycle carries over (a few seconds of telemetry is a few MiB at 20k samples/s);
with more unread the recycle waits."""

TP = tuple[str, int]


class CarryError(ValueError):
    """The unread telemetry could not be read whole, or is over `CARRY_MAX_BYTES`."""


@dataclass(frozen=True, slots=True)
class Carried:
    """One record, as the old broker held it."""

    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None
    timestamp_ms: int

    @property
    def size(self) -> int:
        return len(self.value or b"") + len(self.key or b"")


def start_of_unread(
    ends: dict[TP, int],
    sink: dict[TP, int],
    workers: list[dict[str, Any]],
    *,
    cluster: str | None,
) -> dict[TP, int]:
    """Where each partition's unread records start: the lowest of the sink's committed offset
    and the stream workers' positions (the furthest one in ``cluster`` for each partition;
    none: from the start); partitions read to their end are left out."""
    read: dict[TP, int] = {}
    for w in workers:
        if w["cluster"] == cluster:
            for tp, o in w["offsets"].items():
                read[tp] = max(read.get(tp, 0), o)
    out = {}
    for tp, end in ends.items():
        start = max(0, min(sink.get(tp, -1), read.get(tp, 0)))
        if start < end:
            out[tp] = start
    return out


def read_unread(
    settings: StackSettings,
    starts: dict[TP, int],
    ends: dict[TP, int],
    *,
    max_bytes: int = CARRY_MAX_BYTES,
    timeout_s: float = 10.0,
    drain_s: float = 0.05,
) -> list[Carried]:
    """Every record of the partitions in ``ends`` from ``starts`` (a partition not in it: from
    its end) up to ``ends``, and then what has arrived since in any of them, taken for
    ``drain_s``; in offset order per partition."""
    if not ends:
        return []
    want = {tp: end for tp, end in ends.items() if starts.get(tp, end) < end}
    got: list[Carried] = []
    size = 0
    c = consumer(settings, "perfloop-recycle-probe")
    try:
        c.assign([TopicPartition(t, p, starts.get((t, p), e)) for (t, p), e in ends.items()])
        deadline = time.monotonic() + timeout_s
        drained = False
        while not drained:
            if time.monotonic() >= deadline:
                raise CarryError(f"{len(want)} partition(s) were not read to their end in time")
            drained = not want  # read to the ends: one more call takes what came since
            for m in c.consume(10_000, drain_s if drained else 0.2):
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise CarryError(f"reading what is unread: {err.str()}")
                    continue
                tp = (m.topic(), m.partition())
                rec = Carried(tp[0], tp[1], m.key(), m.value(), m.headers(), m.timestamp()[1])
                got.append(rec)
                size += rec.size
                if size > max_bytes:
                    raise CarryError(f"over {max_bytes >> 20} MiB of telemetry is unread")
                if tp in want and int(m.offset() or 0) >= want[tp] - 1:
                    del want[tp]
    finally:
        c.close()
    return got


def write(settings: StackSettings, records: list[Carried], timeout_s: float = 30.0) -> int:
    """Produce ``records`` into the (new) broker, each to its partition, in order; return how
    many were not delivered."""
    if not records:
        return 0
    failed = 0

    def _done(err: KafkaError | None, _msg: Any) -> None:
        nonlocal failed
        if err is not None:
            failed += 1

    p = producer(settings)
    for r in records:
        while True:
            try:
                p.produce(
                    r.topic, value=r.value, key=r.key, partition=r.partition,
                    headers=r.headers, timestamp=r.timestamp_ms, on_delivery=_done,
                )  # fmt: skip
                break
            except BufferError:  # the local queue is full: let it drain
                p.poll(0.1)
    left = p.flush(timeout_s)
    return failed + left
