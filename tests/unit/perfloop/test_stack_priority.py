"""The embedded services' scheduling policy: by default the warehouse and the sink run under
``SCHED_IDLE`` (they use only CPU time the training job leaves) and the loop (broker, stream
workers, actuator) under ``SCHED_BATCH`` (a fair share, no wakeup preemption of a training
thread); with ``stack_priority`` "normal" every service runs under the ordinary policy; a
service's threads inherit its policy. With "idle" each service also runs in a session of its
own whose scheduling group (Linux autogroup) has nice 19, since a policy orders threads only
inside one group and ``torchrun`` puts each rank in a session (a group) of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perfloop.autogroup import CATCH_UP_NICE
from perfloop.settings import StackSettings
from perfloop.stack.supervisor import AUTOGROUP_NICE, SERVICES, Supervisor, _at_priority, _Child

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")

# the policy of the process, and of a thread it starts later
_PROBE = (
    "import os, threading\n"
    "seen = [os.sched_getscheduler(0)]\n"
    "t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))\n"
    "t.start(); t.join()\n"
    "print(*seen)\n"
)


def _policies(priority: str) -> list[int]:
    proc = _at_priority(
        priority,
        lambda: subprocess.Popen([sys.executable, "-c", _PROBE], stdout=subprocess.PIPE),
    )
    out, _ = proc.communicate(timeout=30)
    return [int(x) for x in out.split()]


def test_services_run_idle_by_default_and_their_threads_too() -> None:
    assert StackSettings().stack_priority == "idle"
    assert _policies("idle") == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE, "the supervisor's own thread is unchanged"


def test_normal_priority_leaves_the_policy_alone() -> None:
    mine = os.sched_getscheduler(0)
    assert _policies("normal") == [mine, mine]


def test_batch_priority_runs_the_service_and_its_threads_under_sched_batch() -> None:
    assert _policies("batch") == [os.SCHED_BATCH, os.SCHED_BATCH]
    assert os.sched_getscheduler(0) != os.SCHED_BATCH, "the supervisor's own thread is unchanged"


def test_a_start_that_fails_raises_in_the_caller() -> None:
    with pytest.raises(FileNotFoundError):
        _at_priority("idle", lambda: subprocess.Popen(["/nonexistent/perfloop-service"]))


def test_a_bad_priority_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="stack_priority"):
        StackSettings(stack_priority="realtime")  # type: ignore[arg-type]


def _supervised(tmp: Path, priority: str) -> dict[str, list[int]]:
    tmp = tmp / priority
    (tmp / "home").mkdir(parents=True)
    sup = Supervisor(StackSettings(home=tmp / "home", stack_priority=priority))  # type: ignore[arg-type]
    seen = {}
    for name in ("broker", "warehouse", *SERVICES):
        child = _Child(name=name, argv=[sys.executable, "-c", _PROBE], ready=None, log=tmp / name)
        sup._spawn(child)
        assert child.proc is not None
        child.proc.wait(timeout=30)
        seen[name] = [int(x) for x in (tmp / name).read_text().split()]
    return seen


def test_the_history_services_yield_and_the_loop_never_preempts(tmp_path: Path) -> None:
    mine = os.sched_getscheduler(0)
    idle, batch = os.SCHED_IDLE, os.SCHED_BATCH
    assert _supervised(tmp_path, "idle") == {
        "broker": [batch, batch],
        "warehouse": [idle, idle],
        "streams": [batch, batch],
        "sink": [idle, idle],
        "actuator": [batch, batch],
    }
    assert set(map(tuple, _supervised(tmp_path, "normal").values())) == {(mine, mine)}


_HAS_AUTOGROUPS = Path("/proc/self/autogroup").exists()
# waits (30 s at most) until the test has looked at it from outside, then says its session
_WAIT_PROBE = (
    "import os, sys, time\n"
    "t = time.monotonic()\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() - t < 30: time.sleep(0.01)\n"
    "print(os.getsid(0))\n"
)


def _groups(tmp: Path, priority: str) -> dict[str, tuple[bool, str]]:
    """Per service: whether it leads a session of its own, and its autogroup line."""
    tmp = tmp / priority
    (tmp / "home").mkdir(parents=True)
    sup = Supervisor(StackSettings(home=tmp / "home", stack_priority=priority))  # type: ignore[arg-type]
    seen = {}
    for name in ("broker", "warehouse", *SERVICES):
        flag = tmp / f"{name}.seen"
        argv = [sys.executable, "-c", _WAIT_PROBE, str(flag)]
        child = _Child(name=name, argv=argv, ready=None, log=tmp / name)
        sup._spawn(child)
        assert child.proc is not None
        group = Path(f"/proc/{child.proc.pid}/autogroup").read_text().strip()
        flag.touch()
        child.proc.wait(timeout=30)
        own_session = int((tmp / name).read_text()) == child.proc.pid
        seen[name] = (own_session, group)
    return seen


@pytest.mark.skipif(not _HAS_AUTOGROUPS, reason="no autogroups in this kernel")
def test_each_service_has_a_scheduling_group_of_its_own_at_nice_19(tmp_path: Path) -> None:
    """The stream worker's at nice 10: it starts behind, and lowers it once caught up."""
    # a process in the kernel's root group (a session never set up since boot, as in some
    # containers) reads an empty line here
    mine = Path("/proc/self/autogroup").read_text()
    seen = _groups(tmp_path, "idle")
    assert all(own for own, _ in seen.values()), seen
    assert all(group for _, group in seen.values()), "every service in a group of its own"
    nice = {name: group.split()[-1] for name, (_, group) in seen.items()}
    assert nice.pop("streams") == str(CATCH_UP_NICE)
    assert set(nice.values()) == {str(AUTOGROUP_NICE)}
    groups = {group.split()[0] for _, group in seen.values()}
    assert len(groups) == len(seen), "one group each"
    assert not set(mine.split()[:1]) & groups
    assert Path("/proc/self/autogroup").read_text() == mine, "the supervisor's group unchanged"


@pytest.mark.skipif(not _HAS_AUTOGROUPS, reason="no autogroups in this kernel")
def test_normal_priority_keeps_the_services_in_the_supervisors_group(tmp_path: Path) -> None:
    mine = Path("/proc/self/autogroup").read_text().strip()
    seen = _groups(tmp_path, "normal")
    assert seen == {name: (False, mine) for name in seen}
