"""Conditions that must last: a detector's per-step condition opens only once it has held
without a break for longer than the job's own noise.

On a busy machine every rank of a healthy job falls behind for a second now and then, its
collectives slow down for a moment, its loader stalls at an epoch boundary. A fault lasts.
`Persistence` tracks, per rank (or per job: one column), when the condition last began to
hold, and learns the job's noise as it goes: the longest run of the condition that ended on
its own before a diagnosis opened. A condition opens once it has held for
``clip(2 × that run, persist_s, max_persist_s)`` of event time and ``persist_steps`` steps
(and the job has completed ``warmup_steps`` steps: a job's first steps are its noisiest); it
resolves after ``clear_steps`` steps without it.

State is a dict of numpy arrays and numbers in the detector's own ``job.det`` entry, so the
funnel's snapshots carry it.

>>> st = {}
>>> p = Persistence(st, width=1, persist_s=1.0, max_persist_s=5.0, persist_steps=2,
...                 clear_steps=2, warmup_steps=0)
>>> NS = 10**9
>>> [bool(p.update(np.array([c]), start=t * NS, end=(t + 1) * NS)[0])
...  for t, c in enumerate([True, False, True, True, True])]
[False, False, False, False, True]
>>> st["noise_ns"]  # the first run lasted 1 s: now 2 s are needed
1000000000
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Persistence"]

NS = 1_000_000_000


class Persistence:
    """The episodes of one detector's condition, over ``width`` columns (ranks, or 1)."""

    def __init__(
        self,
        state: dict[str, Any],
        *,
        width: int,
        persist_s: float,
        max_persist_s: float,
        persist_steps: int,
        clear_steps: int,
        warmup_steps: int,
    ) -> None:
        self.st = state
        for key in ("since", "steps", "off"):
            self._column(key, width, np.int64)
        self._column("active", width, bool)
        state.setdefault("noise_ns", 0)
        state.setdefault("seen", 0)
        self.width = width
        self.min_ns = int(persist_s * NS)
        self.max_ns = int(max(persist_s, max_persist_s) * NS)
        self.persist_steps, self.clear_steps = persist_steps, clear_steps
        self.warmup_steps = warmup_steps

    def _column(self, key: str, n: int, dtype: Any) -> None:
        a = self.st.get(key)
        if a is None or len(a) < n:
            old = a if a is not None else np.zeros(0, dtype=dtype)
            self.st[key] = np.concatenate([old, np.zeros(n - len(old), dtype=dtype)])

    @property
    def active(self) -> np.ndarray:
        return self.st["active"][: self.width]

    @property
    def since(self) -> np.ndarray:
        """When each column's current run began (event time; 0: not holding)."""
        return self.st["since"][: self.width]

    @property
    def need_ns(self) -> int:
        """How long the condition must hold now."""
        return int(np.clip(2 * self.st["noise_ns"], self.min_ns, self.max_ns))

    def update(self, cond: np.ndarray, *, start: Any, end: int) -> np.ndarray:
        """One more step: ``cond`` per column, the step's ``start`` (per column or one time)
        and ``end``; returns which columns are active."""
        st, w = self.st, self.width
        since, steps, off, active = (st[k][:w] for k in ("since", "steps", "off", "active"))
        st["seen"] += 1
        broke = (since > 0) & ~cond & ~active
        if broke.any():  # a run that ended on its own: the job's noise
            st["noise_ns"] = max(int(st["noise_ns"]), int((end - since[broke]).max()))
        since[:] = np.where(cond, np.where(since > 0, since, start), 0)
        steps[:] = np.where(cond, steps + 1, 0)
        off[:] = np.where(cond, 0, off + 1)
        warm = st["seen"] > self.warmup_steps
        lasting = (since > 0) & (end - since >= self.need_ns) & (steps >= self.persist_steps)
        active[:] = ((active | (lasting & warm)) & ~(active & (off >= self.clear_steps))) & (
            warm | active
        )
        return active

    def stop(self) -> None:
        """Nothing holds any more (too few ranks to compare, the detector off)."""
        for k in ("since", "steps", "off"):
            self.st[k][: self.width] = 0
        self.st["active"][: self.width] = False
