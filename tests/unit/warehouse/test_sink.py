"""The sink's batching, commit, outage and flight behaviour, with in-memory stand-ins for the
broker and the warehouse (`sink_fakes`; the real ones run in
tests/integration/test_warehouse_down.py). Bad input: test_sink_bad_input.py; telemetry read
in rounds: test_sink_rounds.py."""

from __future__ import annotations

import threading
from typing import Any

from perfloop.schemas import JobLifecycle, encode_event
from perfloop.schemas.topics import Topics
from tests.unit.warehouse.sink_fakes import (
    ROWS,
    Warehouse,
    make_sink,
    run_until,
    span_batch,
    step_batch,
    windows_message,
)


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
