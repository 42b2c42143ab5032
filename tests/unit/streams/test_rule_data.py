"""The data-wait rule on the loaders of the issue: an I/O-bound loader grows one verified step
at a time past the CPUs while each step helps, a CPU-bound one is fitted to the rank's CPUs,
and when perfloop stops with the job still starved its diagnosis says why."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.schemas import ActuationResult, Command, Diagnosis, JobInfo
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel
from perfloop.streams.outcomes import Outcomes
from perfloop.streams.rules import KNOB_NUM_WORKERS, DataWaitRule

NS = 1_000_000_000
GIB = float(1 << 30)


def _diag(t_s: float, *, share: float = 0.45, bound: float = 1.0, workers: float = 1.0,
          loader_cpu: float = 10.0, rss: float = 0.2 * GIB, used: float = 4 * GIB,
          total: float = 16 * GIB) -> Diagnosis:  # fmt: skip
    return Diagnosis(ts_ns=int(t_s * NS), job_id="j", node="n0", rank=0, diagnosis_id="d1",
                     bottleneck="dataloader_starvation", level="host", loop="training",
                     state="update", onset_ns=NS, step_share=share, confidence=0.9,
                     critical_path=True, ranks=[0],
                     evidence={"data_wait_share": share, "loader_bound": bound,
                               "loader_workers": workers, "loader_cpu_pct": loader_cpu,
                               "loader_rss_bytes": rss, "sys_mem_used_bytes": used,
                               "sys_mem_total_bytes": total})  # fmt: skip


class Job:
    """The rule with the job's facts, and a job agent that applies each recommendation and
    sends its verdict (a gain, or a rollback)."""

    def __init__(self, *, budget: int = 2, bound: int = 8, workers: int = 0) -> None:
        self.outcomes = Outcomes()
        self.rule = DataWaitRule(threshold=0.3, cooldown_s=30, max_workers=64,
                                 outcomes=self.outcomes)  # fmt: skip
        self.rule.observe_info(JobInfo(ts_ns=NS, job_id="j", node="n0", rank=0, cpu_count=2,
                                       extra={"cpu_budget": str(budget), "bounds."
                                              + KNOB_NUM_WORKERS: f"0,{bound}"}))  # fmt: skip
        self.rule.observe_workers("j", workers)
        self.workers = workers

    def recommend(self, t_s: float, **kw: Any) -> tuple[int, int] | None:
        recs = self.rule.evaluate([_diag(t_s, workers=max(self.workers, 1), **kw)])
        assert len(recs) <= 1
        return (int(recs[0].from_value), int(recs[0].to_value)) if recs else None

    def verdict(self, t_s: float, frm: int, to: int, gain: float, status: str = "kept",
                *, reported: bool = True) -> None:  # fmt: skip
        """The agent's verdict (a rollback names the value it restored), and with
        ``reported`` the job's step reports of the value it runs after it."""
        cmd = Command(ts_ns=int(t_s * NS), job_id="j", node="n0", rank=-1, seq=1,
                      knob=KNOB_NUM_WORKERS, from_value=frm, value=to,
                      expires_ts_ns=int((t_s + 60) * NS))  # fmt: skip
        self.outcomes.expect(cmd.event_id, frm, to)
        self.outcomes.observe(ActuationResult(
            ts_ns=int(t_s * NS), job_id="j", node="n0", rank=0, command_id=cmd.event_id,
            status=status, knob=KNOB_NUM_WORKERS, value=to if status == "kept" else frm,
            evidence={"before_ms": 100.0, "after_ms": 100.0 * (1 - gain)}))  # fmt: skip
        self.workers = to if status == "kept" else frm
        if reported:
            self.rule.observe_workers("j", self.workers, int((t_s + 0.1) * NS))


def test_an_io_bound_loader_grows_past_the_cpus_while_each_step_helps() -> None:
    job = Job(budget=2, bound=8)
    assert job.recommend(10, bound=0.0) == (0, 1), "no workers: fitted as before, CPUs less one"
    assert job.recommend(12) is None, "waits for the verdict"
    job.verdict(14, 0, 1, gain=0.30)
    assert job.recommend(14.5) == (1, 2), "kept with a real gain: the next step at once"
    job.verdict(17, 1, 2, gain=0.35)
    assert job.recommend(17.5, share=0.4) == (2, 4)
    job.verdict(20, 2, 4, gain=0.25)
    assert job.recommend(20.5, share=0.35) == (4, 8), "at most twice as many, within the bound"
    job.verdict(23, 4, 8, gain=0.01)  # too little: stop, and say why
    assert job.recommend(23.5) is None and job.recommend(90) is None
    ((jid, bottleneck, note, ev),) = job.rule.drain_notes()
    assert (jid, bottleneck) == ("j", "dataloader_starvation")
    assert "the last step 4 → 8 workers gained +1%, less than 5%" in note
    assert ev["loader_stopped_at"] == 8 and ev["last_step_gain_pct"] == pytest.approx(1.0)


def test_a_step_rolled_back_stops_the_growth() -> None:
    job = Job(workers=2)
    assert job.recommend(10) == (2, 4)
    job.verdict(13, 2, 4, gain=-0.02, status="rolled_back")
    assert job.recommend(13.5) is None and job.recommend(60) is None
    ((_, _, note, _),) = job.rule.drain_notes()
    assert "2 → 4 workers changed the step time by -2% and was rolled back" in note


def test_growth_stays_within_the_job_s_bound_and_the_memory_bound() -> None:
    job = Job(workers=6, bound=8)
    assert job.recommend(10) == (6, 8)
    job.verdict(12, 6, 8, gain=0.2)
    assert job.recommend(12.5) is None
    ((_, _, note, _),) = job.rule.drain_notes()
    assert "I/O-bound and at most 8: the job's own bound holds it at 8 workers" in note
    # 1 GiB a worker, 2 GiB available, half of it for the loader: one more worker
    job = Job(workers=2, bound=32)
    assert job.recommend(10, rss=2 * GIB, used=14 * GIB, total=16 * GIB) == (2, 3)


def test_a_cpu_bound_loader_is_fitted_to_the_rank_s_cpus() -> None:
    job = Job(budget=2, workers=1)
    assert job.recommend(10, bound=2.0, loader_cpu=95.0) is None
    ((_, _, note, _),) = job.rule.drain_notes()
    assert (
        "CPU-bound at the rank's CPU budget (1 workers and the training loop on 2 CPU(s))" in note
    )
    job = Job(budget=4, workers=1)
    assert job.recommend(10, bound=2.0, loader_cpu=95.0, share=0.6) == (1, 3)


def test_without_a_verdict_the_cooldown_applies() -> None:
    job = Job(workers=1)
    assert job.recommend(10) == (1, 2)
    assert job.recommend(30) is None
    assert job.recommend(41) == (1, 2), "tier observe: nothing applied, asked again"


def test_why_perfloop_stopped_is_on_the_diagnosis() -> None:
    f = Funnel()
    t0 = 1_700_000_000 * NS
    for i in range(12):
        t = t0 + (i + 1) * 100_000_000
        cols = {"ts_ns": [t], "rank": [0], "step": [i], "step_time_ms": [100.0],
                "data_wait_ms": [50.0], "num_workers": [4]}  # fmt: skip
        f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n0")), t)
        host = {"ts_ns": [t], "rank": [-1], "pid": [42], "loader_workers": [4],
                "loader_cpu_pct": [40.0], "proc_cpu_pct": [60.0]}  # fmt: skip
        f.observe(decode_batch(encode_batch("host", host, job_id="j", node="n0")), t)
    first = [d for k in range(8) for d in f.tick(t0 + 2 * NS + k * NS // 4)]
    (d,) = [d for d in first if d.bottleneck == "dataloader_starvation"]
    assert d.evidence["loader_bound"] == 1.0 and "I/O-bound" in d.summary, "rank -1: the only rank"
    assert d.evidence["loader_util"] == pytest.approx(0.1)
    f.annotate("j", "dataloader_starvation", "the last step 3 → 4 workers gained +1%, less than "
               "5%", {"loader_stopped": 1.0})  # fmt: skip
    (u,) = f.tick(t0 + 4 * NS)
    assert u.state == "update" and u.evidence["loader_stopped"] == 1.0
    assert u.summary.endswith("perfloop stops here: the last step 3 → 4 workers gained +1%, "
                              "less than 5%")  # fmt: skip


def test_the_next_step_needs_no_new_diagnosis_only_its_verdict_and_fresh_loader_facts() -> None:
    job = Job(budget=2, bound=8)
    rule = job.rule
    (first,) = rule.evaluate([_diag(10, bound=0.0, workers=0.0)], now_ns=10 * NS, job="j")
    assert (first.from_value, first.to_value) == (0, 1)
    job.verdict(12, 0, 1, gain=0.4)
    # the engine asks at every tick of the job: the stored diagnosis still describes the loop
    # loading its own batches (0 workers), so it waits for the facts of the worker it runs now
    assert rule.evaluate([], now_ns=12 * NS, job="j") == []
    assert rule.drain_notes() == []
    (rec,) = rule.evaluate([_diag(13, workers=1.0)], now_ns=13 * NS, job="j")
    assert (rec.from_value, rec.to_value) == (1, 2), "I/O-bound: no cooldown after a kept step"


def test_a_kept_step_is_not_asked_again_while_the_job_s_reports_catch_up() -> None:
    # the verdict comes straight from the agent; the job's step reports of the new value come
    # later, behind the reports of the steps before the change (a quick run: 0 → 1 was asked
    # three more times after it was kept, and applied again)
    job = Job(budget=2, bound=8)
    rule = job.rule
    (first,) = rule.evaluate([_diag(10, bound=0.0, workers=0.0)], now_ns=10 * NS, job="j")
    assert (first.from_value, first.to_value) == (0, 1)
    job.verdict(12, 0, 1, gain=0.4, reported=False)
    for k in range(8):  # the engine asks at every tick of the job
        assert rule.evaluate([], now_ns=12 * NS + k * NS // 4, job="j") == []
    rule.observe_workers("j", 0, int(11.5 * NS))  # a report of a step before the change
    stale = _diag(13, bound=0.0, workers=0.0)  # a diagnosis update of those steps
    assert rule.evaluate([stale], now_ns=13 * NS, job="j") == []
    assert rule.workers("j", 13 * NS) == 1
    settling = _diag(14, bound=0.0, workers=1.0, loader_cpu=0.0)
    settling.evidence["loader_settling"] = 1.0
    assert rule.evaluate([settling], now_ns=14 * NS, job="j") == [], "its CPU is not judged yet"
    (rec,) = rule.evaluate([_diag(15, workers=1.0)], now_ns=15 * NS, job="j")
    assert (rec.from_value, rec.to_value) == (1, 2)
    assert rule.evaluate([_diag(15.25, workers=1.0)], now_ns=int(15.25 * NS), job="j") == []


def test_a_rollback_restores_the_value_before_and_stops() -> None:
    job = Job(workers=2)
    assert job.recommend(10) == (2, 4)
    job.verdict(13, 2, 4, gain=-0.3, status="rolled_back", reported=False)
    assert job.recommend(13.5) is None and job.recommend(60) is None, "not asked again"
    assert job.rule.workers("j", 60 * NS) == 2
    ((_, _, note, ev),) = job.rule.drain_notes()
    assert "2 → 4 workers changed the step time by -30% and was rolled back" in note
    assert ev["loader_stopped_at"] == 2


def test_a_starvation_never_lowers_the_workers() -> None:
    # I/O-bound workers grew to 3 on 2 CPUs until they filled them: the loader is now
    # CPU-bound past the budget less one. It stays at 3, and the diagnosis says why.
    job = Job(budget=2, workers=3)
    assert job.recommend(10, bound=2.0, loader_cpu=120.0) is None
    ((_, _, note, ev),) = job.rule.drain_notes()
    assert "CPU-bound at the rank's CPU budget (3 workers" in note and ev["loader_stopped_at"] == 3
    # nor when nothing says what bounds it (no host readings): the fit is below what it runs
    assert job.recommend(20, bound=0.0) is None


def test_a_first_worker_while_the_rank_s_budget_is_unknown() -> None:
    rule = DataWaitRule(threshold=0.3, cooldown_s=30, max_workers=64)
    rule.observe_workers("j", 0)
    (rec,) = rule.evaluate([_diag(10, bound=0.0, workers=0.0, share=0.7)], now_ns=10 * NS)
    assert (rec.from_value, rec.to_value) == (0, 1) and "not known yet" in rec.rationale


def test_under_the_rule_s_share_it_says_so_and_withdraws_it_when_it_acts_again() -> None:
    job = Job(workers=2)
    assert job.recommend(10, share=0.2) is None
    ((_, _, note, ev),) = job.rule.drain_notes()
    assert note == "its data wait is under the 30% of the step this rule acts on"
    assert ev["loader_stopped_at"] == 2
    assert job.recommend(12, share=0.45) == (2, 4)
    assert job.rule.drain_notes() == [("j", "dataloader_starvation", "", {})]
    f = Funnel()
    t0 = 1_700_000_000 * NS
    for i in range(12):
        t = t0 + (i + 1) * 100_000_000
        cols = {"ts_ns": [t], "rank": [0], "step": [i], "step_time_ms": [100.0],
                "data_wait_ms": [50.0]}  # fmt: skip
        f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n0")), t)
    [d for k in range(8) for d in f.tick(t0 + 2 * NS + k * NS // 4)]
    f.annotate("j", "dataloader_starvation", note, ev)
    (said,) = f.tick(t0 + 4 * NS)
    assert said.summary.endswith(f"perfloop stops here: {note}")
    f.annotate("j", "dataloader_starvation", "", {})
    (again,) = f.tick(t0 + 5 * NS)
    assert "perfloop stops here" not in again.summary and "loader_stopped" not in again.evidence
