"""The real embedded stack: its services' scheduling groups yield (nice 19), and a stream worker
that reads input more than a second old raises its group and the broker's to nice 10
(`perfloop._autogroup.CatchUp`); the history services stay at nice 19. The old input here is a
message sent with a timestamp 10 s in the past (an undecodable one: dead-lettered, the worker
lives on)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from perfloop._autogroup import CATCH_UP_NICE
from perfloop.catalog import Topics
from perfloop.settings import StackSettings
from perfloop.stack import AUTOGROUP_NICE, read_state

from .conftest import wait_for

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/autogroup").exists(), reason="no autogroups in this kernel"
)


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def test_a_worker_behind_its_input_raises_its_group_and_the_brokers(
    stack: StackSettings,
) -> None:
    state = read_state(stack)
    assert state is not None
    pids = {name: svc["pid"] for name, svc in state["services"].items()}
    log = Path(state["services"]["streams"]["log"])
    # the session's stack: the worker may be raised already (behind on an earlier test's load)
    assert {_nice(pids[n]) for n in ("streams", "broker")} <= {AUTOGROUP_NICE, CATCH_UP_NICE}
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
    sent_ms = int((time.time() - 10) * 1000)
    p.produce(Topics.HOST, key=b"catch-up", value=b"not a batch", timestamp=sent_ms)
    assert p.flush(30) == 0
    wait_for(
        lambda: _nice(pids["streams"]) == CATCH_UP_NICE == _nice(pids["broker"]),
        60,
        "the worker's and the broker's groups at nice 10",
    )
    assert "input behind: scheduling group raised to nice 10" in log.read_text()
    for name in ("warehouse", "sink", "actuator"):
        assert _nice(pids[name]) == AUTOGROUP_NICE, name
