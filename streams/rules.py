"""From diagnoses and job facts to recommendations, each with its expected gain and evidence.

`DataWaitRule` reads the funnel's ``dataloader_starvation`` diagnoses. When one is open (or
updated) with ``critical_path`` set and no higher-level cause (``explained_by`` empty), and the
data-wait share in its evidence passes the threshold, it emits one `Recommendation` per job
and cooldown: more loader workers, as many as the data-pipeline model says hide the loading
behind compute, at most the CPUs each rank has less one (for the training loop itself).

`ThreadRule` fits a CPU training job's intra-op threads (``torch.num_threads``) to the cores
its ranks have: the CPUs each rank may use (job info) less the loader workers it runs (those
the data rule just asked for, if more). Threads beyond that oversubscribe the cores and make
every parallel op wait for descheduled threads; fewer leave cores idle while compute is most
of the step. It judges a configuration only after it has run ``settle_steps`` steps.

Both consult `Outcomes` (what similar changes did when applied: prefer what worked) and
leave out a kind of change that was rolled back repeatedly and never kept. Cooldowns are
measured in event time (the diagnoses' or steps' ``ts_ns``), so a backlog read fast is
answered as the same data read live.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Diagnosis, JobInfo, Recommendation
from perfloop.streams.funnel import actionable
from perfloop.streams.outcomes import Outcomes

__all__ = ["KNOB_NUM_WORKERS", "KNOB_THREADS", "DataWaitRule", "ThreadRule", "cpus_per_rank"]

KNOB_NUM_WORKERS = "dataloader.num_workers"
KNOB_THREADS = "torch.num_threads"
NS = 1_000_000_000


def cpus_per_rank(info: JobInfo) -> int:
    """The CPUs one rank of the job may use: its affinity (or the host's CPUs) over the ranks
    on its node.

    >>> cpus_per_rank(JobInfo(ts_ns=1, job_id="j", node="n", rank=0, cpu_count=16,
    ...                       local_world_size=4, extra={"cpu_affinity": "8"}))
    8
    """
    try:
        affinity = int(info.extra.get("cpu_affinity", "0"))
    except ValueError:
        affinity = 0
    if affinity:  # the process's own set, already its share
        return affinity
    return max(1, info.cpu_count // max(1, info.local_world_size))


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
        self._cpus: dict[str, int] = {}  # per job: CPUs per rank, from its job info
        self._last_emit: dict[str, int] = {}
        self._planned: dict[str, tuple[int, int]] = {}  # job -> (workers asked for, when)

    def observe_workers(self, job_id: str, num_workers: int) -> None:
        self._workers[job_id] = num_workers

    def observe_info(self, info: JobInfo) -> None:
        self._cpus[info.job_id] = cpus_per_rank(info)

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
        for d in (self._workers, self._cpus, self._last_emit, self._planned):
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


@dataclass
class _Threads:
    """What `ThreadRule` knows of one job."""

    node: str = ""
    threads: int = 0  # 0: not reported
    cpus: int = 0
    gpu: bool = False
    workers: int = -1
    steps: int = 0  # since the configuration last changed
    step_ms: float = 0.0
    wait_ms: float = 0.0
    last_emit: int | None = None


class ThreadRule:
    """Intra-op threads fitted to the cores a CPU training job's ranks have.

    >>> from perfloop.schemas import JobInfo
    >>> rule = ThreadRule(cooldown_s=30, settle_steps=2)
    >>> rule.observe_info(JobInfo(ts_ns=NS, job_id="j", node="n0", rank=0, cpu_count=2,
    ...                           extra={"torch.num_threads": "8"}))
    >>> rule.observe_steps("j", steps=2, step_ms=200.0, wait_ms=80.0, workers=0)
    >>> [(r.knob, r.from_value, r.to_value) for r in rule.evaluate("j", 2 * NS, workers=1)]
    [('torch.num_threads', 8, 1)]
    """

    def __init__(
        self,
        *,
        cooldown_s: float = 30.0,
        settle_steps: int = 30,
        min_compute_share: float = 0.3,
        outcomes: Outcomes | None = None,
    ) -> None:
        self.cooldown_ns = int(cooldown_s * NS)
        self.settle_steps = settle_steps
        self.min_compute_share = min_compute_share
        self.outcomes = outcomes if outcomes is not None else Outcomes()
        self._jobs: dict[str, _Threads] = {}

    def observe_info(self, info: JobInfo) -> None:
        j = self._jobs.setdefault(info.job_id, _Threads())
        try:
            threads = int(info.extra.get(KNOB_THREADS, "0"))
        except ValueError:
            threads = 0
        if threads != j.threads:
            j.threads, j.steps, j.step_ms, j.wait_ms = threads, 0, 0.0, 0.0
        j.node, j.cpus, j.gpu = info.node, cpus_per_rank(info), info.gpu_count > 0

    def observe_steps(
        self, job: str, *, steps: int, step_ms: float, wait_ms: float, workers: int
    ) -> None:
        """``steps`` more steps of the job, their summed step time and data wait, and the loader
        workers they ran with (a change of workers starts a new configuration)."""
        j = self._jobs.setdefault(job, _Threads())
        if workers != j.workers:
            j.workers, j.steps, j.step_ms, j.wait_ms = workers, 0, 0.0, 0.0
        j.steps += steps
        j.step_ms += step_ms
        j.wait_ms += wait_ms

    def evaluate(
        self, job: str, now_ns: int, *, workers: int | None = None
    ) -> list[Recommendation]:
        """The job's recommendation, if its threads do not fit; ``workers``: the loader workers
        it will run (those the data rule asked for), by default those it runs."""
        j = self._jobs.get(job)
        if j is None or not j.threads or not j.cpus or j.gpu or j.steps < self.settle_steps:
            return []
        if j.last_emit is not None and now_ns - j.last_emit < self.cooldown_ns:
            return []
        loaders = max(j.workers, 0) if workers is None else max(workers, j.workers, 0)
        want = max(1, j.cpus - loaders)
        compute = 1.0 - (j.wait_ms / j.step_ms if j.step_ms > 0 else 0.0)
        if want == j.threads or compute < self.min_compute_share:
            return []
        if self.outcomes.discouraged(job, KNOB_THREADS, j.threads, want):
            return []
        # Heuristic prior: half the ideal scaling of the compute share (the outcomes of
        # similar changes replace it as they come).
        ratio = want / j.threads if want < j.threads else j.threads / want
        gain, confidence, learned = self.outcomes.adjust(
            job, KNOB_THREADS, j.threads, want,
            prior_pct=100 * compute * (1 - ratio) * 0.5, confidence=0.5,
        )  # fmt: skip
        j.last_emit = now_ns
        what = (
            "oversubscribe the cores: parallel ops wait for descheduled threads"
            if j.threads > want
            else "leave cores idle while compute is most of each step"
        )
        return [
            Recommendation(
                ts_ns=now_ns,
                job_id=job,
                node=j.node or "unknown",
                rank=-1,
                knob=KNOB_THREADS,
                from_value=j.threads,
                to_value=want,
                loop="fast",
                expected_gain_pct=round(gain, 2),
                confidence=round(confidence, 3),
                rationale=(
                    f"{j.threads} intra-op threads and {loaders} loader worker"
                    f"{'s' * (loaders != 1)} per rank on {j.cpus} CPUs per rank "
                    f"{what} (compute is {100 * compute:.0f}% of each step over the last "
                    f"{j.steps} steps); {want} fit" + (f"; {learned}" if learned else "")
                ),
                evidence={
                    "num_threads": float(j.threads),
                    "num_workers": float(loaders),
                    "cpus_per_rank": float(j.cpus),
                    "compute_share": round(compute, 4),
                    "steps": float(j.steps),
                },
            )
        ]

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def snapshot(self) -> dict[str, Any]:
        return {job: dict(vars(j)) for job, j in self._jobs.items()}

    def restore(self, state: dict[str, Any]) -> None:
        self._jobs = {job: _Threads(**v) for job, v in state.items()}
