"""Adaptive sampling: the controller's invariants (hypothesis) and the overhead meter."""

from __future__ import annotations

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.producers.adaptive import AdaptiveController, OverheadMeter, SignalSpec


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@st.composite
def specs(draw: st.DrawFn) -> SignalSpec:
    lo = draw(st.floats(0.001, 1.0))
    hi = lo * draw(st.floats(1.0, 200.0))
    start = draw(st.one_of(st.none(), st.floats(lo, hi)))
    return SignalSpec(
        "s",
        lo,
        hi,
        start,
        rel_tol=draw(st.floats(0.0, 0.2)),
        abs_tol=draw(st.floats(0.0, 5.0)),
        counter=draw(st.booleans()),
    )


values = st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=3)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("observe"), values),
        st.tuples(st.just("budget"), st.floats(0.0, 50.0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(spec=specs(), ops=ops, budget=st.floats(0.05, 5.0))
def test_intervals_stay_within_min_and_max(spec: SignalSpec, ops: list, budget: float) -> None:
    ctl = AdaptiveController([spec], budget_pct=budget)
    now = 0.0
    for op, arg in ops:
        if op == "observe":
            now += ctl.interval("s")
            ctl.observe("s", arg, now)
        else:
            ctl.update_budget(arg)
        assert spec.min_interval_s <= ctl.interval("s") <= spec.max_interval_s
        assert ctl.rates_hz()["s"] == pytest.approx(1.0 / ctl.interval("s"))


@settings(max_examples=150, deadline=None)
@given(
    spec=specs(),
    warmup=st.lists(values, max_size=10),
    over=st.lists(
        st.one_of(values.map(lambda v: ("observe", v)), st.floats(0.6, 50.0)), max_size=40
    ),
)
def test_over_budget_intervals_never_shrink(spec: SignalSpec, warmup: list, over: list) -> None:
    ctl = AdaptiveController([spec], budget_pct=0.5)
    now = 0.0
    for v in warmup:
        now += 1.0
        ctl.observe("s", v, now)
    ctl.update_budget(1.0)  # over budget from here on
    before = ctl.interval("s")
    for op in over:
        if isinstance(op, tuple):
            now += ctl.interval("s")
            ctl.observe("s", op[1], now)  # even a signal that jumps
        else:
            ctl.update_budget(op)
        assert ctl.over_budget
        assert ctl.interval("s") >= before
        before = ctl.interval("s")


@settings(max_examples=150, deadline=None)
@given(spec=specs(), value=st.floats(-1e6, 1e6), devices=st.integers(1, 4))
def test_constant_signal_grows_to_max(spec: SignalSpec, value: float, devices: int) -> None:
    ctl = AdaptiveController([spec], budget_pct=0.5, growth=1.5)
    start = spec.start_interval_s or spec.min_interval_s
    reads = math.ceil(math.log(spec.max_interval_s / start) / math.log(1.5)) + 3
    now = 0.0
    seen = []
    for _ in range(reads):
        now += ctl.interval("s")
        ctl.observe("s", [value] * devices, now)
        seen.append(ctl.interval("s"))
    assert seen == sorted(seen)  # never speeds up
    assert ctl.interval("s") == pytest.approx(spec.max_interval_s)


@settings(max_examples=150, deadline=None)
@given(
    lo=st.floats(0.001, 0.5),
    ratio=st.floats(2.0, 100.0),
    level=st.floats(1.0, 1e4),
    jump=st.floats(0.5, 10.0),
)
def test_step_change_returns_to_min_at_the_next_read(
    lo: float, ratio: float, level: float, jump: float
) -> None:
    spec = SignalSpec("s", lo, lo * ratio, rel_tol=0.02, abs_tol=0.1)
    ctl = AdaptiveController([spec], budget_pct=0.5)
    now = 0.0
    for _ in range(40):  # flat: slows down to the maximum
        now += ctl.interval("s")
        ctl.observe("s", [level], now)
    assert ctl.interval("s") == pytest.approx(spec.max_interval_s)
    now += ctl.interval("s")
    ctl.observe("s", [level * (1 + jump)], now)  # a step of 50 % or more
    assert ctl.interval("s") == pytest.approx(spec.min_interval_s)
    assert ctl.due(now + spec.min_interval_s) == ["s"]


def test_budget_scales_intervals_up_and_relaxes_back() -> None:
    spec = SignalSpec("s", 0.01, 1.0)
    ctl = AdaptiveController([spec], budget_pct=0.5, backoff=2.0, relax=2.0)
    ctl.observe("s", [1.0], 0.0)
    ctl.observe("s", [100.0], 0.01)  # moving: at the minimum
    assert ctl.interval("s") == pytest.approx(0.01)
    ctl.update_budget(0.6)  # aiming at 70 % of the budget asks for x1.7; at least x2
    ctl.update_budget(0.6)
    assert ctl.over_budget and ctl.scale == pytest.approx(4.0)
    assert ctl.interval("s") == pytest.approx(0.04)  # stretched at once
    ctl.observe("s", [1.0], 0.05)  # still moving, but over budget: not faster
    assert ctl.interval("s") >= 0.04
    ctl.update_budget(0.4)  # under budget, above half of it: hold
    assert ctl.scale == pytest.approx(4.0)
    ctl.update_budget(0.1)
    ctl.update_budget(0.1)
    assert ctl.scale == pytest.approx(1.0)
    ctl.observe("s", [500.0], 0.1)
    assert ctl.interval("s") == pytest.approx(0.01)


def test_saturated_when_max_intervals_still_cost_too_much() -> None:
    ctl = AdaptiveController([SignalSpec("s", 0.1, 0.4)], budget_pct=0.5)
    for _ in range(10):
        ctl.update_budget(5.0)
    assert ctl.interval("s") == pytest.approx(0.4) and ctl.saturated
    ctl.update_budget(0.1)
    assert not ctl.saturated


def test_counter_signals_are_judged_on_their_rate() -> None:
    spec = SignalSpec("energy", 0.1, 10.0, counter=True, rel_tol=0.05)
    ctl = AdaptiveController([spec])
    t, v = 0.0, 0.0
    for _ in range(20):  # a steady 300 J/s: the counter grows, its rate is flat
        t += ctl.interval("energy")
        v += 300.0 * ctl.interval("energy")
        ctl.observe("energy", [v], t)
    assert ctl.interval("energy") == pytest.approx(10.0)
    t += 10.0
    v += 900.0 * 10.0  # power triples
    ctl.observe("energy", [v], t)
    assert ctl.interval("energy") == pytest.approx(0.1)


def test_disabled_controller_keeps_start_intervals() -> None:
    spec = SignalSpec("s", 0.01, 1.0, start_interval_s=0.1)
    ctl = AdaptiveController([spec], enabled=False)
    for i in range(10):
        ctl.observe("s", [float(i % 2) * 100], float(i))
        ctl.update_budget(50.0)
    assert ctl.interval("s") == 0.1 and ctl.scale == 1.0


def test_non_adaptive_signal_only_stretches_under_budget() -> None:
    host = SignalSpec("host", 1.0, 10.0, adaptive=False)
    ctl = AdaptiveController([host], budget_pct=0.5)
    for i in range(10):
        ctl.observe("host", [], float(i))
    assert ctl.interval("host") == 1.0
    ctl.update_budget(0.5 * 0.7 * 1.2)  # 20 % over the aim (but under budget): hold
    assert ctl.interval("host") == 1.0
    ctl.update_budget(0.6)  # over budget: aim at 70 % of it, x1.71
    assert ctl.interval("host") == pytest.approx(0.6 / 0.35)
    ctl.update_budget(1.4)  # 4x the aim: one bigger step
    assert ctl.interval("host") == pytest.approx(0.6 / 0.35 * 4.0)


def test_due_and_next_due_in() -> None:
    ctl = AdaptiveController([SignalSpec("a", 0.1, 1.0), SignalSpec("b", 0.5, 1.0)])
    assert ctl.due(0.0) == ["a", "b"]  # everything is due at first
    ctl.observe("a", [1.0], 0.0)
    ctl.observe("b", [1.0], 0.0)
    assert ctl.due(0.05) == []
    assert ctl.next_due_in(0.05) == pytest.approx(0.05)
    assert ctl.next_due_in(0.05, ["b"]) == pytest.approx(0.45)
    assert ctl.due(0.2, ["a"]) == ["a"]


def test_set_min_interval_raises_the_floor() -> None:
    ctl = AdaptiveController([SignalSpec("pcie", 0.01, 0.5)])
    ctl.set_min_interval("pcie", 1.0)
    assert ctl.specs["pcie"].max_interval_s == 1.0 and ctl.interval("pcie") == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [{"growth": 0.5}, {"backoff": 1.0}, {"alpha": 0.0}, {"budget_pct": 0.0}, {"target": 1.5}],
)
def test_controller_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="need"):
        AdaptiveController([SignalSpec("s", 0.1, 1.0)], **kwargs)


def test_spec_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="min_interval_s <= max_interval_s"):
        SignalSpec("s", 1.0, 0.5)
    with pytest.raises(ValueError, match="outside"):
        SignalSpec("s", 0.1, 0.5, start_interval_s=2.0)


# -- OverheadMeter -----------------------------------------------------------------------------


def test_meter_uses_wall_time_without_steps() -> None:
    clock = Clock()
    m = OverheadMeter(window_s=10.0, clock=clock)
    clock.t = 4.0
    m.charge(0.02)
    clock.t = 10.0
    assert m.overhead_pct() == pytest.approx(0.2)  # 20 ms over 10 s
    assert m.total_s == pytest.approx(0.02)


def test_meter_uses_step_time_when_steps_are_recorded() -> None:
    clock = Clock()
    m = OverheadMeter(window_s=10.0, clock=clock)
    for _ in range(10):
        clock.t += 0.5
        m.record_step(0.1)  # 1 s of steps in 5 s of wall time (the job was mostly idle)
        m.charge(0.001)
    assert m.overhead_pct() == pytest.approx(1.0)  # 10 ms over 1 s of steps


def test_meter_forgets_cost_outside_the_window() -> None:
    clock = Clock()
    m = OverheadMeter(window_s=10.0, clock=clock)
    m.charge(1.0)
    clock.t = 5.0
    assert m.overhead_pct() == pytest.approx(20.0)
    clock.t = 30.0
    assert m.overhead_pct() == 0.0
    assert m.total_s == pytest.approx(1.0)  # the total is cumulative


def test_meter_ignores_bad_charges() -> None:
    m = OverheadMeter()
    for bad in (-1.0, math.nan, math.inf, 0.0):
        m.charge(bad)
        m.record_step(bad)
    assert m.total_s == 0.0


def test_meter_context_managers_charge_their_block() -> None:
    m = OverheadMeter()
    with m.cpu():
        sum(i * i for i in range(200_000))  # burns CPU time in this thread
    cpu = m.total_s
    assert cpu > 0
    with m.timed():
        threading.Event().wait(0.02)  # wall time, no CPU
    assert m.total_s - cpu >= 0.015


def test_meter_is_thread_safe() -> None:
    m = OverheadMeter()

    def charge() -> None:
        for _ in range(10_000):
            m.charge(1e-6)

    threads = [threading.Thread(target=charge) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.total_s == pytest.approx(0.04)


def test_settle_limits_scale_changes_to_one_per_period() -> None:
    ctl = AdaptiveController([SignalSpec("s", 0.01, 1.0)], backoff=2.0, settle_s=1.0)
    for t in (0.0, 0.25, 0.5, 0.75):  # the same lagging measurement, four times
        ctl.update_budget(0.6, now=t)
    assert ctl.scale == 2.0 and ctl.over_budget
    ctl.update_budget(0.6, now=1.0)
    assert ctl.scale == 4.0
    ctl.update_budget(0.1, now=1.5)  # too soon to relax
    assert ctl.scale == 4.0 and not ctl.over_budget
    ctl.update_budget(0.1, now=2.0)
    assert ctl.scale == pytest.approx(4.0 / 1.25)


def test_meter_short_window_sees_only_recent_cost() -> None:
    clock = Clock()
    m = OverheadMeter(window_s=10.0, clock=clock)
    m.charge(0.5)  # an old burst
    clock.t = 8.0
    m.charge(0.01)
    clock.t = 10.0
    assert m.overhead_pct(2.0) == pytest.approx(0.5, rel=0.2)  # 10 ms over ~2 s
    assert m.overhead_pct() == pytest.approx(5.1)  # 510 ms over 10 s
