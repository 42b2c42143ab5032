"""The data-pipeline model: how many loader workers hide loading, and what that saves."""

from __future__ import annotations

import math

import pytest

from perfloop.models import expected_step_gain, loader_workers_needed

SHARES = [0.0, 0.05, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99]


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("current", [0, 1, 2, 7, 16])
def test_workers_needed_stays_between_current_and_cap(share: float, current: int) -> None:
    n = loader_workers_needed(share, current, max_workers=16)
    assert isinstance(n, int)
    assert current <= n <= max(current, 16)


def test_no_wait_means_no_change() -> None:
    assert loader_workers_needed(0.0, 3, max_workers=16) == 3
    assert loader_workers_needed(0.0, 0, max_workers=16) == 0


def test_workers_needed_matches_the_load_over_compute_bound() -> None:
    # 2 workers waiting half the step: load = 2 steps, compute = 0.5 step -> 4, +25 % headroom.
    assert loader_workers_needed(0.5, 2, max_workers=64) == math.ceil(2 / 0.5 * 1.25)
    assert loader_workers_needed(0.5, 2, max_workers=64, headroom=0.0) == 4


@pytest.mark.parametrize("current", [0, 1, 2, 4])
def test_workers_needed_grows_with_the_wait_share(current: int) -> None:
    needed = [loader_workers_needed(s, current, max_workers=1024) for s in SHARES]
    assert needed == sorted(needed)
    assert needed[-1] > needed[0] or current >= 1024


@pytest.mark.parametrize("share", SHARES)
def test_workers_needed_grows_with_current_workers(share: float) -> None:
    needed = [loader_workers_needed(share, w, max_workers=1024) for w in range(0, 20)]
    assert needed == sorted(needed)


@pytest.mark.parametrize(
    ("share", "current", "cap"),
    [
        (-0.1, 2, 16),
        (1.0, 2, 16),
        (1.5, 2, 16),
        (float("nan"), 2, 16),
        (0.5, -1, 16),
        (0.5, 2, 0),
    ],
)
def test_workers_needed_rejects_bad_input(share: float, current: int, cap: int) -> None:
    with pytest.raises(ValueError):
        loader_workers_needed(share, current, max_workers=cap)


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("current", [0, 1, 2, 8])
def test_gain_is_bounded_by_the_wait_share(share: float, current: int) -> None:
    for new in range(current, current + 40):
        g = expected_step_gain(share, current, new)
        assert 0.0 <= g <= share + 1e-12


@pytest.mark.parametrize("share", [s for s in SHARES if s > 0])
def test_gain_grows_with_more_workers_and_saturates(share: float) -> None:
    gains = [expected_step_gain(share, 2, n) for n in range(2, 1000)]
    assert gains == sorted(gains)
    assert gains[0] == 0.0
    assert gains[-1] == pytest.approx(share)


def test_gain_examples() -> None:
    assert expected_step_gain(0.5, 2, 4) == pytest.approx(0.5)
    assert expected_step_gain(0.5, 2, 3) == pytest.approx(1 / 3)


def test_no_gain_without_more_workers_or_without_waiting() -> None:
    assert expected_step_gain(0.5, 4, 4) == 0.0
    assert expected_step_gain(0.5, 4, 2) == 0.0
    assert expected_step_gain(0.0, 2, 8) == 0.0


def test_the_recommended_target_removes_the_wait() -> None:
    for share in SHARES[1:]:
        target = loader_workers_needed(share, 2, max_workers=1024)
        assert expected_step_gain(share, 2, target) == pytest.approx(share)


@pytest.mark.parametrize(
    ("share", "current", "new"),
    [(1.5, 2, 4), (-0.2, 2, 4), (float("nan"), 2, 4), (0.5, -3, 4), (0.5, 2, -1)],
)
def test_gain_rejects_bad_input(share: float, current: int, new: int) -> None:
    with pytest.raises(ValueError):
        expected_step_gain(share, current, new)
