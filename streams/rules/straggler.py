"""The straggler rule: a rank that keeps the others waiting names its node for the operators.

Nothing inside the job makes one host faster: the remedy of a persistent straggler is the
slow loop's — take its node out of the pool (drain it in Slurm, cordon it in Kubernetes) and
restart elsewhere. When an actionable ``straggler`` diagnosis (open or updated, on the
critical path, no higher-level cause) has lasted ``min_age_s`` of event time, the rule emits
one slow-loop `Recommendation` for that episode (its ``diagnosis_id``) and job: knob
``cluster.drain_node``, ``from_value`` "", ``to_value`` the slow rank's node, with the
diagnosis's evidence (rank, lateness, score, steps, …). The actuator runs its configured action
hook for it, as the job's tier allows (`perfloop.actuators.hook`). A new episode (the straggler
resolved and came back, or another rank) is a new recommendation; one episode is never
recommended twice.

Public through `perfloop.streams.rules`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from perfloop.schemas import Diagnosis, Recommendation
from perfloop.streams.funnel import actionable

__all__ = ["KNOB_DRAIN", "StragglerRule"]

KNOB_DRAIN = "cluster.drain_node"
NS = 1_000_000_000
MAX_EPISODES = 64
"""Episodes remembered per job."""


class StragglerRule:
    """One drain recommendation per job and straggler episode.

    >>> rule = StragglerRule(min_age_s=10)
    >>> d = Diagnosis(ts_ns=12 * NS, job_id="j", node="gpu-7", rank=3, diagnosis_id="s1",
    ...               bottleneck="straggler", level="network", loop="training", state="update",
    ...               onset_ns=NS, step_share=0.3, confidence=0.9, critical_path=True,
    ...               ranks=[3], nodes=["gpu-7"], evidence={"lateness_ms": 41.0})
    >>> [(r.knob, r.to_value, r.loop) for r in rule.evaluate([d])]
    [('cluster.drain_node', 'gpu-7', 'slow')]
    >>> rule.evaluate([d.model_copy(update={"ts_ns": 40 * NS})])  # the same episode
    []
    """

    def __init__(self, *, min_age_s: float = 10.0) -> None:
        self.min_age_ns = int(min_age_s * NS)
        self._done: dict[str, list[str]] = {}  # job -> episodes recommended, oldest first

    def evaluate(self, diagnoses: Iterable[Diagnosis]) -> list[Recommendation]:
        recs = []
        for d in actionable(diagnoses):
            if d.bottleneck != "straggler" or d.ts_ns - d.onset_ns < self.min_age_ns:
                continue
            done = self._done.setdefault(d.job_id, [])
            if d.diagnosis_id in done:
                continue
            node = d.nodes[0] if d.nodes else d.node
            if not node or node == "unknown":
                continue
            done.append(d.diagnosis_id)
            del done[:-MAX_EPISODES]
            rank = d.ranks[0] if len(d.ranks) == 1 else d.rank
            late = d.evidence.get("lateness_ms")
            recs.append(
                Recommendation(
                    ts_ns=d.ts_ns,
                    job_id=d.job_id,
                    node=node,
                    rank=-1,
                    knob=KNOB_DRAIN,
                    from_value="",
                    to_value=node,
                    loop="slow",
                    expected_gain_pct=round(100 * d.step_share, 2),
                    confidence=d.confidence,
                    rationale=(
                        f"rank {rank} on host {node} has kept the others waiting for "
                        f"{(d.ts_ns - d.onset_ns) / NS:.0f} s"
                        + (f", {late:.0f} ms a step" if late is not None else "")
                        + f" (diagnosis {d.diagnosis_id}): {d.summary}; take {node} out of "
                        "the pool and restart the job elsewhere"
                    )[:2000],
                    evidence={
                        **{k: float(v) for k, v in d.evidence.items()},
                        "rank": float(rank),
                        "straggling_s": round((d.ts_ns - d.onset_ns) / NS, 3),
                    },
                )
            )
        return recs

    def forget(self, job: str) -> None:
        self._done.pop(job, None)

    def snapshot(self) -> dict[str, Any]:
        return {"min_age_ns": self.min_age_ns, "done": {j: list(v) for j, v in self._done.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.min_age_ns = state.get("min_age_ns", self.min_age_ns)
        self._done = {j: list(v) for j, v in state.get("done", {}).items()}
