"""The embedded services' scheduling policy: ``SCHED_IDLE`` by default (they use only CPU
time the training job leaves), the ordinary one with ``stack_priority`` "normal"; and a
service's threads inherit it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from perfloop.settings import StackSettings
from perfloop.stack import _at_priority

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


def test_a_start_that_fails_raises_in_the_caller() -> None:
    with pytest.raises(FileNotFoundError):
        _at_priority("idle", lambda: subprocess.Popen(["/nonexistent/perfloop-service"]))


def test_a_bad_priority_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="stack_priority"):
        StackSettings(stack_priority="realtime")  # type: ignore[arg-type]
