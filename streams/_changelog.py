"""The stream tier's state store: per-partition snapshots in the changelog topic.

Each input partition number ``p`` has its own `StreamEngine` (`perfloop.streams.shards`), and
its snapshot is kept in partition ``p`` of ``perfloop.streams.state``, where any worker on any
node can read it: the worker a partition moves to restores it from there, not from a file of
the worker it left. A snapshot is zlib-compressed and cut into records of at most
`CHUNK_BYTES`; each record's key is ``"<p>:<i>"`` (so a compacted topic keeps the latest record
of each piece) and its headers name the snapshot (``perfloop.snapshot``, unique per write), the
piece (``perfloop.part``) and how many there are (``perfloop.parts``). The latest snapshot of a
partition is the last one whose pieces are all there.

`Changelog` writes snapshots (`write`, blocking: call it off the event loop) and keeps, in a
background thread, the latest complete snapshot of every partition as it is written — the
standby copy: a takeover reads it from memory once the thread has read the partition to the
end it had when asked (`latest`), so it costs the time to read what was written since, not
the whole history. At start the thread reads only each partition's last `TAIL_RECORDS`
records (the whole partition if no complete snapshot is among them): a broker that never
compacts (the embedded one) keeps every snapshot ever written.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from perfloop.kafka import _common, producer
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings

__all__ = ["CHUNK_BYTES", "TAIL_RECORDS", "Changelog", "pieces"]

log = logging.getLogger("perfloop.streams")

CHUNK_BYTES = 4 << 20
"""The largest record a snapshot is cut into (the producers' ``message.max.bytes`` is 8 MiB)."""
TAIL_RECORDS = 64
"""At start, how many of each partition's last records are read to find its latest snapshot."""


def pieces(partition: int, data: bytes, snapshot_id: str) -> list[tuple[bytes, bytes, list]]:
    """A snapshot as its records: ``(key, value, headers)``, compressed and cut to size.

    >>> [(k, len(v), [h[0] for h in hs]) for k, v, hs in pieces(3, b"x" * 10, "s")]
    [(b'3:0', 11, ['perfloop.snapshot', 'perfloop.part', 'perfloop.parts'])]
    """
    packed = zlib.compress(data, 1)
    chunks = [packed[i : i + CHUNK_BYTES] for i in range(0, len(packed), CHUNK_BYTES)] or [b""]
    return [
        (
            f"{partition}:{i}".encode(),
            chunk,
            [
                ("perfloop.snapshot", snapshot_id.encode()),
                ("perfloop.part", str(i).encode()),
                ("perfloop.parts", str(len(chunks)).encode()),
            ],
        )
        for i, chunk in enumerate(chunks)
    ]


class _Assembly:
    """The pieces of one partition's snapshots as they are read; the latest complete one."""

    def __init__(self) -> None:
        self.latest: bytes | None = None  # compressed
        self.latest_at = -1  # offset of its last piece
        self._open: dict[str, dict[int, bytes]] = {}

    def take(self, offset: int, value: bytes, headers: dict[str, bytes]) -> None:
        sid = headers.get("perfloop.snapshot", b"").decode()
        try:
            part = int(headers.get("perfloop.part", b"-1"))
            parts = int(headers.get("perfloop.parts", b"0"))
        except ValueError:
            return
        if not sid or not 0 <= part < parts:
            return
        got = self._open.setdefault(sid, {})
        got[part] = value
        if len(got) == parts:
            self.latest = b"".join(got[i] for i in range(parts))
            self.latest_at = offset
            self._open.clear()  # a piece of an older snapshot can no longer complete a newer
        elif len(self._open) > 4:  # pieces of writes that never finished
            self._open.pop(next(iter(self._open)))


class Changelog:
    """Writes the stream engines' snapshots and keeps the latest of each partition (module)."""

    def __init__(self, settings: StreamsSettings, topic: str = Topics.STREAM_STATE) -> None:
        self.settings, self.topic = settings, topic
        self._producer = producer(settings, **{"linger.ms": 0})
        self._lock = threading.Lock()
        self._parts: dict[int, _Assembly] = {}
        self._read_to: dict[int, int] = {}  # next offset the standby reads, per partition
        self._whole: set[int] = set()  # partitions read from their beginning
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._standby, name="state-standby", daemon=True)
        self.written = 0  # snapshots
        self.bytes = 0  # compressed

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._producer.flush(5)

    # -- writing ----------------------------------------------------------------------------
    def write(self, partition: int, data: bytes, timeout_s: float = 10.0) -> int:
        """Write one partition's snapshot and wait for the broker's acknowledgement; raise
        `OSError` if it was not all delivered. Returns the bytes written (compressed)."""
        errors: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err.str())

        records = pieces(partition, data, uuid.uuid4().hex)
        for key, value, headers in records:
            self._producer.produce(
                self.topic,
                key=key,
                value=value,
                headers=headers,
                partition=partition,
                on_delivery=delivered,
            )
        left = self._producer.flush(timeout_s)
        if errors or left:
            raise OSError(
                f"the snapshot of partition {partition} was not written to {self.topic}: "
                + (errors[0] if errors else f"no answer in {timeout_s:.0f} s")
            )
        n = sum(len(v) for _, v, _ in records)
        self.written += 1
        self.bytes += n
        return n

    # -- reading ----------------------------------------------------------------------------
    def latest(self, partition: int, timeout_s: float = 10.0) -> bytes | None:
        """The partition's latest complete snapshot (decompressed; None: it has none), once
        the standby has read the partition to the end it has now. Raise `OSError` if the
        broker does not say where that end is, or the standby does not get there in time."""
        probe = Consumer(_common(self.settings) | {"group.id": "perfloop-state-probe"})
        try:
            _, high = probe.get_watermark_offsets(
                TopicPartition(self.topic, partition), timeout=timeout_s
            )
        except KafkaException as e:
            raise OSError(f"the end of {self.topic}[{partition}] is unknown: {e}") from None
        finally:
            probe.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                part = self._parts.get(partition)
                packed = part.latest if part is not None else None
                read = self._ready.is_set() and self._read_to.get(partition, 0) >= high
                # a tail with no complete snapshot in it is read again from the beginning
                if read and (packed is not None or partition in self._whole):
                    return None if packed is None else zlib.decompress(packed)
            time.sleep(0.02)
        raise OSError(
            f"the standby did not read {self.topic}[{partition}] to its end ({high}) "
            f"in {timeout_s:.0f} s"
        )

    def _standby(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
                return
            except KafkaException as e:  # the broker away: try again
                log.warning("state standby: %s; reading again in 1 s", e)
                self._stop.wait(1.0)

    def _follow(self) -> None:
        conf = _common(self.settings) | {
            "group.id": "perfloop-state-standby",  # assigned, never joined nor committed
            "enable.auto.commit": False,
            "fetch.queue.backoff.ms": 10,
            "fetch.wait.max.ms": 100,
        }
        c = Consumer(conf)
        try:
            md = c.list_topics(self.topic, timeout=10.0).topics.get(self.topic)
            if md is None or md.error is not None or not md.partitions:
                raise KafkaException(f"topic {self.topic} is not there")
            starts = []
            for p in md.partitions:
                low, high = c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10.0)
                start = max(low, high - TAIL_RECORDS)
                with self._lock:
                    self._parts.setdefault(p, _Assembly())
                    self._read_to[p] = start
                    if start <= low:
                        self._whole.add(p)
                starts.append(
                    TopicPartition(self.topic, p, start if start > low else OFFSET_BEGINNING)
                )
            c.assign(starts)
            self._ready.set()
            while not self._stop.is_set():
                msgs = c.consume(500, timeout=0.2)
                with self._lock:
                    for m in msgs:
                        if m.error() is not None:
                            continue
                        p = m.partition()
                        headers = {k: v or b"" for k, v in (m.headers() or [])}
                        self._parts[p].take(m.offset(), m.value() or b"", headers)
                        self._read_to[p] = max(self._read_to.get(p, 0), m.offset() + 1)
                    again = self._tail_without_snapshot(c)
                    for p in again:  # read it all, once; `latest` waits for that meanwhile
                        self._whole.add(p)
                        self._read_to[p] = 0
                for p in again:
                    c.seek(TopicPartition(self.topic, p, OFFSET_BEGINNING))
        finally:
            c.close()

    def _tail_without_snapshot(self, c: Consumer) -> list[int]:
        """Partitions whose tail was read to its end without a complete snapshot in it."""
        out = []
        for p, part in self._parts.items():
            if p in self._whole or part.latest is not None:
                continue
            try:
                low, high = c.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
            except KafkaException:
                continue
            if high > low and self._read_to.get(p, 0) >= high:
                out.append(p)
        return out
