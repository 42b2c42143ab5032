"""Acceptance: if the actuator is killed mid-change, the job keeps its last-known-good value.

An actuator runs as a process of its own (``perfloop service actuator``) on the session's
broker and warehouse; a simulated job in this process runs a `JobAgent`. The actuator turns a
recommendation into a signed command that caps the GPU power — a change that makes every step
about half as slow again. Once the job has applied it, and before the agent's verdict, the actuator
is SIGKILLed. The job goes on stepping: the verdict is the agent's own, so the change is rolled
back to the value before it within ``settle_steps + verify_steps`` steps, acked as
``rolled_back`` and queryable in the warehouse; and the dead actuator issues nothing more.

The session stack runs its own actuator, which reads the same recommendations: it must not
issue the command instead. It takes only recommendations its stream tier signed (the stack's
keyring), and these are unsigned, so it refuses them; the actuator under test runs with
``PERFLOOP_MIN_GAIN_PCT=0``, its own consumer group and its own signing key (the agent trusts
only that key: a command from anyone else would be acked as rejected, and fail the test).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from perfloop.actuators import JobAgent
from perfloop.kafka import consumer, producer
from perfloop.producers import SimConfig, SimulatedJob
from perfloop.schemas import ActuationResult, Recommendation, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from tests.helpers import Collect, recommendation

from .conftest import query as _query
from .conftest import wait_for

pytestmark = pytest.mark.integration

KNOB = "gpu.power_limit_w"
GOOD_W, CAPPED_W = 700.0, 150.0  # 150 W clocks the simulated GPU down: steps ~1.5x slower
WARMUP_STEPS = 30  # more than the agent's baseline (10 steps) before the change is asked for
SETTLE, VERIFY = 2, 20


def _publish(settings: StackSettings, rec: Recommendation) -> None:
    p = producer(settings)
    p.produce(Topics.RECOMMENDATIONS, key=rec.job_id.encode(), value=encode_event(rec))
    assert p.flush(10) == 0


def _start_at_the_end(settings: StackSettings, group: str, topics: list[str]) -> None:
    """Commit ``group``'s offsets at the end of ``topics``, so that an actuator started in that
    group acts only on what comes next, not on the session's earlier recommendations."""
    c = consumer(settings, group)
    try:
        offsets = []
        for topic in topics:
            for part in c.list_topics(topic, timeout=10).topics[topic].partitions:
                _, high = c.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
                offsets.append(TopicPartition(topic, part, high))
        c.commit(offsets=offsets, asynchronous=False)
    finally:
        c.close()


def _decisions(settings: StackSettings, rec_id: str) -> list[tuple[Any, ...]]:
    return _query(
        settings,
        "SELECT outcome, command_id, reason FROM audit WHERE rec_id = {r:String} "
        "ORDER BY ts LIMIT 1 BY event_id",
        r=rec_id,
    )


def _rec(job: str, node: str, to_value: float) -> Recommendation:
    rec: Recommendation = recommendation(
        ts_ns=time.time_ns(), job_id=job, node=node, knob=KNOB, from_value=GOOD_W,
        to_value=to_value, expected_gain_pct=1.0, rationale="a bad guess: it slows the job",
    )  # fmt: skip
    return rec


def test_a_killed_actuator_leaves_the_job_on_its_last_known_good_value(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    job = f"it-killed-{uuid.uuid4().hex[:8]}"
    group = f"it-actuator-{job}"
    key = f"it-key-{uuid.uuid4().hex}"
    _start_at_the_end(stack, group, [Topics.RECOMMENDATIONS, Topics.CONTROL])

    # The job: one rank, one step per boundary, its telemetry kept here (the stream tier must
    # not recommend anything for it), about 2 ms of wall time per 100 ms step.
    cfg = SimConfig(job_id=job, ranks_per_node=1, chunk_steps=1, speed=50.0, seed=11)
    sim = SimulatedJob(cfg, Collect())
    agent = JobAgent(
        stack, job_id=job, node=cfg.node, signing_key=key.encode(),
        handlers=sim.knob_handlers(), read=sim.knob_value, settle_steps=SETTLE, verify_steps=VERIFY,
    )  # fmt: skip
    env = stack_env_vars | {
        "PERFLOOP_GROUP_ID": group,
        "PERFLOOP_SIGNING_KEY": key,
        "PERFLOOP_MIN_GAIN_PCT": "0",
    }
    first = _rec(job, cfg.node, CAPPED_W)
    second = _rec(job, cfg.node, 300.0)  # after the kill: no one may issue it
    seen: dict[str, Any] = {}  # what happened, and at which step
    log_path = tmp_path / "actuator.log"

    def actuator_log() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    def step_boundary(step: int) -> list[ActuationResult]:
        if step == WARMUP_STEPS:
            _publish(stack, first)
        done = agent.step_boundary(step)
        if any(r.status == "applied" for r in done):
            # Mid-change: applied, no verdict yet (the agent judges only the steps to come).
            seen["applied_value"] = sim.power_limit_w
            seen["verifying"] = agent.verifying
            actuator.send_signal(signal.SIGKILL)
            actuator.wait(10)
        if any(r.status == "rolled_back" for r in done):
            seen["rolled_back_at"] = step
            _publish(stack, second)
        return done

    def stop() -> bool:
        if time.monotonic() > deadline:
            return True
        if "rolled_back_at" not in seen:
            return False
        if "refused_at" not in seen:
            # Step on until the live actuator's decision on the second recommendation is in
            # the warehouse (every 20 steps: a query per step would pace the job).
            if (sim.step - seen["rolled_back_at"]) % 20 == 0 and _decisions(stack, second.event_id):
                seen["refused_at"] = sim.step
            return False
        return sim.step >= seen["refused_at"] + SETTLE + VERIFY  # room for a late command

    log = log_path.open("wb")
    actuator = subprocess.Popen(
        [sys.executable, "-m", "perfloop.cli", "service", "actuator"],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert agent.start(20.0), "the control topic was never assigned to the agent"
        deadline = time.monotonic() + 45  # a bound to fail on, not a timing under test
        assert actuator.poll() is None, f"the actuator exited: {actuator_log()}"
        sim.run(
            1e5,
            step_boundary=step_boundary,
            on_step=lambda rep: agent.observe_step(rep.step, rep.step_time_ms),
            stop=stop,
        )
    finally:
        if actuator.poll() is None:
            actuator.kill()
        actuator.wait(10)
        log.close()
        agent.stop()

    results = [(r.status, r.value) for r in agent.results]
    assert "applied_value" in seen, f"no command applied; {results}; actuator: {actuator_log()}"
    assert actuator.returncode == -signal.SIGKILL
    assert seen["applied_value"] == CAPPED_W and seen["verifying"]
    assert "rolled_back_at" in seen, f"no rollback; results: {results}"
    assert "refused_at" in seen, (
        f"no decision on {second.event_id}: {_decisions(stack, second.event_id)}"
    )

    # The agent's own verdict: it hurt, so the job is back on the value before the change,
    # within settle + verify steps of it; and nothing else was applied (or even received).
    applied, rolled_back = agent.results
    assert (applied.status, applied.value) == ("applied", CAPPED_W)
    assert (rolled_back.status, rolled_back.value) == ("rolled_back", GOOD_W)
    assert rolled_back.command_id == applied.command_id
    assert rolled_back.reason.startswith("it hurt")
    assert rolled_back.evidence["ratio"] > 1.2 and rolled_back.evidence["p_value"] < 0.05
    assert 0 < rolled_back.step - applied.step <= SETTLE + VERIFY
    assert sim.power_limit_w == GOOD_W

    # In the warehouse: the ack and the verdict; one command, the killed actuator's, signed;
    # the stack's actuator refused both recommendations and the killed one decided only on
    # the first.
    acks = wait_for(
        lambda: (
            (rows := _query(
                stack,
                "SELECT status, value, command_id FROM actuations WHERE job_id = {j:String} "
                "ORDER BY ts LIMIT 1 BY event_id",
                j=job,
            )) and len(rows) >= 2 and rows
        ),
        30,
        "the ack and the rollback in the warehouse",
    )  # fmt: skip
    assert acks == [
        ("applied", str(CAPPED_W), applied.command_id),
        ("rolled_back", str(GOOD_W), applied.command_id),
    ]
    commands = _query(
        stack,
        "SELECT command_id, rec_id, value, length(signature) FROM commands "
        "WHERE job_id = {j:String} LIMIT 1 BY command_id",
        j=job,
    )
    assert commands == [(applied.command_id, first.event_id, str(CAPPED_W), 64)]
    on_first = wait_for(
        lambda: (d := _decisions(stack, first.event_id)) and len(d) >= 2 and d,
        30,
        "both actuators' decisions on the first recommendation",
    )
    assert sorted(d[:2] for d in on_first) == [("issued", applied.command_id), ("refused", "")]
    [(outcome, command_id, reason)] = _decisions(stack, second.event_id)
    assert (outcome, command_id) == ("refused", "") and "unsigned" in reason, reason
