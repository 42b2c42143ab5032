"""Waits and lateness at collectives: how long each rank waited at each collective for the
last one to arrive, and how late each rank arrived in each step; pure numpy over the
``collectives`` table's rows.

The ranks of a synchronous collective finish it together, so at the k-th collective of a
step (in its process group) the ranks' durations differ by their arrival alone: the rank
the others waited for has the shortest duration, and a rank's wait is its duration minus that
shortest one. No clock is compared across ranks or nodes (as the stream tier's straggler
detector, `perfloop.streams.detection`, does it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from perfloop.report._columns import I64, floats, ints

__all__ = ["Collectives", "collective_waits", "lateness"]


@dataclass(frozen=True)
class Collectives:
    """Collective operations (the ``collectives`` table): their start and duration per rank."""

    rank: np.ndarray
    step: np.ndarray
    group: np.ndarray
    start_ns: np.ndarray
    duration_ms: np.ndarray

    @classmethod
    def of(
        cls,
        *,
        rank: Iterable[Any],
        step: Iterable[Any],
        start_ns: Iterable[Any],
        duration_ms: Iterable[Any],
        group: Iterable[str] | None = None,
    ) -> Collectives:
        r = ints(list(rank))
        g = [""] * r.size if group is None else list(group)
        return cls(
            r,
            ints(list(step)),
            np.asarray(g, dtype=object),
            ints(list(start_ns)),
            floats(list(duration_ms)),
        )

    def __len__(self) -> int:
        return int(self.rank.size)


def _positions(c: Collectives) -> tuple[np.ndarray, np.ndarray]:
    """Each row's collective key (group, step, position in its rank's step) as one id, and
    the sort order that produced the positions."""
    _, group = np.unique(c.group.astype(str), return_inverse=True)
    order = np.lexsort((c.start_ns, c.step, group, c.rank))
    r, g, s = c.rank[order], group[order], c.step[order]
    new = np.ones(order.size, dtype=bool)
    new[1:] = (r[1:] != r[:-1]) | (g[1:] != g[:-1]) | (s[1:] != s[:-1])
    first = np.maximum.accumulate(np.where(new, np.arange(order.size), 0))
    k = np.arange(order.size) - first
    keys = np.stack([g, s, k], axis=1)
    _, ids = np.unique(keys, axis=0, return_inverse=True)
    key = np.empty(order.size, dtype=I64)
    key[order] = ids.reshape(-1)
    return key, order


def _per_collective(c: Collectives) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: its collective's id, the shortest and longest duration of that collective on
    any rank, and how many ranks reported it."""
    key, _ = _positions(c)
    n = int(key.max()) + 1 if key.size else 0
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, key, c.duration_ms)
    np.maximum.at(hi, key, c.duration_ms)
    count = np.bincount(key, minlength=n)
    return key, lo[key], hi[key], count[key]


def collective_waits(c: Collectives) -> np.ndarray:
    """Per row, the milliseconds its rank waited at that collective for the others: its
    duration minus the shortest duration of the same collective (the k-th of the step in its
    group) on any rank; 0 where only one rank reported it.

    >>> c = Collectives.of(rank=[0, 1], step=[1, 1], start_ns=[0, 40e6], duration_ms=[45, 5])
    >>> collective_waits(c).tolist()
    [40.0, 0.0]
    """
    if not len(c):
        return np.zeros(0)
    _, lo, _, count = _per_collective(c)
    return np.where(count > 1, c.duration_ms - lo, 0.0)


def lateness(c: Collectives) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ranks, steps, ms)``: how late each rank arrived at each step's collectives, the
    most it arrived after the first rank at any of them (``ms[i, j]`` for ``ranks[i]`` and
    ``steps[j]``; NaN where the rank reported no collective in that step).

    >>> c = Collectives.of(rank=[0, 0, 1, 1], step=[1, 1, 1, 1], start_ns=[1, 2, 41, 42],
    ...                    duration_ms=[45, 44, 5, 4])
    >>> r, s, ms = lateness(c)
    >>> r.tolist(), s.tolist(), ms.tolist()
    ([0, 1], [1], [[0.0], [40.0]])
    """
    if not len(c):
        return np.zeros(0, I64), np.zeros(0, I64), np.zeros((0, 0))
    _, _, hi, _ = _per_collective(c)
    late = hi - c.duration_ms
    ranks, ri = np.unique(c.rank, return_inverse=True)
    steps, si = np.unique(c.step, return_inverse=True)
    out = np.full((ranks.size, steps.size), -np.inf)
    np.maximum.at(out, (ri, si), late)
    out[np.isneginf(out)] = np.nan
    return ranks, steps, out
