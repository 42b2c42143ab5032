"""Where a rank is inside a step that goes on much longer than its recent ones.

Steps and spans are published when a step ends, so a step that does not end — a hang, a
rank waiting in a collective for another that stopped, a long checkpoint save — says
nothing. `ProgressWatch` runs on the pipeline's worker thread: once the open step has lasted
``max(min_s, factor × the median of the last steps)``, it publishes a
`perfloop.schemas.RankProgress` (phase, collective or call, since when) every ``every_s``
while the step lasts. The stream tier tells from them the rank that stopped from the ranks
that wait for it, and a checkpoint or an evaluation from a hang.

The training thread only appends the step times (`step_done`); the worker thread reads
where the rank is through a callable that snapshots the tracer's state (a few attribute
reads, no lock: a torn read costs one report at most).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

__all__ = ["ProgressWatch", "Where"]

Where = tuple[int, int, str, str, int]
"""(step, step start, phase, op, phase start): times in the tracer's ``perf_counter_ns``."""


class ProgressWatch:
    """Decides when a long step is reported, and reports it.

    >>> sent = []
    >>> w = ProgressWatch(lambda **f: sent.append(f) or True, min_s=2.0, factor=3.0,
    ...                   every_s=2.0, wall_offset_ns=0)
    >>> for _ in range(5): w.step_done(100.0)
    >>> where = lambda: (7, 0, "comm", "all_reduce", 500_000_000)
    >>> w.check(1_000_000_000, where), w.check(2_500_000_000, where)
    (False, True)
    >>> sent[0]["phase"], sent[0]["step"], sent[0]["since_ns"]
    ('comm', 7, 500000000)
    >>> w.check(3_000_000_000, where), w.check(4_600_000_000, where)  # every 2 s
    (False, True)
    """

    def __init__(
        self,
        publish: Callable[..., bool],
        *,
        min_s: float = 2.0,
        factor: float = 3.0,
        every_s: float = 2.0,
        wall_offset_ns: int = 0,
        history: int = 64,
    ) -> None:
        self.publish = publish
        self.min_ns = int(min_s * 1e9)
        self.factor = factor
        self.every_ns = int(every_s * 1e9)
        self.offset = wall_offset_ns
        self._steps: collections.deque[float] = collections.deque(maxlen=history)
        self._last: tuple[int, int] | None = None  # (step, when) of the last report

    def step_done(self, step_ms: float) -> None:
        """A step ended (training thread)."""
        self._steps.append(step_ms)

    def threshold_ns(self) -> int:
        steps = sorted(self._steps)
        if not steps:
            return 1 << 62  # no step yet: nothing to compare with
        median_ms = steps[len(steps) // 2]
        return max(self.min_ns, int(self.factor * median_ms * 1e6))

    def check(self, now: int, where: Callable[[], Where | None]) -> bool:
        """Publish a report if the open step is long and the last one is ``every_s`` old."""
        at = where()
        if at is None:
            return False
        step, start, phase, op, since = at
        if now - start < self.threshold_ns():
            return False
        last = self._last
        if last is not None and last[0] == step and now - last[1] < self.every_ns:
            return False
        self._last = (step, now)
        return bool(
            self.publish(
                step=max(step, 0),
                phase=phase,
                op=op[:64],
                since_ns=max(since + self.offset, 0),
                step_start_ns=max(start + self.offset, 0),
            )
        )
