"""The sink's batching, commit, outage and poison behaviour, with in-memory stand-ins for the
broker and the warehouse (the real ones run in tests/integration/test_warehouse_down.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, DataError, OperationalError
from confluent_kafka import KafkaError, TopicPartition

from perfloop.bad_input import skip_policy
from perfloop.kafka import dlq_headers
from perfloop.schemas import JobLifecycle, encode_batch, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import SinkSettings
from perfloop.warehouse import _sink_rounds as rounds_mod
from perfloop.warehouse import sink as sink_mod
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


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_mod, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(sink_mod, "RETRY_MAX_S", 0.02)


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


def test_rows_are_batched_into_large_inserts_and_committed_after() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=60.0, max_batch_rows=4 * ROWS)
    for i in range(8):
        broker.add(Topics.STEP, step_batch(i))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 8)
    # Full batches — half of max_batch_rows, as one batch is in the air while the next one
    # fills — inserted as soon as they were full (long before the 60 s interval); what one
    # read returned past that is read again for the next batch.
    assert [n for _, n, _ in wh.inserts] == [2 * ROWS] * 4
    assert len(wh.ids()) == len(set(wh.ids())) == 8 * ROWS
    assert sink.stats.inserts == 4 and sink.stats.max_insert_rows == 2 * ROWS
    assert sink.stats.max_pending_rows <= 4 * ROWS + 2 * ROWS


def test_a_due_flush_inserts_what_is_there() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=0.01)
    broker.add(Topics.STEP, step_batch(0, n=3))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert len(wh.ids()) == 3


def test_warehouse_down_pauses_bounds_memory_and_loses_nothing() -> None:
    sink, broker, wh, _ = make_sink(max_batch_rows=3 * ROWS)
    wh.down = True
    for i in range(40):  # steady production through an outage, far past max_batch_rows
        broker.add(Topics.STEP, step_batch(i))
        sink.step()
        sink.step()
    assert sink.paused and broker.paused == {(Topics.STEP, 0)}
    # Held — the failed batch and the one filling behind it — at most max_batch_rows plus
    # the message that filled each (one message per consume call here).
    assert 0 < sink.pending_rows <= 3 * ROWS + 2 * ROWS
    assert sink.stats.max_pending_rows <= 3 * ROWS + 2 * ROWS
    assert broker.cursor < len(broker.log)  # the backlog waits in the broker
    assert broker.commits == [] and wh.calls > 3  # retried; nothing committed
    for i in range(40, 80):  # a backlog builds up in the broker
        broker.add(Topics.STEP, step_batch(i))
    wh.down = False
    run_until(sink, lambda: broker.committed(Topics.STEP) == 80)
    # Draining the backlog holds no more either, and inserts half of it at a time.
    assert sink.stats.max_pending_rows <= 3 * ROWS + 2 * ROWS
    assert sink.stats.max_insert_rows <= 3 * ROWS // 2 + ROWS
    assert not sink.paused and broker.paused == set()
    assert sorted(wh.ids()) == sorted(set(wh.ids()))  # each once
    assert broker.committed(Topics.STEP) == 80
    assert sink.stats.pauses == 1 and sink.stats.paused_s > 0


def test_the_retry_after_a_lost_reply_lands_once() -> None:
    sink, broker, wh, _ = make_sink()
    wh.lose_reply = True
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert len(wh.ids()) == ROWS == len(set(wh.ids()))
    assert sink.stats.pauses == 1 and sink.stats.failed_inserts == 1


def test_a_message_sent_twice_lands_once() -> None:
    sink, broker, wh, _ = make_sink()
    broker.add(Topics.STEP, step_batch(0))
    broker.add(Topics.STEP, step_batch(0))
    broker.add(Topics.STEP, step_batch(1))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 3)
    assert len(wh.ids()) == 2 * ROWS and sink.stats.duplicates == 1


def test_a_batch_the_warehouse_refuses_is_split_and_only_the_bad_message_dead_lettered() -> None:
    sink, broker, wh, dlq = make_sink()

    def refuse(table: str, cols: dict[str, list[Any]]) -> Exception | None:
        if table == "steps" and 13.0 in cols["step_time_ms"]:
            err = DatabaseError("Code: 53. DB::Exception: Type mismatch in step_time_ms")
            err.code = 53
            return err
        return None

    wh.refuse = refuse
    broker.add(Topics.STEP, step_batch(0))
    bad = broker.add(Topics.STEP, step_batch(1, step_time_ms=[13.0] * ROWS))
    broker.add(Topics.STEP, step_batch(2))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 3)
    assert len(wh.ids()) == 2 * ROWS and not sink.paused
    assert len(dlq.sent) == 1 and dlq.sent[0]["value"] == bad.value()
    h = dlq.sent[0]["headers"]
    assert h["perfloop.source.offset"] == b"1" and b"Type mismatch" in h["perfloop.reason"]
    assert sink.stats.rejected == 1


def test_rows_the_client_cannot_encode_are_dead_lettered() -> None:
    sink, broker, wh, dlq = make_sink()
    wh.refuse = lambda t, c: DataError("Unable to create native array for column `x`")
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert (
        len(dlq.sent) == 1
        and b"cannot encode steps rows" in dlq.sent[0]["headers"]["perfloop.reason"]
    )


def test_a_transient_server_error_is_retried_not_dead_lettered() -> None:
    sink, broker, wh, dlq = make_sink()
    errors = [241, 252]  # memory limit, too many parts

    def refuse(table: str, cols: dict[str, list[Any]]) -> Exception | None:
        if errors:
            err = DatabaseError(f"Code: {errors[0]}. DB::Exception: not now")
            err.code = errors.pop(0)
            return err
        return None

    wh.refuse = refuse
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert len(wh.ids()) == ROWS and dlq.sent == []


POISON: dict[str, tuple[str, bytes]] = {
    "windows v1": (Topics.WINDOWS, b'{"kind": "windows", "rows": []}'),
    "windows garbage": (Topics.WINDOWS, b"\x00\x01"),
    "windows ragged": (Topics.WINDOWS, windows_message(2, mean=[1.0])),
    "step garbage": (Topics.STEP, b"{"),
    "step on gpu": (Topics.GPU, step_batch(9, n=1)),
    "host bad version": (Topics.HOST, b'{"kind": "host", "schema_version": 99}'),
    "span empty": (Topics.SPAN, b"{}"),
    "job unknown kind": (Topics.JOB, b'{"kind": "nope"}'),
    "phase invalid": (Topics.PHASES, b'{"kind": "phase", "level": "x"}'),
    "diagnosis invalid": (Topics.DIAGNOSES, b'{"kind": "diagnosis"}'),
    "control not json": (Topics.CONTROL, b"not json"),
    "recommendation list": (Topics.RECOMMENDATIONS, b"[]"),
    "actuation empty": (Topics.ACTUATIONS, b""),
}


@pytest.mark.parametrize("case", sorted(POISON))
def test_poison_goes_to_the_dlq_with_its_reason_and_the_sink_goes_on(case: str) -> None:
    sink, broker, wh, dlq = make_sink()
    topic, value = POISON[case]
    broker.add(topic, value)
    broker.add(Topics.STEP, step_batch(0))
    ends = {(m.topic(), m.partition()): m.offset() + 1 for m in broker.log}
    run_until(sink, lambda: all(broker.committed(t, p) == o for (t, p), o in ends.items()))
    assert len(wh.ids()) == ROWS
    assert len(dlq.sent) == 1 and dlq.sent[0]["value"] == value
    h = dlq.sent[0]["headers"]
    assert h["perfloop.source.topic"] == topic.encode() and h["perfloop.reason"]
    assert sink.stats.dead_letters == 1


def test_a_bug_building_rows_dead_letters_the_message_and_the_sink_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink, broker, wh, dlq = make_sink()
    built = sink_mod.rows_from_message

    def buggy(topic: str, value: bytes) -> Any:
        if topic == Topics.SPAN:
            raise KeyError("duration_ms")  # a row builder's bug, not bad input
        return built(topic, value)

    monkeypatch.setattr(sink_mod, "rows_from_message", buggy)
    broker.add(Topics.SPAN, span_batch(0))
    broker.add(Topics.STEP, step_batch(0))
    ends = {(m.topic(), m.partition()): m.offset() + 1 for m in broker.log}
    run_until(sink, lambda: all(broker.committed(t, p) == o for (t, p), o in ends.items()))
    assert len(wh.ids()) == ROWS  # the steps landed
    (letter,) = dlq.sent
    assert letter["value"] == span_batch(0)
    assert letter["headers"]["perfloop.reason"] == b"internal error: KeyError: 'duration_ms'"


def test_a_sink_told_to_skip_bad_input_counts_it_dropped() -> None:
    broker, wh, dlq = Broker(), Warehouse(), DeadLetters()
    conf = SinkSettings(flush_interval_s=0.05)
    sink = Sink(conf, consumer_=broker, dlq_producer=dlq, warehouse=wh,  # type: ignore[arg-type]
                on_error=skip_policy)  # fmt: skip
    sink.start()
    broker.add(Topics.STEP, b"not json")
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert dlq.sent == [] and sink.stats.dead_letters_dropped == 1


def test_dead_letters_land_in_their_table_and_are_never_dead_lettered_again() -> None:
    sink, broker, wh, dlq = make_sink()
    headers = dlq_headers("windows message: not valid JSON", Topics.WINDOWS, 0, 7)
    broker.add(Topics.DLQ, b"\x00junk", key=b"job-1", headers=headers)
    run_until(sink, lambda: broker.committed(Topics.DLQ) == 1)
    (row,) = wh.tables["dead_letters"]
    assert (row["topic"], row["offset"], row["job_id"]) == (Topics.WINDOWS, 7, "job-1")
    assert row["payload"] == b"\x00junk" and row["reason"].startswith("windows message")
    # A dead letter the warehouse refuses is dropped and logged, not sent to the DLQ again.
    err = DatabaseError("Code: 27. DB::Exception: cannot parse")
    err.code = 27
    wh.refuse = lambda t, c: err if t == "dead_letters" else None
    broker.add(Topics.DLQ, b"more junk", headers=headers)
    run_until(sink, lambda: broker.committed(Topics.DLQ) == 2)
    assert dlq.sent == [] and sink.stats.dead_letters_dropped == 1
    assert len(wh.tables["dead_letters"]) == 1


def test_windows_v2_and_events_land_in_their_tables() -> None:
    sink, broker, wh, _ = make_sink()
    broker.add(Topics.WINDOWS, windows_message(4))
    run_until(sink, lambda: broker.committed(Topics.WINDOWS) == 1)
    assert [r["rank"] for r in wh.tables["windows"]] == [0, 1, 2, 3]


def test_revoked_while_down_forgets_what_it_read_so_it_is_read_again() -> None:
    sink, broker, wh, _ = make_sink()
    wh.down = True
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, lambda: sink.paused)
    assert broker.on_revoke is not None
    broker.on_revoke(broker, broker.assignment())
    assert sink.pending_rows == 0 and broker.commits == []
    # The group hands the partition back from its committed offset: the rows land once.
    broker.cursor, broker.paused = 0, set()
    wh.down = False
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert len(wh.ids()) == ROWS and sink.stats.duplicates == 0


def test_small_messages_do_not_make_a_read_overshoot_the_batch() -> None:
    sink, broker, wh, _ = make_sink(max_batch_rows=3 * ROWS, flush_interval_s=60.0)
    for i in range(50):  # one-row events first, then a backlog of large batches
        ev = JobLifecycle(ts_ns=1 + i, job_id="job", node="n0", rank=0, state="started")
        broker.add(Topics.JOB, encode_event(ev))
    for i in range(30):
        broker.add(Topics.STEP, step_batch(i))
    run_until(sink, lambda: len(wh.ids()) == 30 * ROWS)
    assert sink.stats.max_pending_rows <= 3 * ROWS + 2 * ROWS
    assert len(wh.tables["job_lifecycle"]) == 50


def test_the_bytes_held_are_bounded_by_max_batch_bytes() -> None:
    """A batch is flushed once it holds half of ``max_batch_bytes`` message bytes, however few
    rows that is (here the row bound alone would let the whole backlog in)."""
    sink, broker, wh, _ = make_sink(
        max_batch_rows=10_000 * ROWS, max_batch_bytes=1 << 20, flush_interval_s=0.3
    )
    one = step_batch(0, n=2000)
    for i in range(30):
        broker.add(Topics.STEP, step_batch(i, n=2000))
    run_until(sink, lambda: len(wh.ids()) == 30 * 2000)
    assert sink.stats.max_pending_bytes <= (1 << 20) + 2 * len(one)
    assert sink.stats.inserts > 1


def test_the_next_batch_is_read_while_one_is_being_inserted() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=0.01, max_batch_rows=20 * ROWS)
    release = threading.Event()
    entered = threading.Event()
    insert = wh.insert

    def slow_insert(*args: Any, **kwargs: Any) -> None:
        entered.set()
        assert release.wait(10), "the test never released the insert"
        insert(*args, **kwargs)

    wh.insert = slow_insert  # type: ignore[method-assign]
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, entered.is_set)
    for i in range(1, 4):  # arrive while the first batch is in the air
        broker.add(Topics.STEP, step_batch(i))
    for _ in range(20):
        sink.step()
    assert broker.cursor == 4 and wh.ids() == []  # read and decoded, not yet inserted
    assert sink.pending_rows == 4 * ROWS and broker.commits == []
    release.set()
    run_until(sink, lambda: broker.committed(Topics.STEP) == 4)
    assert [n for _, n, _ in wh.inserts] == [ROWS, 3 * ROWS]  # in the order they were read
    assert len(set(wh.ids())) == 4 * ROWS


def test_windows_are_inserted_on_their_own_while_telemetry_waits_for_its_flush() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=60.0, fast_flush_interval_s=0.01)
    broker.add(Topics.STEP, step_batch(0))
    broker.add(Topics.WINDOWS, windows_message(4))
    run_until(sink, lambda: broker.committed(Topics.WINDOWS) == 1)
    # the windows landed and their offset is committed; the step rows wait for their 60 s
    # flush, their offset not committed
    assert [t for t, _, _ in wh.inserts] == ["windows"] and wh.ids() == []
    assert broker.committed(Topics.STEP) == 0 and sink.pending_rows == ROWS
    sink._next_flush = 0.0  # the telemetry's flush comes due
    run_until(sink, lambda: broker.committed(Topics.STEP) == 1)
    assert len(wh.ids()) == ROWS


def test_fast_rows_go_first_in_a_flight_with_telemetry() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=0.01, fast_flush_interval_s=60.0)
    broker.add(Topics.STEP, step_batch(0))
    broker.add(Topics.WINDOWS, windows_message(2))
    broker.add(Topics.STEP, step_batch(1))
    run_until(sink, lambda: broker.committed(Topics.STEP) == 2)
    assert [t for t, _, _ in wh.inserts] == ["windows", "steps"]


def _held_inserts(wh: Warehouse, table: str) -> tuple[threading.Event, threading.Event]:
    """Make ``wh`` hold inserts into ``table`` until released: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    insert = wh.insert

    def held(t: str, *args: Any, **kwargs: Any) -> None:
        if t == table:
            entered.set()
            assert release.wait(10), "the test never released the insert"
        insert(t, *args, **kwargs)

    wh.insert = held  # type: ignore[method-assign]
    return entered, release


def test_windows_due_while_telemetry_is_in_the_air_go_in_after_the_table_being_inserted() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=0.01, fast_flush_interval_s=0.01)
    entered, release = _held_inserts(wh, "steps")
    broker.add(Topics.STEP, step_batch(0))
    broker.add(Topics.SPAN, span_batch(0))
    run_until(sink, entered.is_set)  # a flight of steps and spans: the steps insert hangs
    broker.add(Topics.WINDOWS, windows_message(3))
    run_until(sink, lambda: sink.stats.joined == 1)
    assert sink.pending_rows == ROWS + 2 + 3  # all of it in the flight now
    release.set()
    run_until(sink, lambda: broker.committed(Topics.WINDOWS) == 1)
    # in before the spans the flight held when they joined; committed when the flight landed
    assert [t for t, _, _ in wh.inserts] == ["steps", "windows", "spans"]
    assert broker.committed(Topics.STEP) == 1 and broker.committed(Topics.SPAN) == 1
    assert sink.pending_rows == 0


def test_windows_do_not_join_a_flight_inserting_windows_or_landing() -> None:
    from perfloop.warehouse._sink_batch import Flight, Pending

    flight = Flight({"windows": Pending(), "steps": Pending()}, {("perfloop.windows", 0): 4})
    assert not flight.join({"windows": Pending()}, {("perfloop.windows", 0): 9}, frozenset())
    assert flight.offsets == {("perfloop.windows", 0): 4}  # nothing of it taken
    del flight.batches["windows"]  # landed
    assert flight.next_table() == "steps"
    assert flight.join({"windows": Pending()}, {("perfloop.windows", 0): 9}, frozenset({"windows"}))
    assert flight.next_table() == "windows"  # next, before the telemetry left
    flight.batches.clear()
    assert flight.next_table() is None  # the insert thread is done: nothing may join now
    assert not flight.join({"phases": Pending()}, {("perfloop.phases", 0): 1}, frozenset())
    assert "phases" not in flight.batches


def test_windows_joined_to_a_flight_that_fails_are_retried_with_it() -> None:
    sink, broker, wh, _ = make_sink(flush_interval_s=0.01, fast_flush_interval_s=0.01)
    entered, release = _held_inserts(wh, "steps")
    broker.add(Topics.STEP, step_batch(0))
    broker.add(Topics.SPAN, span_batch(0))
    run_until(sink, entered.is_set)
    broker.add(Topics.WINDOWS, windows_message(3))
    run_until(sink, lambda: sink.stats.joined == 1)
    wh.down = True  # the steps insert fails once released: the whole flight waits
    release.set()
    run_until(sink, lambda: sink.paused)
    assert broker.committed(Topics.WINDOWS) == 0 and len(wh.tables.get("windows", [])) == 0
    wh.down = False
    run_until(sink, lambda: broker.committed(Topics.WINDOWS) == 1)
    assert len(wh.tables["windows"]) == 3 and len(wh.ids()) == ROWS
    assert len(wh.tables["spans"]) == 2


def test_a_flight_can_be_sized_while_the_insert_thread_drops_its_landed_batches() -> None:
    from perfloop.warehouse._sink_batch import Flight, Pending

    stop = threading.Event()
    errors: list[BaseException] = []

    def size(flight: Flight) -> None:  # the reading thread: pending_rows / pending_bytes
        while not stop.is_set():
            try:
                _ = flight.rows + flight.bytes
            except RuntimeError as e:  # "dictionary changed size during iteration"
                errors.append(e)
                return

    for _ in range(200):
        flight = Flight({f"t{i}": Pending() for i in range(50)}, {})
        reader = threading.Thread(target=size, args=(flight,))
        stop.clear()
        reader.start()
        for table in list(flight.batches):  # the insert thread, as batches land
            del flight.batches[table]
        stop.set()
        reader.join()
    assert errors == []


class Eof(Msg):
    """librdkafka's end-of-partition event (``enable.partition.eof``)."""

    def __init__(self, topic: str, partition: int, offset: int) -> None:
        super().__init__(topic, partition, offset, b"")

    def error(self) -> KafkaError:  # type: ignore[override]
        return KafkaError(KafkaError._PARTITION_EOF)


class Partitioned(Broker):
    """A consumer with a position per partition: it reads only resumed partitions, at most
    ``per_read`` messages of each per call, and tells a partition's end once per new end;
    ``reads`` counts the calls that returned messages of each partition (the fetches that
    cost the embedded broker a listing of the partition)."""

    def __init__(self, per_read: int = 100) -> None:
        super().__init__()
        self.per_read = per_read
        self.at: dict[tuple[str, int], int] = {}
        self.told_end: dict[tuple[str, int], int] = {}
        self.reads: dict[tuple[str, int], int] = {}
        self.ever_paused: set[tuple[str, int]] = set()

    def pause(self, parts: list[TopicPartition]) -> None:
        super().pause(parts)
        self.ever_paused |= self.paused

    def position(self, parts: list[TopicPartition]) -> list[TopicPartition]:  # type: ignore[override]
        return [TopicPartition(tp.topic, tp.partition, self.at.get((tp.topic, tp.partition), -1001))
                for tp in parts]  # fmt: skip

    def consume(self, n: int, timeout: float) -> list[Msg]:
        out: list[Msg] = []
        for tp in sorted({(m.topic(), m.partition()) for m in self.log}):
            if tp in self.paused:
                continue
            mine = [m for m in self.log if (m.topic(), m.partition()) == tp]
            at = self.at.get(tp, 0)
            take = mine[at : at + min(self.per_read, n - len(out))]
            out += take
            if take:
                self.reads[tp] = self.reads.get(tp, 0) + 1
            self.at[tp] = at = at + len(take)
            if at == len(mine) and self.told_end.get(tp) != at:
                self.told_end[tp] = at
                out.append(Eof(*tp, at))
        if not out:
            time.sleep(min(timeout, 0.001))
        return out


def rounds_sink(
    monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> tuple[Sink, Partitioned, Warehouse]:
    monkeypatch.setattr(rounds_mod, "ROUND_LEAD_S", 0.02)
    monkeypatch.setattr(sink_mod, "ROUND_IDLE_S", 0.02)
    broker, wh = Partitioned(), Warehouse()
    defaults = {"flush_interval_s": 0.1, "fetch_max_wait_ms": 1, "telemetry_in_rounds": True}
    conf = SinkSettings(**(defaults | settings))
    sink = Sink(conf, consumer_=broker, dlq_producer=DeadLetters(), warehouse=wh)  # type: ignore[arg-type]
    sink.start()
    return sink, broker, wh


def run_for(sink: Sink, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sink.step()


@pytest.mark.parametrize("rounds", [True, False])
def test_telemetry_is_read_in_rounds_and_nothing_is_lost(
    monkeypatch: pytest.MonkeyPatch, rounds: bool
) -> None:
    sink, broker, wh = rounds_sink(monkeypatch, telemetry_in_rounds=rounds)
    step, windows = (Topics.STEP, 0), (Topics.WINDOWS, 0)
    n = 0
    end = time.monotonic() + 0.5  # ~5 rounds; a message arrives at every turn of the loop
    while time.monotonic() < end:
        broker.add(Topics.STEP, step_batch(n, n=2))
        broker.add(Topics.WINDOWS, windows_message(1, rank=[n]))
        n += 1
        sink.step()
    run_until(sink, lambda: broker.committed(Topics.STEP) == n)
    assert len(wh.ids()) == len(set(wh.ids())) == 2 * n
    assert len(wh.tables["windows"]) == n
    assert windows not in broker.ever_paused  # rows someone waits for are always read
    if rounds:  # the telemetry partition: read about once a round, paused at its end
        assert 3 <= sink.stats.rounds <= 8 and step in broker.ever_paused
        assert broker.reads[step] <= 2 * sink.stats.rounds + 2 < n / 10
    else:  # ... or at every turn that found a new message
        assert sink.stats.rounds == 0 and not broker.ever_paused
        assert broker.reads[step] > n / 2


def test_a_partition_behind_is_not_paused_until_it_reaches_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink, broker, wh = rounds_sink(monkeypatch)
    broker.per_read = 1
    for i in range(40):
        broker.add(Topics.STEP, step_batch(i, n=5))
    turns = 0
    while broker.committed(Topics.STEP) < 40:
        assert (Topics.STEP, 0) not in broker.paused or broker.at[(Topics.STEP, 0)] == 40
        sink.step()
        turns += 1
    assert len(wh.ids()) == 200 and (Topics.STEP, 0) in broker.ever_paused
    assert turns < 200  # read at one message a turn, not one a round


def test_an_idle_telemetry_partition_is_paused_and_read_again_next_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink, broker, wh = rounds_sink(monkeypatch)
    idle = (Topics.STEP, 1)
    broker.add(Topics.STEP, step_batch(0), partition=1)  # read before this sink started:
    broker.at[idle] = broker.told_end[idle] = 1  # nothing new, its end already told
    broker.add(Topics.STEP, step_batch(1))
    run_until(sink, lambda: (Topics.STEP, 0) in broker.paused)
    run_for(sink, 0.3)  # ~3 rounds
    # Nothing taken from it since it was assigned: its position may be another assignment's,
    # and an idle partition costs the broker nothing to fetch anyway.
    assert idle not in broker.ever_paused
    broker.add(Topics.STEP, step_batch(2), partition=1)
    run_until(sink, lambda: idle in broker.paused)  # taken from, then at its end
    broker.add(Topics.STEP, step_batch(3), partition=1)
    run_until(sink, lambda: broker.committed(Topics.STEP, 1) == 3)
    assert sink.stats.rounds >= 1 and len(wh.ids()) == 3 * ROWS


def test_a_partition_past_its_end_is_never_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker restarted empty: the consumer's position is in the old log, past the new
    end, until it takes a message of the new one. Pausing there would seek back each round."""
    sink, broker, _ = rounds_sink(monkeypatch)
    step = (Topics.STEP, 0)
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, lambda: step in broker.paused)
    broker.log.clear()
    broker.at[step] = 500  # where the lost log ended
    broker.paused.clear()
    broker.ever_paused.clear()
    broker.told_end[step] = 0
    broker.add(Topics.STEP, step_batch(1))  # the new log: its end is 1, the position 500
    broker.at[step] = 500
    run_for(sink, 0.3)
    assert step not in broker.ever_paused


def test_a_held_partition_revoked_is_resumed_and_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause outlives the assignment (librdkafka): a held partition revoked is resumed
    first, and once assigned again it is not paused before a message of it is taken."""
    sink, broker, _ = rounds_sink(monkeypatch)
    step = TopicPartition(Topics.STEP, 0)
    broker.add(Topics.STEP, step_batch(0))
    run_until(sink, lambda: (Topics.STEP, 0) in broker.paused)
    assert broker.on_revoke is not None and broker.on_assign is not None
    broker.on_revoke(broker, [step])
    assert (Topics.STEP, 0) not in broker.paused
    broker.on_assign(broker, [step])
    broker.ever_paused.clear()
    broker.told_end.clear()  # the end told again, with nothing taken since the assignment
    run_for(sink, 0.3)
    assert (Topics.STEP, 0) not in broker.ever_paused
