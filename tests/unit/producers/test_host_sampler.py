"""The host sampler on real processes (a fake trainer with loader workers) and patched counters."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import psutil
import pytest

from perfloop.producers._memroom import cgroup_dirs, cgroup_memory_room, peak_virtual_size
from perfloop.producers.host import HostSampler, rank_of
from perfloop.schemas.telemetry import HostSample

# A stand-in for a training process: it forks two "data-loader workers" that hold memory.
TRAINER = """
import multiprocessing as mp, sys, time
def worker(q):
    buf = b"x" * (32 << 20)  # touched pages: they count in RSS
    q.put(len(buf))
    time.sleep(60)
if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(q,), daemon=True) for _ in range(2)]
    for p in ps: p.start()
    q.get(); q.get()
    print("ready", flush=True)
    sys.stdin.read()
"""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def trainer() -> Iterator[subprocess.Popen[str]]:
    env = dict(os.environ, RANK="3")
    p = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    yield p
    if p.poll() is None:
        for child in psutil.Process(p.pid).children(recursive=True):
            child.kill()
        p.kill()
    p.wait(timeout=10)


def _wait_for_workers(pid: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(psutil.Process(pid).children(recursive=True)) < n:
        assert time.monotonic() < deadline, "the fake trainer's workers did not start"
        time.sleep(0.05)


@pytest.mark.parametrize("proc_children", [True, False], ids=["proc-children", "psutil"])
def test_watched_process_with_loader_workers(
    trainer: subprocess.Popen[str], proc_children: bool
) -> None:
    _wait_for_workers(trainer.pid, 2)
    s = HostSampler([trainer.pid])  # rank from the launcher's environment
    s._proc_children &= proc_children  # the portable path where /proc lacks children files
    s.sample()
    (row,) = s.sample()
    assert row["pid"] == trainer.pid and row["rank"] == 3
    assert row["loader_workers"] == 2
    assert row["loader_rss_bytes"] >= 2 * (32 << 20)
    assert row["proc_rss_bytes"] > 0 and row["proc_threads"] >= 1
    assert 0 <= row["sys_cpu_pct"] <= 100
    assert row["sys_mem_total_bytes"] >= row["sys_mem_used_bytes"] > 0
    assert s.children == frozenset(c.pid for c in psutil.Process(trainer.pid).children(True))
    HostSample(ts_ns=1, job_id="j", node="n", **row)  # fits the schema


def test_exited_process_is_dropped_once(
    trainer: subprocess.Popen[str], caplog: pytest.LogCaptureFixture
) -> None:
    s = HostSampler({trainer.pid: 0})
    assert len(s.sample()) == 1 and s.alive
    for child in psutil.Process(trainer.pid).children(recursive=True):
        child.kill()
    trainer.kill()
    trainer.wait(timeout=10)
    assert s.sample() == [] and s.sample() == []
    assert not s.alive and s.pids == {}
    assert sum("exited" in r.getMessage() for r in caplog.records) == 1


def test_rank_given_wins_and_unknown_rank_is_minus_one() -> None:
    assert HostSampler({os.getpid(): 7}).sample()[0]["rank"] == 7
    with mock.patch.object(psutil.Process, "environ", autospec=True, return_value={}):
        assert rank_of(os.getpid()) == -1
    with mock.patch.object(psutil.Process, "environ", autospec=True, return_value={"RANK": "x"}):
        assert rank_of(os.getpid()) == -1
    with mock.patch.object(psutil.Process, "environ", autospec=True, return_value={"RANK": "5"}):
        assert rank_of(os.getpid()) == 5


def test_missing_pid_is_not_watched() -> None:
    s = HostSampler([2**22 + 4321])
    assert s.sample() == [] and not s.alive


def test_node_level_row_without_pids() -> None:
    s = HostSampler()
    (row,) = s.sample()
    assert (row["pid"], row["rank"]) == (0, -1)
    assert "proc_cpu_pct" not in row
    assert {"process", "loader_workers"} <= set(s.missing)


def _cpu(user: float, idle: float, iowait: float) -> object:
    fields = psutil.cpu_times()._fields
    values = {f: 0.0 for f in fields} | {"user": user, "idle": idle, "iowait": iowait}
    return type(psutil.cpu_times())(**values)


def test_rates_from_counters_and_loopback_excluded() -> None:
    clock = Clock()
    disk = iter(
        [SimpleNamespace(read_bytes=r, write_bytes=w) for r, w in [(0, 0), (0, 0), (4e6, 1e6)]]
    )
    nics = iter(
        [
            {"lo": SimpleNamespace(bytes_recv=0, bytes_sent=0)},  # the probe
            {
                "lo": SimpleNamespace(bytes_recv=0, bytes_sent=0),
                "eth0": SimpleNamespace(bytes_recv=1000, bytes_sent=0),
            },
            {
                "lo": SimpleNamespace(bytes_recv=9e9, bytes_sent=9e9),
                "eth0": SimpleNamespace(bytes_recv=1000 + 6e6, bytes_sent=2e6),
            },
        ]
    )
    cpu = iter([_cpu(0, 0, 0), _cpu(10, 80, 10), _cpu(40, 130, 30)])
    with (
        mock.patch.object(
            psutil, "disk_io_counters", autospec=True, side_effect=lambda: next(disk)
        ),
        mock.patch.object(
            psutil, "net_io_counters", autospec=True, side_effect=lambda pernic: next(nics)
        ),
        mock.patch.object(psutil, "cpu_times", autospec=True, side_effect=lambda: next(cpu)),
    ):
        s = HostSampler(clock=clock)
        first = s.sample()[0]
        clock.t += 2.0
        second = s.sample()[0]
    assert first["disk_read_bytes_per_s"] == 0.0  # no previous reading yet
    assert second["disk_read_bytes_per_s"] == pytest.approx(2e6)
    assert second["disk_write_bytes_per_s"] == pytest.approx(5e5)
    assert second["net_rx_bytes_per_s"] == pytest.approx(3e6)  # loopback not counted
    assert second["net_tx_bytes_per_s"] == pytest.approx(1e6)
    # between the two reads: 30 user, 50 idle, 20 iowait out of 100
    assert second["sys_cpu_pct"] == pytest.approx(30.0)
    assert second["sys_iowait_pct"] == pytest.approx(20.0)


def test_platform_without_disk_counters_reports_missing() -> None:
    with mock.patch.object(psutil, "disk_io_counters", autospec=True, return_value=None):
        s = HostSampler()
        row = s.sample()[0]
    assert "disk_io" in s.missing
    assert "disk_read_bytes_per_s" not in row


def test_ranks_started_by_a_launcher_are_watched_as_ranks_with_their_own_workers() -> None:
    """Under `perfloop run -- torchrun …` the watched pid is the launcher: its children that
    carry a RANK are ranks (with their own loader workers), not the launcher's workers."""
    import textwrap

    rank_code = textwrap.dedent(
        """
        import subprocess, sys, time
        w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        print("ready", flush=True)
        time.sleep(30)
        """
    )
    launcher_code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        env = dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
        r = subprocess.Popen([sys.executable, "-c", {rank_code!r}], env=env,
                             stdout=subprocess.PIPE, text=True)
        r.stdout.readline()
        print("ready", flush=True)
        time.sleep(30)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    launcher = subprocess.Popen(
        [sys.executable, "-c", launcher_code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stdout is not None and launcher.stdout.readline().strip() == "ready"
        s = HostSampler([launcher.pid])
        rows = {r["pid"]: r for r in s.sample()}
        assert s.pids[launcher.pid] == -1
        (rank_pid,) = [p for p, rank in s.pids.items() if rank == 1]
        assert rows[launcher.pid]["loader_workers"] == 0
        assert rows[rank_pid]["rank"] == 1 and rows[rank_pid]["loader_workers"] == 1
    finally:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            p.kill()
        launcher.kill()
        launcher.wait()


def test_a_process_s_address_space_limit_is_its_memory_room_and_bad_cgroup_files_are_none(
    tmp_path: Path,
) -> None:
    """A script that caps its own address space (``ulimit -v``, ``RLIMIT_AS``) runs out of it
    long before the host: its host row carries the cap less its virtual size. A process
    without such a cap has no room of its own (the host bounds it)."""
    cap = 3 << 30
    code = (
        "import resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({cap}, resource.RLIM_INFINITY)); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        (row,) = HostSampler({p.pid: 0}).sample()
        peak = peak_virtual_size(p.pid)  # a failed allocation happens at a peak
        assert peak is not None and peak >= psutil.Process(p.pid).memory_info().vms
        assert row["mem_room_limit"] == "address_space"
        assert row["mem_room_bytes"] == pytest.approx(cap - peak, abs=8 << 20)
        HostSample(ts_ns=1, job_id="j", node="n", **row)  # schema-valid
    finally:
        p.kill()
        p.wait()
    (me,) = HostSampler({os.getpid(): 0}).sample()
    if psutil.Process().rlimit(psutil.RLIMIT_AS)[0] == psutil.RLIM_INFINITY:
        assert me["mem_room_limit"] in ("", "cgroup")
    # cgroup files that say nothing usable are no limit; a v1 limit counts its inactive cache
    root, proc = tmp_path / "cg", tmp_path / "proc"
    (root / "memory/slurm/job7").mkdir(parents=True)
    proc.mkdir()
    (proc / "cgroup").write_text("9:cpu:/\n4:memory:/slurm/job7\n0::/\nbroken line\n")
    (root / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")  # none
    (root / "memory/slurm/memory.limit_in_bytes").write_text("garbage\n")
    job = root / "memory/slurm/job7"
    (job / "memory.limit_in_bytes").write_text(str(4 << 30))
    (job / "memory.usage_in_bytes").write_text(str(3 << 30))
    (job / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {1 << 30}\n")
    dirs = cgroup_dirs(proc, root)
    assert dirs[0] == (job, True) and all(v1 for _, v1 in dirs[:3])
    assert cgroup_memory_room(dirs) == 2 << 30
    (job / "memory.usage_in_bytes").unlink()
    assert cgroup_memory_room(dirs) is None, "a limit without its usage is no room to count"


BURN = """import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
while True:
    pass
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_a_process_that_shares_its_cpu_reads_its_run_queue_wait() -> None:
    # three busy processes pinned to one CPU wait for it whenever they do not run (each about
    # two thirds of the time on a quiet machine); a process that sleeps waits for nothing; the
    # first sample of a rate reads 0
    cpu = sorted(os.sched_getaffinity(0))[0]
    busy = [
        subprocess.Popen([sys.executable, "-c", BURN, str(cpu)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for p in busy:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        s = HostSampler({**{p.pid: r for r, p in enumerate(busy)}, idle.pid: 3})
        if "run_delay" in s.missing:
            pytest.skip(s.missing["run_delay"])
        assert {r["proc_run_delay_pct"] for r in s.sample()} == {0.0}
        time.sleep(1.0)
        rows = {r["rank"]: r for r in s.sample()}
    finally:
        for p in (*busy, idle):
            p.kill()
            p.wait()
    for r in (0, 1, 2):  # each is always runnable: it runs, or it waits (for the others)
        assert rows[r]["proc_run_delay_pct"] > 50, rows[r]
        assert rows[r]["proc_run_delay_pct"] + rows[r]["proc_cpu_pct"] == pytest.approx(100, abs=15)
    assert rows[3]["proc_run_delay_pct"] < 5
    HostSample(ts_ns=1, job_id="j", node="n", **rows[0])  # a valid sample
