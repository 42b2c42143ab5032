"""Telemetry read in rounds: each partition read to its end, paused, and read again the next
round, with nothing lost (``telemetry_in_rounds``)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition

from perfloop.schemas.topics import Topics
from perfloop.settings import SinkSettings
from perfloop.warehouse import _sink_rounds as rounds_mod
from perfloop.warehouse import sink as sink_mod
from perfloop.warehouse.sink import Sink
from tests.unit.warehouse.sink_fakes import (
    ROWS,
    Broker,
    DeadLetters,
    Msg,
    Warehouse,
    run_until,
    step_batch,
    windows_message,
)


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
