"""Following events on the real embedded stack: ``perfloop watch`` started before a job
prints its first diagnosis as soon as it is published; the typed client reads from a point in
time (an event published before it started), skips a bad message, and in group mode resumes
after what was committed; the example approver approves a pending recommendation."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import IO

import pytest

from perfloop.client import Follower
from perfloop.kafka import producer
from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher
from perfloop.schemas import Diagnosis, Event, Recommendation
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings

from .conftest import perfloop_cli, stack_signed, wait_for
from .conftest import query as _query

pytestmark = pytest.mark.integration


def _diagnosis(job: str, n: int = 0) -> Diagnosis:
    now = time.time_ns()
    return Diagnosis(
        ts_ns=now, job_id=job, node="n0", rank=-1, diagnosis_id=f"{job}-d{n}",
        bottleneck="dataloader_starvation", level="host", loop="training", state="open",
        onset_ns=now - 2 * 10**9, step_share=0.38, confidence=0.9, critical_path=True,
        ranks=[0, 1], evidence={"data_wait_share": 0.38},
    )  # fmt: skip


Publish = Callable[..., None]


@pytest.fixture
def publish(stack: StackSettings) -> Iterator[Publish]:
    """Publish events through the producers' own path, an `Emitter` of the event's job over a
    `Publisher` (what a job's hooks use): each on its kind's topic, keyed by its job."""
    pub = Publisher(stack, producer_id=f"it-watch-{uuid.uuid4().hex[:6]}")

    def send(*events: Event) -> None:
        for ev in events:
            em = Emitter(pub, job_id=ev.job_id, node=ev.node, producer_id=pub.producer_id)
            assert em.event(ev)
        assert pub.flush(10) == 0

    try:
        yield send
    finally:
        pub.close()


class _Lines:
    """A subprocess's output lines with the moment each was read."""

    def __init__(self, stream: IO[str]) -> None:
        self.q: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[str] = []
        self._t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._t.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.q.put((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, what: str, timeout_s: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                t, line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line with {what!r} in {timeout_s} s: {self.seen}"
                ) from None
            self.seen.append(line)
            if what in line:
                return t, line

    def rest(self) -> list[str]:
        """Every line, once the process has exited."""
        self._t.join(10)
        while not self.q.empty():
            self.seen.append(self.q.get()[1])
        return self.seen


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], _Lines, _Lines]:
    proc = subprocess.Popen(
        [sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, text=True, bufsize=1,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    return proc, _Lines(proc.stdout), _Lines(proc.stderr)


def _interrupt(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_watch_started_before_a_job_prints_its_first_diagnosis_at_once(
    stack_env_vars: dict[str, str], publish: Publish
) -> None:
    job = f"it-watch-{uuid.uuid4().hex[:8]}"
    proc, out, err = _start(["-m", "perfloop.cli", "watch", "--job", job, "--json"],
                            stack_env_vars)  # fmt: skip
    try:
        err.wait_for("perfloop watch: following", 30)
        mine = _diagnosis(job)
        published = time.monotonic()
        publish(_diagnosis(f"other-{job}"), mine)
        printed, line = out.wait_for('"kind":"diagnosis"', 10)
        delay = printed - published
        print(f"\nperfloop watch: diagnosis published → printed in {delay * 1000:.0f} ms")
        doc = json.loads(line)
        assert (doc["job_id"], doc["diagnosis_id"], doc["bottleneck"], doc["ranks"]) == (
            job, mine.diagnosis_id, "dataloader_starvation", [0, 1],
        )  # fmt: skip
        assert delay < 5.0  # the issue asks for 2 s; generous for a loaded CI machine
    finally:
        rc = _interrupt(proc)
    assert rc == 0, err.seen
    assert out.rest() == [line], "the other job's diagnosis was not printed"
    assert not any("Traceback" in ln for ln in err.seen)


def test_the_client_reads_from_a_point_in_time_and_skips_a_bad_message(
    stack: StackSettings, publish: Publish
) -> None:
    job = f"it-since-{uuid.uuid4().hex[:8]}"
    p = producer(stack)
    p.produce(Topics.DIAGNOSES, key=job.encode(), value=b'{"kind": "diagnosis", "ts_ns": -1}')
    assert p.flush(10) == 0
    before = _diagnosis(job, 0)
    publish(before)

    started = time.monotonic()
    with (
        Follower(stack, jobs=[job], kinds=["diagnosis"], since=timedelta(minutes=1)) as past,
        Follower(stack, jobs=[job], kinds=["diagnosis"]) as live,
    ):
        got = past.poll(10)
        print(f"\nclient since 1 min: first event after {time.monotonic() - started:.2f} s "
              f"(read {past.received} messages)")  # fmt: skip
        assert got == before
        assert past.skipped == 1  # the bad one, before it in the same partition
        assert live.poll(1.0) is None  # from now: what came before is not handed out
        after = _diagnosis(job, 1)
        publish(after)
        assert live.poll(10) == after
        assert past.poll(10) == after
        assert live.skipped == 0
        # stop() (what a signal handler calls) ends an iteration in progress
        threading.Timer(0.3, live.stop).start()
        t0 = time.monotonic()
        assert list(live) == [] and time.monotonic() - t0 < 2.0


def test_group_mode_resumes_after_what_was_committed(
    stack: StackSettings, publish: Publish
) -> None:
    job = f"it-group-{uuid.uuid4().hex[:8]}"
    group = f"it-group-{uuid.uuid4().hex[:8]}"
    d = [_diagnosis(job, i) for i in range(3)]
    first = Follower(stack, jobs=[job], kinds=[Diagnosis], group=group)
    try:
        publish(*d)  # during the group's join: from its start, nothing is missed
        assert first.poll(20) == d[0]
        assert first.commit() >= 1
        assert first.poll(10) == d[1]  # handed out, never committed
    finally:
        first.close()
    with Follower(stack, jobs=[job], kinds=[Diagnosis], group=group) as again:
        assert again.poll(20) == d[1]  # at least once: the uncommitted one comes again
        assert again.poll(10) == d[2]
        assert again.commit() >= 1


def test_the_example_approver_approves_a_pending_recommendation(
    stack: StackSettings, stack_env_vars: dict[str, str], publish: Publish
) -> None:
    job = f"it-approver-{uuid.uuid4().hex[:8]}"
    out = perfloop_cli("config", "set", "actuator.tier", "approve", "--job", job,
                       env=stack_env_vars)  # fmt: skip
    assert out.returncode == 0, out.stderr
    log = stack.home / "logs" / "actuator.log"
    wait_for(lambda: f"actuator.tier for job {job}: 'auto' -> 'approve'" in log.read_text(),
             30, "the actuator to take the job's tier")  # fmt: skip
    proc, lines, err = _start(
        ["-m", "perfloop.examples.approver", "--job", job, "--group", f"it-{job}",
         "--seconds", "60", "--min-gain", "10"],
        stack_env_vars,
    )  # fmt: skip
    try:
        lines.wait_for("approver: following", 30)
        recs = [
            Recommendation(
                ts_ns=time.time_ns(), job_id=job, node="n0", rank=-1,
                knob="dataloader.num_workers", from_value=1, to_value=to, loop="fast",
                expected_gain_pct=gain, confidence=0.8, rationale="the loader starves the step",
            )
            for to, gain in ((6, 30.0), (2, 5.0))
        ]  # fmt: skip
        publish(*(stack_signed(stack, r) for r in recs))  # as the stack's stream tier signs
        lines.wait_for(f"approved {recs[0].event_id}", 30)
        lines.wait_for(f"left for a person (expected gain 5% < 10%): perfloop approve "
                       f"{recs[1].event_id}", 10)  # fmt: skip
        issued = wait_for(
            lambda: _query(
                stack,
                "SELECT outcome, actor, command_id FROM audit WHERE rec_id = {r:String} "
                "AND outcome = 'issued'",
                r=recs[0].event_id,
            ),
            30,
            "the actuator to issue the approved command",
        )
        # signed with the stack's owner key (the roster's principal), by the approver
        assert issued[0][1].startswith("owner: approver@") and issued[0][2]
    finally:
        rc = _interrupt(proc)
    assert rc == 0, err.seen
    lines.wait_for("approver: 1 approved, 1 left for a person", 5)
