"""How long the embedded stack can go on: what `perfloop status` says about its headroom.

The embedded broker keeps every record in memory (`perfloop.stack.broker`: no retention), so
its resident memory grows with what the jobs publish (~31 MiB per million samples,
bench/README.md) until the machine runs out. The supervisor samples the broker's RSS once a
minute (`SAMPLE_S`, the last `SAMPLES` kept in the stack's state file); `broker_memory` turns
them and the machine's available memory into a growth rate and the hours left at that rate.
The supervisor recycles the broker (`perfloop.stack._recycle`) every ``broker_recycle_mb`` of
growth, which bounds it: then its recycles are reported instead of the hours left. The
warehouse's TTLs bound its disk (docs/tables.md); `disk` says what it holds and what is free.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from perfloop.settings import StackSettings, WarehouseServerSettings

__all__ = [
    "SAMPLES",
    "SAMPLE_S",
    "broker_memory",
    "disk",
    "headroom",
    "mem_available_bytes",
    "rss_bytes",
]

SAMPLE_S = 60.0
"""How often the supervisor samples the broker's RSS."""
SAMPLES = 61
"""Samples kept: an hour of growth."""
MIN_SPAN_S = 300.0
"""A growth rate needs samples at least this far apart (a young broker's first minutes are
its start-up, not its growth)."""


def rss_bytes(pid: int) -> int | None:
    """The resident memory of process ``pid`` (``VmRSS``), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mem_available_bytes() -> int | None:
    """The machine's available memory (``MemAvailable`` in /proc/meminfo), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def broker_memory(
    samples: list[list[float]], rss_bytes: int | None, available_bytes: int | None
) -> dict[str, Any]:
    """The broker's memory headroom from its RSS ``samples`` (``[unix_s, bytes]``, oldest
    first): its RSS now, its growth per hour over the samples (None under `MIN_SPAN_S` of
    them, or when it did not grow), and the hours until the machine's available memory is
    used up at that rate.

    >>> h = broker_memory([[0, 100 << 20], [1800, 150 << 20]], 150 << 20, 10 << 30)
    >>> h["growth_bytes_per_h"] == 100 << 20, round(h["hours_left"])
    (True, 102)
    >>> broker_memory([[0, 1], [60, 2]], 2, 10)["growth_bytes_per_h"] is None
    True
    """
    out: dict[str, Any] = {
        "rss_bytes": rss_bytes,
        "available_bytes": available_bytes,
        "growth_bytes_per_h": None,
        "over_s": None,
        "hours_left": None,
    }
    if len(samples) >= 2:
        (t0, r0), (t1, r1) = samples[0], samples[-1]
        span = t1 - t0
        if span >= MIN_SPAN_S:
            out["over_s"] = span
            if r1 > r0:
                rate = (r1 - r0) * 3600.0 / span
                out["growth_bytes_per_h"] = rate
                if available_bytes is not None:
                    out["hours_left"] = available_bytes / rate
    return out


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def disk(data_dir: Path) -> dict[str, Any]:
    """What the embedded warehouse's data directory holds and what its disk has free."""
    if not data_dir.is_dir():
        return {"warehouse_bytes": None, "free_bytes": None, "path": str(data_dir)}
    return {
        "warehouse_bytes": _tree_bytes(data_dir),
        "free_bytes": shutil.disk_usage(data_dir).free,
        "path": str(data_dir),
    }


def headroom(
    settings: StackSettings, state: dict[str, Any], services: dict[str, Any]
) -> dict[str, Any]:
    """What `perfloop status` says of the stack's headroom, from its state file (``state``)
    and its services' status: the broker's memory (`broker_memory`), the warehouse's disk."""
    out: dict[str, Any] = {}
    if "broker" in services:
        out["broker_memory"] = broker_memory(
            state.get("broker_rss") or [], services["broker"]["rss_bytes"], mem_available_bytes()
        )
        rec = state.get("broker_recycling")
        if rec and rec.get("every_mb"):  # its memory is bounded: no hours left to run out in
            out["broker_memory"]["hours_left"] = None
            out["broker_recycling"] = rec
    if "warehouse" in services:
        # as the server finds it: PERFLOOP_DATA_DIR, else under the stack's home
        data_dir = WarehouseServerSettings().data_dir or settings.home_dir / "warehouse"
        out["warehouse_disk"] = disk(Path(data_dir))
    return out
