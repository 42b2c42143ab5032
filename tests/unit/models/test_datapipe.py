"""The data-pipeline model: how many loader workers hide loading, and what that saves."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.models.datapipe import pipeline_requirement

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


def test_a_loop_without_workers_waits_for_the_whole_load() -> None:
    """With no workers the main process loads between computes: one worker running beside
    it hides a load shorter than the compute, and the gain is the whole wait."""
    assert loader_workers_needed(0.4, 0, max_workers=16) == 1
    assert loader_workers_needed(0.6, 0, max_workers=16) == math.ceil(0.6 / 0.4 * 1.25)
    assert expected_step_gain(0.4, 0, 1) == pytest.approx(0.4)
    # load 0.6 over 1 worker > compute 0.4: the worker sets the pace
    assert expected_step_gain(0.6, 0, 1) == pytest.approx(0.4)
    assert expected_step_gain(0.6, 0, 2) == pytest.approx(0.6)


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


def _simulated_batches_per_s(
    workers: int, load_s: float, compute_s: float, *, prefetch: int = 2, cv: float = 0.0
) -> float:
    """A discrete-event loader: each worker makes batches one after another (load time
    ``load_s``, lognormal with coefficient of variation ``cv``) and holds at most ``prefetch``
    ready ones; the device takes the oldest ready batch, computes for ``compute_s``. With no
    workers the loop loads each batch itself. Returns batches/s over 2,000 batches."""
    rng = np.random.default_rng(0)
    sigma = math.sqrt(math.log(1 + cv * cv))

    def load() -> float:
        return load_s * float(rng.lognormal(-sigma * sigma / 2, sigma)) if cv else load_s

    n = 2000
    if workers == 0:
        return n / sum(load() + compute_s for _ in range(n))
    ready: list[tuple[float, int]] = []  # (time a batch is ready, worker)
    busy_until = [0.0] * workers
    held = [0] * workers
    for w in range(workers):
        for _ in range(prefetch):
            busy_until[w] += load()
            ready.append((busy_until[w], w))
            held[w] += 1
    t = 0.0
    for _ in range(n):
        ready.sort()
        at, w = ready.pop(0)
        held[w] -= 1
        t = max(t, at) + compute_s
        start = max(busy_until[w], at)  # the worker had a free slot from `at` on
        busy_until[w] = start + load()
        ready.append((busy_until[w], w))
        held[w] += 1
    return n / t


@pytest.mark.parametrize(
    ("batch", "compute", "load", "workers"),
    [(64, 0.05, 0.2, 2), (32, 0.02, 0.3, 0), (128, 0.1, 0.15, 4), (16, 0.01, 0.09, 1)],
)
def test_the_workers_needed_keep_a_simulated_device_fed(
    batch: int, compute: float, load: float, workers: int
) -> None:
    r = pipeline_requirement(batch, compute_s=compute, load_s=load, workers=workers)
    assert r.device_samples_per_s == pytest.approx(batch / compute)
    now = _simulated_batches_per_s(workers, load, compute)
    supplied = min(r.loader_samples_per_s, r.device_samples_per_s)
    assert supplied == pytest.approx(now * batch, rel=0.01)
    fed = _simulated_batches_per_s(r.workers_needed, load, compute)
    assert fed == pytest.approx(1 / compute, rel=0.01), "the device never waits"
    bare = math.ceil(load / compute)  # workers that just keep up, without headroom
    assert r.workers_needed >= bare
    short = _simulated_batches_per_s(bare - 1, load, compute)
    assert short < 0.99 / compute, "one fewer than that leaves it waiting"
    assert r.expected_speedup == pytest.approx(fed / now, rel=0.02)


def test_prefetch_absorbs_jittery_loads() -> None:
    # load times with cv 0.5: the prefetch depth it asks for keeps the device fed far better
    # than one batch per worker would
    r = pipeline_requirement(64, compute_s=0.05, load_s=0.2, workers=2, load_cv=0.5)
    deep = _simulated_batches_per_s(r.workers_needed, 0.2, 0.05, prefetch=r.prefetch_factor, cv=0.5)
    shallow = _simulated_batches_per_s(r.workers_needed, 0.2, 0.05, prefetch=1, cv=0.5)
    assert r.prefetch_factor >= 2
    assert deep > shallow
    assert deep >= 0.97 / 0.05


def test_pipeline_requirement_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="compute_s must be finite and > 0"):
        pipeline_requirement(8, compute_s=0.0, load_s=0.1, workers=1)
    with pytest.raises(ValueError, match="load_s must be finite"):
        pipeline_requirement(8, compute_s=0.1, load_s=math.nan, workers=1)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        pipeline_requirement(0, compute_s=0.1, load_s=0.1, workers=1)
