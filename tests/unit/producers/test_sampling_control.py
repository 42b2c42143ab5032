"""Live sampling changes: the controller's setters, the value checks, and a running sampler."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from perfloop.exceptions import ConfigError
from perfloop.producers.adaptive import (
    SAMPLING_KEYS,
    AdaptiveController,
    SignalSpec,
    sampling_value,
)
from perfloop.producers.emitter import Emitter
from perfloop.producers.gpu import GPU_SIGNALS
from perfloop.producers.node_sampler import NodeSampler
from perfloop.settings import ProducerSettings
from perfloop.testing import FakeGpuBackend


class Collect:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        with self.lock:
            self.sent.append((topic, value))
        return True


def _sampler(**settings: Any) -> NodeSampler:
    base = {"publish_interval_ms": 50, "stats_interval_s": 60.0, "overhead_budget_pct": 100.0}
    em = Emitter(Collect(), job_id="j1", node="n0", producer_id="test")
    return NodeSampler(ProducerSettings(**(base | settings)), em, gpu_backend=FakeGpuBackend())


def _wait(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- the controller ---------------------------------------------------------------------------


def test_set_interval_moves_the_scheduled_read_and_starts_over() -> None:
    ctl = AdaptiveController([SignalSpec("host", 10.0, 100.0, adaptive=False)])
    ctl.observe("host", (), now=0.0)
    assert ctl.next_due_in(1.0) == pytest.approx(9.0)
    assert ctl.set_interval("host", 0.5, min_interval_s=0.5, max_interval_s=5.0) == 0.5
    assert ctl.due(1.0) == ["host"]  # it was read at 0: a 0.5 s interval is overdue
    ctl.observe("host", (), now=1.0)
    assert ctl.next_due_in(1.0) == pytest.approx(0.5)
    spec = ctl.specs["host"]
    assert (spec.min_interval_s, spec.max_interval_s, spec.start_interval_s) == (0.5, 5.0, 0.5)


def test_set_interval_keeps_a_raised_floor_and_the_budget_scale() -> None:
    ctl = AdaptiveController([SignalSpec("gpu.pcie", 0.01, 1.0)], budget_pct=0.5)
    ctl.set_min_interval("gpu.pcie", 0.5)  # a signal that is slow to read
    assert ctl.set_interval("gpu.pcie", 0.02) == 0.5  # not below its floor
    ctl.update_budget(50.0)  # far over budget: the scale stretches every interval
    assert ctl.scale > 1
    assert ctl.set_interval("gpu.pcie", 0.6, max_interval_s=10.0) == pytest.approx(
        min(10.0, 0.6 * ctl.scale)
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_set_interval_refuses_a_non_positive_interval(bad: float) -> None:
    ctl = AdaptiveController([SignalSpec("host", 1.0, 10.0)])
    with pytest.raises(ValueError, match="interval must be"):
        ctl.set_interval("host", bad)
    assert ctl.interval("host") == 1.0


def test_disabling_adaptation_returns_to_the_start_intervals() -> None:
    ctl = AdaptiveController([SignalSpec("temp", 0.1, 0.8, start_interval_s=0.2)])
    for t in range(6):
        ctl.observe("temp", [60.0], now=float(t))  # flat: grows towards the maximum
    ctl.update_budget(10.0)
    assert ctl.interval("temp") > 0.2 and ctl.scale > 1
    ctl.set_enabled(False)
    assert (ctl.interval("temp"), ctl.scale, ctl.over_budget) == (0.2, 1.0, False)
    ctl.observe("temp", [99.0], now=7.0)  # would move it, were adaptation on
    ctl.update_budget(10.0)
    assert ctl.interval("temp") == 0.2
    ctl.set_enabled(True)
    ctl.observe("temp", [10.0], now=8.0)  # it moved: down to the minimum
    assert ctl.interval("temp") == 0.1


def test_a_larger_budget_ends_the_backoff() -> None:
    ctl = AdaptiveController([SignalSpec("temp", 0.1, 10.0)], budget_pct=0.5, settle_s=100.0)
    ctl.update_budget(2.0, now=0.0)
    assert ctl.over_budget
    ctl.set_budget(5.0)
    ctl.update_budget(2.0, now=1.0)  # within settle_s, but under the new budget
    assert not ctl.over_budget and ctl.budget_pct == 5.0
    ctl.set_budget(0.1)
    scale = ctl.scale
    ctl.update_budget(2.0, now=2.0)  # a new budget is judged at once, not after settle_s
    assert ctl.over_budget and ctl.scale > scale
    with pytest.raises(ValueError):
        ctl.set_budget(0.0)


# -- value checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [-1, 0, 0.5, 1, 5, 9.999, 10, 10.5, 100, 1000, 60_000, 60_001, 600_000, 600_001]
)
@pytest.mark.parametrize("key", [k for k, f in SAMPLING_KEYS.items() if f != "adaptive_sampling"])
def test_numeric_values_are_accepted_exactly_when_the_settings_accept_them(
    key: str, value: float
) -> None:
    field = SAMPLING_KEYS[key]
    try:
        ProducerSettings(**{field: value})
        valid = True
    except ValidationError:
        valid = False
    if valid:
        assert sampling_value(key, value) == float(value)
    else:
        with pytest.raises(ConfigError, match=rf"^{key}={value!r} is outside [\[(]"):
            sampling_value(key, value)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("sampling.gpu_interval_ms", "fast", "must be a number"),
        ("sampling.gpu_interval_ms", True, "must be a number"),
        ("sampling.host_interval_ms", math.nan, "is outside"),
        ("sampling.adaptive", 1, "must be true or false"),
        ("sampling.adaptive", "yes", "must be true or false"),
        ("sampling.bogus", 1, "unknown sampling setting 'sampling.bogus'; valid: sampling."),
    ],
)
def test_bad_values_are_refused_in_one_line(key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as exc:
        sampling_value(key, value)
    assert "\n" not in str(exc.value)


# -- NodeSampler.configure --------------------------------------------------------------------


def test_configure_gpu_interval_with_fixed_sampling_sets_every_gpu_signal() -> None:
    s = _sampler(gpu_interval_ms=100, adaptive_sampling=False)
    assert s.configure("sampling.gpu_interval_ms", 40) == (100.0, 40.0)
    assert s.settings.gpu_interval_ms == 40.0
    assert {s.controller.interval(f"gpu.{n}") for n in GPU_SIGNALS} == {0.04}
    assert s.controller.interval("host") == s.settings.host_interval_ms / 1000


def test_configure_gpu_interval_slower_than_the_maximum_widens_it() -> None:
    s = _sampler(gpu_interval_ms=100, gpu_max_interval_ms=1000)
    s.configure("sampling.gpu_interval_ms", 5000)
    spec = s.controller.specs["gpu.power"]
    assert (spec.start_interval_s, spec.max_interval_s) == (5.0, 5.0)
    s.configure("sampling.gpu_interval_ms", 200)  # as a restart would: back to the maximum
    spec = s.controller.specs["gpu.power"]
    assert (spec.start_interval_s, spec.max_interval_s) == (0.2, 1.0)


def test_configure_adaptive_and_budget() -> None:
    s = _sampler(adaptive_sampling=True, overhead_budget_pct=0.5)
    assert s.configure("sampling.adaptive", False) == (True, False)
    assert not s.controller.enabled and not s.settings.adaptive_sampling
    assert s.configure("sampling.overhead_budget_pct", 2.5) == (0.5, 2.5)
    assert s.controller.budget_pct == 2.5


@pytest.mark.parametrize(
    ("key", "value"),
    [("sampling.host_interval_ms", 1), ("sampling.gpu_rate", 5), ("sampling.adaptive", "no")],
)
def test_a_refused_change_changes_nothing(key: str, value: Any) -> None:
    s = _sampler()
    settings, intervals = s.settings, s.controller.intervals()
    specs = dict(s.controller.specs)
    with pytest.raises(ConfigError):
        s.configure(key, value)
    assert s.settings is settings
    assert s.controller.intervals() == intervals and s.controller.specs == specs


def test_a_running_sampler_follows_a_new_host_interval() -> None:
    s = _sampler(host_interval_ms=60_000, adaptive_sampling=False)
    s.start()
    try:
        _wait(lambda: s.host_samples >= 1, 10, "the first host sample")
        time.sleep(0.6)  # longer than the loop's longest wait: nothing more is due
        assert s.host_samples == 1
        s.configure("sampling.host_interval_ms", 20)
        _wait(lambda: s.host_samples >= 6, 10, "host samples at the new interval")
        s.configure("sampling.host_interval_ms", 60_000)
        time.sleep(0.6)  # a read already due may still land
        n = s.host_samples
        time.sleep(0.6)
        assert s.host_samples == n
    finally:
        s.stop()
    assert s.controller.rates_hz()["host"] == pytest.approx(1 / 60)


def test_configure_from_many_threads_while_sampling() -> None:
    s = _sampler(gpu_interval_ms=20, host_interval_ms=50)
    s.start()
    errors: list[BaseException] = []

    def change(ms: int) -> None:
        try:
            for _ in range(20):
                s.configure("sampling.gpu_interval_ms", ms)
                s.configure("sampling.host_interval_ms", ms)
        except BaseException as e:  # collected: asserted below
            errors.append(e)

    threads = [threading.Thread(target=change, args=(ms,)) for ms in (20, 30, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.stop()
    assert errors == []
    final = s.settings.host_interval_ms
    assert final in (20.0, 30.0, 40.0)
    assert s.controller.interval("host") == pytest.approx(final / 1000)
