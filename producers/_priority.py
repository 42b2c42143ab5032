"""perfloop's threads inside a training process run at a low CPU priority.

On a node whose cores the job keeps busy, a telemetry thread that wakes up takes a core
from a training thread, and the training thread's peers then wait for it at the next
barrier of a parallel op (or, in DDP, at the next gradient all-reduce): a small theft costs
the step much more than it takes. Linux keeps a scheduling policy and a nice value per thread,
and a new thread inherits its creator's, so `in_background` builds perfloop's machinery
(publisher, Kafka clients, worker threads) from a thread that first lowers itself: every
thread made there, librdkafka's included, runs niced and under ``SCHED_BATCH``, and the
training threads keep their priority. Nice makes a busy core give perfloop's threads a small
share of its time; ``SCHED_BATCH`` makes a waking perfloop thread wait for the running
training thread's time slice to end (or for it to block) instead of preempting it on wakeup.
Neither starves perfloop: it still gets its share of a saturated core. ``nice`` 0 leaves
everything as it is.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["in_background", "lower_this_thread"]

T = TypeVar("T")


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` and move it to ``SCHED_BATCH`` (Linux:
    both per thread) when it runs under the ordinary policy; never raises."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    batch, other = getattr(os, "SCHED_BATCH", None), getattr(os, "SCHED_OTHER", None)
    with contextlib.suppress(OSError, AttributeError):
        if batch is not None and os.sched_getscheduler(0) == other:  # 0: this thread
            os.sched_setscheduler(0, batch, os.sched_param(0))


def in_background(fn: Callable[..., T], *args: Any, nice: int = 19, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a helper thread niced by ``nice`` (threads it starts inherit
    that); its result, or its exception re-raised here.

    >>> import os, threading
    >>> def my_nice(): return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    >>> in_background(my_nice, nice=5) >= min(19, my_nice() + 5) or os.name != "posix"
    True
    """
    if nice <= 0:
        return fn(*args, **kwargs)
    out: dict[str, Any] = {}

    def run() -> None:
        lower_this_thread(nice)
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, name="perfloop-start", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]
