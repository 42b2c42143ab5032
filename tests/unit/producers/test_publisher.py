"""The publisher without a broker: publish() never blocks or raises, an unreachable broker
sends everything to the spool (bounded, oldest dropped and counted), a restart replays the
spool, and every accepted message is accounted for in the stats.

Bad input and what happens to it:
- a value that is not bytes, an empty topic, a key that is not str/bytes: refused (False),
  counted ``failed``, one warning line per kind of problem (repeats are counted, not logged);
- a message over the client's ``message.max.bytes``: refused at once, counted ``failed``,
  never retried;
- publish after close(): refused, counted ``failed``;
- a spool that is full: its oldest segment is dropped, counted in ``dropped`` and
  ``dropped_samples``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher, PublisherStats, count_samples
from perfloop.producers.spool import Spool
from perfloop.schemas import ProducerStats, decode_event, encode_batch, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ProducerSettings


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unreachable(home: Path, **kw: Any) -> ProducerSettings:
    """A producer whose broker does not answer (nothing listens on the port)."""
    return ProducerSettings(
        home=home,
        kafka_port=closed_port(),
        kafka_bootstrap_override=None,
        message_timeout_ms=1000,
        **kw,
    )


def batch(i: int, samples: int = 5) -> bytes:
    cols = {
        "ts_ns": np.arange(samples, dtype=np.int64) + i * 1000,
        "rank": np.zeros(samples, dtype=np.int64),
        "step": np.arange(samples, dtype=np.int64),
        "step_time_ms": np.full(samples, 100.0),
    }
    return encode_batch("step", cols, job_id="j1", node="n0", producer_id="test", seq=i + 1)


def wait_until(check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s")


def balanced(st: PublisherStats) -> bool:
    """Every message offered (or restored) is in exactly one place."""
    return st.accepted + st.refused + st.restored == (
        st.published + st.failed + st.dropped + st.corrupt + st.in_flight + st.spool_messages
    )


@pytest.fixture
def publishers() -> Iterator[list[Publisher]]:
    made: list[Publisher] = []
    yield made
    for p in made:
        p.close(timeout_s=0)


def test_unreachable_broker_publish_returns_true_and_everything_lands_in_the_spool(
    tmp_path: Path, publishers: list[Publisher]
) -> None:
    s = unreachable(tmp_path)
    pub = Publisher(s, producer_id="rank0")
    publishers.append(pub)
    assert all(pub.publish(Topics.STEP, "j1", batch(i)) for i in range(20))
    st = wait_until(lambda: (x := pub.stats).spooled == 20 and x)
    assert st.published == 0 and st.spool_messages == 20 and st.in_flight == 0
    assert st.failed == st.dropped == 0 and st.recycles >= 1 and balanced(st)
    assert st.spool_bytes > 20 * len(batch(0)) and st.spool_bytes <= s.spool_max_bytes
    assert list((tmp_path / "spool" / "rank0").glob("*.seg"))
    assert pub.flush(0.1) == 20  # still outstanding: the broker never answered


def test_a_restarted_publisher_finds_the_spool_and_owns_it(
    tmp_path: Path, publishers: list[Publisher]
) -> None:
    s = unreachable(tmp_path)
    pub = Publisher(s, producer_id="rank0")
    for i in range(5):
        pub.publish(Topics.STEP, "j1", batch(i))
    pub.close(timeout_s=0)  # what was in memory goes to the spool
    st = pub.stats
    assert st.spool_messages == 5 and st.published == 0 and balanced(st)
    again = Publisher(s, producer_id="rank0")
    publishers.append(again)
    st = wait_until(lambda: (x := again.stats).restored == 5 and x)
    assert st.spool_messages == 5 and balanced(st)
    assert again.publish(Topics.STEP, "j1", batch(5))
    st = wait_until(lambda: (x := again.stats).spool_messages == 6 and x)
    assert balanced(st)


def test_a_spool_held_by_another_process_is_left_alone(tmp_path: Path) -> None:
    s = unreachable(tmp_path)
    with Spool(tmp_path / "spool" / "p", max_bytes=1 << 20, segment_bytes=1 << 16) as other:
        pub = Publisher(s, producer_id="p")
        pub.publish(Topics.STEP, "j1", batch(0))
        pub.close(timeout_s=0)
        assert pub.stats.spooled == 1 and other.records == 0
    assert list((tmp_path / "spool" / f"p-{os.getpid()}").glob("*.seg"))


def test_the_spool_bound_holds_and_the_oldest_are_dropped_and_counted(
    tmp_path: Path, publishers: list[Publisher]
) -> None:
    one = len(batch(0, samples=10))
    s = unreachable(tmp_path, spool_max_bytes=12 * one, spool_segment_bytes=3 * one)
    pub = Publisher(s, producer_id="small")
    publishers.append(pub)
    for i in range(40):
        assert pub.publish(Topics.STEP, "j1", batch(i, samples=10))
    st = wait_until(lambda: (x := pub.stats).in_flight == 0 and x.dropped and x)
    assert st.spool_bytes_peak <= 12 * one
    assert st.dropped_samples == 10 * st.dropped
    assert st.spooled == 40 and st.spool_messages == 40 - st.dropped
    assert balanced(st)


def test_bad_input_is_refused_counted_and_said_once(
    tmp_path: Path, publishers: list[Publisher], caplog: pytest.LogCaptureFixture
) -> None:
    pub = Publisher(unreachable(tmp_path), producer_id="bad")
    publishers.append(pub)
    big = b"x" * (9 << 20)  # over message.max.bytes (8 MiB)
    with caplog.at_level(logging.WARNING, logger="perfloop.producers"):
        assert pub.publish(Topics.STEP, "j1", big) is False
        assert pub.publish(Topics.STEP, "j1", big) is False
        assert pub.publish(Topics.STEP, "j1", "not bytes") is False  # type: ignore[arg-type]
        assert pub.publish("", "j1", b"{}") is False
        assert pub.publish(Topics.STEP, None, b"{}") is False  # type: ignore[arg-type]
    st = pub.stats
    assert st.failed == st.refused == 5 and st.accepted == 0 and balanced(st)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("over the" in line for line in lines) == 1  # the repeat was counted only
    assert all("\n" not in line for line in lines)


def test_publish_after_close_is_refused(tmp_path: Path) -> None:
    pub = Publisher(unreachable(tmp_path), producer_id="closed")
    pub.close(timeout_s=0)
    assert pub.publish(Topics.STEP, "j1", batch(0)) is False
    assert pub.stats.failed == 1


def test_more_than_the_memory_bound_goes_to_disk_not_away(
    tmp_path: Path, publishers: list[Publisher]
) -> None:
    pub = Publisher(unreachable(tmp_path), producer_id="tiny", max_buffer_bytes=20_000)
    publishers.append(pub)
    n = 200
    accepted = sum(pub.publish(Topics.STEP, "j1", batch(i)) for i in range(n))
    st = wait_until(lambda: (x := pub.stats).in_flight == 0 and x)
    # What the memory could not hold was refused at once (counted dropped); everything
    # accepted reached the disk.
    assert st.accepted == accepted and st.refused == n - accepted == st.dropped
    assert st.spooled == accepted and st.published == st.failed == 0 and balanced(st)


def test_emitter_batches_go_through_and_stats_event_reports_them(
    tmp_path: Path, publishers: list[Publisher]
) -> None:
    pub = Publisher(unreachable(tmp_path), producer_id="em")
    publishers.append(pub)
    em = Emitter(pub, job_id="j1", node="n0", producer_id="em", max_samples=1000)
    em.extend(
        "step",
        ts_ns=np.arange(2500, dtype=np.int64),
        rank=np.zeros(2500, dtype=np.int64),
        step=np.arange(2500, dtype=np.int64),
        step_time_ms=np.full(2500, 100.0),
    )
    assert em.flush() == 3
    pub.close(timeout_s=0)  # no broker: the three messages go to the spool
    st = pub.stats
    ev = pub.stats_event("j1", "n0", 0, samples=em.samples)
    assert isinstance(ev, ProducerStats)
    assert (ev.samples, ev.messages, ev.spooled, ev.published) == (2500, 3, 3, 0)
    assert ev.spool_bytes == st.spool_bytes and ev.cpu_time_ms > 0 and ev.overhead_pct >= 0
    assert decode_event(encode_event(ev)) == ev


def test_a_batch_that_cannot_be_encoded_loses_its_own_rows_only() -> None:
    """Bad input: a kind whose rows cannot be encoded is lost (its sequence number is used,
    so the gap marks it) and the flush raises for the caller to count; the other kinds of
    the same flush still leave, together."""

    class Collect:
        def __init__(self) -> None:
            self.sent: list[str] = []

        def publish(self, topic: str, key: str, value: bytes) -> bool:
            self.sent.append(topic)
            return True

    pub = Collect()
    em = Emitter(pub, job_id="j1", node="n0", producer_id="em")
    em.add("step", ts_ns=1, rank=0, step=0, step_time_ms=1.0)
    bad = {"phase": ["forward"], "name": ["f"], "duration_ms": [object()], "depth": [0]}
    em.extend("span", ts_ns=[1], rank=[0], step=[0], **bad)  # sorted first: "span" < "step"
    with pytest.raises(TypeError, match="not JSON serializable"):
        em.flush()
    assert pub.sent == [Topics.STEP] and (em.samples, em.messages) == (1, 1)
    em.add("span", ts_ns=2, rank=0, step=1, phase="forward", name="f", duration_ms=1.0, depth=0)
    assert em.flush() == 1 and pub.sent[-1] == Topics.SPAN


def test_start_stats_publishes_producer_stats_events_on_its_own(
    tmp_path: Path, publishers: list[Publisher]
) -> None:
    pub = Publisher(unreachable(tmp_path), producer_id="st")
    publishers.append(pub)
    pub.start_stats("j1", "n0", 0, samples=lambda: 7, interval_s=0.1)
    wait_until(lambda: pub.stats.accepted >= 2)


def test_count_samples_reads_the_ts_column_of_a_batch() -> None:
    assert count_samples(batch(0, samples=7)) == 7
    assert count_samples(batch(0, samples=1)) == 1
    assert count_samples(b'{"columns":{"ts_ns":[]}}') == 0
    assert count_samples(b'{"kind":"lifecycle"}') == 1  # one event


def test_a_fatal_error_out_of_poll_replaces_the_producer_and_the_thread_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """librdkafka raises a fatal error (an idempotent producer's UNKNOWN_PRODUCER_ID after the
    broker lost its log) out of poll(), never to error_cb: it once ended the publisher's thread,
    and every later publish was refused as "after close()". The producer is replaced instead."""
    from confluent_kafka import KafkaError, KafkaException

    pub = Publisher(unreachable(tmp_path), producer_id="fatal")
    try:
        assert pub.publish(Topics.STEP, "j1", batch(0))
        real = pub._producer

        class Raising:
            """The producer, but poll() raises the fatal error once."""

            raised = False

            def poll(self, timeout: float = 0) -> int:
                if not Raising.raised:
                    Raising.raised = True
                    err = KafkaError(
                        KafkaError.UNKNOWN_PRODUCER_ID, "unknown producer id", fatal=True
                    )
                    raise KafkaException(err)
                return int(real.poll(timeout))

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        before = pub.stats.recycles
        with caplog.at_level(logging.WARNING):
            pub._producer = Raising()  # type: ignore[assignment]
            assert pub.publish(Topics.STEP, "j1", batch(1))
            deadline = time.monotonic() + 10
            while pub.stats.recycles == before and time.monotonic() < deadline:
                time.sleep(0.05)
        assert Raising.raised and pub.stats.recycles > before
        assert pub.publish(Topics.STEP, "j1", batch(2)), "the publisher still takes messages"
        assert not any("publisher thread failed" in r.getMessage() for r in caplog.records)
        assert any("fatal producer error" in r.getMessage() for r in caplog.records)
    finally:
        pub.close(timeout_s=0)
    assert pub.stats.failed == 0
