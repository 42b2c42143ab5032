"""In-memory stand-ins for the sink's broker, dead-letter producer and warehouse, the
messages they carry, and a sink wired to them (the sink's unit tests share them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from clickhouse_connect.driver.exceptions import OperationalError
from confluent_kafka import TopicPartition

from perfloop.schemas import encode_batch
from perfloop.settings import SinkSettings
from perfloop.warehouse.sink import Sink

ROWS = 500  # samples per step batch


def windows_message(n: int, **override: Any) -> bytes:
    t = 1_700_000_000_000_000_000
    cols: dict[str, Any] = {
        "ts_ns": [t] * n,
        "window_end_ns": [t + 10**9] * n,
        "closed_ns": [t + 2 * 10**9] * n,
        "job_id": ["job"] * n,
        "node": ["n0"] * n,
        "rank": list(range(n)),
        "device": [-1] * n,
        "metric": ["step_time_ms"] * n,
        "count": [1] * n,
    }
    cols |= {k: [1.0] * n for k in ("window_s", "hop_s", "mean", "min", "max", "p50", "p95")}
    cols |= {k: [1.0] * n for k in ("p99", "rate_per_s", "slope_per_s")}
    return orjson.dumps({"kind": "windows", "v": 2, "columns": cols | override})


class Msg:
    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        value: bytes,
        key: bytes | None = b"job",
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        self._t, self._p, self._o, self._v, self._k, self._h = (
            topic,
            partition,
            offset,
            value,
            key,
            headers,
        )

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._t

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def value(self) -> bytes:
        return self._v

    def key(self) -> bytes | None:
        return self._k

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._h

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


class Broker:
    """A consumer over an in-memory log: honours pause/resume and records commits."""

    def __init__(self) -> None:
        self.log: list[Msg] = []
        self.cursor = 0
        self.paused: set[tuple[str, int]] = set()
        self.commits: list[dict[tuple[str, int], int]] = []
        self.on_revoke: Callable[..., None] | None = None
        self.on_assign: Callable[..., None] | None = None

    def add(self, topic: str, value: bytes, partition: int = 0, **kw: Any) -> Msg:
        offset = sum(1 for m in self.log if (m.topic(), m.partition()) == (topic, partition))
        msg = Msg(topic, partition, offset, value, **kw)
        self.log.append(msg)
        return msg

    def subscribe(
        self,
        topics: list[str],
        on_revoke: Callable[..., None],
        on_assign: Callable[..., None] | None = None,
    ) -> None:
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in {(m.topic(), m.partition()) for m in self.log}]

    def pause(self, parts: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in parts}

    def resume(self, parts: list[TopicPartition]) -> None:
        self.paused -= {(tp.topic, tp.partition) for tp in parts}

    def consume(self, n: int, timeout: float) -> list[Msg]:
        out: list[Msg] = []
        while self.cursor < len(self.log) and len(out) < n:
            m = self.log[self.cursor]
            if (m.topic(), m.partition()) in self.paused:
                break  # one partition in these tests: paused means nothing is read
            out.append(m)
            self.cursor += 1
        if not out:
            time.sleep(min(timeout, 0.001))
        return out

    def position(self, parts: list[TopicPartition]) -> list[TopicPartition]:
        read = self.log[: self.cursor]
        return [
            TopicPartition(tp.topic, tp.partition, sum(1 for m in read if m.topic() == tp.topic
                                                       and m.partition() == tp.partition))
            for tp in parts
        ]  # fmt: skip

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool) -> tuple[int, int]:
        return 0, sum(1 for m in self.log if (m.topic(), m.partition()) == (tp.topic, tp.partition))

    def seek(self, tp: TopicPartition) -> None:
        for i, m in enumerate(self.log):
            if (m.topic(), m.partition(), m.offset()) == (tp.topic, tp.partition, tp.offset):
                self.cursor = min(self.cursor, i)

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits.append({(tp.topic, tp.partition): tp.offset for tp in offsets})

    def committed(self, topic: str, partition: int = 0) -> int:
        for c in reversed(self.commits):
            if (topic, partition) in c:
                return c[(topic, partition)]
        return 0

    def close(self) -> None:
        pass


class DeadLetters:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def produce(self, topic: str, key: bytes | None, value: bytes, headers: Any) -> None:
        self.sent.append({"topic": topic, "value": value, "headers": dict(headers)})

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return 0


class Warehouse:
    """Keeps inserted rows per table; deduplicates by token as ClickHouse does."""

    def __init__(self) -> None:
        self.down = False
        self.lose_reply = False  # the insert lands, the reply does not
        self.refuse: Callable[[str, dict[str, list[Any]]], Exception | None] = lambda t, c: None
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.tokens: set[str] = set()
        self.inserts: list[tuple[str, int, str]] = []
        self.calls = 0

    def insert(
        self,
        table: str,
        data: list[list[Any]],
        column_names: list[str],
        column_oriented: bool,
        settings: dict[str, str],
    ) -> None:
        self.calls += 1
        if self.down:
            raise OperationalError("Error HTTPConnectionPool: Connection refused")
        cols = dict(zip(column_names, data, strict=True))
        refused = self.refuse(table, cols)
        if refused is not None:
            raise refused
        token = settings["insert_deduplication_token"]
        if token not in self.tokens:
            self.tokens.add(token)
            rows = [dict(zip(cols, r, strict=True)) for r in zip(*cols.values(), strict=True)]
            self.tables.setdefault(table, []).extend(rows)
            self.inserts.append((table, len(rows), token))
        if self.lose_reply:
            self.lose_reply = False
            raise OperationalError("Connection reset by peer")

    def insert_arrow(self, table: str, arrow_table: Any, settings: dict[str, str]) -> None:
        cols = arrow_table.to_pydict()
        self.insert(table, list(cols.values()), list(cols), True, settings)

    def ping(self) -> bool:
        return not self.down

    def close(self) -> None:
        pass

    def ids(self, table: str = "steps") -> list[str]:
        return [r["event_id"] for r in self.tables.get(table, [])]


def span_batch(i: int) -> bytes:
    cols = {
        "ts_ns": [1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_100 + i],
        "rank": [0, 1],
        "step": [i, i],
        "phase": ["forward", "backward"],
        "name": ["forward", "backward"],
        "duration_ms": [10.0, 20.0],
    }
    return encode_batch("span", cols, job_id="job", node="n0", batch_id=f"s{i}")


def step_batch(i: int, n: int = ROWS, **over: Any) -> bytes:
    cols = {
        "ts_ns": [1_700_000_000_000_000_000 + i * n + k for k in range(n)],
        "rank": [k % 4 for k in range(n)],
        "step": [i * n + k for k in range(n)],
        "step_time_ms": [100.0] * n,
    } | over
    return encode_batch("step", cols, job_id="job", node="n0", batch_id=f"b{i}")


def make_sink(**settings: Any) -> tuple[Sink, Broker, Warehouse, DeadLetters]:
    broker, wh, dlq = Broker(), Warehouse(), DeadLetters()
    conf = SinkSettings(**({"flush_interval_s": 0.05, "max_batch_rows": 5 * ROWS} | settings))
    sink = Sink(conf, consumer_=broker, dlq_producer=dlq, warehouse=wh)  # type: ignore[arg-type]
    sink.start()
    return sink, broker, wh, dlq


def run_until(sink: Sink, done: Callable[[], bool], limit: int = 2000) -> None:
    for _ in range(limit):
        sink.step()
        if done():
            return
    raise AssertionError("the sink did not get there")
