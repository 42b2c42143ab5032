"""Acceptance: the broker is SIGKILLed mid-run (the embedded memory broker restarts empty) while
a producer publishes steady batches; every event the producer accepted lands in the warehouse
exactly once.

The kill runs on a stack of its own, brought up like the session's `stack` fixture: the
session stack is shared, and other tests rely on its services never having restarted (as
`test_cli_stack` does for its own broker kill)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher
from perfloop.schemas import decode_batch
from perfloop.settings import ProducerSettings, StackSettings
from perfloop.stack import read_state
from perfloop.warehouse import client

from .conftest import pid_alive, private_stack, wait_for

pytestmark = pytest.mark.integration

BATCH = 100  # samples per batch, one batch every 50 ms


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(tmp_path_factory.mktemp("perfloop-broker-loss")) as settings:
        yield settings


class Ledger:
    """Stands between the emitter and the publisher: the event ids of every accepted batch."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.ids: set[str] = set()
        self.messages = 0

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        ok = self.publisher.publish(topic, key, value)
        if ok:
            self.ids.update(decode_batch(value).event_ids())
            self.messages += 1
        return ok


def _broker(stack: StackSettings) -> dict[str, Any]:
    state = read_state(stack)
    assert state is not None, "the stack is not up"
    return dict(state["services"]["broker"])


def _warehouse(stack: StackSettings, job: str) -> tuple[int, int, set[str]]:
    ch = client(stack)
    try:
        q = {"j": job}
        n, uniq = ch.query(
            "SELECT count(), uniqExact(event_id) FROM steps WHERE job_id = {j:String}",
            parameters=q,
        ).result_rows[0]
        ids = ch.query(
            "SELECT DISTINCT event_id FROM steps WHERE job_id = {j:String}", parameters=q
        ).result_rows
    finally:
        ch.close()
    return int(n), int(uniq), {r[0] for r in ids}


def test_broker_killed_mid_run_every_accepted_event_lands_exactly_once(
    own_stack: StackSettings, tmp_path: Path
) -> None:
    stack = own_stack
    job = f"it-bl-{uuid.uuid4().hex[:8]}"
    settings = ProducerSettings(
        home=stack.home,
        kafka_port=stack.kafka_port,
        clickhouse_port=stack.clickhouse_port,
        kafka_bootstrap_override=stack.kafka_bootstrap_override,
        linger_ms=5,
        spool_dir=tmp_path / "spool",
        spool_max_bytes=32 << 20,
        spool_segment_bytes=256 << 10,
    )
    pub = Publisher(settings, producer_id="broker-loss")
    ledger = Ledger(pub)
    em = Emitter(ledger, job_id=job, node="n0", producer_id="broker-loss")
    stop = threading.Event()
    steps = [0]

    def produce() -> None:  # a training loop: steady steps, never waits on the publisher
        while not stop.wait(0.05):
            s0 = steps[0]
            n = np.arange(s0, s0 + BATCH, dtype=np.int64)
            em.extend(
                "step",
                ts_ns=time.time_ns() - 1_000_000 + (n - s0),
                rank=n % 4,
                step=n,
                step_time_ms=np.full(BATCH, 100.0),
            )
            em.flush()
            steps[0] += BATCH

    loop = threading.Thread(target=produce, name="test-training-loop", daemon=True)
    loop.start()
    try:
        # Let the sink take some of it, then kill the broker while batches keep coming.
        wait_for(lambda: _warehouse(stack, job)[0] > 0, 30, "the first rows in the warehouse")
        time.sleep(0.3)  # some acknowledged batches are not consumed yet
        before = _broker(stack)
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: not pid_alive(before["pid"]), 10, "the broker to die")
        wait_for(
            lambda: (b := _broker(stack))["pid"] != before["pid"] and b["state"] == "running",
            60,
            "the supervisor to restart the broker",
        )
        time.sleep(2.0)  # publishing goes on after the restart
    finally:
        stop.set()
        loop.join(10)
    assert pub.flush(60) == 0, f"still outstanding: {pub.stats}"
    st = pub.stats

    # The producer: nothing refused, failed or dropped; every accepted message acknowledged
    # once (resends are extra); the restart was noticed; the spool stayed in its bound.
    assert ledger.messages == st.accepted > 0
    assert st.published == st.accepted
    assert st.refused == st.failed == st.dropped == st.corrupt == 0
    assert st.in_flight == st.spool_messages == 0
    assert st.broker_losses >= 1 and st.resent >= 1 and st.recycles >= 1
    assert st.spooled >= 1 and st.replayed == st.spooled
    assert 0 < st.spool_bytes_peak <= settings.spool_max_bytes

    # The warehouse: the same event ids, each once.
    wait_for(
        lambda: _warehouse(stack, job)[2] >= ledger.ids,
        90,
        f"all {len(ledger.ids)} accepted events in the warehouse",
    )
    time.sleep(2.5)  # a late repeat would land within two sink flushes
    count, uniq, ids = _warehouse(stack, job)
    assert ids == ledger.ids
    assert count == uniq == len(ledger.ids)
    pub.close()


def test_a_restarted_process_replays_what_its_spool_kept(
    own_stack: StackSettings, tmp_path: Path
) -> None:
    stack = own_stack
    job = f"it-rs-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    with socket.socket() as s:  # a port nothing listens on: the broker is unreachable
        s.bind(("127.0.0.1", 0))
        dead_port = int(s.getsockname()[1])
    first = Publisher(
        ProducerSettings(
            home=tmp_path, kafka_port=dead_port, kafka_bootstrap_override=None, spool_dir=spool
        ),
        producer_id="restart",
    )
    ledger = Ledger(first)
    em = Emitter(ledger, job_id=job, node="n0", producer_id="restart", max_samples=50)
    n = np.arange(500, dtype=np.int64)
    em.extend("step", ts_ns=time.time_ns() + n, rank=n % 2, step=n, step_time_ms=n + 1.0)
    assert em.flush() == 10
    first.close(timeout_s=0)  # the process ends before the broker answered
    assert first.stats.spool_messages == 10

    settings = ProducerSettings(
        home=stack.home,
        kafka_port=stack.kafka_port,
        clickhouse_port=stack.clickhouse_port,
        kafka_bootstrap_override=stack.kafka_bootstrap_override,
        spool_dir=spool,
    )
    again = Publisher(settings, producer_id="restart")
    assert again.flush(60) == 0
    st = again.stats
    assert st.restored == st.replayed == st.published == 10
    assert st.spool_messages == 0 and not list(spool.glob("*.seg"))
    again.close()
    wait_for(
        lambda: _warehouse(stack, job)[2] == ledger.ids, 60, "the replayed events in the warehouse"
    )
    count, uniq, _ = _warehouse(stack, job)
    assert count == uniq == 500
