"""perfloop's threads inside a training process: niced and under ``SCHED_BATCH`` (Linux), so
a telemetry thread that wakes never preempts a training thread; the caller's thread and
policy are left as they were, and ``nice`` 0 changes nothing."""

from __future__ import annotations

import os
import threading

import pytest

from perfloop.producers._priority import in_background

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")


def _mine() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _and_a_thread_it_starts() -> list[tuple[int, int]]:
    seen = [_mine()]
    t = threading.Thread(target=lambda: seen.append(_mine()))
    t.start()
    t.join()
    return seen


def test_perfloops_threads_run_niced_under_sched_batch_and_their_threads_too() -> None:
    policy, nice = _mine()
    if policy != os.SCHED_OTHER:
        pytest.skip("this test process does not run under the ordinary policy")
    want = (os.SCHED_BATCH, min(19, nice + 5))
    assert in_background(_and_a_thread_it_starts, nice=5) == [want, want]
    assert _mine() == (policy, nice), "the calling (training) thread is unchanged"


def test_nice_zero_changes_nothing() -> None:
    mine = _mine()
    assert in_background(_and_a_thread_it_starts, nice=0) == [mine, mine]


def test_an_error_in_the_background_is_raised_in_the_caller() -> None:
    def boom() -> None:
        raise RuntimeError("no broker")

    with pytest.raises(RuntimeError, match="no broker"):
        in_background(boom, nice=5)
