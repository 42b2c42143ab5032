"""Bad commands on the real broker: an unsigned, a tampered, an expired, a replayed and an
out-of-bounds command change nothing in the job, and each is acked as rejected with its reason,
queryable in the warehouse beside the one valid command the job applied."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Producer

from perfloop.actuators import JobAgent, sign
from perfloop.schemas import Command, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.warehouse import client

from .conftest import wait_for

pytestmark = pytest.mark.integration

KEY = b"bad-commands-key"
KNOB = "dataloader.num_workers"
NS = 1_000_000_000


def test_bad_commands_are_rejected_and_audited(stack: StackSettings) -> None:
    job = f"bad-cmd-{uuid.uuid4().hex[:8]}"
    applied: list[Any] = []
    agent = JobAgent(stack, job_id=job, node="n0", signing_key=KEY, handlers={KNOB: applied.append})
    assert agent.start(wait_assigned_s=30), "the agent reads the control topic"
    now = time.time_ns()

    def cmd(seq: int, value: Any = 4, **kw: Any) -> Command:
        fields: dict[str, Any] = dict(ts_ns=now, job_id=job, node="n0", rank=-1, seq=seq,
                                      knob=KNOB, from_value=2, value=value,
                                      expires_ts_ns=now + 60 * NS)  # fmt: skip
        return Command(**(fields | kw))

    valid = sign(cmd(10), KEY)
    sent = [
        ("unsigned", cmd(1)),
        ("tampered", sign(cmd(2), KEY).model_copy(update={"value": 64})),
        ("expired", sign(cmd(3, expires_ts_ns=now - NS), KEY)),
        ("valid", valid),
        ("replayed", valid),
        ("out of bounds", sign(cmd(11, value=1000), KEY)),
        ("another key", sign(cmd(12), b"someone-else")),
    ]
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
    try:
        for _, c in sent:
            p.produce(Topics.CONTROL, key=job.encode(), value=encode_event(c))
        assert p.flush(15) == 0
        # every bad one is acked as it arrives; the valid one waits for a step boundary
        wait_for(lambda: len(agent.results) == len(sent) - 1, 30, "an ack for each bad command")
        assert applied == []
        agent.step_boundary(1)  # the valid one is applied here, and only it
    finally:
        agent.stop()
    assert applied == [4]
    reasons = [(r.status, r.reason) for r in agent.results]
    assert [s for s, _ in reasons] == ["rejected"] * 6 + ["applied"], reasons
    why = [r for _, r in reasons[:6]]
    assert why[0] == "unsigned: it carries no signature"
    assert why[1] == why[5] == "signature does not verify"
    assert why[2].startswith("expired")
    assert why[3] == "sequence 10 already seen (last 10)"
    assert why[4] == f"{KNOB}=1000 is outside [0, 64]"

    ch = client(stack)
    try:

        def landed() -> bool:
            n = ch.query(
                "SELECT count() FROM actuations WHERE job_id = {j:String}", parameters={"j": job}
            ).result_rows[0][0]
            return int(n) == len(sent)

        wait_for(landed, 30, "the acks in the warehouse")
        rows = ch.query(
            "SELECT status, reason FROM actuations WHERE job_id = {j:String} ORDER BY ts",
            parameters={"j": job},
        ).result_rows
    finally:
        ch.close()
    assert sorted(s for s, _ in rows) == ["applied"] + ["rejected"] * 6
    assert {r for s, r in rows if s == "rejected"} == set(why)
