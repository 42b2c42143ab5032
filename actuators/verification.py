"""Did a change help? `ChangeVerifier` judges one applied change from the step times around
it, pure (no I/O): the job agent feeds it the steps after the change and rolls the change back
when the verdict says so.

The steps before the change are the baseline. After it, the first ``settle_steps`` are skipped
(a rebuilt data-loader iterator or a new thread pool warms up), then the steps after are
compared with as many steps just before the change: their medians (robust to the spikes step
times have: a garbage collection, a neighbour's burst) and a two-sided Mann–Whitney U test
(normal approximation, ties corrected; free of any assumption on the distribution). The
verdict, at the first look (``verify_steps`` after):

- ``rolled_back`` at once when a loss after the change is NaN or infinite (it broke training);
- ``rolled_back`` when the step time got significantly worse: ``p < alpha`` and the median
  grew by more than ``min_effect`` (3 %);
- ``kept`` when the median did not grow by more than ``min_effect``: it helped (significantly
  faster) or it did not hurt;
- with ``must_help`` (a change made only to speed steps up: loader workers, threads, the
  loader's prefetch and pinning; `perfloop.schemas.knobs.SPEED_KNOBS`) ``kept`` only
  when it helped — significantly faster, by more than ``min_effect`` — and judged on more
  steps while it did not yet: a change with no measured gain is undone (the job goes back to
  the state it is known to run well in), since a gain nobody measured is no reason to keep a
  change whose effect is unknown;
- otherwise — slower by the median, not yet significantly (or, with ``must_help``, not yet
  significantly faster) — the change is judged on more steps: the next look compares
  ``verify_steps`` more steps after it with as many more before it (the same number on both
  sides, so neither median is the noisier one), up to ``max_verify_steps`` (3 ×
  ``verify_steps``). The older steps join the baseline only when they ran at the level of the
  newest ``verify_steps`` (not significantly more than 3 % apart): steps from before the fault
  that prompted the change are not the state it was made for, and a cure judged against them
  looks like harm. For the same reason, when a clear level shift lies among the steps a look
  compares with (medians more than ``min_effect`` apart, the rank test's p below ``alpha``
  divided by the places tried, at least `MIN_BASELINE` steps each side), only the steps since
  the strongest one are the baseline: a change made a few steps after a fault's onset. It is
  rolled back as soon as the slowdown is significant, kept as soon as the
  median is within ``min_effect``, and rolled back at the last look if it stayed slower than
  that (with ``must_help``: if it did not help by then): a change is kept only when the evidence
  says it did not hurt (with ``must_help``: that it helped).

So a change that clearly hurt is undone within ``settle_steps + verify_steps`` steps of being
applied, one that may have hurt within ``settle_steps + max_verify_steps``. Every verdict
carries its evidence: medians before and after, their ratio, the p-value, the steps it was
judged on before and after, whether the judgement was extended, and the settle steps.

>>> v = ChangeVerifier([100.0] * 20, settle_steps=1, verify_steps=10)
>>> [v.observe(150.0 + i % 3) for i in range(10)][-1] is None
True
>>> verdict = v.observe(151.0)
>>> verdict.outcome, round(verdict.evidence["ratio"], 1)
('rolled_back', 1.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ChangeVerifier", "Verdict", "mann_whitney_p"]

MIN_BASELINE = 5
"""Fewer steps before the change than this and it cannot be judged (it is kept)."""


@dataclass(frozen=True)
class Verdict:
    """What to do with a change, why, and the figures it rests on."""

    outcome: str  # "kept" or "rolled_back"
    reason: str
    evidence: dict[str, float] = field(default_factory=dict)

    @property
    def rollback(self) -> bool:
        return self.outcome == "rolled_back"


def mann_whitney_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of the Mann–Whitney U test of ``a`` against ``b`` (normal
    approximation with the tie correction; 1.0 when every value is equal).

    >>> round(mann_whitney_p([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), 4)
    0.0122
    >>> mann_whitney_p([1, 1, 1], [1, 1, 1])
    1.0
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    both = np.concatenate([x, y])
    order = np.argsort(both, kind="stable")
    ranks = np.empty(len(both))
    sorted_vals = both[order]
    # average ranks of ties
    starts = np.flatnonzero(np.r_[True, sorted_vals[1:] != sorted_vals[:-1]])
    ends = np.r_[starts[1:], len(both)]
    avg = (starts + ends + 1) / 2.0  # ranks are 1-based
    ranks[order] = np.repeat(avg, ends - starts)
    u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    tie = np.sum((ends - starts) ** 3 - (ends - starts))
    var = n1 * n2 / 12.0 * ((n + 1) - tie / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return 1.0
    z = (abs(u1 - n1 * n2 / 2.0) - 0.5) / math.sqrt(var)  # continuity correction
    return float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


class ChangeVerifier:
    """Judges one change from the step times before it (``before``, oldest first; the last
    ``max_verify_steps`` are used at most) and those fed to `observe` after it; `observe`
    returns the `Verdict` once there is one, else None."""

    def __init__(
        self,
        before: Sequence[float],
        *,
        settle_steps: int = 2,
        verify_steps: int = 20,
        max_verify_steps: int | None = None,
        alpha: float = 0.05,
        min_effect: float = 0.03,
        must_help: bool = False,
    ) -> None:
        longest = 3 * verify_steps if max_verify_steps is None else max_verify_steps
        if settle_steps < 0 or verify_steps < 3 or longest < verify_steps:
            raise ValueError(
                "need settle_steps ≥ 0, verify_steps ≥ 3 and max_verify_steps ≥ verify_steps, "
                f"got {settle_steps}, {verify_steps}, {longest}"
            )
        self.before = [float(t) for t in before if math.isfinite(t) and t > 0]
        self.settle_steps, self.verify_steps = settle_steps, verify_steps
        self.max_verify_steps = longest
        self.alpha, self.min_effect = alpha, min_effect
        self.must_help = must_help
        self.after: list[float] = []
        self.seen = 0
        self.looks = 0
        self._next_look = verify_steps
        self.verdict: Verdict | None = None

    @property
    def max_steps(self) -> int:
        """Steps after the change by which the verdict comes at the latest (with usable step
        times; a change after which no step time is usable is judged after 4 × this)."""
        return self.settle_steps + self.max_verify_steps

    def observe(self, step_time_ms: float, loss: float | None = None) -> Verdict | None:
        """Take one step after the change; the verdict, once there is one (then always it)."""
        if self.verdict is not None:
            return self.verdict
        self.seen += 1
        if loss is not None and not math.isfinite(loss):
            self.verdict = Verdict(
                "rolled_back",
                f"the loss became {loss} {self.seen} step(s) after the change",
                {"steps_after": float(self.seen)},
            )
            return self.verdict
        if self.seen <= self.settle_steps:
            return None
        if math.isfinite(step_time_ms) and step_time_ms > 0:
            self.after.append(float(step_time_ms))
        out_of_steps = self.seen >= 4 * self.max_steps
        if len(self.after) < self._next_look and not out_of_steps:
            return None
        final = out_of_steps or len(self.after) >= self.max_verify_steps
        self.verdict = self._judge(final=final)
        if self.verdict is None:  # slower, not significantly: judge on more steps
            self._next_look = min(self._next_look + self.verify_steps, self.max_verify_steps)
        return self.verdict

    def _baseline(self, n: int) -> list[float]:
        """The ``n`` newest steps before the change (at least ``verify_steps``), unless the older
        of them ran at another level than the newest ``verify_steps`` (a fault's onset, a
        finished warm-up): then those newest only, the state the change was made for; and
        when a clear level shift lies among those (a change made a few steps after the
        fault's onset), the steps since it."""
        recent = self.before[-self.verify_steps :]
        wider = self.before[-max(n, self.verify_steps) :]
        cut = self._level_shift(wider)
        if cut is not None:
            return wider[cut:]
        older = wider[: len(wider) - len(recent)]
        if len(older) < MIN_BASELINE:
            return wider
        shift = float(np.median(recent)) / float(np.median(older))
        if abs(shift - 1) > self.min_effect and mann_whitney_p(older, recent) < self.alpha:
            return recent
        return wider

    def _level_shift(self, xs: list[float]) -> int | None:
        """Where the strongest level shift in ``xs`` begins, when it is clear: medians more
        than ``min_effect`` apart and the Mann–Whitney p-value below ``alpha`` divided by the
        number of places tried (so that trying every place does not find shifts in steady
        steps by chance), with `MIN_BASELINE` steps on each side; else None."""
        places = range(MIN_BASELINE, len(xs) - MIN_BASELINE + 1)
        if not places:
            return None
        best, best_p = None, self.alpha / len(places)
        for i in places:
            left, right = xs[:i], xs[i:]
            shift = float(np.median(right)) / float(np.median(left))
            if abs(shift - 1) <= self.min_effect:
                continue
            p = mann_whitney_p(left, right)
            if p < best_p:
                best, best_p = i, p
        return best

    def _judge(self, *, final: bool) -> Verdict | None:
        self.looks += 1
        n = len(self.after)
        before = self._baseline(n)
        if len(before) < MIN_BASELINE or n < 3:
            return Verdict(
                "kept",
                f"too few steps to judge ({len(self.before)} before, {n} after)",
                {"n_before": float(len(self.before)), "n_after": float(n)},
            )
        b, a = float(np.median(before)), float(np.median(self.after))
        ratio = a / b
        p = mann_whitney_p(before, self.after)
        extended = self.looks > 1
        ev = {
            "before_ms": b,
            "after_ms": a,
            "ratio": ratio,
            "p_value": p,
            "n_before": float(len(before)),
            "n_after": float(n),
            "extended": float(extended),
            "settle_steps": float(self.settle_steps),
        }
        on = f"{len(before)} steps before, {n} after"
        if extended:
            on += f", extended from {self.verify_steps}"
        change = (
            f"step time p50 {b:.1f} → {a:.1f} ms ({100 * (ratio - 1):+.1f} %, p = {p:.2g}; {on})"
        )
        slower = ratio > 1 + self.min_effect
        if p < self.alpha and slower:
            return Verdict("rolled_back", f"it hurt: {change}", ev)
        if p < self.alpha and ratio < 1 - self.min_effect:
            return Verdict("kept", f"it helped: {change}", ev)
        limit = f"{100 * self.min_effect:g} %"
        if not slower and not self.must_help:
            return Verdict("kept", f"it did not hurt (not slower than {limit}): {change}", ev)
        if not final:
            return None
        if not slower:  # must_help, and no gain measured by the last look
            why = f"it did not help (not significantly faster by more than {limit})"
            return Verdict("rolled_back", f"{why}: {change}", ev)
        return Verdict("rolled_back", f"it stayed slower than {limit}: {change}", ev)
