"""The warehouse sink: every topic in `TABLES`, batched into its table, at least once.

Rows accumulate in memory per table and are inserted column by column about once a second
(or at ``max_batch_rows``). Each insert carries a deduplication token built from the ids of
the messages it holds (batch or event ids), so a retried batch lands once; offsets are
committed only after every insert they cover succeeded. While the warehouse is down the sink
pauses its consumer (memory stays bounded by one batch) and retries with backoff; nothing is
lost. A message that does not decode goes to ``perfloop.dlq`` with the reason and the source,
and is committed past.

A message that arrives twice (a producer resending what a restarted broker lost) carries the
same batch or event id; the sink remembers the last ``dedup_window_messages`` ids and drops a
repeat. The memory is per sink process: after a sink restart, a repeat can land once more.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from clickhouse_connect.driver.exceptions import ClickHouseError
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from perfloop.catalog import KIND_TABLES, KIND_TOPICS, TABLES, Topics
from perfloop.exceptions import PerfloopError
from perfloop.kafka import consumer, dlq_headers, producer
from perfloop.schemas import SchemaError, decode_batch, decode_event
from perfloop.settings import SinkSettings
from perfloop.warehouse import client

__all__ = ["Sink", "rows_from_message"]

log = logging.getLogger("perfloop.sink")

Rows = dict[str, list[Any]]


def _str(v: Any) -> str:
    return "" if v is None else str(v)


def _telemetry(data: bytes) -> tuple[str, Rows, str]:
    batch = decode_batch(data)
    n = len(batch)
    cols: Rows = {
        "ts": batch.columns["ts_ns"].tolist(),
        "event_id": batch.event_ids(),
        "job_id": [batch.job_id] * n,
        "node": [batch.node] * n,
    }
    for name, arr in batch.columns.items():
        if name == "ts_ns":
            continue
        values = arr.tolist()
        if name in _NULLABLE:  # NaN stands for "not reported": store NULL
            values = [None if v != v else v for v in values]
        cols[name] = values
    return KIND_TABLES[batch.kind], cols, batch.batch_id


_NULLABLE = frozenset({"loss", "grad_norm", "lr"})


def _windows(data: bytes) -> tuple[str, Rows, str]:
    try:
        doc = orjson.loads(data)
        rows = doc["rows"]
        cols: Rows = {"ts": [], "event_id": []}
        for r in rows:
            cols["ts"].append(int(r["ts_ns"]))
            cols["event_id"].append(f"{r['job_id']}:{r['rank']}:{r['metric']}:{r['ts_ns']}")
            for k in (
                "job_id",
                "node",
                "rank",
                "metric",
                "window_s",
                "count",
                "mean",
                "min",
                "max",
                "p50",
                "p95",
                "p99",
                "rate_per_s",
                "slope_per_s",
            ):
                cols.setdefault(k, []).append(r[k])
            cols.setdefault("window_end", []).append(int(r["window_end_ns"]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise SchemaError(f"windows message is malformed: {type(e).__name__}: {e}") from None
    return "windows", cols, ""


def _event(data: bytes, topic: str) -> tuple[str, Rows, str]:
    ev = decode_event(data)
    if KIND_TOPICS[ev.KIND] != topic:
        raise SchemaError(f"{ev.KIND} event does not belong on {topic}")
    row = ev.model_dump()
    row["ts"] = row.pop("ts_ns")
    row.pop("schema_version")
    shape = _EVENT_SHAPES.get(ev.KIND)
    if shape is not None:
        shape(row)
    return KIND_TABLES[ev.KIND], {k: [v] for k, v in row.items()}, ev.event_id


def _recommendation(row: dict[str, Any]) -> None:
    row["rec_id"] = row["event_id"]
    row["from_value"], row["to_value"] = _str(row["from_value"]), _str(row["to_value"])


def _command(row: dict[str, Any]) -> None:
    row["command_id"] = row["event_id"]
    row["from_value"], row["value"] = _str(row["from_value"]), _str(row["value"])
    row["expires_ts"] = row.pop("expires_ts_ns")


def _actuation(row: dict[str, Any]) -> None:
    row["value"] = _str(row["value"])


def _ground_truth(row: dict[str, Any]) -> None:
    row["onset"] = row.pop("onset_ns")
    end = row.pop("end_ns")
    row["end"] = end or None


_EVENT_SHAPES: dict[str, Callable[[dict[str, Any]], None]] = {
    "recommendation": _recommendation,
    "command": _command,
    "actuation": _actuation,
    "ground_truth": _ground_truth,
}
_BATCH_TOPICS = frozenset({Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN})


def rows_from_message(topic: str, data: bytes) -> tuple[str, Rows, str]:
    """The table, its columns and the message's dedup id for one message of ``topic``.

    Raise `SchemaError` if the message is bad or does not belong on ``topic``. The dedup id
    is the batch id (telemetry) or the event id (job and control events): a message sent
    twice carries the same one.
    """
    if topic == Topics.WINDOWS:
        return _windows(data)
    if topic in _BATCH_TOPICS:
        table, cols, dedup = _telemetry(data)
        if table not in TABLES[topic]:
            raise SchemaError(f"a {table} batch does not belong on {topic}")
        return table, cols, dedup
    return _event(data, topic)


class _RecentIds:
    """The ids of the last ``capacity`` messages inserted, to drop a message sent twice."""

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, key: str) -> bool:
        return key in self._ids

    def add(self, key: str) -> None:
        self._ids[key] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)


@dataclass
class _Pending:
    """Rows waiting for one table's next insert, and the identity of what they came from."""

    columns: Rows = field(default_factory=dict)
    rows: int = 0
    ids: list[str] = field(default_factory=list)

    def extend(self, cols: Rows, message_id: str) -> None:
        # Every builder of one table yields the same columns (defaults are filled at decode).
        for k, v in cols.items():
            self.columns.setdefault(k, []).extend(v)
        self.rows += len(cols["ts"])
        self.ids.append(message_id)

    def token(self) -> str:
        """The insert's deduplication token: a hash of the messages it holds, by their own ids.

        Offsets would not do: a broker that restarts empty numbers its log from 0 again, so a
        new insert could repeat an old token and be dropped by the warehouse as a retry.
        """
        h = hashlib.sha256("\n".join(sorted(self.ids)).encode())
        return h.hexdigest()[:32]


class Sink:
    """Consumes the catalog's topics and inserts them into the warehouse."""

    def __init__(self, settings: SinkSettings) -> None:
        self.settings = settings
        self._stop = threading.Event()
        self._consumer = consumer(
            settings, settings.group_id, **{"session.timeout.ms": settings.session_timeout_ms}
        )
        self._dlq = producer(settings)
        self._ch = client(settings)
        self._pending: dict[str, _Pending] = {}
        self._offsets: dict[tuple[str, int], int] = {}
        self._paused = False
        self.inserted_rows = 0
        self.dead_letters = 0
        self.duplicates = 0
        self._seen = _RecentIds(settings.dedup_window_messages)

    def start(self) -> None:
        # Land and commit what was read from partitions before they move to another sink.
        self._consumer.subscribe(list(TABLES), on_revoke=lambda c, parts: self._flush())

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.start()
        last_flush = time.monotonic()
        try:
            while not self._stop.is_set():
                # Paused partitions yield nothing, but polling keeps the group membership.
                msgs = self._consumer.consume(5000, 0.2)
                for msg in msgs:
                    self._take(msg)
                buffered = sum(p.rows for p in self._pending.values())
                due = time.monotonic() - last_flush >= self.settings.flush_interval_s
                if (
                    due and (buffered or self._offsets)
                ) or buffered >= self.settings.max_batch_rows:
                    self._flush()
                    last_flush = time.monotonic()
            self._flush()
        finally:
            self._consumer.close()
            self._dlq.flush(5)
            self._ch.close()

    def _take(self, msg: Message) -> None:
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", msg.error())
            return
        topic, part, off = msg.topic(), msg.partition(), msg.offset()
        try:
            table, cols, dedup = rows_from_message(topic, msg.value() or b"")
        except SchemaError as e:
            log.warning("dead letter %s[%s]@%s: %s", topic, part, off, e)
            self._dlq.produce(
                Topics.DLQ,
                key=msg.key(),
                value=msg.value(),
                headers=dlq_headers(str(e), topic, part, off),
            )
            self._dlq.poll(0)
            self.dead_letters += 1
        else:
            if dedup and dedup in self._seen:  # sent twice (a producer's resend): drop
                self.duplicates += 1
            else:
                if dedup:
                    self._seen.add(dedup)
                # A message without an id of its own (windows) is known by its content.
                message_id = dedup or hashlib.sha1(msg.value() or b"").hexdigest()
                self._pending.setdefault(table, _Pending()).extend(cols, message_id)
        self._offsets[(topic, part)] = off + 1

    def _flush(self) -> None:
        for table in list(self._pending):
            pending = self._pending[table]
            try:
                self._ch.insert(
                    table,
                    list(pending.columns.values()),
                    column_names=list(pending.columns),
                    column_oriented=True,
                    settings={"insert_deduplication_token": pending.token()},
                )
            except (ClickHouseError, PerfloopError, OSError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log.warning("insert into %s failed, pausing consumption: %s", table, first)
                self._pause()
                return
            self.inserted_rows += pending.rows
            del self._pending[table]
        if self._offsets:
            self._dlq.flush(5)
            try:
                self._consumer.commit(
                    offsets=[TopicPartition(t, p, o) for (t, p), o in self._offsets.items()],
                    asynchronous=False,
                )
            except KafkaException as e:  # e.g. a rebalance: the next flush commits again
                log.warning("offset commit failed, will retry: %s", e)
            else:
                self._offsets.clear()
        self._resume()

    def _pause(self) -> None:
        if not self._paused:
            self._consumer.pause(self._consumer.assignment())
            self._paused = True
        time.sleep(min(5.0, self.settings.flush_interval_s))

    def _resume(self) -> None:
        if self._paused:
            self._consumer.resume(self._consumer.assignment())
            self._paused = False
