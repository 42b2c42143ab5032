"""How much more memory one training process may take before a limit of its own stops it.

A process can run out of memory long before its host does:

- its address-space limit (``RLIMIT_AS``, ``ulimit -v``; a script or a batch system may set
  it): an allocation fails once the process's virtual size (``VmSize``) would pass it. The
  room is counted from its peak (``VmPeak``): a step's temporaries come and go between two
  readings, and a leak fails at the peak, not at the size a reading happens to catch;
- its cgroup's memory limit (a container, a Slurm job step, a Kubernetes pod: cgroup v2
  ``memory.max``, v1 ``memory.limit_in_bytes``, the tightest along the cgroup's ancestors):
  the kernel reclaims, then kills, once the cgroup's usage would pass it. Usage counts the
  page cache the cgroup touched; its inactive part (``inactive_file``) is reclaimed first,
  so it is room too.

`memory_room` gives the least room of the two and which limit it is; with neither, the host's
available memory is the bound (the host sample carries it).
"""

from __future__ import annotations

import resource
from pathlib import Path

from perfloop.producers._cpu import _read
from perfloop.producers._cpu import cgroup_dirs as _cgroup_dirs

__all__ = [
    "address_space_limit",
    "cgroup_dirs",
    "cgroup_memory_room",
    "memory_room",
    "peak_virtual_size",
]

_UNLIMITED = 1 << 60
"""A limit at least this large is no limit (cgroup v1 writes ~2^63 for none)."""


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max" (v2: no limit) or garbage


def _inactive_file(stat: str | None, v1: bool) -> int:
    key = "total_inactive_file" if v1 else "inactive_file"
    for line in (stat or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value.strip()) or 0
    return 0


def cgroup_dirs(proc: Path, root: Path = Path("/sys/fs/cgroup")) -> list[tuple[Path, bool]]:
    """The memory-controller directories of the process at ``proc`` (``/proc/<pid>``) and of
    its cgroup's ancestors, each with whether it is cgroup v1, innermost first
    (`perfloop.producers._cpu.cgroup_dirs`)."""
    return _cgroup_dirs(proc, root, "memory")


def cgroup_memory_room(dirs: list[tuple[Path, bool]]) -> int | None:
    """The least room under a memory limit along ``dirs`` (`cgroup_dirs`), or None when none
    of them has a limit.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); (d / "job").mkdir()
    >>> _ = (d / "memory.max").write_text("max\\n")
    >>> _ = (d / "job/memory.max").write_text("1000000\\n")
    >>> _ = (d / "job/memory.current").write_text("700000\\n")
    >>> _ = (d / "job/memory.stat").write_text("anon 600000\\ninactive_file 50000\\n")
    >>> cgroup_memory_room([(d / "job", False), (d, False)])
    350000
    """
    best: int | None = None
    for d, v1 in dirs:
        limit = _int(_read(d / ("memory.limit_in_bytes" if v1 else "memory.max")))
        if limit is None or limit >= _UNLIMITED:
            continue
        used = _int(_read(d / ("memory.usage_in_bytes" if v1 else "memory.current")))
        if used is None:
            continue
        used -= _inactive_file(_read(d / "memory.stat"), v1)
        room = max(0, limit - max(0, used))
        if best is None or room < best:
            best = room
    return best


def address_space_limit(pid: int) -> int | None:
    """Process ``pid``'s soft ``RLIMIT_AS`` in bytes, or None (none, or it cannot be read).

    >>> import os
    >>> address_space_limit(os.getpid()) is None or address_space_limit(os.getpid()) > 0
    True
    """
    try:
        soft, _ = resource.prlimit(pid, resource.RLIMIT_AS)  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # not Linux, gone, or not ours
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0 or soft >= _UNLIMITED:
        return None
    return int(soft)


def peak_virtual_size(pid: int) -> int | None:
    """The largest virtual size process ``pid`` has had (``VmPeak``), or None.

    >>> import os
    >>> peak_virtual_size(os.getpid()) > 0, peak_virtual_size(2**22 + 12345)
    (True, None)
    """
    text = _read(Path(f"/proc/{pid}/status"))
    for line in (text or "").splitlines():
        if line.startswith("VmPeak:"):
            parts = line.split()
            kib = _int(parts[1]) if len(parts) > 1 else None
            return kib * 1024 if kib is not None else None
    return None


def memory_room(
    pid: int, vms_bytes: int, dirs: list[tuple[Path, bool]] | None = None
) -> tuple[int, str]:
    """``(bytes, limit)``: the least room process ``pid`` (virtual size ``vms_bytes`` now) has
    under its address-space limit (``"address_space"``, from its peak virtual size) or its
    cgroup's memory limit (``"cgroup"``; ``dirs`` from `cgroup_dirs`), or ``(0, "")`` when
    neither limits it.

    >>> memory_room(2**22 + 12345, 0, [])   # no such process, no cgroup
    (0, '')
    """
    room, limit = 0, ""
    cap = address_space_limit(pid)
    if cap is not None:
        peak = max(vms_bytes, peak_virtual_size(pid) or 0)
        room, limit = max(0, cap - peak), "address_space"
    cg = cgroup_memory_room(dirs or [])
    if cg is not None and (not limit or cg < room):
        room, limit = cg, "cgroup"
    return room, limit
