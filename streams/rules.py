"""From diagnoses to recommendations: only an unexplained, critical-path bottleneck acts.

`DataWaitRule` reads the funnel's ``dataloader_starvation`` diagnoses. When one is open (or
updated) with ``critical_path`` set and no higher-level cause (``explained_by`` empty), and the
data-wait share in its evidence passes the threshold, it emits one `Recommendation` per job
and cooldown: more loader workers, as many as the data-pipeline model says hide the loading
behind compute. Every other bottleneck is reported by its diagnosis alone until the
optimization tier adds its own rules. The cooldown is measured in the diagnoses' event time
(their ``ts_ns``), so a backlog read fast is answered as the same data read live.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Diagnosis, Recommendation
from perfloop.streams.funnel import actionable

__all__ = ["KNOB_NUM_WORKERS", "DataWaitRule"]

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

    def __init__(self, *, threshold: float, cooldown_s: float, max_workers: int) -> None:
        self.threshold = threshold
        self.cooldown_ns = int(cooldown_s * NS)
        self.max_workers = max_workers
        self._workers: dict[str, int] = {}
        self._last_emit: dict[str, int] = {}

    def observe_workers(self, job_id: str, num_workers: int) -> None:
        self._workers[job_id] = num_workers

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
            target = loader_workers_needed(min(share, 0.95), current, max_workers=self.max_workers)
            if target <= current:
                continue
            gain = expected_step_gain(share, current, target)
            self._last_emit[d.job_id] = now
            where = f"{len(d.ranks)} ranks" if d.ranks else "the job"
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
                    expected_gain_pct=round(100 * gain, 2),
                    confidence=d.confidence,
                    rationale=(
                        f"{where} wait for input {100 * share:.0f}% of each step "
                        f"(diagnosis {d.diagnosis_id}, on the critical path); "
                        f"{current} loader workers cannot keep up, {target} can"
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
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.threshold = state["threshold"]
        self.cooldown_ns = state["cooldown_ns"]
        self._workers = dict(state["workers"])
        self._last_emit = dict(state["last_emit"])
