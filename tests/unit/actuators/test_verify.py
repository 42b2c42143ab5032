"""`ChangeVerifier` and its Mann–Whitney test, against scipy where it is installed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.actuators.verify import ChangeVerifier, mann_whitney_p

times = st.lists(st.floats(1, 1000, allow_nan=False), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(times, times)
def test_mann_whitney_matches_scipys_asymptotic_test(a: list[float], b: list[float]) -> None:
    stats = pytest.importorskip("scipy.stats")
    a_, b_ = np.round(a, 1), np.round(b, 1)  # rounding makes ties
    if np.all(np.concatenate([a_, b_]) == a_[0]):
        assert mann_whitney_p(a_, b_) == 1.0
        return
    want = stats.mannwhitneyu(a_, b_, method="asymptotic", use_continuity=True).pvalue
    assert mann_whitney_p(a_, b_) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("settle", [0, 3])
def test_the_verdict_comes_within_settle_plus_verify_steps(settle: int) -> None:
    v = ChangeVerifier([100.0] * 10, settle_steps=settle, verify_steps=5)
    verdicts = [v.observe(200.0) for _ in range(v.max_steps)]
    assert verdicts[:-1] == [None] * (v.max_steps - 1)
    assert verdicts[-1] is not None and verdicts[-1].rollback
    assert v.observe(50.0) is verdicts[-1], "decided once"


def test_settling_steps_are_not_judged() -> None:
    v = ChangeVerifier([100.0] * 10, settle_steps=2, verify_steps=5)
    for t in (900.0, 900.0, 100, 101, 99, 100, 102):  # a slow warm-up, then as before
        verdict = v.observe(t)
    assert verdict is not None and not verdict.rollback


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_broken_loss_rolls_back_at_once(loss: float) -> None:
    v = ChangeVerifier([100.0] * 10, settle_steps=5, verify_steps=5)
    assert v.observe(100.0, 1.0) is None
    verdict = v.observe(100.0, loss)
    assert verdict is not None and verdict.rollback and verdict.evidence["steps_after"] == 2


def test_unusable_step_times_are_skipped_and_a_verdict_still_comes() -> None:
    v = ChangeVerifier([100.0, math.nan, -1.0] + [100.0] * 9, settle_steps=0, verify_steps=5)
    assert len(v.before) == 10
    verdicts = [v.observe(t) for t in [math.nan] * 100]
    assert verdicts[-1] is not None and verdicts[-1].reason.startswith("too few steps")
