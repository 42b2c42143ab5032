"""The real embedded stack: its services yield to the job, in idle CPU control groups where the
machine lets the supervisor make them (`perfloop._cpugroup`), else in autogroups at nice 19;
a stream worker starts with its group raised (it starts behind) and lowers it once it kept up;
one that reads input more than a second old raises its group and the broker's (the loop's
control group to weight 110, or their autogroups to nice 10; `perfloop.autogroup.CatchUp`);
the history services stay idle. The old input here is a
message sent with a timestamp 10 s in the past (an undecodable one: dead-lettered, the worker
lives on)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from perfloop._cpugroup import CATCH_UP_SHARES, cpu_dir
from perfloop.autogroup import CATCH_UP_NICE
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.stack import AUTOGROUP_NICE, read_state

from .conftest import wait_for

pytestmark = pytest.mark.integration

LOWERED_S = 50
"""A worker lowers its group after 30 s within half a second of its input (`CatchUp`)."""


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def _cpu_group(pid: int) -> Path | None:
    """The idle control group the supervisor put ``pid`` in, or None."""
    d = cpu_dir(Path(f"/proc/{pid}"))
    return d if d is not None and d.name.startswith("perfloop-") else None


def _idle(group: Path) -> bool:
    return (group / "cpu.idle").read_text().strip() == "1"


def test_a_worker_behind_its_input_raises_its_group_and_the_brokers(
    stack: StackSettings,
) -> None:
    state = read_state(stack)
    assert state is not None
    pids = {name: svc["pid"] for name, svc in state["services"].items()}
    log = Path(state["services"]["streams"]["log"])
    groups = {name: _cpu_group(pid) for name, pid in pids.items()}
    if all(groups.values()):
        _raises_the_loops_group(stack, groups, log)  # type: ignore[arg-type]
        return
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("neither control groups nor autogroups here")
    assert not any(groups.values()), f"some services in control groups, some not: {groups}"
    # the session's stack: the worker started raised, or was behind on an earlier test's load;
    # once it kept up for 30 s it lowers its group and the broker's
    started = "starting behind: scheduling group raised to nice 10"
    wait_for(lambda: started in log.read_text(), LOWERED_S, "the worker started, raised")
    wait_for(
        lambda: _nice(pids["streams"]) == AUTOGROUP_NICE == _nice(pids["broker"]),
        LOWERED_S,
        "the worker's and the broker's groups back at nice 19 once it kept up",
    )
    _send_old_input(stack)
    wait_for(
        lambda: _nice(pids["streams"]) == CATCH_UP_NICE == _nice(pids["broker"]),
        60,
        "the worker's and the broker's groups at nice 10",
    )
    assert "input behind: scheduling group raised to nice 10" in log.read_text()
    for name in ("warehouse", "sink", "actuator", "accountant"):
        assert _nice(pids[name]) == AUTOGROUP_NICE, name


def _send_old_input(stack: StackSettings) -> None:
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
    sent_ms = int((time.time() - 10) * 1000)
    p.produce(Topics.HOST, key=b"catch-up", value=b"not a batch", timestamp=sent_ms)
    assert p.flush(30) == 0


def _raises_the_loops_group(stack: StackSettings, groups: dict[str, Path], log: Path) -> None:
    loop, history = groups["streams"], groups["sink"]
    assert groups["broker"] == groups["actuator"] == loop and loop.name.endswith("-loop")
    assert groups["warehouse"] == history != loop and history.name.endswith("-history")
    assert _idle(history)
    started = "starting behind: scheduling group raised to weight 110"
    wait_for(lambda: started in log.read_text(), LOWERED_S, "the worker started, raised")
    wait_for(lambda: _idle(loop), LOWERED_S, "the loop's group idle again once the worker kept up")
    _send_old_input(stack)
    wait_for(lambda: not _idle(loop), 60, "the loop's group raised from idle")
    weight = loop / ("cpu.shares" if (loop / "cpu.shares").exists() else "cpu.weight")
    assert int(weight.read_text()) in (CATCH_UP_SHARES, round(CATCH_UP_SHARES * 100 / 1024))
    assert "input behind: scheduling group raised to weight 110" in log.read_text()
    assert _idle(history), "the history services stay idle"
