"""Conditions that must last: a detector's per-step condition opens only once it has held
without a break for longer than the job's own noise.

On a busy machine every rank of a healthy job falls behind for a second now and then, its
collectives slow down for a moment, its loader stalls at an epoch boundary. A fault lasts.
`Persistence` tracks, per rank (or per job: one column), when the condition last began to
hold, and learns the job's noise as it goes: the longest run of the condition that ended on
its own before a diagnosis opened and, when the detector gives one, how strong the condition
typically is in the job's steps (``level``: e.g. how late the latest rank is, every step,
against the threshold ``scale``; the median over the job's first `NOISE_STEPS` steps after
its warm-up). A condition opens once it has held for
``clip(max(2 × that run, level_s × level / scale), persist_s, max_persist_s)`` of event time
(``level_s``: ``persist_s`` unless the detector says otherwise) and ``persist_steps`` steps
(and the job has completed ``warmup_steps`` steps: a job's first steps are its noisiest;
before `MIN_NOISE_STEPS` levels are known, ``max_persist_s`` applies); it resolves after
``clear_steps`` steps without it. A detector whose condition flickers while it lasts may let a
run go on through ``bridge_steps`` steps without it: the run counts from its first step, and
ends (teaching the noise) only after more steps without it.

State is a dict of numpy arrays and numbers in the detector's own ``job.det`` entry, so the
funnel's snapshots carry it.

>>> st = {}
>>> p = Persistence(st, width=1, persist_s=1.0, max_persist_s=5.0, persist_steps=2,
...                 clear_steps=2, warmup_steps=0)
>>> NS = 10**9
>>> [bool(p.update(np.array([c]), start=(t + 1) * NS, end=(t + 2) * NS)[0])
...  for t, c in enumerate([True, False, True, True, True, True])]
[False, False, False, True, True, True]
>>> st["noise_ns"]  # the first run lasted 1 s: now 2 s are needed
1000000000
>>> p = Persistence({}, width=1, persist_s=2.0, max_persist_s=5.0, persist_steps=2,
...                 clear_steps=2, warmup_steps=0, bridge_steps=1)
>>> [bool(p.update(np.array([c]), start=(t + 1) * NS, end=(t + 2) * NS)[0])
...  for t, c in enumerate([True, False, True, True, False, False])]
[False, False, True, True, True, False]
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["MIN_NOISE_STEPS", "NOISE_STEPS", "Persistence"]

NS = 1_000_000_000
NOISE_STEPS = 64
"""Steps after the warm-up whose levels set the job's noise."""
MIN_NOISE_STEPS = 16
"""Levels needed before the noise is trusted."""


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
        scale: float = 0.0,
        level_s: float | None = None,
        bridge_steps: int = 0,
    ) -> None:
        self.st = state
        self.scale = scale
        for key in ("since", "steps", "off", "held"):
            self._column(key, width, np.int64)
        self._column("active", width, bool)
        state.setdefault("noise_ns", 0)
        state.setdefault("seen", 0)
        state.setdefault("levels", [])
        self.width = width
        self.min_ns = int(persist_s * NS)
        self.level_ns = int((persist_s if level_s is None else level_s) * NS)
        self.max_ns = int(max(persist_s, max_persist_s) * NS)
        self.persist_steps, self.clear_steps = persist_steps, clear_steps
        self.bridge_steps = bridge_steps
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
        need = 2 * self.st["noise_ns"]
        if self.scale > 0:
            levels = self.st["levels"]
            if len(levels) < MIN_NOISE_STEPS:
                return self.max_ns
            need = max(need, self.level_ns * float(np.median(levels)) / self.scale)
        return int(np.clip(need, self.min_ns, self.max_ns))

    def update(
        self, cond: np.ndarray, *, start: Any, end: int, level: float = np.nan
    ) -> np.ndarray:
        """One more step: ``cond`` per column, the step's ``start`` (per column or one time)
        and ``end``, and the condition's strength in it (``level``); returns which columns
        are active."""
        st, w = self.st, self.width
        since, steps, off, active, held = (
            st[k][:w] for k in ("since", "steps", "off", "active", "held")
        )
        st["seen"] += 1
        warm = st["seen"] > self.warmup_steps
        if warm and level == level and len(st["levels"]) < NOISE_STEPS:
            st["levels"].append(float(level))
        off[:] = np.where(cond, 0, off + 1)
        ended = (since > 0) & (off > self.bridge_steps)
        broke = ended & ~active
        if broke.any():  # a run that ended on its own (it last held at ``held``): the noise
            st["noise_ns"] = max(int(st["noise_ns"]), int((held[broke] - since[broke]).max()))
        since[:] = np.where(cond & (since == 0), start, np.where(ended, 0, since))
        steps[:] = np.where(cond, steps + 1, np.where(ended, 0, steps))
        held[:] = np.where(cond, end, held)
        lasting = cond & (since > 0) & (end - since >= self.need_ns)
        lasting &= steps >= self.persist_steps
        active[:] = ((active | (lasting & warm)) & ~(active & (off >= self.clear_steps))) & (
            warm | active
        )
        return active

    def stop(self) -> None:
        """Nothing holds any more (too few ranks to compare, the detector off)."""
        for k in ("since", "steps", "off", "held"):
            self.st[k][: self.width] = 0
        self.st["active"][: self.width] = False
