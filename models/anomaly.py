"""How unusual a window of job metrics is: per-feature running statistics, one chi-square score.

`WindowAnomaly` scores windows (e.g. one job's 1-s window: ``step_time_ms``,
``data_wait_share``, ``comm_share``, ``sm_util_pct``, ``power_w``, … any keys; a key may appear
or disappear from one window to the next) against what the job's windows usually look like.

**Normal.** Each feature keeps an exponentially weighted mean ``m`` and variance ``v`` (weight
``alpha`` on the newest window; the first windows are averaged plainly, weight ``1/n``). A
feature counts once it has been seen ``warmup`` times; its deviation is
``z = (x − m) / sqrt(v + (min_rel_std · |m|)² + min_std²)`` — the floors keep a feature that
never moved (a clock pinned at its maximum) from turning a rounding step into an alarm.

**Score.** Over the ``k`` counted features observed in the window, ``d² = Σ z²`` is, for
independent Gaussian features at their usual level, chi-square distributed with ``k`` degrees
of freedom; the score is its CDF, ``P(χ²_k ≤ d²)``, by the Wilson–Hilferty approximation
(Wilson & Hilferty 1931: ``(d²/k)^(1/3)`` is close to normal with mean ``1 − 2/(9k)`` and
variance ``2/(9k)``), so no scipy is needed. A score ``s`` means "as extreme as a fraction ``s``
of usual windows": at threshold ``t`` about ``1 − t`` of normal windows alarm. No counted
feature: 0.0.

**Learning while anomalous.** Once a feature is counted, the deviation it learns from is
clipped to ``clip`` of its standard deviations (one odd window moves the mean and inflates the
variance by a bounded amount). A window scoring at least ``hold_score`` is learned with its
weight multiplied by ``damping``, so a long anomaly is not absorbed as the new normal at once
(and, being clipped, does not inflate the variance so much that the next fault is missed);
after ``max_hold`` such windows in a row the hold ends and windows are learned at full weight
and unclipped until one scores below ``hold_score``. A lasting change of regime (a new batch
size, another node) therefore alarms for ``max_hold`` windows (5 min by default, for 1-s
windows), stops a few windows later (the full-weight windows widen the variance first), and its
level is the new mean within about ``3 / alpha`` more windows.

Cost: ~11-15 µs per ``learn_one`` + ``score_one`` with 7 features (plain Python floats: for a
handful of features that is faster than numpy's per-call overhead), measured on this project's
2-core CI machine with CPython 3.11.

>>> m = WindowAnomaly(warmup=10)
>>> for i in range(200):
...     m.learn_one({"step_time_ms": 100.0 + (i * 7 % 11) - 5, "sm_util_pct": 95.0 + i % 3})
>>> m.score_one({"step_time_ms": 101.0, "sm_util_pct": 96.0}) < 0.9
True
>>> m.score_one({"step_time_ms": 160.0, "sm_util_pct": 96.0}) > 0.999
True
>>> m.score_one({}), m.score_one({"new_feature": 3.0})
(0.0, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from perfloop.models.base import Features, Scorer, feature, register

__all__ = ["ALARM_SCORE", "WindowAnomaly", "chi2_cdf"]

ALARM_SCORE = 0.9999
"""The score from which a window is reported as anomalous (the stream worker's default,
``predict.anomaly_threshold``): about 1 in 10,000 usual windows for independent Gaussian
features. Real features move together (step time, collective time and power rise at once), so
usual windows reach it more often than that; bench/models.py measures how often."""


def chi2_cdf(q: float, k: int) -> float:
    """``P(χ²_k ≤ q)`` by the Wilson–Hilferty approximation (0 for ``k = 0``).

    Against the tables' quantiles it is within 0.003 at 0.95 and 0.0015 at 0.999 for k ≥ 1.

    >>> round(chi2_cdf(7.815, 3), 2), round(chi2_cdf(16.266, 3), 3)  # tables: 0.95, 0.999
    (0.95, 0.999)
    """
    if q <= 0 or k <= 0:
        return 0.0
    c = 2.0 / (9.0 * k)
    zz = ((q / k) ** (1.0 / 3.0) - (1.0 - c)) / math.sqrt(c)
    return 0.5 * math.erfc(-zz / math.sqrt(2.0))


def _windows(seed: int) -> Iterator[tuple[dict[str, float], float | None]]:
    """A job's 1-s windows: steady metrics, then 15 s of data-loader starvation; the comm
    share is missing from every fifth window."""
    rng = np.random.default_rng(seed)
    for i in range(90):
        starving = 60 <= i < 75
        x = {
            "step_time_ms": float(rng.normal(210.0 if starving else 100.0, 2.0)),
            "data_wait_share": float(abs(rng.normal(0.5 if starving else 0.01, 0.005))),
            "sm_util_pct": float(rng.normal(45.0 if starving else 93.0, 1.0)),
            "power_w": float(rng.normal(380.0 if starving else 640.0, 6.0)),
        }
        if i % 5:
            x["comm_share"] = float(abs(rng.normal(0.05, 0.004)))
        yield x, None


@register(example=lambda: WindowAnomaly(warmup=10), stream=_windows)
class WindowAnomaly(Scorer):
    """Anomaly score in [0, 1] of a window of metrics; see the module's docstring."""

    def __init__(
        self,
        alpha: float = 0.02,
        warmup: int = 20,
        hold_score: float = 0.999,
        damping: float = 0.02,
        max_hold: int = 300,
        clip: float = 3.0,
        min_rel_std: float = 0.002,
        min_std: float = 1e-4,
    ) -> None:
        if not (0.0 < alpha <= 1.0 and 0.0 <= damping <= 1.0 and 0.0 < hold_score <= 1.0):
            raise ValueError(
                "need 0 < alpha <= 1, 0 <= damping <= 1, 0 < hold_score <= 1; got "
                f"{alpha!r}, {damping!r}, {hold_score!r}"
            )
        if warmup < 2 or max_hold < 0 or clip <= 0 or min_rel_std < 0 or min_std <= 0:
            raise ValueError(
                "need warmup >= 2, max_hold >= 0, clip > 0, min_rel_std >= 0, min_std > 0; got "
                f"{warmup!r}, {max_hold!r}, {clip!r}, {min_rel_std!r}, {min_std!r}"
            )
        self.alpha = alpha
        self.warmup = warmup
        self.hold_score = hold_score
        self.damping = damping
        self.max_hold = max_hold
        self.clip = clip
        self.min_rel_std = min_rel_std
        self.min_std = min_std
        self.n_seen = 0
        self._stats: dict[str, list[float]] = {}  # name → [count, mean, variance]
        self._held = 0  # windows in a row at or above hold_score

    def _values(self, x: Features) -> dict[str, float]:
        out = {}
        for name in x:
            v = feature(x, name)
            if v is not None:
                out[name] = v
        return out

    def _score(self, values: dict[str, float]) -> float:
        d2, k = 0.0, 0
        stats, warm, rel, floor2 = self._stats, self.warmup, self.min_rel_std, self.min_std**2
        for name, v in values.items():
            st = stats.get(name)
            if st is None or st[0] < warm:
                continue
            m = st[1]
            d = v - m
            d2 += d * d / (st[2] + (rel * m) ** 2 + floor2)
            k += 1
        return chi2_cdf(d2, k) if k else 0.0

    def score_one(self, x: Features) -> float:
        return self._score(self._values(x))

    def learn_one(self, x: Features, y: float | None = None) -> None:
        values = self._values(x)
        if not values:
            return
        self.n_seen += 1
        damp, robust = 1.0, True
        if self._score(values) >= self.hold_score:
            self._held += 1
            if self._held <= self.max_hold:
                damp = self.damping
            else:
                robust = False  # the hold is over: learn the new regime as it is
        else:
            self._held = 0
        warm, rel, floor2 = self.warmup, self.min_rel_std, self.min_std**2
        for name, v in values.items():
            st = self._stats.get(name)
            if st is None:
                self._stats[name] = [1.0, v, 0.0]
                continue
            st[0] += 1.0
            a = max(self.alpha, 1.0 / st[0]) * damp
            d = v - st[1]
            if robust and st[0] > warm:
                lim = self.clip * math.sqrt(st[2] + (rel * st[1]) ** 2 + floor2)
                d = min(max(d, -lim), lim)
            inc = a * d
            st[1] += inc
            st[2] = (1.0 - a) * (st[2] + d * inc)

    @property
    def holding(self) -> bool:
        """Whether learning is damped now (the last windows scored high)."""
        return 0 < self._held <= self.max_hold
