"""The thread rule: a CPU training job's intra-op threads fitted to each rank's real CPU budget.

Every rank publishes its own job info: its threads (``torch.num_threads``), whether the
script set them itself (``torch.num_threads.by_script``) and its CPU budget (``cpu_budget``:
its affinity and its container's CPU quota, shared among the launcher's local ranks; an older
producer's affinity or node CPUs over its local ranks — never a shared affinity counted whole
for each rank). A recommendation is for the whole job (rank -1), so it fits the rank with the
smallest budget: ``want = max(1, budget − the cores its loader workers keep busy)``.

- **Lower** on an actionable ``thread_oversubscription`` diagnosis (`perfloop.streams.funnel`):
  the largest thread count of the job's ranks to ``want``. Lowering a count the script set
  itself is fine: it oversubscribes.
- **Raise** only when every rank runs fewer threads than ``want``, none of them set by the
  script (its own choice is kept; a launcher's default is not a choice), compute is at least
  ``min_compute_share`` of the step and the configuration has run ``settle_steps`` steps.
  Never past the budget (nor the job's own bound, ``bounds.torch.num_threads``).

A job with GPUs is left alone (its threads feed the GPUs). Outcomes of similar changes adjust
the expected gain; a kind of change rolled back repeatedly and never kept is not recommended
again. Cooldowns are in event time.

Public through `perfloop.streams.rules`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from perfloop.schemas import Diagnosis, JobInfo, Recommendation
from perfloop.streams.outcomes import Outcomes

__all__ = ["KNOB_THREADS", "ThreadRule", "rank_budget"]

KNOB_THREADS = "torch.num_threads"
NS = 1_000_000_000


def rank_budget(info: JobInfo) -> int:
    """The CPUs one rank may use, from its job info (0: unknown).

    >>> rank_budget(JobInfo(ts_ns=1, job_id="j", node="n", rank=0, cpu_count=2,
    ...                     local_world_size=2, extra={"cpu_budget": "1"}))
    1
    >>> rank_budget(JobInfo(ts_ns=1, job_id="j", node="n", rank=0, cpu_count=16,
    ...                     local_world_size=4, extra={"cpu_affinity": "16"}))
    4
    """
    budget = _int(info.extra.get("cpu_budget"))
    if budget >= 1:
        return budget
    cpus = _int(info.extra.get("cpu_affinity")) or info.cpu_count
    return max(1, cpus // max(1, info.local_world_size)) if cpus else 0


def _int(text: str | None) -> int:
    try:
        return int(float(text)) if text else 0
    except ValueError:
        return 0


@dataclass
class _Rank:
    threads: int = 0  # 0: not reported
    budget: int = 0  # 0: unknown
    by_script: bool = False
    bound: int = 0  # the job's own upper bound for the knob (0: none said)


@dataclass
class _Job:
    node: str = ""
    gpu: bool = False
    ranks: dict[int, _Rank] = field(default_factory=dict)
    workers: int = -1
    steps: int = 0  # since the configuration last changed
    step_ms: float = 0.0
    wait_ms: float = 0.0
    last_emit: int | None = None
    over: Diagnosis | None = None  # the open thread_oversubscription diagnosis


class ThreadRule:
    """Intra-op threads per job from its ranks' CPU budgets (see the module docstring).

    >>> rule = ThreadRule(cooldown_s=30, settle_steps=2)
    >>> for r in (0, 1):
    ...     rule.observe_info(JobInfo(ts_ns=NS, job_id="j", node="n0", rank=r, cpu_count=16,
    ...                               local_world_size=2, extra={"torch.num_threads": "1",
    ...                                                          "cpu_budget": "8"}))
    >>> rule.observe_steps("j", steps=2, step_ms=200.0, wait_ms=20.0, workers=2)
    >>> [(r.knob, r.from_value, r.to_value) for r in rule.evaluate("j", 2 * NS)]
    [('torch.num_threads', 1, 6)]
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
        self._jobs: dict[str, _Job] = {}

    # -- input -------------------------------------------------------------------------------
    def observe_info(self, info: JobInfo) -> None:
        """A rank's job info: its threads, who set them, its budget (a change of threads
        starts a new configuration)."""
        j = self._jobs.setdefault(info.job_id, _Job())
        rank = j.ranks.setdefault(max(info.rank, 0), _Rank())
        threads = _int(info.extra.get(KNOB_THREADS))
        if threads != rank.threads:
            rank.threads, j.steps, j.step_ms, j.wait_ms = threads, 0, 0.0, 0.0
        rank.budget = rank_budget(info)
        rank.by_script = KNOB_THREADS + ".by_script" in info.extra
        hi = info.extra.get(f"bounds.{KNOB_THREADS}", "").split(",")[-1]
        rank.bound = _int(hi)
        j.node, j.gpu = info.node, j.gpu or info.gpu_count > 0

    def observe_steps(
        self, job: str, *, steps: int, step_ms: float, wait_ms: float, workers: int
    ) -> None:
        """``steps`` more steps of the job, their summed step time and data wait, and the loader
        workers they ran with (a change of workers starts a new configuration)."""
        j = self._jobs.setdefault(job, _Job())
        if workers != j.workers:
            j.workers, j.steps, j.step_ms, j.wait_ms = workers, 0, 0.0, 0.0
        j.steps += steps
        j.step_ms += step_ms
        j.wait_ms += wait_ms

    def observe_diagnoses(self, diagnoses: Iterable[Diagnosis]) -> None:
        """Thread-oversubscription diagnoses: the open, actionable one is what lowering acts
        on; its resolution ends it."""
        for d in diagnoses:
            if d.bottleneck != "thread_oversubscription" or d.job_id not in self._jobs:
                continue
            j = self._jobs[d.job_id]
            actionable = d.state != "resolved" and d.critical_path and not d.explained_by
            j.over = d if actionable else None

    # -- decision ----------------------------------------------------------------------------
    def evaluate(
        self,
        job: str,
        now_ns: int,
        *,
        workers: int | None = None,
        diagnoses: Iterable[Diagnosis] = (),
    ) -> list[Recommendation]:
        """The job's recommendation, if its threads do not fit; ``workers``: the loader workers
        it will run (those the data rule asked for), by default those it runs."""
        self.observe_diagnoses(diagnoses)
        j = self._jobs.get(job)
        if j is None or j.gpu:
            return []
        ranks = [r for r in j.ranks.values() if r.threads and r.budget]
        if not ranks or (j.last_emit is not None and now_ns - j.last_emit < self.cooldown_ns):
            return []
        planned = max(j.workers, 0) if workers is None else max(workers, j.workers, 0)
        loaders = float(planned)
        if j.over is not None and "loader_cores" in j.over.evidence:
            loaders = min(loaders, round(j.over.evidence["loader_cores"]))
        tightest = min(ranks, key=lambda r: r.budget)
        want = max(1, tightest.budget - int(loaders))
        bounds = [r.bound for r in ranks if r.bound]
        if bounds:
            want = min(want, min(bounds))
        most = max(r.threads for r in ranks)
        least = min(r.threads for r in ranks)
        compute = 1.0 - (j.wait_ms / j.step_ms if j.step_ms > 0 else 0.0)
        if j.over is not None and most > want:
            current, why = most, "over"
        elif (
            j.over is None
            and least < want
            and most < want
            and not any(r.by_script for r in ranks)
            and compute >= self.min_compute_share
            and j.steps >= self.settle_steps
        ):
            current, why = least, "under"
        else:
            return []
        if self.outcomes.discouraged(job, KNOB_THREADS, current, want):
            return []
        ratio = want / current if want < current else current / want
        share = j.over.step_share if j.over is not None else compute * (1 - ratio) * 0.5
        gain, confidence, learned = self.outcomes.adjust(
            job, KNOB_THREADS, current, want,
            prior_pct=100 * share, confidence=j.over.confidence if j.over else 0.5,
        )  # fmt: skip
        j.last_emit = now_ns
        return [self._recommend(job, j, now_ns, current, want, why, loaders, gain, confidence,
                                learned, tightest, compute)]  # fmt: skip

    def _recommend(
        self,
        job: str,
        j: _Job,
        now_ns: int,
        current: int,
        want: int,
        why: str,
        loaders: float,
        gain: float,
        confidence: float,
        learned: str,
        tightest: _Rank,
        compute: float,
    ) -> Recommendation:
        ranks = len(j.ranks)
        where = f"{ranks} ranks" if ranks > 1 else "the rank"
        if why == "over":
            d = j.over
            assert d is not None
            what = (
                f"{current} intra-op threads and {loaders:.0f} busy loader worker(s) on "
                f"{tightest.budget} CPU(s) (the smallest budget of {where}) oversubscribe "
                f"the cores: parallel ops wait for descheduled threads (diagnosis "
                f"{d.diagnosis_id}); {want} fit"
            )
        else:
            what = (
                f"{current} intra-op threads leave cores idle: {where} may use "
                f"{tightest.budget} CPU(s) each, {loaders:.0f} of them for loader workers, and "
                f"compute is {100 * compute:.0f}% of each step over the last {j.steps} steps; "
                f"{want} fit"
            )
        return Recommendation(
            ts_ns=now_ns,
            job_id=job,
            node=j.node or "unknown",
            rank=-1,
            knob=KNOB_THREADS,
            from_value=current,
            to_value=want,
            loop="fast",
            expected_gain_pct=round(gain, 2),
            confidence=round(confidence, 3),
            rationale=what + (f"; {learned}" if learned else ""),
            evidence={
                "num_threads": float(current),
                "num_workers": float(loaders),
                "cpu_budget": float(tightest.budget),
                "compute_share": round(compute, 4),
                "steps": float(j.steps),
                "ranks": float(ranks),
            },
        )

    # -- state -------------------------------------------------------------------------------
    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    def snapshot(self) -> dict[str, Any]:
        out = {}
        for job, j in self._jobs.items():
            d = {k: v for k, v in vars(j).items() if k not in ("ranks", "over")}
            d["ranks"] = {r: asdict(x) for r, x in j.ranks.items()}
            d["over"] = j.over.model_dump() if j.over is not None else None
            out[job] = d
        return out

    def restore(self, state: dict[str, Any]) -> None:
        self._jobs = {}
        for job, d in state.items():
            if "ranks" not in d:  # a snapshot of the per-job rule: its facts come again
                continue
            j = _Job(**{k: v for k, v in d.items() if k not in ("ranks", "over")})
            j.ranks = {int(r): _Rank(**x) for r, x in d["ranks"].items()}
            j.over = Diagnosis(**d["over"]) if d.get("over") else None
            self._jobs[job] = j
