"""Goodput: useful training progress per second, and the batch size that maximises it.

Following Pollux (Qiao et al., OSDI'21), goodput is throughput times statistical efficiency:

* **Statistical efficiency** comes from the gradient noise scale ``B_noise = tr(Σ) / |G|²``
  (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"), where ``G`` is the
  true gradient and ``Σ`` the per-example gradient covariance. Relative to the initial batch
  size ``M0``, a batch of ``M`` examples makes ``E(M) = (B_noise + M0) / (B_noise + M)`` as
  much progress per example; ``E(M0) = 1`` and ``E(M) <= 1`` for ``M >= M0``.
* **Throughput** (examples/s) comes from a step-time model linear in the batch size,
  ``t(M) = a + b·M`` (fixed cost ``a`` per step, ``b`` per example), fitted by least squares on
  observed ``(batch size, step time)`` pairs.

Goodput ``M / t(M) · E(M)`` counts ``M0``-equivalent examples per second. With the linear step
model it peaks at ``M* = sqrt(a · B_noise / b)``: more noise or more fixed cost favours larger
batches. :func:`recommend_batch_size` proposes a change when the predicted gain passes a
threshold (5 % by default, as Pollux and AdaptDL do).

:class:`GradientNoiseScale` estimates ``B_noise`` online from squared gradient norms at two
batch sizes (McCandlish et al., Appendix A) — in data-parallel training, one replica's local
gradient (the small batch) and the all-reduced gradient (the big batch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from perfloop.models.base import Forecaster, feature, register

__all__ = [
    "BatchSizeRecommendation",
    "GradientNoiseScale",
    "StepTimeModel",
    "goodput",
    "recommend_batch_size",
    "statistical_efficiency",
]


def _finite(name: str, value: float, *, positive: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0.0 or (positive and v == 0.0):
        raise ValueError(
            f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}"
        )
    return v


def statistical_efficiency(batch_size: float, noise_scale: float, base_batch_size: float) -> float:
    """Progress per example at ``batch_size`` relative to ``base_batch_size`` (Pollux).

    >>> statistical_efficiency(1000, 1000.0, 125)
    0.5625
    >>> statistical_efficiency(128, 1000.0, 128)
    1.0
    """
    m = _finite("batch_size", batch_size, positive=True)
    b = _finite("noise_scale", noise_scale)
    m0 = _finite("base_batch_size", base_batch_size, positive=True)
    return (b + m0) / (b + m)


@dataclass(frozen=True)
class StepTimeModel:
    """Step time linear in the batch size: ``t(M) = overhead_s + per_example_s · M``.

    >>> model = StepTimeModel.fit([32, 64, 128], [0.12, 0.14, 0.18])
    >>> round(model.overhead_s, 3), round(model.per_example_s * 1e3, 3)
    (0.1, 0.625)
    >>> round(model.throughput(128), 1)  # examples per second
    711.1
    """

    overhead_s: float
    per_example_s: float

    def __post_init__(self) -> None:
        _finite("overhead_s", self.overhead_s)
        _finite("per_example_s", self.per_example_s)
        if self.overhead_s == 0.0 and self.per_example_s == 0.0:
            raise ValueError("overhead_s and per_example_s cannot both be 0")

    @classmethod
    def fit(cls, batch_sizes: Sequence[float], step_times_s: Sequence[float]) -> StepTimeModel:
        """Least-squares fit on observed pairs, kept physical: a negative intercept refits
        through the origin, a negative slope refits a constant (the mean step time).
        """
        if len(batch_sizes) != len(step_times_s):
            raise ValueError(
                f"batch_sizes and step_times_s differ in length: "
                f"{len(batch_sizes)} != {len(step_times_s)}"
            )
        xs = [_finite("batch size", x, positive=True) for x in batch_sizes]
        ys = [_finite("step time", y, positive=True) for y in step_times_s]
        if len(set(xs)) < 2:
            raise ValueError(f"need at least 2 distinct batch sizes to fit, got {sorted(set(xs))}")
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
        slope = sxy / sxx
        intercept = my - slope * mx
        if slope <= 0.0:
            return cls(overhead_s=my, per_example_s=0.0)
        if intercept < 0.0:
            slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
            return cls(overhead_s=0.0, per_example_s=slope)
        return cls(overhead_s=intercept, per_example_s=slope)

    def step_time(self, batch_size: float) -> float:
        """Predicted seconds per step."""
        return self.overhead_s + self.per_example_s * batch_size

    def throughput(self, batch_size: float) -> float:
        """Predicted examples per second."""
        return batch_size / self.step_time(batch_size)


def goodput(
    batch_size: float, noise_scale: float, base_batch_size: float, step_model: StepTimeModel
) -> float:
    """``M0``-equivalent examples per second: throughput × statistical efficiency.

    >>> model = StepTimeModel(overhead_s=0.1, per_example_s=0.001)
    >>> goodput(400, 1600.0, 100, model)  # 400 / 0.5 s · (1700 / 2000)
    680.0
    """
    eff = statistical_efficiency(batch_size, noise_scale, base_batch_size)
    return step_model.throughput(batch_size) * eff


@dataclass(frozen=True)
class BatchSizeRecommendation:
    """The goodput-maximising batch size and whether moving to it is worth it.

    ``gain`` is the predicted relative goodput gain over the current batch size (0.25 = 25 %
    more progress per second); ``apply`` is true when it reaches ``min_gain``.
    """

    batch_size: int
    current_batch_size: int
    goodput: float
    current_goodput: float
    gain: float
    min_gain: float
    apply: bool


def recommend_batch_size(
    current_batch_size: int,
    noise_scale: float,
    step_model: StepTimeModel,
    *,
    base_batch_size: int | None = None,
    min_batch_size: int = 1,
    max_batch_size: int,
    granularity: int = 1,
    min_gain: float = 0.05,
) -> BatchSizeRecommendation:
    """Pick the batch size in ``[min_batch_size, max_batch_size]``, a multiple of
    ``granularity``, with the highest goodput; ``base_batch_size`` (``M0``) defaults to the
    current one.

    With ``t(M) = 0.1 + 0.001·M`` s and ``B_noise = 1600`` the optimum is
    ``sqrt(0.1 · 1600 / 0.001) = 400``:

    >>> model = StepTimeModel(overhead_s=0.1, per_example_s=0.001)
    >>> r = recommend_batch_size(100, 1600.0, model, max_batch_size=4096, granularity=8)
    >>> r.batch_size, round(r.gain, 3), r.apply
    (400, 0.36, True)
    """
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity!r}")
    if current_batch_size < 1:
        raise ValueError(f"current_batch_size must be >= 1, got {current_batch_size!r}")
    if not 1 <= min_batch_size <= max_batch_size:
        raise ValueError(
            f"need 1 <= min_batch_size <= max_batch_size, got {min_batch_size}, {max_batch_size}"
        )
    gain_floor = _finite("min_gain", min_gain)
    b = _finite("noise_scale", noise_scale)
    m0 = current_batch_size if base_batch_size is None else base_batch_size
    lo = -(-min_batch_size // granularity) * granularity  # smallest multiple >= min
    hi = (max_batch_size // granularity) * granularity  # largest multiple <= max
    if lo > hi:
        raise ValueError(f"no multiple of {granularity} in [{min_batch_size}, {max_batch_size}]")
    # Goodput is unimodal in M with its peak at sqrt(a·B/b) (inf when b = 0): the best
    # multiple is one of the two around the peak, clipped into the bounds.
    a, per = step_model.overhead_s, step_model.per_example_s
    peak = math.inf if per == 0.0 else math.sqrt(a * b / per)
    below = hi if peak >= hi else max(lo, int(peak // granularity) * granularity)
    above = min(hi, below + granularity)
    candidates = sorted({below, above})

    def score(m: int) -> float:
        return goodput(m, b, m0, step_model)

    best = max(candidates, key=lambda m: (score(m), -m))  # ties: the smaller batch
    current = score(current_batch_size)
    best_goodput = score(best)
    if best_goodput <= current:
        best, best_goodput = current_batch_size, current
    gain = best_goodput / current - 1.0
    return BatchSizeRecommendation(
        batch_size=best,
        current_batch_size=current_batch_size,
        goodput=best_goodput,
        current_goodput=current,
        gain=gain,
        min_gain=gain_floor,
        apply=gain >= gain_floor and best != current_batch_size,
    )


class GradientNoiseScale(Forecaster):
    """Online estimate of the gradient noise scale ``B_noise = tr(Σ) / |G|²``.

    Each observation gives the squared gradient norms measured at two batch sizes,
    ``B_small < B_big``. Since ``E|G_B|² = |G|² + tr(Σ) / B``, McCandlish et al. (Appendix A)
    derive unbiased estimates

    * ``|G|² ≈ (B_big·|G_big|² - B_small·|G_small|²) / (B_big - B_small)``
    * ``tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)``

    which are each smoothed by an exponentially weighted moving average (weight ``alpha`` on
    the newest) before taking the ratio, as single-step estimates are very noisy.

    ``x`` holds ``grad_sq_small``, ``grad_sq_big``, ``batch_small`` and ``batch_big``. As every
    online model (`perfloop.models.base`), it never fails on its input: an observation missing
    any of them is skipped, an invalid one (non-finite, a batch size ≤ 0, ``batch_big`` not
    above ``batch_small``) is skipped and counted in ``n_invalid``. ``predict_one`` ignores its
    argument and returns the current estimate, or ``default`` while there is none (before the
    first observation, or while the smoothed ``|G|²`` is not positive: noise swamps the
    signal); `estimated` says which.

    >>> gns = GradientNoiseScale(alpha=0.5)
    >>> gns.learn_one({"grad_sq_small": 3.0, "grad_sq_big": 1.5,
    ...                "batch_small": 100, "batch_big": 400})
    >>> gns.predict_one({}), gns.estimated  # |G|² = 1.0, tr(Σ) = 200.0
    (200.0, True)
    """

    KEYS: tuple[str, ...] = ("grad_sq_small", "grad_sq_big", "batch_small", "batch_big")

    def __init__(self, alpha: float = 0.05, default: float = 0.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.default = default
        self._grad_sq = math.nan
        self._trace = math.nan
        self._n = 0
        self.n_invalid = 0

    @property
    def n(self) -> int:
        """Observations learned so far."""
        return self._n

    @property
    def grad_sq(self) -> float:
        """Smoothed estimate of ``|G|²`` (``nan`` before the first observation)."""
        return self._grad_sq

    @property
    def trace_sigma(self) -> float:
        """Smoothed estimate of ``tr(Σ)`` (``nan`` before the first observation)."""
        return self._trace

    @property
    def estimated(self) -> bool:
        """Whether `predict_one` gives an estimate (not ``default``)."""
        return self._n > 0 and self._grad_sq > 0.0

    def learn_one(self, x: Mapping[str, float], y: float | None = None) -> None:
        """Fold one pair of squared gradient norms into the estimate (``y`` is unused)."""
        if any(k not in x for k in self.KEYS):
            return
        values = [feature(x, k) for k in self.KEYS]
        if any(v is None for v in values):
            self.n_invalid += 1
            return
        g_small, g_big, b_small, b_big = (float(v) for v in values)  # type: ignore[arg-type]
        if b_small <= 0 or b_big <= b_small:
            self.n_invalid += 1
            return
        grad_sq = (b_big * g_big - b_small * g_small) / (b_big - b_small)
        trace = (g_small - g_big) / (1.0 / b_small - 1.0 / b_big)
        if self._n == 0:
            self._grad_sq, self._trace = grad_sq, trace
        else:
            a = self.alpha
            self._grad_sq += a * (grad_sq - self._grad_sq)
            self._trace += a * (trace - self._trace)
        self._n += 1

    def predict_one(self, x: Mapping[str, float] | None = None) -> float:
        """The current ``B_noise`` estimate, in examples (``default`` while there is none)."""
        if not self.estimated:
            return self.default
        return max(0.0, self._trace) / self._grad_sq


def _norm_pairs(seed: int) -> Iterator[tuple[dict[str, float], float | None]]:
    """Squared gradient norms at batch sizes 32 and 512 around |G|² = 2, tr(Σ) = 800."""
    rng = random.Random(seed)
    for _ in range(60):
        small, big = 2 + 800 / 32, 2 + 800 / 512
        yield (
            {
                "grad_sq_small": small * rng.uniform(0.7, 1.3),
                "grad_sq_big": big * rng.uniform(0.9, 1.1),
                "batch_small": 32.0,
                "batch_big": 512.0,
            },
            None,
        )


register(example=lambda: GradientNoiseScale(), stream=_norm_pairs)(GradientNoiseScale)
