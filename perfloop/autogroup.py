"""Linux autogroups: the scheduling group of a session, and how a stream worker that fell
behind takes back a share of the CPUs.

The embedded stack's services each run in a session of their own whose group is at nice 19
(`perfloop.stack`): beside a training job that keeps every CPU busy they get ~1.5 % of a CPU
each, and yield the rest. A stream worker needs more than that on such a job, so it falls
behind its input and its diagnoses come later and later: on the bench's jobs its input was
more than 2 s old 13-30 s into 10 of 15 runs (9 of the 9 single-process ones, which keep both
CPUs busy; 1 of the 6 DDP ones), and a memory leak was diagnosed
11.5-16 s after it began with the worker and the broker at nice 19, 7.2-8.6 s with both at
nice 10 (bench/README.md). Held at nice 10 all the time, the loop cost a healthy 2-rank DDP job
~1.7 points of its speed. So `CatchUp` raises the worker's group, and the embedded broker's, to
``CATCH_UP_NICE`` once the input it reads is behind by more than ``behind_s`` (the age of the
oldest message read since the last tick, by its Kafka timestamp), and lowers them again once it
has been within ``caught_up_s`` for ``hold_s``. On a machine whose jobs keep its CPUs busy
that is close to nice 10 throughout: in the bench's five-round run (jobs 2 s apart) the group
stayed raised through nearly every healthy run, DDP ones included, and healthy DDP ran at
0.904× of plain (bench/README.md, evening of 2026-11-28). Held idle or held raised through
whole runs instead (`bench/overhead_split.py`, variants ``loop_idle`` and ``loop_raised``),
that job's speed showed no difference beyond the spread of its pairs (bench/README.md,
morning of 2026-11-29), so the rule stays as it is.

A worker starts behind (it imports, joins its group, restores its snapshot, then reads what
came meanwhile), so the supervisor starts it raised (``PERFLOOP_GROUP_RAISED``) and it lowers
its group like any other catch-up, once it has kept up for ``hold_s``. Started idle beside a
single-process job that kept both CPUs busy, the worker took 18 s from its partitions'
assignment to ready, and the job's memory leak was diagnosed 30 s after it began, at the end
of the job (bench/README.md, 2026-11-29).

Where the supervisor put the services in idle CPU control groups instead (`perfloop._cpugroup`),
the worker's target is the loop's group (worker, broker and actuator): raised, it leaves idle
for an ordinary weight of 110 (what an autogroup at nice 10 weighs); lowered, it is idle again.

Linux lets a group's nice value be raised and lowered back to 0 without privileges; only a
negative value needs them (measured here as root only). Where there are no autogroups, or a
process is gone, nothing changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from perfloop._cpugroup import CATCH_UP_SHARES, set_idle

__all__ = ["CATCH_UP_NICE", "CatchUp", "Target", "set_autogroup_nice"]

CATCH_UP_NICE = 10
"""The group nice of a worker (and broker) that fell behind: weight 110 against a busy
session's 1024, enough to catch up (it needs ~5 % of a CPU), not enough to crowd a rank."""

Target = tuple[int, str]
"""A process whose group `CatchUp` sets: its pid and a word its command line must hold (a pid
may be reused by another process after a restart: never change a stranger's group); or, pid
0, the directory of a CPU control group (`perfloop._cpugroup`)."""


def set_autogroup_nice(pid: int, nice: int, timeout_s: float = 2.0) -> bool:
    """Set the nice value of the scheduling group of process ``pid``'s session (Linux
    autogroups). An unprivileged process may do it once per 100 ms on the whole machine
    (EAGAIN otherwise): retried for ``timeout_s``. False where it could not be set (no
    autogroups, or the process is gone); the service then runs as it would have without."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(f"/proc/{pid}/autogroup", os.O_WRONLY)
        except OSError:
            return False
        try:
            os.write(fd, str(nice).encode())
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        except OSError:
            return False
        finally:
            os.close(fd)
        time.sleep(0.11)


def _is(target: Target) -> bool:
    pid, word = target
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return word.encode() in f.read()
    except OSError:
        return False


def _set(target: Target, nice: int) -> bool:
    if target[0] == 0:  # a control group: idle at the yielding nice, weight 110 raised
        return set_idle(Path(target[1]), idle=nice > CATCH_UP_NICE)
    return _is(target) and set_autogroup_nice(target[0], nice, timeout_s=0.5)


class CatchUp:
    """Raise ``targets``' groups from ``idle_nice`` to ``catch_up_nice`` while the input is
    behind; `seen` takes each message's age, `tick` decides (returns "raised" or "lowered"
    when it changed the groups, else None).

    >>> calls, now = [], [0.0]
    >>> c = CatchUp([(1, "w")], 19, setter=lambda t, n: calls.append(n) or True,
    ...             clock=lambda: now[0], background=False)
    >>> c.seen(0.3); c.tick()
    >>> c.seen(2.5); c.tick()
    'raised'
    >>> now[0] = 3.0; c.seen(0.2); c.tick()
    >>> now[0] = 33.5; c.seen(0.1); c.tick()
    'lowered'
    >>> calls
    [10, 19]
    """

    def __init__(
        self,
        targets: Sequence[Target],
        idle_nice: int,
        *,
        catch_up_nice: int = CATCH_UP_NICE,
        behind_s: float = 1.0,
        caught_up_s: float = 0.5,
        hold_s: float = 30.0,
        setter: Callable[[Target, int], bool] = _set,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
        raised: bool = False,
        broker_pid: Callable[[], int | None] | None = None,
    ) -> None:
        self.targets = list(targets)
        # The embedded broker's pid now: a recycle or a crash replaces the process, so the
        # "tansu" target follows it (None: the pid given stays).
        self._broker_pid = broker_pid
        self.idle_nice, self.catch_up_nice = idle_nice, catch_up_nice
        self.behind_s, self.caught_up_s, self.hold_s = behind_s, caught_up_s, hold_s
        self._setter, self._clock, self.background = setter, clock, background
        self.raised = False
        self.raises = 0
        self._worst = 0.0  # the oldest age seen since the last tick
        self._calm_since: float | None = None
        if raised:  # a worker that starts is behind: raised until it kept up for hold_s
            self._apply(self.catch_up_nice)
            self.raised = True
            self.raises += 1

    def seen(self, age_s: float) -> None:
        """A message read ``age_s`` after it was sent."""
        if age_s > self._worst:
            self._worst = age_s

    def tick(self) -> str | None:
        worst, self._worst = self._worst, 0.0
        now = self._clock()
        if self.raised and self._moved():  # a new broker process starts at the yielding nice
            self._apply(self.catch_up_nice)
        if not self.raised:
            if worst > self.behind_s:
                self._apply(self.catch_up_nice)
                self.raised, self._calm_since = True, None
                self.raises += 1
                return "raised"
            return None
        if worst > self.caught_up_s:
            self._calm_since = None
            return None
        if self._calm_since is None:
            self._calm_since = now
            return None
        if now - self._calm_since < self.hold_s:
            return None
        self._apply(self.idle_nice)
        self.raised = False
        return "lowered"

    def describe(self, moved: str) -> str:
        """What `tick`'s ``moved`` did, for the worker's log."""
        if self.targets and self.targets[0][0] == 0:
            return (
                f"raised to weight {CATCH_UP_SHARES} (an autogroup at nice {self.catch_up_nice})"
                if moved == "raised"
                else "back to idle"
            )
        return (
            f"raised to nice {self.catch_up_nice}"
            if moved == "raised"
            else f"back to nice {self.idle_nice}"
        )

    def _moved(self) -> bool:
        """Whether the broker is another process than the "tansu" target (which then
        follows it)."""
        pid = self._broker_pid() if self._broker_pid is not None else None
        if pid is None:
            return False
        moved = False
        for i, (old, word) in enumerate(self.targets):
            if word == "tansu" and old != pid:
                self.targets[i] = (pid, word)
                moved = True
        return moved

    def _apply(self, nice: int) -> None:
        self._moved()
        targets = list(self.targets)

        def run() -> None:
            for t in targets:
                with contextlib.suppress(Exception):  # a group that cannot be set stays as is
                    self._setter(t, nice)

        if not self.background:
            run()
            return
        # off the caller's thread: an unprivileged write may wait ~100 ms for its turn
        threading.Thread(target=run, name="perfloop-autogroup", daemon=True).start()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CatchUp | None:
        """The worker's controller when the supervisor put it in a group of its own at a
        yielding nice (``PERFLOOP_GROUP_NICE``; the embedded broker's pid in
        ``PERFLOOP_BROKER_PID``) or in an idle CPU control group with the broker
        (``PERFLOOP_CPU_GROUP``, its directory), else None."""
        env = dict(os.environ) if env is None else env
        try:
            idle = int(env.get("PERFLOOP_GROUP_NICE", ""))
        except ValueError:
            return None
        raised = env.get("PERFLOOP_GROUP_RAISED") == "1"
        group = env.get("PERFLOOP_CPU_GROUP", "")
        if group and idle > CATCH_UP_NICE:
            return cls([(0, group)], idle, raised=raised)
        if idle <= CATCH_UP_NICE or os.getsid(0) != os.getpid():
            return None  # not yielding, or not in a session (a group) of its own
        targets: list[Target] = [(os.getpid(), "perfloop")]
        with contextlib.suppress(ValueError):
            targets.append((int(env.get("PERFLOOP_BROKER_PID", "")), "tansu"))
        home = env.get("PERFLOOP_HOME")
        follow = (lambda: broker_pid_in(Path(home))) if home else None
        return cls(targets, idle, raised=raised, broker_pid=follow)


def broker_pid_in(home: Path) -> int | None:
    """The embedded broker's pid in the stack's state file under ``home`` (None: no state,
    or no broker).

    >>> broker_pid_in(Path("/nonexistent")) is None
    True
    """
    try:
        doc = json.loads((home / "stack.json").read_text())
        return int(doc["services"]["broker"]["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
