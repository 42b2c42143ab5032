"""A rank's CPU budget: its affinity, its container's quota (cgroup v1 and v2, with their
ancestors), and the launcher's other ranks on the node; unreadable or odd files mean no quota.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from perfloop.producers._cpu import cgroup_cpu_limit, cpu_budget


def _files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"p/cgroup": "0::/a/b\n", "cg/a/b/cpu.max": "max 100000\n"}, None),
        ({"p/cgroup": "0::/a/b\n", "cg/a/cpu.max": "250000 100000\n"}, 2.5),  # an ancestor
        ({"p/cgroup": "0::/\n", "cg/cpu.max": "50000 100000\n"}, 0.5),
        (
            {
                "p/cgroup": "4:cpu,cpuacct:/pod/c1\n1:memory:/pod\n",
                "cg/cpu,cpuacct/pod/c1/cpu.cfs_quota_us": "300000\n",
                "cg/cpu,cpuacct/pod/c1/cpu.cfs_period_us": "100000\n",
            },
            3.0,
        ),
        (
            {
                "p/cgroup": "3:cpu:/\n",
                "cg/cpu/cpu.cfs_quota_us": "-1\n",
                "cg/cpu/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        ({"p/cgroup": "0::/x\n", "cg/x/cpu.max": "garbage\n"}, None),
        ({"p/cgroup": "not a cgroup line\n"}, None),
        ({}, None),  # no /proc/self/cgroup at all
    ],
)
def test_the_container_quota_is_read_from_either_cgroup_version(
    tmp_path: Path, files: dict[str, str], limit: float | None
) -> None:
    _files(tmp_path, files)
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "p") == limit


@pytest.mark.parametrize(
    ("ranks", "affinity", "machine", "quota", "cpus"),
    [
        (1, 2, 2, None, 2),  # one process: every CPU it may run on
        (2, 2, 2, None, 1),  # torchrun, 2 ranks on 2 CPUs: one each
        (4, 2, 2, None, 1),  # more ranks than CPUs: never below one
        (2, 8, 16, None, 8),  # pinned to 8 of 16: its own
        (2, 16, 16, 4.0, 2),  # a 4-CPU container shared by 2 ranks
        (1, 16, 16, 0.5, 1),  # half a CPU still runs one thread
        (3, 16, 16, None, 5),  # 16 / 3, rounded down
    ],
)
def test_the_budget_is_the_ranks_share(
    ranks: int, affinity: int, machine: int, quota: float | None, cpus: int
) -> None:
    budget = cpu_budget(ranks, affinity=affinity, machine=machine, quota=quota)
    assert budget.cpus == cpus and budget.why


def test_this_process_has_a_budget_within_its_affinity() -> None:
    import os

    budget = cpu_budget(1)
    assert 1 <= budget.cpus <= len(os.sched_getaffinity(0))
