"""Time to the next phase transition, from the lengths and successions the job has shown.

`PhaseTransitionForecaster` reads a job's phase changes — run level (warmup, steady, eval,
checkpoint, stalled) or step level (data_wait, forward, backward, comm, optimizer) — as
``learn_one({"ts_s": t, "phase": code})``: the job entered phase ``code`` (an integer code the
caller assigns) at event time ``t``. It keeps, per phase, experts on how long the phase
lasts — exponentially weighted means of its past lengths (weights ``alphas`` on the newest) and
its last length — each with a discounted sum (``gamma``) of its squared relative errors, and
expects the experts' mean weighted by ``exp(-beta · (loss / best loss - 1))``: a steady
schedule is averaged, a drifting one followed. It counts which phase follows which.

``predict_one({"ts_s": now})`` forecasts the seconds from ``now`` until the current phase ends:
``since + expected_length(current) - now``, at least 0; without ``ts_s``, the whole expected
length.
Before the current phase has been seen to end once it answers ``math.inf`` (no transition
foreseen). `next_phase` names the most frequent successor of the current phase.

A periodic evaluation (steady 600 s, eval 30 s, steady 600 s, …) is forecast to within the
period's jitter after one cycle; the baseline — "the phase lasts as long as it did last
time" — is what it beats when lengths jitter, and ties when they drift (bench/models.py).

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
    """Seconds until the current phase ends, from each phase's recent lengths."""

    def __init__(
        self,
        alphas: tuple[float, ...] = (0.1, 0.3, 0.6),
        gamma: float = 0.8,
        beta: float = 5.0,
        max_phases: int = 64,
    ) -> None:
        if not alphas or not all(0.0 < a <= 1.0 for a in alphas) or max_phases < 1:
            raise ValueError(
                f"need alphas in (0, 1] and max_phases >= 1; got {alphas}, {max_phases}"
            )
        if not 0.0 < gamma < 1.0 or beta <= 0:
            raise ValueError(f"need 0 < gamma < 1 and beta > 0; got {gamma}, {beta}")
        self.alphas = tuple(alphas)
        self.gamma = gamma
        self.beta = beta
        self.max_phases = max_phases
        # phase code → [expert forecasts of its length (averages, then the last one), losses]
        self._length: dict[int, tuple[list[float], list[float]]] = {}
        self._next: dict[int, dict[int, int]] = {}  # phase → successor → count
        self._cur: int | None = None
        self._since = 0.0

    def _expected(self, phase: int) -> float | None:
        st = self._length.get(phase)
        if st is None:
            return None
        guesses, losses = st
        best = max(min(losses), 1e-12)
        w = [math.exp(-self.beta * (loss / best - 1.0)) for loss in losses]
        return sum(wi * g for wi, g in zip(w, guesses, strict=True)) / sum(w)

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
            self._learn_length(self._cur, t - self._since)
            succ = self._next.setdefault(self._cur, {})
            succ[phase] = succ.get(phase, 0) + 1
        if self._cur is None or t >= self._since:
            self._cur, self._since = phase, t

    def _learn_length(self, phase: int, length: float) -> None:
        st = self._length.get(phase)
        if st is None:
            if len(self._length) < self.max_phases:
                self._length[phase] = (
                    [length] * (len(self.alphas) + 1),
                    [0.0] * (len(self.alphas) + 1),
                )
            return
        guesses, losses = st
        scale = max(length, 1e-9)
        for i, g in enumerate(guesses):
            losses[i] = self.gamma * losses[i] + ((g - length) / scale) ** 2
        for i, a in enumerate(self.alphas):
            guesses[i] += a * (length - guesses[i])
        guesses[-1] = length

    def predict_one(self, x: Features) -> float:
        if self._cur is None:
            return math.inf
        m = self._expected(self._cur)
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
