"""Shared pieces of the funnel's per-job state (`JobState`, `perfloop.streams.detection`):
the array specs, `Finding`, and episode bookkeeping."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "COMPUTE_CLASSES",
    "COMPUTE_PHASES",
    "MAX_STEPS",
    "MEMORY_CLASSES",
    "NS",
    "POWER_BITS",
    "SLOWDOWN_BITS",
    "STEPS",
    "THERMAL_BITS",
    "Finding",
    "episodes_update",
    "ring_depth",
]

STEPS = 64  # steps kept per rank (the ring) at the least
MAX_STEPS = 512  # ... and at the most
WAIT_S = 2.0  # a step (and a rank's report of it) is waited for this long of the job's steps
RING_CELLS = 16384  # steps x ranks a ring may hold beyond STEPS a rank (~160 bytes each)
NS = 1_000_000_000

THERMAL_BITS = 0x20 | 0x40  # NVML SwThermalSlowdown | HwThermalSlowdown
POWER_BITS = 0x4 | 0x80  # NVML SwPowerCap | HwPowerBrakeSlowdown
SLOWDOWN_BITS = THERMAL_BITS | POWER_BITS | 0x8  # | HwSlowdown
COMPUTE_PHASES = ("forward", "backward", "optimizer")

_RING: dict[str, tuple[Any, Any]] = {  # name: (dtype, fill)
    "st": (np.float64, np.nan),  # step time, ms
    "wait": (np.float64, np.nan),  # data wait, ms
    "end": (np.int64, 0),  # step end, event time
    "mem": (np.float64, np.nan),  # allocated (else reserved) bytes at step end
    "peak": (np.float64, np.nan),
    "compute": (np.float64, 0.0),  # forward + backward + optimizer spans, ms
    "n_compute": (np.int8, 0),  # 1: spans of this kind arrived
    "comm": (np.float64, 0.0),  # comm spans, ms
    "p2p": (np.float64, 0.0),  # ... of them, point-to-point ones (a pipeline's), ms
    "n_comm": (np.int8, 0),
    "coll": (np.float64, 0.0),  # collectives, ms
    "n_coll": (np.int8, 0),
    "aside": (np.float64, 0.0),  # checkpoint and eval spans (depth 0): not compute, ms
    "incomm": (np.float64, 0.0),  # comm spans inside forward/backward/optimizer (depth 1), ms
    "busy": (np.float64, np.nan),  # GPU busy (kernel summary stream -1), ms
}
_RANK: dict[str, tuple[Any, Any]] = {
    "node": (np.int64, -1),
    "last_step": (np.int64, -1),
    "proc_cpu": (np.float64, np.nan),
    "run_delay": (np.float64, np.nan),  # host samples: its threads' wait for a CPU, % of a core
    # host samples: loader workers, their CPU (100 = one core; smoothed) and memory
    "loader_workers": (np.float64, np.nan),
    "loader_cpu": (np.float64, np.nan),
    "loader_rss": (np.float64, np.nan),
    "loader_settled": (np.int64, 0),  # readings of the current worker count, its first left out
    "loader_since": (np.int64, 0),  # the first reading of the current worker count
    "num_workers": (np.float64, np.nan),  # the loader's workers, as the rank's steps say
    "loader_ran": (np.float64, np.nan),  # the latest worker count above 0
    "changed_ns": (np.int64, 0),  # when a knob of the rank last changed (job info, workers)
    # host samples: room under a memory limit of the rank's own, the RSS it was read at, and
    # which limit (1 address space, 2 cgroup; 0: none, the host's memory is the bound)
    "mem_room": (np.float64, np.nan),
    "mem_room_rss": (np.float64, np.nan),
    "mem_room_limit": (np.int8, 0),
    # job info: intra-op threads, the CPUs the rank may use, whether the script set threads
    "threads": (np.float64, np.nan),
    "budget": (np.float64, np.nan),
    "by_script": (np.int8, 0),
    # the rank's latest RankProgress: when, its step, phase (`PROGRESS_PHASES` index), since
    "p_ts": (np.int64, 0),
    "p_step": (np.int64, -1),
    "p_phase": (np.int64, -1),
    "p_since": (np.int64, 0),
    "ended": (np.int8, 0),  # its lifecycle says it finished, failed or was killed
}
_EPISODE = {"start": (np.int64, 0), "on": (np.int64, 0), "off": (np.int64, 0)}
_DEV: dict[str, tuple[Any, Any]] = {
    "node": (np.int64, -1),
    "device": (np.int64, -1),
    "rank": (np.int64, -1),
    "ts": (np.int64, 0),
    "clock": (np.float64, np.nan),
    "base": (np.float64, 0.0),  # highest unthrottled SM clock seen
    "temp": (np.float64, np.nan),
    "util": (np.float64, np.nan),  # mean SM util of the latest batch
    "reasons": (np.int64, 0),
    "mem_total": (np.float64, 0.0),
    "dbe": (np.int64, np.iinfo(np.int64).max),  # latest ECC DBE count; max: none seen yet
    "xid": (np.int64, 0),
    "last_xid": (np.int64, 0),
    "err_ns": (np.int64, 0),
    **{f"th_{k}": v for k, v in _EPISODE.items()},
    **{f"pw_{k}": v for k, v in _EPISODE.items()},
}
_NODE: dict[str, tuple[Any, Any]] = {
    "cpu": (np.float64, np.nan),
    "iowait": (np.float64, np.nan),
    "mem_used": (np.float64, np.nan),
    "mem_total": (np.float64, np.nan),
    "ts": (np.int64, 0),
    **{f"cpu_{k}": v for k, v in _EPISODE.items()},
}
MEMORY_CLASSES = ("elementwise", "reduction", "norm", "memcpy", "memset")
COMPUTE_CLASSES = ("gemm", "conv", "attention")


@dataclass
class Finding:
    """One condition a detector holds active now (the funnel turns it into a diagnosis)."""

    key: str
    bottleneck: str
    onset_ns: int
    step_share: float
    confidence: float
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    rank: int = -1
    step: int = 0
    evidence: dict[str, float] = field(default_factory=dict)
    summary: str = ""
    mark: str = ""  # what, when it changes, is worth an update at once (not after update_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ring_depth(world: int) -> int:
    """Steps the ring keeps for a job of ``world`` ranks: `RING_CELLS` shared out, a power of
    two from `STEPS` to `MAX_STEPS`. A step is waited for `WAIT_S` of the job's steps behind
    the newest (at least half of `STEPS`, at most half the ring), and a rank's batch comes up
    to a publish interval after another's: a small job stepping fast (a 2-rank job at 200
    steps a second has 400 steps in 2 s) needs the depth; a large one steps slower and would
    pay for it in every rank."""
    depth = MAX_STEPS
    while depth > STEPS and depth * max(world, 1) > RING_CELLS:
        depth //= 2
    return depth


def alloc(spec: dict[str, tuple[Any, Any]], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {k: np.full(shape, fill, dtype=dt) for k, (dt, fill) in spec.items()}


def grow(arrs: dict[str, np.ndarray], spec: dict[str, tuple[Any, Any]], n: int, axis: int) -> None:
    for k, (dt, fill) in spec.items():
        a = arrs[k]
        if a.shape[axis] >= n:
            continue
        pad = list(a.shape)
        pad[axis] = n - a.shape[axis]
        arrs[k] = np.concatenate([a, np.full(pad, fill, dtype=dt)], axis=axis)


def episodes_update(
    arrs: dict[str, np.ndarray], prefix: str, idx: np.ndarray, ts: np.ndarray, on: np.ndarray
) -> None:
    """Fold samples into per-slot episodes: ``<prefix>start`` is the first "on" sample after
    the latest "off" one (0: none), ``<prefix>on`` / ``<prefix>off`` the latest of each.

    An episode is unbroken "on" samples; callers open on its length and resolve on how long
    "off" has lasted, so a flickering signal keeps an open episode but cannot open a new one.

    >>> a = {"x_start": np.zeros(1, np.int64), "x_on": np.zeros(1, np.int64),
    ...      "x_off": np.zeros(1, np.int64)}
    >>> episodes_update(a, "x_", np.zeros(4, np.int64), np.array([1, 2, 3, 4]),
    ...                 np.array([False, True, True, True]))
    >>> int(a["x_start"][0]), int(a["x_on"][0]), int(a["x_off"][0])
    (2, 4, 1)
    """
    start, last_on, last_off = arrs[prefix + "start"], arrs[prefix + "on"], arrs[prefix + "off"]
    off = ~on
    if off.any():
        np.maximum.at(last_off, idx[off], ts[off])
    if on.any():
        np.maximum.at(last_on, idx[on], ts[on])
        after = on & (ts > last_off[idx])
        cand = np.full(len(start), np.iinfo(np.int64).max)
        np.minimum.at(cand, idx[after], ts[after])
        keep = start > last_off
        start[:] = np.where(keep, start, np.where(cand < np.iinfo(np.int64).max, cand, 0))
    else:
        start[start <= last_off] = 0


def number(text: str | None) -> float:
    """A job info value as a number; NaN when absent or not a number."""
    try:
        return float(text) if text is not None else np.nan
    except ValueError:
        return np.nan
