"""From diagnoses and job facts to recommendations, each with its expected gain and evidence.

`DataWaitRule` reads the funnel's ``dataloader_starvation`` diagnoses. When one is open (or
updated) with ``critical_path`` set and no higher-level cause (``explained_by`` empty), and the
data-wait share in its evidence passes the threshold, it emits one `Recommendation` per job
and cooldown: more loader workers, as many as the data-pipeline model says hide the loading
behind compute, at most the CPUs each rank has less one (for the training loop itself).

`ThreadRule` (`perfloop.streams._rule_threads`) fits a CPU training job's intra-op threads
to each rank's real CPU budget.

Both consult `Outcomes` (what similar changes did when applied: prefer what worked) and
leave out a kind of change that was rolled back repeatedly and never kept. Cooldowns are
measured in event time (the diagnoses' or steps' ``ts_ns``), so a backlog read fast is
answered as the same data read live.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Diagnosis, JobInfo, Recommendation
from perfloop.streams._rule_threads import KNOB_THREADS, ThreadRule, rank_budget
from perfloop.streams.funnel import actionable
from perfloop.streams.outcomes import Outcomes

__all__ = ["KNOB_NUM_WORKERS", "KNOB_THREADS", "DataWaitRule", "ThreadRule", "rank_budget"]

KNOB_NUM_WORKERS = "dataloader.num_workers"
NS = 1_000_000_000


class DataWaitRule:
    """Stateful rule over diagnoses; `observe_workers` feeds each job's current setting.

    >>> rule = DataWaitRule(threshold=0.3, cooldown_s=30, max_workers=16)
    >>> rule.observe_workers("j", 2)
    >>> d = Diagnosis(ts_ns=10 * NS, job_id="j", node="n0", rank=-1, diagnosis_id="d1",
    ...               bottleneck="dataloader_starvation", level="host", loop="training",
    ...               state="open", onset_ns=9 * NS, step_share=0.5, confidence=0.9,
    ...               critical_path=True, ranks=[0, 1], evidence={"data_wait_share": 0.5})
    >>> [(r.knob, r.from_value, r.to_value) for r in rule.evaluate([d], now_ns=10 * NS)]
    [('dataloader.num_workers', 2, 5)]
    >>> rule.evaluate([d.model_copy(update={"ts_ns": 11 * NS})])  # within the cooldown
    []
    """

    def __init__(
        self,
        *,
        threshold: float,
        cooldown_s: float,
        max_workers: int,
        outcomes: Outcomes | None = None,
    ) -> None:
        self.threshold = threshold
        self.cooldown_ns = int(cooldown_s * NS)
        self.max_workers = max_workers
        self.outcomes = outcomes if outcomes is not None else Outcomes()
        self._workers: dict[str, int] = {}
        self._cpus: dict[str, int] = {}  # per job: its smallest CPU budget of a rank
        self._budgets: dict[str, dict[int, int]] = {}  # per job and rank, from its job info
        self._last_emit: dict[str, int] = {}
        self._planned: dict[str, tuple[int, int]] = {}  # job -> (workers asked for, when)

    def observe_workers(self, job_id: str, num_workers: int) -> None:
        self._workers[job_id] = num_workers

    def observe_info(self, info: JobInfo) -> None:
        budget = rank_budget(info)
        if budget:  # the job's smallest budget over its ranks
            self._budgets.setdefault(info.job_id, {})[info.rank] = budget
            self._cpus[info.job_id] = min(self._budgets[info.job_id].values())

    def workers(self, job_id: str, now_ns: int) -> int:
        """The loader workers the job runs, or those this rule asked for within its cooldown
        (the change may not have reached the job yet)."""
        current = self._workers.get(job_id, 0)
        planned = self._planned.get(job_id)
        if planned is not None and now_ns - planned[1] < self.cooldown_ns:
            return max(current, planned[0])
        return current

    def forget(self, job_id: str) -> None:
        """The job ended: drop what this rule keeps of it."""
        for d in (self._workers, self._cpus, self._budgets, self._last_emit, self._planned):
            d.pop(job_id, None)

    def max_for(self, job_id: str) -> int:
        """Workers the job may get: its CPUs per rank less one for the loop (when known)."""
        cpus = self._cpus.get(job_id)
        return self.max_workers if cpus is None else max(1, min(self.max_workers, cpus - 1))

    def evaluate(
        self, diagnoses: Iterable[Diagnosis], *, now_ns: int | None = None
    ) -> list[Recommendation]:
        """Recommendations for these diagnoses; the cooldown runs on ``now_ns``, by default
        each diagnosis's own ``ts_ns`` (event time)."""
        recs = []
        for d in actionable(diagnoses):
            if d.bottleneck != "dataloader_starvation":
                continue
            share = float(d.evidence.get("data_wait_share", d.step_share))
            last = self._last_emit.get(d.job_id)
            now = d.ts_ns if now_ns is None else now_ns
            if share < self.threshold or (last is not None and now - last < self.cooldown_ns):
                continue
            current = self._workers.get(d.job_id, 0)
            cap = self.max_for(d.job_id)
            target = loader_workers_needed(min(share, 0.95), current, max_workers=cap)
            if target <= current:
                continue
            if self.outcomes.discouraged(d.job_id, KNOB_NUM_WORKERS, current, target):
                continue
            gain, confidence, learned = self.outcomes.adjust(
                d.job_id, KNOB_NUM_WORKERS, current, target,
                prior_pct=100 * expected_step_gain(share, current, target),
                confidence=d.confidence,
            )  # fmt: skip
            self._last_emit[d.job_id] = now
            self._planned[d.job_id] = (target, now)
            n = len(d.ranks)
            where = (
                f"{n} ranks wait" if n > 1 else f"rank {d.ranks[0]} waits" if n else "the job waits"
            )
            recs.append(
                Recommendation(
                    ts_ns=d.ts_ns,
                    job_id=d.job_id,
                    node=d.node,
                    rank=-1,
                    knob=KNOB_NUM_WORKERS,
                    from_value=current,
                    to_value=target,
                    loop="fast",
                    expected_gain_pct=round(gain, 2),
                    confidence=round(confidence, 3),
                    rationale=(
                        f"{where} for input {100 * share:.0f}% of each step "
                        f"(diagnosis {d.diagnosis_id}, on the critical path); "
                        f"{current} loader workers cannot keep up, {target} can"
                        + (
                            f" (at most {cap}: the CPUs each rank has, less one)"
                            if target == cap and cap < self.max_workers
                            else ""
                        )
                        + (f"; {learned}" if learned else "")
                    ),
                    evidence={
                        **{k: float(v) for k, v in d.evidence.items()},
                        "data_wait_share": round(share, 4),
                        "num_workers": float(current),
                        "onset_s": d.onset_ns / NS,
                    },
                )
            )
        return recs

    # -- component protocol ------------------------------------------------------------------
    def configure(self, key: str, value: Any) -> tuple[Any, Any]:
        """``rules.data_wait_share_threshold`` (0..1) or ``rules.cooldown_s`` (≥ 0)."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if key == "rules.data_wait_share_threshold" and 0 < value < 1:
            old, self.threshold = self.threshold, float(value)
            return old, self.threshold
        if key == "rules.cooldown_s" and value >= 0:
            old_s, self.cooldown_ns = self.cooldown_ns / NS, int(value * NS)
            return old_s, float(value)
        raise ConfigError(
            f"bad rule setting {key}={value!r}; valid: rules.data_wait_share_threshold "
            "(0 < x < 1), rules.cooldown_s (≥ 0)"
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "cooldown_ns": self.cooldown_ns,
            "workers": dict(self._workers),
            "last_emit": dict(self._last_emit),
            "cpus": dict(self._cpus),
            "planned": {j: list(p) for j, p in self._planned.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.threshold = state["threshold"]
        self.cooldown_ns = state["cooldown_ns"]
        self._workers = dict(state["workers"])
        self._last_emit = dict(state["last_emit"])
        self._cpus = dict(state.get("cpus", {}))
        self._planned = {j: (p[0], p[1]) for j, p in state.get("planned", {}).items()}
