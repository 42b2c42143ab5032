"""Acceptance: a sink that starts again remembers what already landed.

A producer resends what it is not sure of (`Publisher` after a broker lost messages), and a
restarted sink reads again from its last commit. A running sink drops a message it took
before by its id; a sink that starts takes the ids of the rows that landed in the last
``PERFLOOP_DEDUP_SEED_S`` seconds of event time from the warehouse
(`perfloop.warehouse._sink_seed`). On the stack's own sink process, SIGKILLed (the process
itself) and restarted by the supervisor: a batch sent again after the restart lands once, an
event sent again lands once, and a batch whose rows are older than the window lands again
(the window is a bound, not a promise).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from perfloop.kafka import producer
from perfloop.schemas import JobLifecycle, encode_event
from perfloop.schemas.codec import encode_batch
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.stack import read_state

from .conftest import private_stack, query, wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(
        tmp_path_factory.mktemp("perfloop-sink-restart"),
        PERFLOOP_BROKER_RECYCLE_MB="0",
        PERFLOOP_FLUSH_INTERVAL_S="0.5",
    ) as settings:
        yield settings


def _steps(job: str, batch_id: str, t_ns: int) -> bytes:
    return encode_batch(
        "step",
        {"ts_ns": [t_ns, t_ns + 1], "rank": [0, 1], "step": [1, 1], "step_time_ms": [10.0, 11.0]},
        job_id=job,
        node="n0",
        batch_id=batch_id,
    )


def _sink_pid(stack: StackSettings) -> int:
    state = read_state(stack)
    assert state is not None
    return int(state["services"]["sink"]["pid"])


def test_what_landed_before_a_sink_restart_lands_once_when_sent_again(
    stack: StackSettings,
) -> None:
    run = uuid.uuid4().hex[:6]
    job = f"sr-{run}"
    now = time.time_ns()
    fresh = _steps(job, f"fresh-{run}", now)
    old = _steps(job, f"old-{run}", now - 3 * 3600 * NS)  # beyond the 600 s window
    extra = _steps(job, f"extra-{run}", now + 2)
    started = encode_event(JobLifecycle(ts_ns=now, job_id=job, node="n0", rank=0, state="started"))
    ended = encode_event(
        JobLifecycle(ts_ns=now + 1, job_id=job, node="n0", rank=0, state="finished", exit_code=0)
    )
    p = producer(stack)
    # With `extra` and `started` the first inserts hold more than the repeats will: an insert
    # of exactly the same messages again would be dropped by the warehouse's own
    # deduplication token, whether the sink remembered them or not.
    first = [(Topics.STEP, fresh), (Topics.STEP, old), (Topics.STEP, extra)]
    for topic, data in [*first, (Topics.JOB, started), (Topics.JOB, ended)]:
        p.produce(topic, key=job.encode(), value=data)
    assert p.flush(15) == 0

    def counts() -> tuple[int, int, int]:
        (fresh_n, old_n) = query(
            stack,
            "SELECT countIf(event_id LIKE 'fresh-%'), countIf(event_id LIKE 'old-%') "
            "FROM steps WHERE job_id = {j:String}",
            j=job,
        )[0]
        (events,) = query(
            stack, "SELECT count() FROM job_lifecycle WHERE job_id = {j:String}", j=job
        )[0]
        return int(fresh_n), int(old_n), int(events)

    wait_for(lambda: counts() == (2, 2, 2), 30, "the first copies to land")

    pid = _sink_pid(stack)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _sink_pid(stack) != pid, 30, "the supervisor to restart the sink")
    log = stack.home_dir / "logs" / "sink.log"
    wait_for(
        lambda: "message ids already in the warehouse" in log.read_text(errors="replace"),
        30,
        "the restarted sink to read the ids that landed",
    )

    for topic, data in ((Topics.STEP, fresh), (Topics.STEP, old), (Topics.JOB, ended)):
        p.produce(topic, key=job.encode(), value=data)  # byte for byte, as a resend
    assert p.flush(15) == 0
    wait_for(lambda: counts()[1] == 4, 30, "the old batch (outside the window) to land again")
    time.sleep(2.0)  # four flush intervals: a repeat of the others would have landed too
    assert counts() == (2, 4, 2), "fresh batch and event once; old batch twice"
