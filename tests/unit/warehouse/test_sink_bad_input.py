"""What the sink does with bad input: a batch the warehouse refuses is split and only the bad
message dead-lettered, poison goes to the DLQ with its reason, a dead letter is never
dead-lettered again, and a bug building rows stops nothing."""

from __future__ import annotations

from typing import Any

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, DataError

from perfloop.bad_input import skip_policy
from perfloop.kafka import dlq_headers
from perfloop.schemas.topics import Topics
from perfloop.settings import SinkSettings
from perfloop.warehouse import sink as sink_mod
from perfloop.warehouse.sink import Sink
from tests.unit.warehouse.sink_fakes import (
    ROWS,
    Broker,
    DeadLetters,
    Warehouse,
    make_sink,
    run_until,
    span_batch,
    step_batch,
    windows_message,
)


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
