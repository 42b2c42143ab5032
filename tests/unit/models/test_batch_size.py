"""Goodput (Pollux): efficiency from the gradient noise scale, throughput from step times."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from perfloop.models.batch_size import (
    GradientNoiseScale,
    StepTimeModel,
    goodput,
    recommend_batch_size,
    statistical_efficiency,
)


def test_efficiency_is_one_at_the_base_batch_and_follows_pollux() -> None:
    assert statistical_efficiency(256, 500.0, 256) == 1.0
    # (B + M0) / (B + M) = (1000 + 100) / (1000 + 1000)
    assert statistical_efficiency(1000, 1000.0, 100) == pytest.approx(0.55)
    # No gradient noise: one big step is worth as much as one small one -> M0 / M.
    assert statistical_efficiency(400, 0.0, 100) == pytest.approx(0.25)


@given(
    base=st.integers(min_value=1, max_value=10_000),
    extra=st.integers(min_value=0, max_value=100_000),
    noise=st.floats(min_value=0.0, max_value=1e7),
)
def test_efficiency_is_in_zero_one_from_the_base_batch_up(
    base: int, extra: int, noise: float
) -> None:
    e = statistical_efficiency(base + extra, noise, base)
    assert 0.0 < e <= 1.0
    assert statistical_efficiency(base + extra + 1, noise, base) <= e


def test_step_time_fit_recovers_a_noisy_line() -> None:
    rng = np.random.default_rng(0)
    sizes = np.repeat([16, 32, 64, 128, 256], 20)
    times = 0.05 + 0.002 * sizes + rng.normal(0, 0.002, sizes.size)
    m = StepTimeModel.fit(sizes.tolist(), times.tolist())
    assert m.overhead_s == pytest.approx(0.05, abs=0.002)
    assert m.per_example_s == pytest.approx(0.002, rel=0.02)
    assert m.throughput(100) == pytest.approx(100 / m.step_time(100))


def test_step_time_fit_stays_physical() -> None:
    flat = StepTimeModel.fit([32, 64], [0.2, 0.19])  # GPU not yet saturated
    assert flat.per_example_s == 0.0 and flat.overhead_s == pytest.approx(0.195)
    origin = StepTimeModel.fit([10, 20], [0.05, 0.15])  # line would cross below zero
    assert origin.overhead_s == 0.0 and origin.per_example_s > 0.0


def test_step_time_fit_rejects_unusable_data() -> None:
    with pytest.raises(ValueError, match="2 distinct batch sizes"):
        StepTimeModel.fit([32, 32], [0.1, 0.1])
    with pytest.raises(ValueError, match="differ in length"):
        StepTimeModel.fit([32, 64], [0.1])
    with pytest.raises(ValueError, match="step time must be finite and > 0"):
        StepTimeModel.fit([32, 64], [0.1, math.nan])


def test_recommendation_is_the_analytic_optimum() -> None:
    # G(M) = M / (a + bM) · (B + M0) / (B + M) peaks at M* = sqrt(aB / b) = sqrt(0.1·1600/0.001).
    model = StepTimeModel(overhead_s=0.1, per_example_s=0.001)
    r = recommend_batch_size(100, 1600.0, model, max_batch_size=10_000, granularity=16)
    assert r.batch_size == 400
    assert r.current_goodput == pytest.approx(100 / 0.2)
    assert r.goodput == pytest.approx(400 / 0.5 * 1700 / 2000)
    assert r.gain == pytest.approx(680 / 500 - 1) and r.apply


def test_recommendation_matches_brute_force_with_granularity_and_bounds() -> None:
    model = StepTimeModel(overhead_s=0.03, per_example_s=0.0007)
    for noise in (0.0, 50.0, 3000.0, 1e6):
        r = recommend_batch_size(
            64, noise, model, min_batch_size=20, max_batch_size=2000, granularity=24
        )
        grid = range(24, 2000 + 1, 24)
        best = max(grid, key=lambda m: (goodput(m, noise, 64, model), -m))
        best_goodput = goodput(best, noise, 64, model)
        assert r.goodput == pytest.approx(max(best_goodput, r.current_goodput))
        if best_goodput > r.current_goodput:
            assert r.batch_size == best


def test_no_noise_favours_the_smallest_batch_and_huge_noise_the_largest() -> None:
    model = StepTimeModel(overhead_s=0.01, per_example_s=0.001)
    assert recommend_batch_size(256, 0.0, model, max_batch_size=1024).batch_size == 1
    assert recommend_batch_size(256, 1e9, model, max_batch_size=1024).batch_size == 1024


def test_small_gains_are_not_applied() -> None:
    model = StepTimeModel(overhead_s=0.1, per_example_s=0.001)
    # Current 380 is within 0.1 % of the optimum 400: found, but not worth a change.
    r = recommend_batch_size(380, 1600.0, model, base_batch_size=100, max_batch_size=4096)
    assert r.batch_size == 400 and 0.0 < r.gain < 0.05 and not r.apply
    assert recommend_batch_size(
        380, 1600.0, model, base_batch_size=100, max_batch_size=4096, min_gain=0.0
    ).apply
    at_best = recommend_batch_size(400, 1600.0, model, max_batch_size=4096)
    assert at_best.batch_size == 400 and at_best.gain == 0.0 and not at_best.apply


def test_recommendation_rejects_bad_arguments() -> None:
    model = StepTimeModel(overhead_s=0.1, per_example_s=0.001)
    with pytest.raises(ValueError, match=r"no multiple of 64 in \[10, 50\]"):
        recommend_batch_size(32, 100.0, model, min_batch_size=10, max_batch_size=50, granularity=64)
    with pytest.raises(ValueError, match=r"noise_scale must be finite and >= 0, got -1\.0"):
        recommend_batch_size(32, -1.0, model, max_batch_size=64)
    with pytest.raises(ValueError, match="min_batch_size <= max_batch_size"):
        recommend_batch_size(32, 1.0, model, min_batch_size=128, max_batch_size=64)
    with pytest.raises(ValueError, match="cannot both be 0"):
        StepTimeModel(overhead_s=0.0, per_example_s=0.0)


def synthetic_norms(
    seed: int, steps: int, b_small: int, b_big: int
) -> tuple[float, list[dict[str, float]]]:
    """Squared norms of batch gradients G + N(0, Σ/B) with known G and diagonal Σ."""
    rng = np.random.default_rng(seed)
    dim = 200
    g = rng.normal(0.0, 0.05, dim)
    var = rng.uniform(0.5, 1.5, dim)
    true_noise_scale = float(var.sum() / (g @ g))
    obs = []
    for _ in range(steps):
        small = g + rng.normal(0.0, 1.0, dim) * np.sqrt(var / b_small)
        big = g + rng.normal(0.0, 1.0, dim) * np.sqrt(var / b_big)
        obs.append(
            {
                "grad_sq_small": float(small @ small),
                "grad_sq_big": float(big @ big),
                "batch_small": float(b_small),
                "batch_big": float(b_big),
            }
        )
    return true_noise_scale, obs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_scale_estimator_recovers_the_true_value(seed: int) -> None:
    truth, obs = synthetic_norms(seed, 3000, 32, 512)
    gns = GradientNoiseScale(alpha=0.01)
    for x in obs:
        gns.learn_one(x)
    assert gns.n == 3000
    assert gns.predict_one({}) == pytest.approx(truth, rel=0.10)


def test_noise_scale_estimator_exact_on_noise_free_expectations() -> None:
    # Feed E|G_B|² = |G|² + tr(Σ)/B exactly: |G|² = 2, tr(Σ) = 800 -> B_noise = 400.
    gns = GradientNoiseScale(alpha=0.3)
    for small, big in ((16, 256), (8, 64), (32, 1024)):
        gns.learn_one(
            {
                "grad_sq_small": 2 + 800 / small,
                "grad_sq_big": 2 + 800 / big,
                "batch_small": small,
                "batch_big": big,
            }
        )
    assert gns.grad_sq == pytest.approx(2.0)
    assert gns.trace_sigma == pytest.approx(800.0)
    assert gns.predict_one({}) == pytest.approx(400.0)


def test_noise_scale_estimator_edge_cases_and_pickling() -> None:
    gns = GradientNoiseScale()
    assert gns.predict_one({}) == 0.0 and not gns.estimated  # `default` until an estimate
    gns.learn_one({"grad_sq_small": 1.0})  # missing keys: skipped
    assert gns.n == 0 and gns.n_invalid == 0
    # invalid observations are skipped and counted, never raised (the models' contract)
    gns.learn_one({"grad_sq_small": 1.0, "grad_sq_big": 1.0, "batch_small": 64, "batch_big": 64})
    gns.learn_one(
        {"grad_sq_small": 1.0, "grad_sq_big": math.nan, "batch_small": 8, "batch_big": 64}
    )
    gns.learn_one({"grad_sq_small": 1.0, "grad_sq_big": 1.0, "batch_small": 0, "batch_big": 64})
    assert gns.n == 0 and gns.n_invalid == 3 and not gns.estimated
    with pytest.raises(ValueError, match="alpha must be in"):
        GradientNoiseScale(alpha=0.0)
    _, obs = synthetic_norms(3, 50, 16, 256)
    for x in obs:
        gns.learn_one(x)
    clone = pickle.loads(pickle.dumps(gns))
    assert clone.alpha == gns.alpha and clone.predict_one({}) == gns.predict_one({})
    # Signal swamped by noise (smoothed |G|² <= 0): no estimate rather than a negative one.
    swamped = GradientNoiseScale(alpha=1.0, default=-1.0)
    swamped.learn_one({"grad_sq_small": 1.0, "grad_sq_big": 0.5, "batch_small": 1, "batch_big": 2})
    assert swamped.grad_sq == 0.0 and not swamped.estimated and swamped.predict_one({}) == -1.0
