"""The data-wait rule: when waiting for input dominates the step, recommend more loader workers.

It reads closed windows of ``data_wait_share`` per rank, takes the job-wide mean for each
window, and when it passes the threshold — and data wait is the largest part of the step —
emits one `Recommendation` per job and cooldown, with the target from the data-pipeline model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Recommendation
from perfloop.streams.windows import NS, WindowRow

__all__ = ["KNOB_NUM_WORKERS", "DataWaitRule"]

KNOB_NUM_WORKERS = "dataloader.num_workers"


class DataWaitRule:
    """Stateful rule over closed windows; `observe_workers` feeds the current setting.

    >>> rule = DataWaitRule(threshold=0.3, cooldown_s=30, max_workers=16)
    >>> rule.observe_workers("j", 2)
    >>> w = WindowRow("j", "n0", 0, "data_wait_share", 0, 10 * NS, 10.0, 50, 0.5, 0.4, 0.6,
    ...               0.5, 0.6, 0.6, 5.0, 0.0)
    >>> [(r.knob, r.from_value, r.to_value) for r in rule.evaluate([w])]
    [('dataloader.num_workers', 2, 5)]
    >>> rule.evaluate([w])  # within the cooldown
    []
    """

    def __init__(self, *, threshold: float, cooldown_s: float, max_workers: int) -> None:
        self.threshold = threshold
        self.cooldown_ns = int(cooldown_s * NS)
        self.max_workers = max_workers
        self._workers: dict[str, int] = {}
        self._last_emit: dict[str, int] = {}

    def observe_workers(self, job_id: str, num_workers: int) -> None:
        self._workers[job_id] = num_workers

    def evaluate(self, rows: Iterable[WindowRow]) -> list[Recommendation]:
        shares: dict[tuple[str, int], list[WindowRow]] = defaultdict(list)
        for r in rows:
            if r.metric == "data_wait_share":
                shares[(r.job_id, r.ts_ns)].append(r)
        recs = []
        for (job_id, start), ranks in sorted(shares.items(), key=lambda kv: kv[0][1]):
            share = sum(r.mean for r in ranks) / len(ranks)
            end = ranks[0].window_end_ns
            last = self._last_emit.get(job_id)
            # Data wait dominates the step once it is the largest part of it; the threshold
            # keeps small, harmless waits from producing recommendations.
            if share < self.threshold or (last is not None and end - last < self.cooldown_ns):
                continue
            current = self._workers.get(job_id, 0)
            target = loader_workers_needed(min(share, 0.95), current, max_workers=self.max_workers)
            if target <= current:
                continue
            gain = expected_step_gain(share, current, target)
            self._last_emit[job_id] = end
            recs.append(
                Recommendation(
                    ts_ns=end,
                    job_id=job_id,
                    node=ranks[0].node,
                    rank=-1,
                    knob=KNOB_NUM_WORKERS,
                    from_value=current,
                    to_value=target,
                    loop="fast",
                    expected_gain_pct=round(100 * gain, 2),
                    confidence=min(1.0, 0.5 + 0.1 * len(ranks)),
                    rationale=(
                        f"ranks wait for input {100 * share:.0f}% of each step "
                        f"(window {ranks[0].window_s:g} s, {len(ranks)} ranks); "
                        f"{current} loader workers cannot keep up, {target} can"
                    ),
                    evidence={
                        "data_wait_share": round(share, 4),
                        "ranks": float(len(ranks)),
                        "window_start_s": start / NS,
                        "num_workers": float(current),
                    },
                )
            )
        return recs
