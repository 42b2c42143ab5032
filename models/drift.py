"""Regime changes in step time and phase shares: ADWIN or Page–Hinkley per feature.

A regime change — the step time or a phase's share of it moving to a new level and staying
there — is what the slow loop acts on: the job is no longer the job its configuration was
chosen for. `RegimeDetector` watches each feature in ``features`` with its own detector from
river (`river.drift.ADWIN`, Bifet & Gavaldà 2007, adaptive windows whose two halves differ
beyond a Hoeffding-style bound at confidence ``delta``; or `river.drift.PageHinkley`, Page 1954,
a cumulative deviation from the running mean beyond ``threshold``).

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
from river import drift

from perfloop.models.base import Features, Scorer, feature, register

__all__ = ["RegimeDetector"]

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
        method: Literal["adwin", "page_hinkley"] = "adwin",
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
            return drift.ADWIN(delta=self.delta)  # type: ignore[no-untyped-call]
        return drift.PageHinkley(min_instances=self.warmup, threshold=self.threshold)

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
            det.update(v)
            if det.drift_detected:
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
