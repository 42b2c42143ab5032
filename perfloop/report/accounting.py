"""Accounting of one job: where its wall time went (goodput and badput by cause), what it
achieved (samples/s, tokens/s, MFU), what it burned (energy) and what it cost (money).

Pure functions over the warehouse's rows, given as numpy columns; no I/O
(`perfloop.report.data` reads the rows, `perfloop.report.html` shows the figures).

**Where the wall time went.** Each rank's timeline, from the job's start to its end, is painted
with labelled intervals; where intervals overlap the earlier label of `PAINT_ORDER` wins, and
time no interval covers is ``idle``. Every nanosecond gets exactly one label, so the categories
of a rank sum to the job's wall time exactly (integer nanoseconds); the job's figures are the
mean over its ranks. The intervals:

- ``restart``: a step number going back (the job resumed from a checkpoint) or a second
  ``started`` lifecycle event: the gap before the step, and every re-done step;
- ``checkpoint``, ``eval``: the ``checkpoint`` and ``eval`` spans;
- ``hang``: an open ``hang`` diagnosis (every rank), and the part of a step beyond the rank's
  median step time when the step took more than `HANG_FACTOR` times that median and more
  than `HANG_MIN_MS` beyond it;
- ``warmup``: the first ``warmup_steps`` steps of each rank;
- ``straggler_wait``: at each collective, the time a rank waited for the last one to arrive
  (its duration minus the shortest duration of the same collective on any rank: the ranks of
  a synchronous collective finish it together, so no clocks are compared across ranks);
- ``data_wait``: each step's wait for its batch, at the step's start;
- ``productive``: the rest of each step;
- ``startup``: before the rank's first step.

>>> steps = Steps.of(rank=[0, 0, 0], step=[0, 1, 2], end_ns=[2e9, 3e9, 4e9],
...                  step_ms=[1000, 1000, 1000], data_wait_ms=[0, 250, 0])
>>> t = time_accounting(steps, start_ns=0, end_ns=5 * 10**9, warmup_steps=1)
>>> {c: t.seconds(c) for c in CATEGORIES if t.rank_ns[c]}
{'productive': 1.75, 'data_wait': 0.25, 'warmup': 1.0, 'startup': 1.0, 'idle': 1.0}
>>> sum(t.rank_ns.values()) == t.ranks * t.wall_ns
True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfloop.report._columns import I64, floats, ints
from perfloop.report.collectives import Collectives, collective_waits

__all__ = [
    "CATEGORIES",
    "HANG_FACTOR",
    "HANG_MIN_MS",
    "PAINT_ORDER",
    "DiagnosisCost",
    "Prices",
    "Spans",
    "Steps",
    "TimeAccount",
    "diagnosis_costs",
    "energy_joules",
    "hourly_price",
    "mfu",
    "time_accounting",
]

PAINT_ORDER: tuple[str, ...] = (
    "restart",
    "checkpoint",
    "eval",
    "hang",
    "warmup",
    "straggler_wait",
    "data_wait",
    "productive",
    "startup",
)
"""Labels in the order they win where their intervals overlap; uncovered time is ``idle``."""

CATEGORIES: tuple[str, ...] = (
    "productive",
    "data_wait",
    "straggler_wait",
    "hang",
    "restart",
    "checkpoint",
    "eval",
    "warmup",
    "startup",
    "idle",
)
"""Where wall time goes: ``productive`` is goodput, every other one badput."""

HANG_FACTOR = 10.0
"""A step longer than this many times its rank's median step time counts as hung beyond it…"""
HANG_MIN_MS = 5000.0
"""… when it also lasted this much longer than the median (a slow step is not a hang)."""


@dataclass(frozen=True)
class Steps:
    """Finished steps (the ``steps`` table), one entry per step of one rank."""

    rank: np.ndarray
    step: np.ndarray
    end_ns: np.ndarray
    step_ms: np.ndarray
    data_wait_ms: np.ndarray
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, I64))

    @classmethod
    def of(
        cls,
        *,
        rank: Iterable[Any],
        step: Iterable[Any],
        end_ns: Iterable[Any],
        step_ms: Iterable[Any],
        data_wait_ms: Iterable[Any] | None = None,
        samples: Iterable[Any] | None = None,
        tokens: Iterable[Any] | None = None,
    ) -> Steps:
        """Columns of any sequence type, converted (missing counts are zeros)."""
        r = ints(list(rank))
        n = r.size

        def opt(v: Iterable[Any] | None) -> list[Any]:
            return [0] * n if v is None else list(v)

        return cls(
            rank=r,
            step=ints(list(step)),
            end_ns=ints(list(end_ns)),
            step_ms=floats(list(step_ms)),
            data_wait_ms=floats(opt(data_wait_ms)),
            samples=ints(opt(samples)),
            tokens=ints(opt(tokens)),
        )

    def __len__(self) -> int:
        return int(self.rank.size)


@dataclass(frozen=True)
class Spans:
    """Phase spans (the ``spans`` table) that take time out of training: ``phase`` is
    ``checkpoint`` or ``eval`` (others are ignored by the accounting)."""

    rank: np.ndarray
    start_ns: np.ndarray
    duration_ms: np.ndarray
    phase: np.ndarray

    @classmethod
    def of(
        cls,
        *,
        rank: Iterable[Any],
        start_ns: Iterable[Any],
        duration_ms: Iterable[Any],
        phase: Iterable[str],
    ) -> Spans:
        return cls(
            ints(list(rank)),
            ints(list(start_ns)),
            floats(list(duration_ms)),
            np.asarray(list(phase), dtype=object),
        )


def _union_ns(starts: np.ndarray, ends: np.ndarray) -> int:
    """Length of the union of the intervals ``[starts[i], ends[i])``, in exact integers."""
    keep = ends > starts
    s, e = starts[keep], ends[keep]
    if not s.size:
        return 0
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    reach = np.maximum.accumulate(e)
    before = np.concatenate((s[:1], reach[:-1]))
    return int(np.maximum(0, e - np.maximum(s, before)).sum())


@dataclass(frozen=True)
class TimeAccount:
    """Where a job's wall time went: ``rank_ns[category]`` summed over ``ranks`` ranks; the
    categories of `CATEGORIES` sum to ``ranks * wall_ns`` exactly."""

    wall_ns: int
    ranks: int
    rank_ns: Mapping[str, int]

    def seconds(self, category: str) -> float:
        """Seconds of the job's wall time in ``category`` (the mean over its ranks)."""
        return self.rank_ns[category] / self.ranks / 1e9

    def share(self, category: str) -> float:
        """Share of the job's wall time in ``category`` (0..1)."""
        total = self.ranks * self.wall_ns
        return self.rank_ns[category] / total if total else 0.0

    @property
    def goodput(self) -> float:
        """Share of wall time spent on productive steps."""
        return self.share("productive")


def _rank_intervals(
    steps: Steps,
    sel: np.ndarray,
    *,
    t0: int,
    t1: int,
    warmup_steps: int,
    hang_factor: float,
    started_ns: np.ndarray,
) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """The labelled intervals of one rank's steps."""
    o = np.argsort(steps.end_ns[sel], kind="stable")
    end = steps.end_ns[sel][o]
    ms = steps.step_ms[sel][o]
    start = end - ints(ms * 1e6)
    dw = ints(np.clip(steps.data_wait_ms[sel][o], 0.0, ms) * 1e6)
    num = steps.step[sel][o]
    n = end.size
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {c: [] for c in PAINT_ORDER}
    out["productive"].append((start, end))
    out["data_wait"].append((start, start + dw))
    w = min(warmup_steps, n)
    out["warmup"].append((start[:w], end[:w]))
    out["startup"].append((np.array([t0]), np.array([start.min()])))
    med = float(np.median(ms))
    long = ms > np.maximum(hang_factor * med, med + HANG_MIN_MS)
    excess = ints((ms[long] - med) * 1e6)
    out["hang"].append((end[long] - excess, end[long]))
    # restarts: re-done steps, and the gap before the first of them
    before = np.concatenate(([np.iinfo(I64).min], np.maximum.accumulate(num)[:-1]))
    redo = num <= before
    first_redo = np.flatnonzero(redo[1:] & ~redo[:-1]) + 1
    out["restart"].append((start[redo], end[redo]))
    out["restart"].append((end[first_redo - 1], start[first_redo]))
    # a second start of the rank: the gap between the steps around it
    later = started_ns[started_ns > start.min()]
    j = np.searchsorted(start, later)
    gap_a = end[np.clip(j - 1, 0, n - 1)]
    gap_b = np.where(j < n, start[np.clip(j, 0, n - 1)], t1)
    out["restart"].append((gap_a, gap_b))
    return out


def time_accounting(
    steps: Steps,
    *,
    start_ns: int,
    end_ns: int,
    spans: Spans | None = None,
    collectives: Collectives | None = None,
    hangs: Sequence[tuple[int, int]] = (),
    starts: Sequence[tuple[int, int]] = (),
    warmup_steps: int = 3,
    hang_factor: float = HANG_FACTOR,
) -> TimeAccount:
    """Paint each rank's ``[start_ns, end_ns)`` (see the module docstring) and add up.

    ``hangs`` are ``(from_ns, to_ns)`` intervals of hang diagnoses (every rank); ``starts``
    are ``(rank, ts_ns)`` of the job's ``started`` lifecycle events. A job without steps
    spent its whole wall time starting up (one rank).
    """
    t0, t1 = int(start_ns), max(int(start_ns), int(end_ns))
    wall = t1 - t0
    ranks = np.unique(steps.rank)
    if not ranks.size:
        return TimeAccount(wall, 1, {c: (wall if c == "startup" else 0) for c in CATEGORIES})
    totals = dict.fromkeys(CATEGORIES, 0)
    waits = collective_waits(collectives) if collectives is not None else np.zeros(0)
    start_rank = np.array([r for r, _ in starts], dtype=I64)
    start_ts = np.array([t for _, t in starts], dtype=I64)
    for r in ranks:
        iv = _rank_intervals(
            steps,
            steps.rank == r,
            t0=t0,
            t1=t1,
            warmup_steps=warmup_steps,
            hang_factor=hang_factor,
            started_ns=start_ts[start_rank == r],
        )
        if spans is not None and spans.rank.size:
            for phase in ("checkpoint", "eval"):
                m = (spans.rank == r) & (spans.phase == phase)
                a = spans.start_ns[m]
                iv[phase].append((a, a + ints(spans.duration_ms[m] * 1e6)))
        if collectives is not None and len(collectives):
            m = (collectives.rank == r) & (waits > 0)
            a = collectives.start_ns[m]
            iv["straggler_wait"].append((a, a + ints(waits[m] * 1e6)))
        if hangs:
            iv["hang"].append(
                (np.array([a for a, _ in hangs], I64), np.array([b for _, b in hangs], I64))
            )
        covered = 0
        a_all: list[np.ndarray] = []
        b_all: list[np.ndarray] = []
        for label in PAINT_ORDER:
            for a, b in iv[label]:
                a_all.append(np.clip(np.asarray(a, I64), t0, t1))
                b_all.append(np.clip(np.asarray(b, I64), t0, t1))
            now = _union_ns(np.concatenate(a_all), np.concatenate(b_all))
            totals[label] += now - covered
            covered = now
        totals["idle"] += wall - covered
    return TimeAccount(wall, int(ranks.size), totals)


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOP/s a step achieves over the device's peak.

    >>> round(mfu(3e12, 0.01, 989.5e12), 4)  # 3 TFLOP in 10 ms on an H100 (BF16 dense peak)
    0.3032
    """
    if flops_per_step < 0 or step_s <= 0 or peak_flops <= 0:
        raise ValueError(
            f"mfu needs flops >= 0, step time > 0 and peak > 0; got {flops_per_step}, "
            f"{step_s}, {peak_flops}"
        )
    return flops_per_step / step_s / peak_flops


def energy_joules(
    energy_first_mj: float,
    energy_last_mj: float,
    mean_power_w: float,
    span_s: float,
) -> float:
    """Energy one device used: its NVML energy counter's rise when it rose, else its mean
    power over the span of its samples.

    >>> energy_joules(1_000, 61_000, 0, 0), energy_joules(0, 0, 300.0, 2.0)
    (60.0, 600.0)
    """
    if energy_last_mj > energy_first_mj > 0:
        return (energy_last_mj - energy_first_mj) / 1000.0
    return max(0.0, mean_power_w) * max(0.0, span_s)


@dataclass(frozen=True)
class Prices:
    """What an hour of one device costs, in ``currency``."""

    gpu_hour: float
    cpu_hour: float
    currency: str = "USD"


def hourly_price(gpus: int, cpus: int, prices: Prices) -> float:
    """The job's price per hour: its GPUs at the GPU-hour price; a job without GPUs, its CPUs
    at the CPU-hour price.

    >>> hourly_price(8, 96, Prices(2.5, 0.05)), hourly_price(0, 4, Prices(2.5, 0.05))
    (20.0, 0.2)
    """
    if gpus > 0:
        return gpus * prices.gpu_hour
    return max(cpus, 0) * prices.cpu_hour


@dataclass(frozen=True)
class DiagnosisCost:
    """What one diagnosis costs: its share of step time at the job's hourly price."""

    diagnosis_id: str
    bottleneck: str
    is_open: bool
    share: float
    per_hour: float
    hours: float
    total: float


def diagnosis_costs(
    rows: Iterable[Mapping[str, Any]], price_per_hour: float, end_ns: int
) -> list[DiagnosisCost]:
    """One cost per diagnosis from its rows (``diagnosis_id``, ``bottleneck``, ``state``,
    ``ts_ns``, ``onset_ns``, ``step_share``, in time order): its mean share of step time
    over its rows × the job's price per hour, and that rate over the time it was open (from
    its onset to its resolution, or to ``end_ns`` when still open).

    >>> rows = [dict(diagnosis_id="d", bottleneck="straggler", state="open", ts_ns=2 * 3600e9,
    ...              onset_ns=3600e9, step_share=0.25)]
    >>> c = diagnosis_costs(rows, 20.0, 3 * 3600 * 10**9)[0]
    >>> c.is_open, c.per_hour, c.hours, c.total
    (True, 5.0, 2.0, 10.0)
    """
    last: dict[str, dict[str, Any]] = {}
    onset: dict[str, int] = {}
    shares: dict[str, list[float]] = {}
    for row in rows:
        did = str(row["diagnosis_id"])
        onset.setdefault(did, int(row["onset_ns"]))
        shares.setdefault(did, []).append(float(row["step_share"]))
        last[did] = dict(row)
    out = []
    for did, row in last.items():
        is_open = row["state"] != "resolved"
        until = end_ns if is_open else int(row["ts_ns"])
        hours = max(0, until - onset[did]) / 3.6e12
        share = sum(shares[did]) / len(shares[did])
        rate = share * price_per_hour
        out.append(
            DiagnosisCost(did, str(row["bottleneck"]), is_open, share, rate, hours, rate * hours)
        )
    return out
