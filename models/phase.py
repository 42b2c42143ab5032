"""Time to the next phase transition, from the lengths and successions the job has shown.

`PhaseTransitionForecaster` reads a job's phase changes — run level (warmup, steady, eval,
checkpoint, stalled) or step level (data_wait, forward, backward, comm, optimizer) — as
``learn_one({"ts_s": t, "phase": code})``: the job entered phase ``code`` (an integer code the
caller assigns) at event time ``t``. It keeps, per phase, an exponentially weighted mean of
how long the phase lasts (weight ``alpha`` on the newest), and counts which phase follows which.

``predict_one({"ts_s": now})`` forecasts the seconds from ``now`` until the current phase ends:
``since + mean_length(current) - now``, at least 0; without ``ts_s``, the whole mean length.
Before the current phase has been seen to end once it answers ``math.inf`` (no transition
foreseen). `next_phase` names the most frequent successor of the current phase.

A periodic evaluation (steady 600 s, eval 30 s, steady 600 s, …) is forecast to within the
period's jitter after one cycle; the baseline — "the phase lasts as long as it did last
time" — is what the moving average beats when lengths jitter (bench/models.py).

>>> f = PhaseTransitionForecaster()
>>> t = 0.0
>>> for _ in range(4):
...     f.learn_one({"ts_s": t, "phase": 1}); t += 600
...     f.learn_one({"ts_s": t, "phase": 2}); t += 30
>>> f.learn_one({"ts_s": t, "phase": 1})
>>> f.predict_one({"ts_s": t + 100}), f.next_phase()
(500.0, 2)
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from perfloop.models.base import Features, Forecaster, feature, register

__all__ = ["PhaseTransitionForecaster"]


class PhaseTransitionForecaster(Forecaster):
    """Seconds until the current phase ends, from each phase's mean length."""

    def __init__(self, alpha: float = 0.3, max_phases: int = 64) -> None:
        if not 0.0 < alpha <= 1.0 or max_phases < 1:
            raise ValueError(f"need 0 < alpha <= 1 and max_phases >= 1; got {alpha}, {max_phases}")
        self.alpha = alpha
        self.max_phases = max_phases
        self._length: dict[int, float] = {}  # phase code → mean length (s)
        self._next: dict[int, dict[int, int]] = {}  # phase → successor → count
        self._cur: int | None = None
        self._since = 0.0

    @property
    def current(self) -> int | None:
        """The phase the job is in (None before the first change)."""
        return self._cur

    def learn_one(self, x: Features, y: float | None = None) -> None:
        t, code = feature(x, "ts_s"), feature(x, "phase")
        if t is None or code is None or not float(code).is_integer():
            return
        phase = int(code)
        if self._cur is not None and t >= self._since:
            length = t - self._since
            m = self._length.get(self._cur)
            if m is not None or len(self._length) < self.max_phases:
                self._length[self._cur] = length if m is None else m + self.alpha * (length - m)
            succ = self._next.setdefault(self._cur, {})
            succ[phase] = succ.get(phase, 0) + 1
        if self._cur is None or t >= self._since:
            self._cur, self._since = phase, t

    def predict_one(self, x: Features) -> float:
        if self._cur is None:
            return math.inf
        m = self._length.get(self._cur)
        if m is None:
            return math.inf
        now = feature(x, "ts_s")
        if now is None:
            return m
        return max(0.0, self._since + m - now)

    def next_phase(self) -> int | None:
        """The phase that most often followed the current one (None: not seen yet)."""
        succ = self._next.get(self._cur) if self._cur is not None else None
        if not succ:
            return None
        return max(sorted(succ), key=lambda k: succ[k])


def _periodic(seed: int) -> Iterator[tuple[dict[str, float], float | None]]:
    """Run-level changes of a job that evaluates every ~600 s for ~30 s, with jitter."""
    rng = np.random.default_rng(seed)
    t = 0.0
    for _ in range(30):
        yield {"ts_s": t, "phase": 1.0}, None
        t += float(600 + rng.normal(0, 20))
        yield {"ts_s": t, "phase": 2.0}, None
        t += float(30 + rng.normal(0, 2))


register(example=lambda: PhaseTransitionForecaster(), stream=_periodic)(PhaseTransitionForecaster)
