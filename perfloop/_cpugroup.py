"""CPU control groups for the embedded stack: its services in groups the kernel treats as idle.

A service in an autogroup at nice 19 (`perfloop.autogroup`) weighs little, but when a rank
wakes up on a CPU where the service runs, the kernel lets the service finish its time slice
first (the two groups are peers); on a job whose ranks meet at every step, a rank held up
that way holds up all. A control group whose ``cpu.idle`` is 1 is, to the kernel, a group of
``SCHED_IDLE`` tasks: any ordinary thread that wakes up takes its CPU at once, and it weighs
3 against a rank's 1024, while it still has every CPU the job leaves idle. Measured on a
healthy 2-rank DDP job under ``perfloop run --tier observe`` on a 2-core machine against the
plain job, alternating on one stack, medians of four pairs: 0.825× of the plain steps/s with
the services in autogroups at nice 19, 0.896× with them in such groups (``python
bench/overhead_split.py --variants full,autogroups``; bench/README.md).

The supervisor makes two groups beside its own (Linux cgroups, v1 ``cpu`` hierarchy or v2
with the ``cpu`` controller): ``perfloop-<pid>-loop`` (broker, stream workers, actuator) and
``perfloop-<pid>-history`` (warehouse, sink), both idle. A stream worker that falls behind
its input makes the loop's group an ordinary one of weight 110 (what an autogroup at nice 10
weighs) until it has caught up (`perfloop.autogroup.CatchUp`). Where the groups cannot be
made (no write access to the hierarchy, no ``cpu.idle`` in the kernel) the stack falls back
to autogroups; nothing here ever raises.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["CATCH_UP_SHARES", "StackGroups", "cpu_dir", "set_idle"]

CATCH_UP_SHARES = 110
"""The loop group's weight while the worker catches up (v1 ``cpu.shares``; v2's ``cpu.weight``
is this scaled to its default of 100 for 1024): an autogroup's at nice 10."""


def _v2_weight(shares: int) -> int:
    return max(1, round(shares * 100 / 1024))


def cpu_dir(proc: Path = Path("/proc/self")) -> Path | None:
    """The directory of the CPU controller's control group that process ``proc`` is in (v1
    ``cpu`` hierarchy first, else the v2 one), or None where there is none."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            v2 = path
        elif "cpu" in ctrls.split(","):
            v1 = path
    for m in mounts:
        fields, _, tail = m.partition(" - ")
        f, t = fields.split(), tail.split()
        if len(f) < 5 or len(t) < 3:
            continue
        root, point, fstype, opts = f[3], f[4], t[0], t[2].split(",")
        want = v1 if fstype == "cgroup" and "cpu" in opts else None
        if want is None and fstype == "cgroup2" and v1 is None:
            want = v2
        if want is None:
            continue
        rel = want if root == "/" else want.removeprefix(root)
        return Path(point) / rel.lstrip("/")
    return None


def set_idle(group: Path, idle: bool) -> bool:
    """Make ``group`` idle (``cpu.idle`` 1) or an ordinary group of weight `CATCH_UP_SHARES`;
    False where it could not be done."""
    try:
        (group / "cpu.idle").write_text("1" if idle else "0")
        if not idle:  # leaving idle restores the default weight (1024), not the one set before
            _set_weight(group, CATCH_UP_SHARES)
        return True
    except OSError:
        return False


def _set_weight(group: Path, shares: int) -> None:
    if (group / "cpu.shares").exists():
        (group / "cpu.shares").write_text(str(shares))
    else:
        (group / "cpu.weight").write_text(str(_v2_weight(shares)))


class StackGroups:
    """The supervisor's two idle groups (see the module's docstring), made at construction;
    `ok` is False where they could not be made (nothing was left behind then)."""

    NAMES = ("loop", "history")

    def __init__(self, base: Path | None = None, tag: str | None = None) -> None:
        self.base = cpu_dir() if base is None else base
        self.tag = tag or f"perfloop-{os.getpid()}"
        self.groups: dict[str, Path] = {}
        self.error = ""
        if self.base is None:
            self.error = "no CPU control group found for this process"
            return
        self._sweep()
        try:
            for name in self.NAMES:
                g = self.base / f"{self.tag}-{name}"
                g.mkdir(exist_ok=True)
                self.groups[name] = g
                (g / "cpu.idle").write_text("1")
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
            self.remove()

    @property
    def ok(self) -> bool:
        return bool(self.groups) and not self.error

    def add(self, name: str, pid: int) -> bool:
        """Move process ``pid`` (every thread of it) into group ``name``."""
        g = self.groups.get(name)
        if g is None:
            return False
        try:
            (g / "cgroup.procs").write_text(str(pid))
            return True
        except OSError:
            return False

    def remove(self) -> None:
        """Remove the groups (once their processes have exited); never raises."""
        for g in self.groups.values():
            with contextlib.suppress(OSError):
                g.rmdir()
        self.groups = {}

    def _sweep(self) -> None:
        """Remove empty groups that supervisors no longer alive left behind."""
        assert self.base is not None
        with contextlib.suppress(OSError):
            for g in self.base.glob("perfloop-*-*"):
                pid = g.name.split("-")[1]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    with contextlib.suppress(OSError):
                        g.rmdir()
