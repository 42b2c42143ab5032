"""Arrival at the collectives: which rank the others waited for, step by step.

Every collective a rank reports is timed from its *arrival* (the rank reaching the call; a
DDP gradient bucket: its gradients ready) to its completion. The ranks of a synchronous
collective complete it together, so at the k-th collective of a step the ranks' waits differ
by their arrival alone: rank i arrived ``max_j wait_jk - wait_ik`` after the first rank to get
there. No clock is compared across ranks or nodes.

A rank's *lateness* in a step is the most it arrived after the first at any of the step's
collectives: a rank's delay builds up until a collective evens the ranks out, and DDP's
bucket all-reduces overlap (adding them up would count one delay once per bucket). The rank
that waits is never late; the rank the others wait for is late by how long they waited.

`ArrivalRing` keeps, per step of the detector ring, slot and rank, each collective's wait in
its order of arrival within the step (the k-th call of a step is the same collective on every
rank: collectives are issued in program order). A step with more than `MAX_COLLECTIVES`
collectives folds the later ones onto the first by their maximum, which keeps the late rank's
waits short and the others' long, so lateness stays a lower bound.

>>> ring = ArrivalRing(4)
>>> ring.grow(2)
>>> # step 1, two buckets each; rank 1 arrives 40 ms after rank 0 at both
>>> ring.add(np.array([1, 1, 1, 1]), np.array([0, 0, 1, 1]), np.array([1, 2, 41, 42]),
...          np.array([45.0, 44.0, 5.0, 4.0]))
>>> ring.lateness(np.array([1])).tolist()
[[0.0, 40.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MAX_COLLECTIVES", "ArrivalRing"]

MAX_COLLECTIVES = 16
"""Collectives of one step kept apart (per rank); later ones fold onto these."""


class ArrivalRing:
    """Waits at each collective of the last ``steps`` ring slots, per rank."""

    def __init__(self, steps: int) -> None:
        self.wait = np.full((steps, MAX_COLLECTIVES, 0), np.nan, dtype=np.float32)
        self.count = np.zeros((steps, 0), dtype=np.int32)  # collectives seen per slot, rank

    @property
    def ranks(self) -> int:
        return int(self.count.shape[1])

    def grow(self, ranks: int) -> None:
        """Make room for ``ranks`` ranks."""
        extra = ranks - self.ranks
        if extra <= 0:
            return
        steps = self.count.shape[0]
        self.wait = np.concatenate(
            [self.wait, np.full((steps, MAX_COLLECTIVES, extra), np.nan, np.float32)], axis=2
        )
        self.count = np.concatenate([self.count, np.zeros((steps, extra), np.int32)], axis=1)

    def moved(self, rows: np.ndarray, to: np.ndarray, steps: int) -> ArrivalRing:
        """A ring of ``steps`` slots holding these ``rows`` at slots ``to``."""
        ring = ArrivalRing(steps)
        ring.grow(self.ranks)
        ring.wait[to], ring.count[to] = self.wait[rows], self.count[rows]
        return ring

    def reset(self, rows: np.ndarray) -> None:
        """Ring slots taken by a new step."""
        self.wait[rows] = np.nan
        self.count[rows] = 0

    def add(self, slot: np.ndarray, rank: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> None:
        """Collectives of one batch: each row's ring slot, rank, arrival time and duration."""
        if not len(slot):
            return
        order = np.lexsort((ts, rank, slot))
        s, r = slot[order], rank[order]
        first = np.r_[True, (s[1:] != s[:-1]) | (r[1:] != r[:-1])]
        pos = np.arange(len(s))
        within = pos - np.maximum.accumulate(np.where(first, pos, 0))
        seq = self.count[s, r] + within
        np.add.at(self.count, (s, r), 1)
        np.fmax.at(self.wait, (s, seq % MAX_COLLECTIVES, r), dur[order].astype(np.float32))

    def lateness(self, rows: np.ndarray) -> np.ndarray:
        """(rows, ranks): each rank's lateness in ms at the steps of ``rows``; NaN for a rank
        without collectives there (or a step where fewer than two ranks reported one)."""
        w = self.wait[rows].astype(np.float64)  # (n, k, ranks)
        shared = (~np.isnan(w)).sum(axis=2) >= 2
        first = np.fmax.reduce(w, axis=2)  # the longest wait: the first to arrive
        late = np.where(shared[:, :, None], first[:, :, None] - w, np.nan)
        return np.fmax.reduce(late, axis=1)

    def to_state(self) -> dict[str, Any]:
        return {"wait": self.wait.copy(), "count": self.count.copy()}

    @classmethod
    def from_state(cls, doc: dict[str, Any] | None, steps: int, ranks: int) -> ArrivalRing:
        ring = cls(steps)
        if doc is not None:
            ring.wait, ring.count = doc["wait"].copy(), doc["count"].copy()
        ring.grow(ranks)
        return ring
