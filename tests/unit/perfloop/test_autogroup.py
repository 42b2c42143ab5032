"""A stream worker that falls behind its input raises its scheduling group (and the embedded
broker's) from the stack's yielding nice 19 to nice 10, and lowers it again once it has kept up
for a while (`perfloop.autogroup.CatchUp`); it never changes the group of a process that is
not the one it was told of, and does nothing where the supervisor did not put it in a yielding
group of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perfloop.autogroup import CATCH_UP_NICE, CatchUp, _set
from perfloop.settings import StackSettings
from perfloop.stack.supervisor import AUTOGROUP_NICE, SERVICES, Supervisor, _Child

_HAS_AUTOGROUPS = Path("/proc/self/autogroup").exists()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _controller() -> tuple[CatchUp, list[tuple[int, int]], Clock]:
    calls: list[tuple[int, int]] = []
    clock = Clock()
    c = CatchUp(
        [(11, "perfloop"), (12, "tansu")],
        AUTOGROUP_NICE,
        setter=lambda t, n: calls.append((t[0], n)) or True,
        clock=clock,
        background=False,
    )
    return c, calls, clock


def test_the_defaults() -> None:
    c, _, _ = _controller()
    assert (c.idle_nice, c.catch_up_nice) == (AUTOGROUP_NICE, CATCH_UP_NICE) == (19, 10)
    assert (c.behind_s, c.caught_up_s, c.hold_s) == (1.0, 0.5, 30.0)


def test_input_within_a_second_leaves_the_groups_yielding() -> None:
    c, calls, clock = _controller()
    for i in range(100):
        clock.t = i * 0.5
        c.seen(0.1 + (i % 10) * 0.1)  # up to 1.0 s behind
        assert c.tick() is None
    assert calls == [] and not c.raised


def test_a_worker_behind_raises_both_groups_once_and_lowers_them_after_calm() -> None:
    c, calls, clock = _controller()
    hold = c.hold_s
    c.seen(0.3)
    c.seen(1.6)  # the oldest message of the tick counts
    assert c.tick() == "raised"
    assert calls == [(11, CATCH_UP_NICE), (12, CATCH_UP_NICE)]
    # catching up: still behind by more than 0.5 s, then within it, for less than the hold
    for t, age in [(0.5, 3.0), (1.0, 1.2), (1.5, 0.6), (2.0, 0.4), (4.0, 0.3), (1.9 + hold, 0.2)]:
        clock.t = t
        c.seen(age)
        assert c.tick() is None, t
    clock.t = 2.0 + hold  # within 0.5 s for the whole hold since 2.0
    assert c.tick() == "lowered"
    assert calls[2:] == [(11, AUTOGROUP_NICE), (12, AUTOGROUP_NICE)] and not c.raised
    clock.t = 3.0 + hold
    c.seen(1.1)
    assert c.tick() == "raised" and c.raises == 2


def test_a_late_message_while_raised_starts_the_calm_again() -> None:
    c, calls, clock = _controller()
    c.seen(5.0)
    assert c.tick() == "raised"
    clock.t = 1.0
    assert c.tick() is None  # calm from 1.0
    clock.t = c.hold_s
    c.seen(0.7)  # behind by more than 0.5 s: not calm
    assert c.tick() is None
    clock.t = 1.5 + c.hold_s
    assert c.tick() is None, "calm again only since the last tick"
    clock.t = 2.0 + 2 * c.hold_s
    assert c.tick() == "lowered" and len(calls) == 4


def test_a_tick_without_input_counts_as_calm() -> None:
    c, calls, clock = _controller()
    c.seen(5.0)
    assert c.tick() == "raised"
    for t in (1.0, 3.0, 1.5 + c.hold_s):
        clock.t = t
        out = c.tick()
    assert out == "lowered" and len(calls) == 4


def test_a_setter_that_fails_leaves_the_worker_running() -> None:
    def boom(target: tuple[int, str], nice: int) -> bool:
        raise PermissionError("no")

    c = CatchUp([(1, "x")], 19, setter=boom, background=False)
    c.seen(9.0)
    assert c.tick() == "raised" and c.raised


def test_the_worker_acts_only_in_a_yielding_group_of_its_own() -> None:
    if os.getsid(0) == os.getpid():
        pytest.skip("the test runner leads its own session")
    env = {"PERFLOOP_GROUP_NICE": "19", "PERFLOOP_BROKER_PID": "1234"}
    assert CatchUp.from_env(env) is None, "in the runner's session: never the user's group"
    probe = (
        "import json, sys\n"
        "from perfloop.autogroup import CatchUp\n"
        "out = {}\n"
        "for k, env in json.loads(sys.argv[1]).items():\n"
        "    c = CatchUp.from_env(env)\n"
        "    out[k] = None if c is None else [c.idle_nice, c.targets]\n"
        "print(json.dumps(out))\n"
    )
    cases = {
        "both": env,
        "no_broker": {"PERFLOOP_GROUP_NICE": "19"},
        "bad_pid": {"PERFLOOP_GROUP_NICE": "19", "PERFLOOP_BROKER_PID": "x"},
        "not_yielding": {"PERFLOOP_GROUP_NICE": "0"},
        "bad_nice": {"PERFLOOP_GROUP_NICE": "nineteen"},
        "unset": {},
    }
    proc = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        check=True,
    )
    seen = json.loads(proc.stdout.splitlines()[-1])
    pid = seen["both"][1][0][0]
    assert seen["both"] == [19, [[pid, "perfloop"], [1234, "tansu"]]]
    assert seen["no_broker"] == seen["bad_pid"] == [19, [[pid, "perfloop"]]]
    assert seen["not_yielding"] is seen["bad_nice"] is seen["unset"] is None


@pytest.mark.skipif(not _HAS_AUTOGROUPS, reason="no autogroups in this kernel")
def test_a_group_is_set_only_for_the_process_it_was_told_of() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        group = Path(f"/proc/{proc.pid}/autogroup")
        time.sleep(0.2)
        before = group.read_text()
        assert not _set((proc.pid, "tansu"), 12), "a pid now held by another program"
        assert group.read_text() == before
        assert _set((proc.pid, "time.sleep"), 12)
        assert group.read_text().split()[-1] == "12"
    finally:
        proc.kill()
        proc.wait()
    assert not _set((proc.pid, "time.sleep"), 12), "a process that is gone"


_ENV_PROBE = (
    "import json, os\n"
    "print(json.dumps({k: v for k, v in os.environ.items() if k in "
    "('PERFLOOP_GROUP_NICE', 'PERFLOOP_BROKER_PID', 'PERFLOOP_GROUP_RAISED')}))\n"
)


@pytest.mark.parametrize("priority", ["idle", "normal"])
def test_the_supervisor_tells_the_stream_worker_its_group_and_the_brokers(
    tmp_path: Path, priority: str
) -> None:
    (tmp_path / "home").mkdir()
    sup = Supervisor(StackSettings(home=tmp_path / "home", stack_priority=priority))  # type: ignore[arg-type]
    seen, pids = {}, {}
    for name in ("broker", "warehouse", *SERVICES):
        argv = [sys.executable, "-c", _ENV_PROBE]
        child = _Child(name=name, argv=argv, ready=None, log=tmp_path / name)
        sup._children.append(child)
        sup._spawn(child)
        assert child.proc is not None
        pids[name] = child.proc.pid
        child.proc.wait(timeout=30)
        seen[name] = json.loads((tmp_path / name).read_text().splitlines()[-1])
    if priority == "normal":
        assert all(v == {} for v in seen.values()), seen
        return
    assert seen.pop("streams") == {
        "PERFLOOP_GROUP_NICE": str(AUTOGROUP_NICE),
        "PERFLOOP_BROKER_PID": str(pids["broker"]),
        "PERFLOOP_GROUP_RAISED": "1",  # it starts behind
    }
    assert all(v == {} for v in seen.values()), "only the stream worker raises groups"


def test_a_group_the_supervisor_cannot_set_is_said_in_the_services_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import perfloop.stack.supervisor as stack

    monkeypatch.setattr(stack, "set_autogroup_nice", lambda pid, nice: False)
    (tmp_path / "home").mkdir()
    sup = Supervisor(StackSettings(home=tmp_path / "home"))
    child = _Child(name="sink", argv=[sys.executable, "-c", "pass"], ready=None, log=tmp_path / "s")
    sup._spawn(child)
    assert child.proc is not None and child.proc.wait(timeout=30) == 0
    lines = (tmp_path / "s").read_text().splitlines()
    assert lines == [
        "perfloop supervisor: sink's scheduling group was not set to nice 19 (no autogroups in "
        "this kernel?): it competes with the job as an equal"
    ]


def test_a_raised_worker_raises_the_broker_that_replaced_the_one_it_was_told_of() -> None:
    """A recycle or a crash starts a new broker process at the yielding nice: a worker that is
    raised raises it too, and lowers the new one, never the old pid, when it has kept up."""
    calls: list[tuple[int, int]] = []
    clock, broker = Clock(), [12]
    c = CatchUp(
        [(11, "perfloop"), (12, "tansu")],
        AUTOGROUP_NICE,
        setter=lambda t, n: calls.append((t[0], n)) or True,
        clock=clock,
        background=False,
        broker_pid=lambda: broker[0],
    )
    c.seen(3.0)
    assert c.tick() == "raised" and calls == [(11, 10), (12, 10)]
    calls.clear()
    assert c.tick() is None and calls == []  # the same broker: nothing again
    broker[0] = 13  # replaced
    c.seen(3.0)
    c.tick()
    assert calls == [(11, 10), (13, 10)]
    calls.clear()
    for t in (1.0, 40.0):
        clock.t = t
        c.seen(0.1)
        moved = c.tick()
    assert moved == "lowered" and calls == [(11, 19), (13, 19)]


def test_the_broker_pid_comes_from_the_stack_state(tmp_path: Path) -> None:
    from perfloop.autogroup import broker_pid_in

    assert broker_pid_in(tmp_path) is None
    (tmp_path / "stack.json").write_text(json.dumps({"services": {"broker": {"pid": 4242}}}))
    assert broker_pid_in(tmp_path) == 4242
    (tmp_path / "stack.json").write_text("{not json")
    assert broker_pid_in(tmp_path) is None
