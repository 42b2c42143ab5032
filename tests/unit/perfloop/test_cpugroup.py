"""The embedded stack's idle CPU control groups (`perfloop._cpugroup`): where a process's CPU
controller lives, the two groups the supervisor makes (idle, removed when it stops, nothing
left behind when they cannot be made), and the stream worker's catch-up raising the loop's
group to an ordinary one of weight 110 and back to idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perfloop._cpugroup import CATCH_UP_SHARES, StackGroups, cpu_dir, set_idle
from perfloop.autogroup import CatchUp, _set


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    p = tmp_path / "proc"
    p.mkdir()
    (p / "cgroup").write_text(cgroup)
    (p / "mountinfo").write_text(mountinfo)
    return p


_V1 = (
    "30 24 0:26 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "31 24 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "38 24 0:34 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)


def test_the_v1_cpu_hierarchy_comes_first(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:memory:/x\n1:cpu:/jobs/a\n0::/\n", _V1)
    assert cpu_dir(proc) == Path("/sys/fs/cgroup/cpu/jobs/a")


def test_a_container_sees_its_own_group_as_the_mounts_root(tmp_path: Path) -> None:
    mounts = "40 30 0:26 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
    proc = _proc(tmp_path, "2:cpu,cpuacct:/docker/abc/svc\n", mounts)
    assert cpu_dir(proc) == Path("/sys/fs/cgroup/cpu,cpuacct/svc")


def test_v2_alone(tmp_path: Path) -> None:
    mounts = "25 20 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    proc = _proc(tmp_path, "0::/user.slice/u.scope\n", mounts)
    assert cpu_dir(proc) == Path("/sys/fs/cgroup/user.slice/u.scope")


def test_no_cpu_controller_or_no_proc_files(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "4:memory:/x\n", "31 24 0:27 / /m rw - cgroup cgroup rw,memory\n")
    assert cpu_dir(proc) is None
    assert cpu_dir(tmp_path / "nowhere") is None


def test_groups_that_cannot_be_made_leave_nothing_and_say_why(tmp_path: Path) -> None:
    g = StackGroups(base=tmp_path / "absent", tag="perfloop-1")
    assert not g.ok and g.groups == {} and "FileNotFoundError" in g.error
    assert not g.add("loop", os.getpid())
    assert not (tmp_path / "absent").exists()


def test_groups_are_made_idle_and_a_dead_supervisors_empty_ones_swept(tmp_path: Path) -> None:
    dead = tmp_path / "perfloop-999999999-loop"
    live = tmp_path / f"perfloop-{os.getpid()}-loop"
    dead.mkdir()
    live.mkdir()
    g = StackGroups(base=tmp_path, tag="perfloop-7")
    assert g.ok, g.error
    assert not dead.exists(), "an empty group of a supervisor that is gone"
    assert live.exists(), "a live supervisor's group"
    for name in ("loop", "history"):
        assert (tmp_path / f"perfloop-7-{name}" / "cpu.idle").read_text() == "1"
    assert g.add("history", 4321)
    assert (tmp_path / "perfloop-7-history" / "cgroup.procs").read_text() == "4321"
    assert not g.add("nope", 4321)


def test_catch_up_on_a_control_group_toggles_it_between_idle_and_weight_110(
    tmp_path: Path,
) -> None:
    group = tmp_path / "perfloop-7-loop"
    group.mkdir()
    (group / "cpu.weight").write_text("100")  # a v2 group
    c = CatchUp.from_env({"PERFLOOP_GROUP_NICE": "19", "PERFLOOP_CPU_GROUP": str(group)})
    assert c is not None and c.targets == [(0, str(group))], "no session of its own needed"
    assert _set((0, str(group)), c.catch_up_nice)
    assert (group / "cpu.idle").read_text() == "0"
    assert (group / "cpu.weight").read_text() == str(round(CATCH_UP_SHARES * 100 / 1024))
    assert c.describe("raised") == "raised to weight 110 (an autogroup at nice 10)"
    assert _set((0, str(group)), c.idle_nice)
    assert (group / "cpu.idle").read_text() == "1" and c.describe("lowered") == "back to idle"
    assert not set_idle(tmp_path / "gone", idle=True)
    assert CatchUp.from_env({"PERFLOOP_CPU_GROUP": str(group)}) is None, "not yielding"


def _real_base() -> Path | None:
    base = cpu_dir()
    if base is None or not os.access(base, os.W_OK) or not (base / "cpu.idle").exists():
        return None
    return base


@pytest.mark.skipif(_real_base() is None, reason="no writable CPU control group with cpu.idle")
def test_a_real_process_in_the_real_idle_group() -> None:
    g = StackGroups()
    assert g.ok, g.error
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert g.add("loop", proc.pid)
        name = f"{g.tag}-loop"
        assert name in Path(f"/proc/{proc.pid}/cgroup").read_text()
        loop = g.groups["loop"]
        assert (loop / "cpu.idle").read_text().strip() == "1"
        assert set_idle(loop, idle=False)
        assert (loop / "cpu.idle").read_text().strip() == "0"
        weight = loop / ("cpu.shares" if (loop / "cpu.shares").exists() else "cpu.weight")
        want = CATCH_UP_SHARES if weight.name == "cpu.shares" else round(CATCH_UP_SHARES / 10.24)
        assert int(weight.read_text()) == want
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.1)
    g.remove()
    assert not (g.base / f"{g.tag}-loop").exists() and g.groups == {}  # type: ignore[operator]


_ENV_PROBE = "import os; print(os.environ.get('PERFLOOP_CPU_GROUP', ''))"


def test_the_supervisor_puts_each_service_in_its_group_and_a_new_worker_starts_raised(
    tmp_path: Path,
) -> None:
    from perfloop.settings import StackSettings
    from perfloop.stack.supervisor import Supervisor, _Child

    (tmp_path / "home").mkdir()
    sup = Supervisor(StackSettings(home=tmp_path / "home"))
    (tmp_path / "cg").mkdir()
    sup._groups = StackGroups(base=tmp_path / "cg", tag="perfloop-7")
    assert sup._groups.ok, sup._groups.error
    loop, history = sup._groups.groups["loop"], sup._groups.groups["history"]
    (loop / "cpu.idle").write_text("1")  # the last worker had caught up and lowered it
    seen = {}
    for name in ("broker", "warehouse", "streams", "sink", "actuator"):
        child = _Child(
            name=name, argv=[sys.executable, "-c", _ENV_PROBE], ready=None, log=tmp_path / name
        )
        sup._spawn(child)
        assert child.proc is not None and child.proc.wait(timeout=30) == 0
        group = history if name in ("warehouse", "sink") else loop
        assert (group / "cgroup.procs").read_text() == str(child.proc.pid), name
        seen[name] = (tmp_path / name).read_text().strip()
    assert seen == {
        "broker": "",
        "warehouse": "",
        "streams": str(loop),
        "sink": "",
        "actuator": "",
    }, "only the stream worker raises the loop's group"
    assert (loop / "cpu.idle").read_text() == "0", "a new worker starts behind: loop raised"


def test_a_worker_started_behind_raises_its_group_at_once_and_lowers_it_once_caught_up(
    tmp_path: Path,
) -> None:
    group = tmp_path / "perfloop-7-loop"
    group.mkdir()
    (group / "cpu.idle").write_text("1")
    (group / "cpu.weight").write_text("100")
    now = [0.0]
    env = {"PERFLOOP_GROUP_NICE": "19", "PERFLOOP_CPU_GROUP": str(group)}
    c = CatchUp.from_env(env | {"PERFLOOP_GROUP_RAISED": "1"})
    assert c is not None and c.raised and c.raises == 1
    deadline = time.monotonic() + 5  # applied off the caller's thread
    while (group / "cpu.idle").read_text() != "0" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (group / "cpu.idle").read_text() == "0", "raised while it starts"
    c._clock, c.background = (lambda: now[0]), False
    c.seen(3.0)  # the input it finds waiting is old: stays raised
    assert c.tick() is None and c.raised
    c.seen(0.1)
    assert c.tick() is None  # caught up: the hold starts
    now[0] = 30.5
    c.seen(0.1)
    assert c.tick() == "lowered" and (group / "cpu.idle").read_text() == "1"
    plain = CatchUp.from_env(env)
    assert plain is not None and not plain.raised and plain.raises == 0
