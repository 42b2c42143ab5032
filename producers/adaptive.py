"""Adaptive sampling inside an overhead budget: `OverheadMeter` and `AdaptiveController`.

**OverheadMeter** accounts the producer's own cost against the job's time. Sampler threads
wrap each round in ``meter.cpu()`` (their CPU time, `time.thread_time`); training hooks wrap
their work in ``meter.timed()`` (wall time lost by the training thread) or call
``meter.charge(seconds)`` with a duration they measured themselves; a hook that knows the step
time calls ``meter.record_step(step_time_s)``. ``overhead_pct()`` is the cost charged over the
last ``window_s`` as a share of the job's step time in that window (the sum of recorded steps),
or of wall time when no step was recorded. Every method is thread-safe and cheap (a lock and a
clock read); none raises into the caller::

    meter = OverheadMeter()
    with meter.timed():              # in a training hook
        emitter.add("step", ...)
    meter.record_step(0.120)         # the step took 120 ms
    stats.overhead_pct = meter.overhead_pct()

**AdaptiveController** sets one sampling interval per signal (`SignalSpec`). Each time a
signal is read, ``observe(name, values, now)`` compares every value with its exponentially
weighted mean: a value outside the tolerance band (``abs_tol + rel_tol·|mean|``) means the
signal moves, and its interval drops to the minimum at once; a signal that stays inside the
band is flat, and its interval grows by ``growth`` each read, up to the maximum. A noisy signal
(high variance) keeps landing outside the band and stays fast; a steady one slows down.
Counters (``counter=True``) are judged on their rate.

``update_budget(overhead_pct)`` (the meter's figure) multiplies every interval by one scale.
Over budget, the scale grows in proportion to aim at ``target`` (70 %) of the budget — by at
least ``backoff``, at most 10× a step — and no interval shrinks until overhead is back under
budget. Under half the budget, the scale shrinks the same way (by at most ``relax`` a step)
back towards 1; in between it holds. With ``settle_s``, the scale changes at most once per
``settle_s`` (set it to the measurement's window, so that a lagging figure does not wind the
scale up). Intervals always stay within
``[min_interval_s, max_interval_s]``: when even the maximum intervals cost more than the
budget, the controller says so (``saturated``) and does not go slower than the maximum.

**Live changes.** ``set_interval``, ``set_enabled`` and ``set_budget`` change a running
controller from any thread (a control message, `NodeSampler.configure`); the next read of a
signal follows its new interval. `SAMPLING_KEYS` names the sampling settings that may be
changed live and `sampling_value` checks a new value against the bounds of its
`ProducerSettings` field.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import annotated_types

from perfloop.exceptions import ConfigError
from perfloop.settings import ProducerSettings

__all__ = [
    "SAMPLING_KEYS",
    "AdaptiveController",
    "OverheadMeter",
    "SignalSpec",
    "sampling_value",
]

SAMPLING_KEYS: dict[str, str] = {
    "sampling.gpu_interval_ms": "gpu_interval_ms",
    "sampling.host_interval_ms": "host_interval_ms",
    "sampling.adaptive": "adaptive_sampling",
    "sampling.overhead_budget_pct": "overhead_budget_pct",
}
"""Sampling settings a `ConfigChange` (target "producers") may change live → the
`ProducerSettings` field each one sets."""


def sampling_value(key: str, value: Any) -> float | bool:
    """``value`` checked for the live sampling setting ``key``: a bool for
    ``sampling.adaptive``, else a finite number within the bounds of its `ProducerSettings`
    field (as float). Raises `ConfigError` naming the bad key or value and the valid ones.

    >>> sampling_value("sampling.gpu_interval_ms", 50)
    50.0
    >>> sampling_value("sampling.gpu_interval_ms", 5)
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: sampling.gpu_interval_ms=5 is outside [10, 60000]
    """
    name = SAMPLING_KEYS.get(key)
    if name is None:
        raise ConfigError(f"unknown sampling setting {key!r}; valid: {', '.join(SAMPLING_KEYS)}")
    info = ProducerSettings.model_fields[name]
    if info.annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={value!r} must be a number")
    v = float(value)
    lo, lo_open, hi, hi_open = -math.inf, False, math.inf, False
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            lo = float(meta.ge)  # type: ignore[arg-type]
        elif isinstance(meta, annotated_types.Gt):
            lo, lo_open = float(meta.gt), True  # type: ignore[arg-type]
        elif isinstance(meta, annotated_types.Le):
            hi = float(meta.le)  # type: ignore[arg-type]
        elif isinstance(meta, annotated_types.Lt):
            hi, hi_open = float(meta.lt), True  # type: ignore[arg-type]
    inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not (math.isfinite(v) and inside):
        raise ConfigError(
            f"{key}={value!r} is outside {'(' if lo_open else '['}{lo:g}, {hi:g}"
            f"{')' if hi_open else ']'}"
        )
    return v


class OverheadMeter:
    """The producer's cost (CPU time of its threads, time spent in hooks) against the job's time.

    >>> clock = iter([0.0, 0.0, 10.0, 10.0]).__next__
    >>> m = OverheadMeter(window_s=10.0, clock=clock)
    >>> m.charge(0.05)                    # 50 ms of producer time at t=0
    >>> round(m.overhead_pct(), 3)        # over 10 s of wall time
    0.5
    >>> round(m.total_s, 3)
    0.05
    """

    def __init__(
        self,
        window_s: float = 10.0,
        *,
        buckets: int = 40,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError(f"window_s must be > 0 and buckets >= 1, got {window_s}, {buckets}")
        self.window_s = window_s
        self._bucket_s = window_s / buckets
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        # [bucket start, charged seconds, step seconds]
        self._buckets: deque[list[float]] = deque([[self._start, 0.0, 0.0]], maxlen=buckets + 1)
        self.total_s = 0.0
        """Everything charged since the meter was made, in seconds."""

    def _roll(self, now: float) -> list[float]:
        cur = self._buckets[-1]
        if now - cur[0] >= self._bucket_s:
            start = cur[0] + self._bucket_s * math.floor((now - cur[0]) / self._bucket_s)
            cur = [start, 0.0, 0.0]
            self._buckets.append(cur)
            while self._buckets and now - self._buckets[0][0] > self.window_s + self._bucket_s:
                self._buckets.popleft()
        return cur

    def charge(self, seconds: float) -> None:
        """Account ``seconds`` of producer cost now (negative or non-finite values are ignored)."""
        if not seconds > 0 or seconds == math.inf:
            return
        now = self._clock()
        with self._lock:
            self._roll(now)[1] += seconds
            self.total_s += seconds

    def record_step(self, step_time_s: float) -> None:
        """Tell the meter one training step took ``step_time_s`` (the budget's denominator)."""
        if not step_time_s > 0 or step_time_s == math.inf:
            return
        now = self._clock()
        with self._lock:
            self._roll(now)[2] += step_time_s

    @contextmanager
    def cpu(self) -> Iterator[None]:
        """Charge the CPU time the current thread spends in the block (sampler threads)."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.charge(time.thread_time() - t0)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Charge the wall time spent in the block (hooks running in the training thread)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.charge(time.perf_counter() - t0)

    def overhead_pct(self, window_s: float | None = None) -> float:
        """Producer cost over the last ``window_s`` (default: the meter's window, at most that)
        as a percentage of step time, or of wall time when no step was recorded."""
        now = self._clock()
        window = self.window_s if window_s is None else min(window_s, self.window_s)
        with self._lock:
            self._roll(now)
            live = [b for b in self._buckets if now - b[0] <= window]
            if not live:
                return 0.0
            charged = sum(b[1] for b in live)
            steps = sum(b[2] for b in live)
            wall = max(now - live[0][0], self._bucket_s)
        denominator = steps if steps > 0 else wall
        return 100.0 * charged / denominator


@dataclass(frozen=True)
class SignalSpec:
    """How one signal may be sampled.

    ``start_interval_s`` is where it begins (``min_interval_s`` when ``None``); ``rel_tol`` and
    ``abs_tol`` are the band inside which a value counts as unchanged; ``counter`` judges a
    cumulative counter by its rate; ``adaptive=False`` keeps the start interval (only the
    overhead budget stretches it).

    >>> SignalSpec("power", 0.01, 1.0).rel_tol
    0.02
    """

    name: str
    min_interval_s: float
    max_interval_s: float
    start_interval_s: float | None = None
    rel_tol: float = 0.02
    abs_tol: float = 0.0
    counter: bool = False
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.min_interval_s <= self.max_interval_s < math.inf:
            raise ValueError(
                f"signal {self.name!r}: need 0 < min_interval_s <= max_interval_s, got "
                f"{self.min_interval_s}, {self.max_interval_s}"
            )
        s = self.start_interval_s
        if s is not None and not self.min_interval_s <= s <= self.max_interval_s:
            raise ValueError(
                f"signal {self.name!r}: start_interval_s {s} is outside "
                f"[{self.min_interval_s}, {self.max_interval_s}]"
            )
        if self.rel_tol < 0 or self.abs_tol < 0:
            raise ValueError(f"signal {self.name!r}: tolerances must be >= 0")


class _State:
    __slots__ = ("base", "interval", "means", "next_t", "prev", "prev_t", "reads")

    def __init__(self, start: float) -> None:
        self.base = start  # the interval variance alone asks for
        self.interval = start  # what is used: base x budget scale, clamped
        self.means: list[float] = []
        self.prev: list[float] = []
        self.prev_t: float | None = None
        self.next_t = -math.inf  # due at once
        self.reads = 0


class AdaptiveController:
    """Per-signal sampling intervals from observed variance, within an overhead budget.

    >>> ctl = AdaptiveController([SignalSpec("temp", 0.1, 0.8)], budget_pct=0.5)
    >>> for t in range(7):
    ...     ctl.observe("temp", [60.0], now=float(t))
    >>> ctl.interval("temp")          # flat: grew to the maximum
    0.8
    >>> ctl.observe("temp", [85.0], now=7.0)
    >>> ctl.interval("temp")          # it moved: back to the minimum at once
    0.1
    >>> ctl.update_budget(2.0)        # 2 % overhead against a 0.5 % budget
    >>> ctl.observe("temp", [60.0], now=8.0); ctl.interval("temp") > 0.1
    True
    """

    def __init__(
        self,
        specs: Sequence[SignalSpec],
        *,
        budget_pct: float = 0.5,
        enabled: bool = True,
        growth: float = 1.5,
        alpha: float = 0.3,
        backoff: float = 1.5,
        relax: float = 1.25,
        settle_s: float = 0.0,
        target: float = 0.7,
    ) -> None:
        if (
            growth < 1
            or backoff <= 1
            or relax <= 1
            or not 0 < alpha <= 1
            or budget_pct <= 0
            or not 0 < target <= 1
        ):
            raise ValueError(
                "need growth >= 1, backoff > 1, relax > 1, 0 < alpha <= 1, budget_pct > 0 "
                "and 0 < target <= 1"
            )
        self.specs = {s.name: s for s in specs}
        if len(self.specs) != len(specs):
            raise ValueError("signal names must be unique")
        self.budget_pct = budget_pct
        self.enabled = enabled
        self.growth, self.alpha, self.backoff, self.relax = growth, alpha, backoff, relax
        self.settle_s = settle_s
        self.target = target
        self._aim = target * budget_pct
        self._changed_at = -math.inf
        self.scale = 1.0
        self.over_budget = False
        self.saturated = False
        """True when every interval is at its maximum and overhead is still over budget."""
        self._max_scale = max(s.max_interval_s / s.min_interval_s for s in specs) if specs else 1.0
        self._lock = threading.Lock()
        self._state = {
            s.name: _State(
                s.start_interval_s if s.start_interval_s is not None else s.min_interval_s
            )
            for s in specs
        }

    def interval(self, name: str) -> float:
        """The interval in seconds ``name`` is sampled at now."""
        return self._state[name].interval

    def intervals(self) -> dict[str, float]:
        return {n: st.interval for n, st in self._state.items()}

    def rates_hz(self) -> dict[str, float]:
        """Sampling rate per signal, in Hz (what `ProducerStats.rates_hz` carries)."""
        return {n: 1.0 / st.interval for n, st in self._state.items()}

    def due(self, now: float, names: Iterable[str] | None = None) -> list[str]:
        """Signals (among ``names``, default all) whose next read is due at ``now``."""
        names = self._state if names is None else names
        return [n for n in names if self._state[n].next_t <= now]

    def next_due_in(self, now: float, names: Iterable[str] | None = None) -> float:
        """Seconds from ``now`` until one of ``names`` (default all) is due; 0 if one is."""
        names = self._state if names is None else names
        return max(0.0, min((self._state[n].next_t for n in names), default=math.inf) - now)

    def set_min_interval(self, name: str, seconds: float) -> None:
        """Raise the floor of ``name`` (a signal that is costly to read); its max follows."""
        with self._lock:
            spec = self.specs[name]
            lo = max(spec.min_interval_s, seconds)
            hi = max(spec.max_interval_s, lo)
            start = spec.start_interval_s
            start = None if start is None else min(hi, max(lo, start))
            self.specs[name] = replace(
                spec, min_interval_s=lo, max_interval_s=hi, start_interval_s=start
            )
            st = self._state[name]
            st.base = min(hi, max(lo, st.base))
            st.interval = min(hi, max(lo, st.interval))
            self._max_scale = max(s.max_interval_s / s.min_interval_s for s in self.specs.values())

    def set_interval(
        self,
        name: str,
        seconds: float,
        *,
        min_interval_s: float | None = None,
        max_interval_s: float | None = None,
    ) -> float:
        """Start ``name`` over at ``seconds`` (thread-safe); return the interval now in use.

        The signal's start interval becomes ``seconds`` (within its bounds; ``min_interval_s``
        and ``max_interval_s`` replace them when given, the maximum never below the minimum);
        its variance history is kept, the budget scale still applies, and the read already
        scheduled moves by the difference (a shorter interval is due sooner).

        >>> ctl = AdaptiveController([SignalSpec("host", 1.0, 10.0, adaptive=False)])
        >>> ctl.set_interval("host", 0.2, min_interval_s=0.2, max_interval_s=2.0)
        0.2
        """
        if not (0 < seconds < math.inf):
            raise ValueError(f"signal {name!r}: interval must be > 0 and finite, got {seconds}")
        with self._lock:
            spec = self.specs[name]
            lo = spec.min_interval_s if min_interval_s is None else min_interval_s
            hi = max(lo, spec.max_interval_s if max_interval_s is None else max_interval_s)
            start = min(hi, max(lo, seconds))
            spec = replace(spec, min_interval_s=lo, max_interval_s=hi, start_interval_s=start)
            self.specs[name] = spec  # validated by SignalSpec
            st = self._state[name]
            old = st.interval
            st.base = start
            st.interval = min(hi, max(lo, start * self.scale)) if self.enabled else start
            if math.isfinite(st.next_t):
                st.next_t += st.interval - old
            self._max_scale = max(s.max_interval_s / s.min_interval_s for s in self.specs.values())
            return st.interval

    def set_enabled(self, enabled: bool) -> None:
        """Turn adaptation on or off live; off, every signal returns to its start interval."""
        with self._lock:
            self.enabled = enabled
            if enabled:
                return
            self.scale, self.over_budget, self.saturated = 1.0, False, False
            for name, st in self._state.items():
                spec = self.specs[name]
                start = (
                    spec.min_interval_s if spec.start_interval_s is None else spec.start_interval_s
                )
                old = st.interval
                st.base = st.interval = start
                if math.isfinite(st.next_t):
                    st.next_t += start - old

    def set_budget(self, budget_pct: float) -> None:
        """Change the overhead budget live; the next `update_budget` reacts to it at once."""
        if not (0 < budget_pct < math.inf):
            raise ValueError(f"budget_pct must be > 0 and finite, got {budget_pct}")
        with self._lock:
            self.budget_pct = budget_pct
            self._aim = self.target * budget_pct
            self._changed_at = -math.inf

    def _moved(
        self, spec: SignalSpec, st: _State, values: Sequence[float], now: float
    ) -> bool | None:
        """Whether the signal moved; ``None`` when there is nothing to compare with yet."""
        xs = [float(v) for v in values]
        if spec.counter:
            raw, prev, prev_t = xs, st.prev, st.prev_t
            st.prev, st.prev_t = raw, now
            if prev_t is None or len(prev) != len(raw) or now <= prev_t:
                st.means = []
                return None
            xs = [(a - b) / (now - prev_t) for a, b in zip(raw, prev, strict=True)]
        if len(st.means) != len(xs):  # first read, or the set of devices changed
            st.means = xs
            return None
        moved = False
        for i, x in enumerate(xs):
            m = st.means[i]
            if not math.isfinite(x):
                continue
            if abs(x - m) > spec.abs_tol + spec.rel_tol * abs(m):
                moved = True
            st.means[i] = m + self.alpha * (x - m)
        return moved

    def observe(self, name: str, values: Sequence[float], now: float) -> None:
        """Record one read of ``name`` (one value per device or field) taken at ``now``."""
        with self._lock:
            spec = self.specs[name]
            st = self._state[name]
            st.reads += 1
            if self.enabled:
                moved = self._moved(spec, st, values, now)
                if spec.adaptive and moved is not None:
                    st.base = (
                        spec.min_interval_s
                        if moved
                        else min(spec.max_interval_s, st.base * self.growth)
                    )
                new = min(spec.max_interval_s, max(spec.min_interval_s, st.base * self.scale))
                if self.over_budget:
                    new = max(new, st.interval)
                st.interval = new
            st.next_t = now + st.interval

    def skip(self, name: str, now: float) -> None:
        """Reschedule ``name`` without a reading (it could not be read this time)."""
        with self._lock:
            self._state[name].next_t = now + self._state[name].interval

    def update_budget(self, overhead_pct: float, now: float | None = None) -> None:
        """Feed the measured overhead; scale intervals so it stays within ``budget_pct``.

        With ``settle_s`` > 0 and ``now`` given, the scale changes at most once per
        ``settle_s``: the measurement lags, and reacting to every reading of the same
        overhead would slow sampling down far more than needed.
        """
        if not self.enabled or not math.isfinite(overhead_pct):
            return
        with self._lock:
            settled = now is None or now - self._changed_at >= self.settle_s
            if overhead_pct > self.budget_pct:
                self.over_budget = True
                if settled:  # aim at `target` of the budget, by at least `backoff`
                    factor = max(self.backoff, min(overhead_pct / self._aim, 10.0))
                    self.scale = min(self._max_scale, self.scale * factor)
                    self._changed_at = -math.inf if now is None else now
                for n, st in self._state.items():  # stretch now, not only at the next read
                    spec = self.specs[n]
                    stretched = min(spec.max_interval_s, st.base * self.scale)
                    st.interval = max(st.interval, stretched)
                self.saturated = all(
                    st.interval >= self.specs[n].max_interval_s for n, st in self._state.items()
                )
            else:
                self.over_budget = False
                self.saturated = False
                if overhead_pct < 0.5 * self.budget_pct and settled and self.scale > 1.0:
                    factor = max(overhead_pct / self._aim, 1.0 / self.relax)
                    self.scale = max(1.0, self.scale * factor)
                    self._changed_at = -math.inf if now is None else now
