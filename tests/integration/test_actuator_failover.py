"""Acceptance: an actuator killed and replaced mid-run acts on no recommendation twice and
loses no command.

The worst moment to die: the actuator has published a command and its decision, and has not
yet committed the recommendation's offset. Its replacement then reads that recommendation
again. Here actuator A (a process of its own, ``perfloop service actuator``) issues a command
for recommendation R1 and is SIGKILLed; actuator B starts with its input positioned at R1
again, as if A had died before its commit. B must read back what A did
(``perfloop.control``, `ActuatorService.recall`): R1 refused as already issued, no second
command; R2, for another knob, issued (nothing lost) with a higher sequence number; R3, for
R1's knob right after, refused for the cooldown A's command started.

The session stack runs its own actuator on the same recommendations; these expect 1 % and its
hysteresis (``actuator.min_gain_pct`` 5) refuses them. A and B run with
``PERFLOOP_MIN_GAIN_PCT=0``, their own signing key and consumer groups.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from perfloop.kafka import consumer, producer
from perfloop.schemas import Recommendation, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from tests.helpers import recommendation

from .conftest import query as _query
from .conftest import wait_for

pytestmark = pytest.mark.integration

TOPICS = [Topics.RECOMMENDATIONS, Topics.CONTROL, Topics.JOB, Topics.ACTUATIONS]


def _rec(job: str, knob: str, from_value: Any, to_value: Any) -> Recommendation:
    rec: Recommendation = recommendation(
        ts_ns=time.time_ns(), job_id=job, node="n0", knob=knob, from_value=from_value,
        to_value=to_value, expected_gain_pct=1.0, rationale="failover test",
    )  # fmt: skip
    return rec


def _publish(settings: StackSettings, rec: Recommendation) -> TopicPartition:
    """Publish ``rec``; return where it landed."""
    where: list[TopicPartition] = []
    p = producer(settings)
    p.produce(Topics.RECOMMENDATIONS, key=rec.job_id.encode(), value=encode_event(rec),
              on_delivery=lambda err, msg: where.append(
                  TopicPartition(msg.topic(), msg.partition(), msg.offset())))  # fmt: skip
    assert p.flush(10) == 0 and where
    return where[0]


def _position(settings: StackSettings, group: str, at: TopicPartition | None = None) -> None:
    """Commit ``group``'s offsets at the end of every topic the actuator reads, but at ``at``
    for its partition: an actuator started in the group reads what comes next, and ``at``."""
    c = consumer(settings, group)
    try:
        offsets = []
        for topic in TOPICS:
            for part in c.list_topics(topic, timeout=10).topics[topic].partitions:
                _, high = c.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
                if at is not None and (topic, part) == (at.topic, at.partition):
                    high = at.offset
                offsets.append(TopicPartition(topic, part, high))
        c.commit(offsets=offsets, asynchronous=False)
    finally:
        c.close()


def _commands(settings: StackSettings, job: str) -> list[tuple[Any, ...]]:
    return _query(
        settings,
        "SELECT rec_id, command_id, seq, knob FROM commands WHERE job_id = {j:String} "
        "ORDER BY seq LIMIT 1 BY event_id",
        j=job,
    )


def _decided(settings: StackSettings, rec_id: str, after_ns: int = 0) -> list[tuple[Any, ...]]:
    """Decisions on ``rec_id`` made after ``after_ns``, in time order, as (outcome, command_id,
    reason). The session stack's actuator refuses it unsigned (or for its expected gain): left
    out. It may
    instead have read A's command first and refused it as already issued, as B does; it reads
    it within a second of A, so ``after_ns`` (when B started) tells B's decisions apart."""
    rows = _query(
        settings,
        "SELECT outcome, command_id, reason FROM audit WHERE rec_id = {r:String} "
        "AND toUnixTimestamp64Nano(ts) > {after:Int64} ORDER BY ts LIMIT 1 BY event_id",
        r=rec_id,
        after=after_ns,
    )
    theirs = ("expected gain", "recommendation refused")
    return [r for r in rows if not str(r[2]).startswith(theirs)]


def test_a_replaced_actuator_acts_on_nothing_twice_and_loses_nothing(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    job = f"it-failover-{uuid.uuid4().hex[:8]}"
    key = f"it-key-{uuid.uuid4().hex}"
    env = stack_env_vars | {"PERFLOOP_SIGNING_KEY": key, "PERFLOOP_MIN_GAIN_PCT": "0"}
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        group = f"it-actuator-{job}-{name}"
        log = (tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "perfloop.cli", "service", "actuator"],
            env=env | {"PERFLOOP_GROUP_ID": group}, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs.append(proc)
        return proc

    def log_of(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    r1 = _rec(job, "dataloader.num_workers", 0, 2)
    try:
        _position(stack, f"it-actuator-{job}-a")
        a = start("a")
        wait_for(lambda: "assigned" in log_of("a"), 60, "actuator A to take its partitions")
        at = _publish(stack, r1)
        wait_for(lambda: _commands(stack, job), 30, "A's command for R1")
        a.send_signal(signal.SIGKILL)  # the process itself
        assert a.wait(10) == -signal.SIGKILL

        # B resumes at R1, as if A had died before committing it.
        _position(stack, f"it-actuator-{job}-b", at)
        b_at = time.time_ns()
        start("b")
        wait_for(lambda: _decided(stack, r1.event_id, b_at), 60, "B's decision on R1 again")
        r2 = _rec(job, "torch.num_threads", 4, 2)
        r3 = _rec(job, "dataloader.num_workers", 2, 4)
        _publish(stack, r2)
        _publish(stack, r3)
        wait_for(
            lambda: _decided(stack, r2.event_id) and _decided(stack, r3.event_id),
            30,
            "B's decisions on R2 and R3",
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    commands = wait_for(
        lambda: (rows := _commands(stack, job)) and len(rows) >= 2 and rows,
        30,
        "the commands in the warehouse",
    )
    by_rec = {rec_id: (cmd, seq) for rec_id, cmd, seq, _ in commands}
    assert [c[0] for c in commands].count(r1.event_id) == 1, commands  # R1: one command
    assert r2.event_id in by_rec, f"R2 was lost: {commands}; B: {log_of('b')[-2000:]}"
    assert r3.event_id not in by_rec, commands
    assert by_rec[r2.event_id][1] > by_rec[r1.event_id][1]  # the sequence goes on
    assert len(commands) == 2

    issued = [r for r in _decided(stack, r1.event_id) if r[0] == "issued"]
    assert [r[1] for r in issued] == [by_rec[r1.event_id][0]], issued  # A's, and only A's
    (again,) = _decided(stack, r1.event_id, b_at)
    assert again[0] == "refused"
    assert again[2] == f"already issued as command {by_rec[r1.event_id][0]}"
    (r3_decision,) = _decided(stack, r3.event_id)
    assert r3_decision[0] == "refused" and r3_decision[2].startswith("cooldown: ")
    recalled = re.search(r"recall: (\d+) command\(s\)", log_of("b"))
    assert recalled and int(recalled.group(1)) >= 1, log_of("b")[-2000:]
