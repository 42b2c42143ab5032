"""The data-wait rule: loader workers for a starved job, one verified step at a time.

It reads the funnel's ``dataloader_starvation`` diagnoses. When one is actionable (open or
updated, on the critical path, no higher-level cause) and its data-wait share passes the
threshold, it recommends more loader workers for the job (rank -1). What the diagnosis says
bounds the loader (`perfloop.streams.detection.loader`: ``loader_bound``) decides how many:

- **no workers** (the loop loads its own batches, no signal yet): as many as the
  data-pipeline model says hide the loading behind compute, at most the rank's CPU budget
  less one (for the training loop); one while the budget is not known (the job's info has
  not come yet: a first worker is safe, and the next step comes with its verdict);
- **CPU-bound** (the workers compute): fitted to the CPUs the rank has — at most its budget
  less one. A loader that became CPU-bound with more workers than that (I/O-bound workers
  that grew until they filled the CPUs) stays as it is: a starvation never lowers workers;
- **I/O-bound** (the workers wait on storage): more workers than CPUs help. It grows them
  one verified step at a time — at least one more, at most twice as many, as many as the
  model asks — within the job's own bound (``bounds.dataloader.num_workers`` of its job
  info) and a memory bound: the workers' resident memory per worker, times the workers, within
  ``mem_share`` of the host's available memory.

It never recommends the value the job runs, nor fewer workers. The value the job runs is
what its step reports say (`observe_workers`) or, once a verdict came, the value the verdict
left (kept: the new one, rolled back: the old one): step reports older than that verdict,
still on their way, do not override it. While a rank's workers just changed, their CPU is not
judged yet (`perfloop.streams.detection.loader`): the rule waits for the diagnosis that judges
the workers the job runs now.

After a change it waits for its verdict (`Outcomes.last`: the job agent's ``kept`` or
``rolled_back`` on ``perfloop.actuations``, each verdict used once), not for the cooldown: a
change kept with a gain of at least ``min_step_gain`` lets the next step go at once. It stops
when a step is rolled back, gains less than that, or no bound leaves room, and says why:
`drain_notes` hands the engine one note per stop for the funnel to put on the diagnosis
(`Funnel.annotate`: "the last step 3 → 4 workers gained 1 % and was rolled back"). Without a
verdict (a job in tier observe, a refused command) the cooldown applies, as before. Cooldowns
are in event time.

Public through `perfloop.streams.rules`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Diagnosis, JobInfo, Recommendation
from perfloop.streams.detection import BOUND_CPU, BOUND_IO
from perfloop.streams.funnel import actionable
from perfloop.streams.outcomes import Outcomes
from perfloop.streams.rules.threads import rank_budget

__all__ = ["KNOB_NUM_WORKERS", "DataWaitRule"]

KNOB_NUM_WORKERS = "dataloader.num_workers"
NS = 1_000_000_000
Note = tuple[str, str, str, dict[str, float]]
"""(job, bottleneck, why perfloop stopped, evidence) for `perfloop.streams.Funnel.annotate`."""


@dataclass
class _Loader:
    """What the rule knows of one job."""

    workers: int = 0
    budgets: dict[int, int] | None = None  # rank -> CPU budget
    bound: int = 0  # the job's own upper bound for the knob (0: unknown)
    last_emit: int | None = None
    planned: tuple[int, int, int] | None = None  # (from, to, when) of the last recommendation
    stop: str = ""  # why growing stopped after a verdict ("" : it did not)
    stop_at: int = -1  # the workers it stopped at
    noted: str = ""  # the last note handed out
    diag: Diagnosis | None = None  # the job's latest actionable starvation diagnosis
    known_ns: int = 0  # the job's clock at the verdict that said what it runs (0: none)
    judged: str = ""  # the command of the last verdict the rule acted on


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
    >>> rule.evaluate([d.model_copy(update={"ts_ns": 11 * NS})])  # waits for its verdict
    []
    """

    def __init__(
        self,
        *,
        threshold: float,
        cooldown_s: float,
        max_workers: int,
        outcomes: Outcomes | None = None,
        min_step_gain: float = 0.05,
        mem_share: float = 0.5,
    ) -> None:
        self.threshold = threshold
        self.cooldown_ns = int(cooldown_s * NS)
        self.max_workers = max_workers
        self.outcomes = outcomes if outcomes is not None else Outcomes()
        self.min_step_gain = min_step_gain
        self.mem_share = mem_share
        self._jobs: dict[str, _Loader] = {}
        self._notes: list[Note] = []

    # -- input -------------------------------------------------------------------------------
    def observe_workers(self, job_id: str, num_workers: int, ts_ns: int | None = None) -> None:
        """The loader workers the job's steps report, as of its clock ``ts_ns``: a report
        older than the verdict the rule last acted on is of the value before it."""
        j = self._jobs.setdefault(job_id, _Loader())
        if ts_ns is not None and ts_ns <= j.known_ns:
            return
        j.workers = num_workers
        if j.stop and num_workers != j.stop_at:  # someone changed them: judge afresh
            j.stop, j.stop_at = "", -1

    def observe_info(self, info: JobInfo) -> None:
        j = self._jobs.setdefault(info.job_id, _Loader())
        budget = rank_budget(info)
        if budget:
            j.budgets = {**(j.budgets or {}), max(info.rank, 0): budget}
        hi = info.extra.get(f"bounds.{KNOB_NUM_WORKERS}", "").split(",")[-1]
        with contextlib.suppress(ValueError):
            j.bound = int(float(hi)) if hi else j.bound

    def workers(self, job_id: str, now_ns: int) -> int:
        """The loader workers the job runs, or those this rule asked for while the change is
        on its way (until its verdict, at most a cooldown)."""
        j = self._jobs.get(job_id)
        if j is None:
            return 0
        if j.planned is not None and now_ns - j.planned[2] < self.cooldown_ns:
            return max(j.workers, j.planned[1])
        return j.workers

    def max_for(self, job_id: str) -> int:
        """Workers the job may get from its CPUs: its smallest budget less one for the loop."""
        j = self._jobs.get(job_id)
        if j is None or not j.budgets:
            return self.max_workers
        return max(1, min(self.max_workers, min(j.budgets.values()) - 1))

    def drain_notes(self) -> list[Note]:
        """Why the rule stopped, for each job it stopped for since the last call."""
        out, self._notes = self._notes, []
        return out

    # -- decision ----------------------------------------------------------------------------
    def evaluate(
        self,
        diagnoses: Iterable[Diagnosis],
        *,
        now_ns: int | None = None,
        job: str | None = None,
    ) -> list[Recommendation]:
        """Recommendations for these diagnoses; the cooldown runs on ``now_ns``, by default
        each diagnosis's own ``ts_ns`` (event time). With ``job``, that job's latest actionable
        starvation diagnosis is judged again even when none came now (a verdict may have come
        since: the next step need not wait for the diagnosis's next update)."""
        fresh: dict[str, Diagnosis] = {}
        for d in diagnoses:
            if d.bottleneck != "dataloader_starvation":
                continue
            j = self._jobs.setdefault(d.job_id, _Loader())
            j.diag = d if actionable([d]) else None
            if j.diag is not None:
                fresh[d.job_id] = d
        if job is not None and job not in fresh and job in self._jobs:
            d0 = self._jobs[job].diag
            if d0 is not None and now_ns is not None:
                fresh[job] = d0.model_copy(update={"ts_ns": max(d0.ts_ns, now_ns)})
        recs = []
        for d in fresh.values():
            ev = d.evidence
            share = max(float(ev.get("data_wait_share", d.step_share)),
                        float(ev.get("data_wait_share_window", 0.0)))  # fmt: skip
            j = self._jobs[d.job_id]
            if share < self.threshold:
                if not j.stop:  # (a stop after a verdict says more)
                    why = f"its data wait is under the {100 * self.threshold:.0f}% of the step"
                    self._stop(d, j, j.workers, f"{why} this rule acts on", held=True)
                continue
            now = d.ts_ns if now_ns is None else now_ns
            if j.stop or not self._may_go(d, j, now):
                continue
            if j.workers != ev.get("loader_workers", j.workers) and j.workers > 0:
                continue  # its loader facts are of the workers before: wait for fresh ones
            if (
                j.workers > 0
                and "loader_workers" in ev
                and ev.get("loader_bound", 0.0)
                not in (
                    BOUND_IO,
                    BOUND_CPU,
                )
            ):
                continue  # the workers just changed: their CPU is judged on the next samples
            rec = self._next(d, j, share, now)
            if rec is not None:
                recs.append(rec)
        return recs

    def _may_go(self, d: Diagnosis, j: _Loader, now: int) -> bool:
        """Whether the last change is judged (its verdict, else the cooldown) and helped."""
        if j.planned is None:
            return j.last_emit is None or now - j.last_emit >= self.cooldown_ns
        frm, to, when = j.planned
        v = self.outcomes.last(d.job_id, KNOB_NUM_WORKERS)
        if (
            v is None
            or v["value"] != to
            or v["ts_ns"] < when - 60 * NS
            or v.get("command", f"{to}@{v['ts_ns']}") == j.judged
        ):
            return now - when >= self.cooldown_ns  # no verdict: the cooldown, as before
        j.judged = v.get("command", f"{to}@{v['ts_ns']}")
        j.known_ns = max(j.known_ns, int(v["ts_ns"]))
        gain = float(v["gain"])
        pct = f"{100 * gain:+.0f}%" if gain == gain else "an unknown share"
        if v["status"] == "rolled_back":
            restored = v.get("restored")
            j.workers = int(restored) if isinstance(restored, int | float) else frm
            return self._stop(d, j, j.workers, f"the last step {frm} → {to} workers changed the "
                              f"step time by {pct} and was rolled back", gain)  # fmt: skip
        j.workers = to  # kept: the job runs it (its step reports may still be on their way)
        if not gain >= self.min_step_gain:
            return self._stop(d, j, to, f"the last step {frm} → {to} workers gained {pct}, "
                              f"less than {100 * self.min_step_gain:.0f}%", gain)  # fmt: skip
        j.planned, j.last_emit = None, None  # kept, with a real gain: the next step at once
        return True

    def _stop(
        self,
        d: Diagnosis,
        j: _Loader,
        at: int,
        why: str,
        gain: float = math.nan,
        *,
        held: bool = False,
    ) -> bool:
        """Stop growing at ``at`` workers and say why: for good after a verdict, or while a
        bound holds (``held``: judged again at every diagnosis)."""
        if not held:
            j.stop, j.stop_at, j.planned = why, at, None
        if why == j.noted:
            return False
        j.noted = why
        ev = {"loader_stopped": 1.0, "loader_stopped_at": float(at)}
        if gain == gain:
            ev["last_step_gain_pct"] = round(100 * gain, 2)
        self._notes.append((d.job_id, d.bottleneck, why, ev))
        return False

    def _next(self, d: Diagnosis, j: _Loader, share: float, now: int) -> Recommendation | None:
        current = j.workers
        budget = min(j.budgets.values()) if j.budgets else int(d.evidence.get("cpu_budget", 0))
        fit = max(1, min(self.max_workers, budget - 1)) if budget else self.max_workers
        bound = d.evidence.get("loader_bound", 0.0)
        s = min(share, 0.95)
        if current == 0 or bound not in (BOUND_IO, BOUND_CPU):
            first = 1 if current == 0 and not budget else fit  # a first worker is always safe
            target = loader_workers_needed(s, current, max_workers=first)
            how = (
                f"at most {fit}: the rank's {budget} CPU(s) less one"
                if budget
                else "one: the rank's CPU budget is not known yet"
                if current == 0
                else ""
            )
            if target <= current:
                self._stop(d, j, current, f"{current} workers fill the rank's {budget} CPU(s) "
                           "less one for the training loop", held=True)  # fmt: skip
                return None
        elif bound == BOUND_CPU:
            target = min(loader_workers_needed(s, current, max_workers=fit), fit)
            how = f"CPU-bound: fitted to the rank's {budget} CPU(s) less one"
            if target <= current:  # (never fewer: a starvation does not lower workers)
                why = (
                    f"the loader is CPU-bound at the rank's CPU budget ({current} workers "
                    f"and the training loop on {budget} CPU(s))"
                )
                self._stop(d, j, current, why, held=True)
                return None
        else:
            room, limit = self._io_room(d, j)
            model = loader_workers_needed(s, current, max_workers=max(room, current + 1))
            target = min(max(current + 1, min(model, 2 * current)), room)
            how = f"I/O-bound: the next verified step ({limit})"
            if target <= current:
                self._stop(d, j, current, f"the loader is I/O-bound and {limit} holds it at "
                           f"{current} workers", held=True)  # fmt: skip
                return None
        if target <= current:
            return None  # never the value the job runs, nor fewer workers
        if self.outcomes.discouraged(d.job_id, KNOB_NUM_WORKERS, current, target):
            return None
        gain, confidence, learned = self.outcomes.adjust(
            d.job_id, KNOB_NUM_WORKERS, current, target,
            prior_pct=100 * expected_step_gain(s, current, target), confidence=d.confidence,
        )  # fmt: skip
        j.last_emit, j.planned = now, (current, target, now)
        if j.noted:  # it acts again: what it said about stopping no longer holds
            j.noted = ""
            self._notes.append((d.job_id, d.bottleneck, "", {}))
        n = len(d.ranks)
        where = f"{n} ranks wait" if n > 1 else f"rank {d.ranks[0]} waits" if n else "the job waits"
        return Recommendation(
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
                f"{where} for input {100 * share:.0f}% of each step (diagnosis "
                f"{d.diagnosis_id}, on the critical path); {current} loader workers cannot keep "
                f"up, {target} can"
                + (f" ({how})" if how else "")
                + (f"; {learned}" if learned else "")
            ),
            evidence={
                **{k: float(v) for k, v in d.evidence.items()},
                "data_wait_share": round(share, 4),
                "num_workers": float(current),
                "onset_s": d.onset_ns / NS,
            },
        )

    def _io_room(self, d: Diagnosis, j: _Loader) -> tuple[int, str]:
        """The most workers an I/O-bound loader may get, and what sets it."""
        room, limit = (j.bound, "the job's own bound") if j.bound else (self.max_workers, "")
        limit = limit or "perfloop's bound"
        ev = d.evidence
        rss, workers = ev.get("loader_rss_bytes", 0.0), ev.get("loader_workers", 0.0)
        total, used = ev.get("sys_mem_total_bytes", 0.0), ev.get("sys_mem_used_bytes", 0.0)
        if rss > 0 and workers >= 1 and total > 0:
            per = rss / workers
            mem = int(workers + self.mem_share * max(0.0, total - used) / per)
            if mem < room:
                room, limit = mem, f"the memory bound ({per / 2**20:.0f} MiB a worker)"
        return room, f"at most {room}: {limit}"

    # -- component protocol ------------------------------------------------------------------
    def forget(self, job_id: str) -> None:
        """The job ended: drop what this rule keeps of it."""
        self._jobs.pop(job_id, None)

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
            "jobs": {job: asdict(j) for job, j in self._jobs.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.threshold = state["threshold"]
        self.cooldown_ns = state["cooldown_ns"]
        self._jobs = {}
        for job, d in state.get("jobs", {}).items():
            j = _Loader(**d)
            if j.budgets is not None:
                j.budgets = {int(r): b for r, b in j.budgets.items()}
            if j.planned is not None:
                j.planned = (j.planned[0], j.planned[1], j.planned[2])
            self._jobs[job] = j
        for job, workers in state.get("workers", {}).items():  # a snapshot before per-job state
            self._jobs.setdefault(job, _Loader()).workers = workers
