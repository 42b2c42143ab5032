"""The embedded services' scheduling policy: by default the warehouse and the sink run under
``SCHED_IDLE`` (they use only CPU time the training job leaves) and the loop (broker, stream
workers, actuator) under ``SCHED_BATCH`` (a fair share, no wakeup preemption of a training
thread); with ``stack_priority`` "normal" every service runs under the ordinary policy; a
service's threads inherit its policy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perfloop.settings import StackSettings
from perfloop.stack import SERVICES, Supervisor, _at_priority, _Child

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
