"""The CPUs one training process (one rank) may really use.

A rank's CPU budget is what decides how many intra-op threads and loader workers fit: more
than that and threads wait for each other's cores. Three things bound it:

- the process's CPU affinity (``sched_getaffinity``): a launcher or the script may pin it;
- a container's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``, the smallest along the cgroup's ancestors), shared by every process
  in the container;
- the other ranks the launcher started on this node (``LOCAL_WORLD_SIZE``): ranks that share
  one affinity set, or one container, share its CPUs.

A rank whose affinity set is at most its share of the machine (``cpu_count / local ranks``)
is taken as pinned to CPUs of its own; otherwise the set is shared by the local ranks.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["CpuBudget", "cgroup_cpu_limit", "cgroup_dirs", "cpu_budget"]


class CpuBudget(tuple[int, str]):
    """``(cpus, why)``: the whole CPUs a rank may use, and how that was found."""

    @property
    def cpus(self) -> int:
        return self[0]

    @property
    def why(self) -> str:
        return self[1]


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _quota_v2(text: str) -> float | None:
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(quota: str, period: str) -> float | None:
    try:
        q, p = float(quota), float(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


_V1_MOUNTS = {"cpu": ("cpu,cpuacct",)}
"""Where a v1 controller may be mounted besides its own name and the line's controllers."""


def cgroup_dirs(proc: Path, root: Path, controller: str) -> list[tuple[Path, bool]]:
    """The directories of ``controller`` (``cpu``, ``memory``) for the process at ``proc``
    (``/proc/<pid>``, or ``/proc/self``) and its cgroup's ancestors, each with whether it is
    cgroup v1, innermost first; those that do not exist (another mount namespace) are left
    out."""
    lines = _read(proc / "cgroup")
    out: list[tuple[Path, bool]] = []
    for line in (lines or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2: one hierarchy
            base, v1 = root, False
        elif controller in controllers.split(","):  # v1: the controller's own hierarchy
            names = (controllers, controller, *_V1_MOUNTS.get(controller, ()))
            bases = [root / n for n in names if (root / n).is_dir()]
            if not bases:
                continue
            base, v1 = bases[0], True
        else:
            continue
        for d in [base / rel] + [base / p for p in _parents(rel)]:
            if d.is_dir():
                out.append((d, v1))
    return out


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self")
) -> float | None:
    """The CPUs this process's cgroup (or an ancestor) may use, or None when unlimited.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); (d / "p").mkdir(); (d / "cg/job").mkdir(parents=True)
    >>> _ = (d / "p/cgroup").write_text("0::/job\\n")
    >>> _ = (d / "cg/cpu.max").write_text("400000 100000\\n")
    >>> _ = (d / "cg/job/cpu.max").write_text("150000 100000\\n")
    >>> cgroup_cpu_limit(d / "cg", d / "p")
    1.5
    """
    best: float | None = None
    for d, v1 in cgroup_dirs(proc, root, "cpu"):
        if v1:
            q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
            limit = _quota_v1(q, p) if q and p else None
        else:
            text = _read(d / "cpu.max")
            limit = _quota_v2(text) if text else None
        if limit is not None and (best is None or limit < best):
            best = limit
    return best


def _parents(rel: str) -> list[str]:
    """``a/b/c`` → ``a/b``, ``a``, ``""``."""
    parts = [p for p in rel.split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def cpu_budget(
    local_ranks: int,
    *,
    affinity: int | None = None,
    machine: int | None = None,
    quota: float | bool | None = True,
) -> CpuBudget:
    """The whole CPUs one of ``local_ranks`` ranks on this node may use, and why.

    ``affinity``, ``machine`` (the node's CPUs) and ``quota`` (the container's CPUs; True:
    read it) default to this process's.

    >>> cpu_budget(2, affinity=2, machine=2, quota=None)
    (1, '2 CPUs shared by 2 local ranks')
    >>> cpu_budget(2, affinity=1, machine=2, quota=None)
    (1, 'pinned to 1 CPU')
    >>> cpu_budget(1, affinity=16, machine=16, quota=4.0)
    (4, 'container quota 4 CPUs')
    >>> cpu_budget(4, affinity=16, machine=16, quota=6.0)
    (1, 'container quota 6 CPUs shared by 4 local ranks')
    """
    local_ranks = max(1, int(local_ranks))
    aff = _affinity() if affinity is None else max(1, int(affinity))
    total = (os.cpu_count() or aff) if machine is None else max(1, int(machine))
    limit = cgroup_cpu_limit() if quota is True else (None if quota is False else quota)
    plural = "s" if aff != 1 else ""
    if local_ranks == 1:
        share, why = (
            float(aff),
            (f"pinned to {aff} CPU{plural}" if aff < total else f"{aff} CPU{plural}"),
        )
    elif aff * local_ranks <= total:
        share, why = float(aff), f"pinned to {aff} CPU{plural}"
    else:
        share, why = aff / local_ranks, f"{aff} CPU{plural} shared by {local_ranks} local ranks"
    if limit is not None:
        per = limit / local_ranks
        if per < share:
            share = per
            why = f"container quota {limit:g} CPUs" + (
                f" shared by {local_ranks} local ranks" if local_ranks > 1 else ""
            )
    return CpuBudget((max(1, math.floor(share + 1e-9)), why))
