"""Regime changes in step time and phase shares: ADWIN or Page–Hinkley per feature.

A regime change — the step time or a phase's share of it moving to a new level and staying
there — is what the slow loop acts on: the job is no longer the job its configuration was
chosen for. `RegimeDetector` watches each feature in ``features`` with its own detector: the
Page–Hinkley test (Page 1954; `PageHinkley`: the cumulative deviation from the running mean,
up or down, beyond ``threshold``; the default, as it found more changes sooner than ADWIN on
the simulator's faults, bench/models.py) or river's ADWIN (`river.drift.ADWIN`, Bifet &
Gavaldà 2007: adaptive windows whose two halves differ beyond a Hoeffding-style bound at
confidence ``delta``). river is imported only for ADWIN: importing it takes ~1 s, which a
restarted stream worker would otherwise wait for.

Step time is watched relative to its level at the start of the regime (the mean of its first
``warmup`` values), so one ``threshold`` suits a 10-ms and a 10-s step; shares are watched as
they are. After a change every detector restarts, and no change is reported again for
``min_gap`` steps, so one move is one report.

``learn_one(x)`` takes one step (or window); ``changed`` names the features whose regime changed
at that step; ``score_one(x)`` is 1.0 right after a change and 0.0 otherwise.

>>> d = RegimeDetector(features=("step_time_ms",))
>>> flags = []
>>> for t in range(600):
...     d.learn_one({"step_time_ms": (100.0 if t < 300 else 125.0) + (t * 7919 % 13) - 6})
...     flags.append(d.score_one({}))
>>> first = flags.index(1.0); 300 <= first < 340, sum(flags)
(True, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from perfloop.models.base import Features, Scorer, feature, register

__all__ = ["PageHinkley", "RegimeDetector"]


class PageHinkley:
    """The two-sided Page–Hinkley test on one series (``update`` says whether it changed).

    The running mean ``m`` of what it saw; the cumulative sums ``Σ (x - m - delta)`` and
    ``Σ (x - m + delta)``, each faded by ``alpha`` a value; a change once either has moved
    more than ``threshold`` from its extreme (a rise above the lowest, a fall below the
    highest), after ``min_instances`` values. Then it starts over. The defaults for ``delta``
    and ``alpha`` are river's.

    >>> ph = PageHinkley(min_instances=5, threshold=1.0)
    >>> [ph.update(v) for v in [1.0] * 10 + [2.0] * 3]
    [False, False, False, False, False, False, False, False, False, False, False, True, False]
    """

    def __init__(
        self,
        min_instances: int = 30,
        threshold: float = 50.0,
        delta: float = 0.005,
        alpha: float = 1 - 0.0001,
    ) -> None:
        self.min_instances = min_instances
        self.threshold = threshold
        self.delta = delta
        self.alpha = alpha
        self._reset()

    def _reset(self) -> None:
        self._n = 0
        self._mean = 0.0
        self._up = self._up_min = 0.0
        self._down = self._down_max = 0.0

    def update(self, x: float) -> bool:
        self._n += 1
        self._mean += (x - self._mean) / self._n
        dev = x - self._mean
        self._up = self.alpha * self._up + dev - self.delta
        self._up_min = min(self._up_min, self._up)
        self._down = self.alpha * self._down + dev + self.delta
        self._down_max = max(self._down_max, self._down)
        if self._n < self.min_instances:
            return False
        if self._up - self._up_min > self.threshold or self._down_max - self._down > self.threshold:
            self._reset()
            return True
        return False


RELATIVE = ("step_time_ms",)
"""Features watched relative to their level at the start of a regime (the rest as they are)."""


class RegimeDetector(Scorer):
    """Per-feature regime-change detection over a stream of steps or windows."""

    def __init__(
        self,
        features: tuple[str, ...] = (
            "step_time_ms",
            "data_wait_share",
            "forward_share",
            "backward_share",
            "comm_share",
            "optimizer_share",
        ),
        method: Literal["adwin", "page_hinkley"] = "page_hinkley",
        delta: float = 0.002,
        threshold: float = 0.5,
        warmup: int = 20,
        min_gap: int = 50,
    ) -> None:
        if method not in ("adwin", "page_hinkley"):
            raise ValueError(f"unknown method {method!r}; valid: adwin, page_hinkley")
        if not 0.0 < delta < 1.0 or threshold <= 0 or warmup < 1 or min_gap < 0:
            raise ValueError(
                f"need 0 < delta < 1, threshold > 0, warmup >= 1, min_gap >= 0; got {delta}, "
                f"{threshold}, {warmup}, {min_gap}"
            )
        self.features = tuple(features)
        self.method = method
        self.delta = delta
        self.threshold = threshold
        self.warmup = warmup
        self.min_gap = min_gap
        self.changed: tuple[str, ...] = ()
        self.n_changes = 0
        self._det: dict[str, Any] = {}
        self._ref: dict[str, list[float]] = {}  # [sum, n] of a relative feature's first values
        self._quiet = 0  # steps since the last change

    def _detector(self) -> Any:
        if self.method == "adwin":
            from river import drift  # ~1 s to import: only when asked for

            return drift.ADWIN(delta=self.delta)  # type: ignore[no-untyped-call]
        return PageHinkley(min_instances=self.warmup, threshold=self.threshold)

    def _restart(self) -> None:
        self._det.clear()
        self._ref.clear()

    def learn_one(self, x: Features, y: float | None = None) -> None:
        changed = []
        for name in self.features:
            v = feature(x, name)
            if v is None:
                continue
            if name in RELATIVE:
                ref = self._ref.setdefault(name, [0.0, 0.0])
                if ref[1] < self.warmup:
                    ref[0] += v
                    ref[1] += 1
                    continue
                level = ref[0] / ref[1]
                if level <= 0:
                    continue
                v = v / level
            det = self._det.get(name)
            if det is None:
                det = self._det[name] = self._detector()
            if isinstance(det, PageHinkley):
                moved = det.update(v)
            else:
                det.update(v)
                moved = det.drift_detected
            if moved:
                changed.append(name)
        self._quiet += 1
        if changed and self._quiet > self.min_gap:
            self.changed = tuple(changed)
            self.n_changes += 1
            self._quiet = 0
            self._restart()
        else:
            self.changed = ()
            if changed:
                for name in changed:  # too soon after the last: start that feature over
                    self._det.pop(name, None)

    def score_one(self, x: Features) -> float:
        return 1.0 if self.changed else 0.0


def _shares(seed: int) -> Iterator[tuple[dict[str, float], float | None]]:
    rng = np.random.default_rng(seed)
    for t in range(300):
        wait = 0.05 if t < 150 else 0.3
        step = 100.0 / (1 - wait) + rng.normal(0, 2)
        x = {"step_time_ms": float(step), "data_wait_share": float(wait + rng.normal(0, 0.01))}
        x["forward_share"] = float((1 - x["data_wait_share"]) * 0.35)
        if math.isfinite(step):
            yield x, None


register(example=lambda: RegimeDetector(), stream=_shares)(RegimeDetector)
