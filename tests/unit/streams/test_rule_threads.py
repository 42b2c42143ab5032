"""The thread rule and the thread-oversubscription diagnosis it acts on, per rank from each
rank's real CPU budget (the issue: 2 ranks on 2 CPUs with the script's own
set_num_threads(1) were given 2 threads each, and step time tripled)."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.schemas import Diagnosis, JobInfo
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel
from perfloop.streams.rules import ThreadRule

NS = 1_000_000_000


def _info(rank: int = 0, *, threads: int, budget: int | None = 1, by_script: bool = False,
          cpus: int = 2, local: int = 2, affinity: int | None = None, gpus: int = 0,
          bound: int | None = None, job: str = "j") -> JobInfo:  # fmt: skip
    extra = {"torch.num_threads": str(threads)}
    if budget is not None:
        extra["cpu_budget"] = str(budget)
    if by_script:
        extra["torch.num_threads.by_script"] = str(threads)
    if affinity is not None:
        extra["cpu_affinity"] = str(affinity)
    if bound is not None:
        extra["bounds.torch.num_threads"] = f"1,{bound}"
    return JobInfo(ts_ns=NS, job_id=job, node="n0", rank=rank, world_size=local,
                   local_world_size=local, cpu_count=cpus, gpu_count=gpus, extra=extra)  # fmt: skip


def _rule(*infos: JobInfo, steps: int = 40, wait: float = 0.1, workers: int = 0) -> ThreadRule:
    rule = ThreadRule(cooldown_s=30, settle_steps=30)
    for info in infos:
        rule.observe_info(info)
    rule.observe_steps("j", steps=steps, step_ms=100.0 * steps, wait_ms=100.0 * wait * steps,
                       workers=workers)  # fmt: skip
    return rule


def _over(share: float = 0.6, loader_cores: float = 0.0, state: str = "open") -> Diagnosis:
    return Diagnosis(ts_ns=5 * NS, job_id="j", node="n0", rank=0, diagnosis_id="d-threads",
                     bottleneck="thread_oversubscription", level="host", loop="inner",
                     state=state, onset_ns=NS, step_share=share, confidence=0.8,
                     critical_path=state != "resolved", ranks=[0],
                     evidence={"loader_cores": loader_cores})  # fmt: skip


def _recs(rule: ThreadRule, t_s: float = 10, **kw: Any) -> list[tuple[Any, Any]]:
    return [(r.from_value, r.to_value) for r in rule.evaluate("j", int(t_s * NS), **kw)]


def test_the_issue_two_ranks_on_two_cpus_with_the_scripts_own_one_thread_get_nothing() -> None:
    rule = _rule(*(_info(r, threads=1, budget=1, by_script=True) for r in (0, 1)), wait=0.0)
    assert _recs(rule) == []


def test_an_older_producer_s_shared_affinity_is_divided_among_the_local_ranks() -> None:
    infos = [_info(r, threads=1, budget=None, affinity=2, cpus=2, local=2) for r in (0, 1)]
    assert _recs(_rule(*infos, wait=0.0)) == [], "2 CPUs shared by 2 ranks: 1 each"


def test_idle_cores_are_filled_up_to_the_budget_less_the_loader_workers() -> None:
    infos = [_info(r, threads=1, budget=8, cpus=16) for r in (0, 1)]  # a launcher's default
    (rec,) = _rule(*infos, workers=2).evaluate("j", 10 * NS)
    assert (rec.from_value, rec.to_value, rec.rank) == (1, 6, -1)
    assert "may use 8 CPU(s)" in rec.rationale and rec.evidence["cpu_budget"] == 8.0


def test_a_count_the_script_set_is_never_raised() -> None:
    infos = [_info(r, threads=2, budget=8, cpus=16, by_script=True) for r in (0, 1)]
    assert _recs(_rule(*infos)) == []


def test_the_smallest_budget_of_the_ranks_and_the_jobs_own_bound_hold() -> None:
    rule = _rule(_info(0, threads=1, budget=8, cpus=16), _info(1, threads=1, budget=3, cpus=16))
    assert _recs(rule) == [(1, 3)]
    rule = _rule(*(_info(r, threads=1, budget=8, cpus=16, bound=4) for r in (0, 1)))
    assert _recs(rule) == [(1, 4)]


def test_oversubscription_is_lowered_on_its_diagnosis_only() -> None:
    infos = [_info(r, threads=16, budget=1, by_script=True) for r in (0, 1)]
    rule = _rule(*infos)
    assert _recs(rule) == [], "no diagnosis, no change"
    (rec,) = rule.evaluate("j", 10 * NS, diagnoses=[_over(0.6)])
    assert (rec.from_value, rec.to_value) == (16, 1)
    assert "d-threads" in rec.rationale and rec.expected_gain_pct == pytest.approx(60.0)
    assert _recs(rule, t_s=20) == [], "cooldown"


def test_busy_loader_workers_take_their_cores_from_the_threads() -> None:
    rule = _rule(_info(threads=8, budget=4, local=1, cpus=4), workers=2)
    assert _recs(rule, diagnoses=[_over(loader_cores=1.9)]) == [(8, 2)]
    rule = _rule(_info(threads=8, budget=4, local=1, cpus=4), workers=4)
    # workers that wait on storage burn little CPU: they leave the cores to the threads
    assert _recs(rule, diagnoses=[_over(loader_cores=0.3)]) == [(8, 4)]


def test_a_resolved_diagnosis_stops_the_lowering_and_a_gpu_job_is_left_alone() -> None:
    rule = _rule(_info(threads=16, budget=1))
    rule.observe_diagnoses([_over(), _over(state="resolved")])
    assert _recs(rule) == []
    rule = _rule(_info(threads=16, budget=1, gpus=1))
    assert _recs(rule, diagnoses=[_over()]) == []


def test_the_rule_s_state_survives_a_snapshot() -> None:
    rule = _rule(*(_info(r, threads=16, budget=1) for r in (0, 1)))
    rule.observe_diagnoses([_over()])
    again = ThreadRule(cooldown_s=30, settle_steps=30)
    again.restore(rule.snapshot())
    assert _recs(again) == [(16, 1)]


# -- the diagnosis ------------------------------------------------------------------------------
def _job(threads: int, budget: int, *, workers: int = 0, loader_cpu: float = 0.0,
         wait_ms: float = 5.0, steps: int = 30, ranks: int = 1,
         children: int | None = None) -> list[Diagnosis]:  # fmt: skip
    f = Funnel()
    t0 = 1_700_000_000 * NS
    for r in range(ranks):
        f.observe_event(_info(r, threads=threads, budget=budget, by_script=True, local=ranks), t0)
    for i in range(steps):
        t = t0 + (i + 1) * 100_000_000
        cols = {"ts_ns": [t] * ranks, "rank": list(range(ranks)), "step": [i] * ranks,
                "step_time_ms": [100.0] * ranks, "data_wait_ms": [wait_ms] * ranks,
                "num_workers": [workers] * ranks}  # fmt: skip
        f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n0")), t)
        host = {"ts_ns": [t] * ranks, "rank": list(range(ranks)),
                "loader_workers": [workers if children is None else children] * ranks,
                "loader_cpu_pct": [loader_cpu] * ranks,
                "proc_cpu_pct": [100.0] * ranks, "sys_cpu_pct": [100.0] * ranks}  # fmt: skip
        f.observe(decode_batch(encode_batch("host", host, job_id="j", node="n0")), t)
    out = []
    for k in range(20):
        out += f.tick(t0 + steps * 100_000_000 + k * 250_000_000)
    return [d for d in out if d.state == "open"]


def test_threads_past_the_budget_while_compute_dominates_are_diagnosed() -> None:
    (d,) = _job(threads=16, budget=2)
    assert (d.bottleneck, d.level, d.ranks, d.critical_path) == (
        "thread_oversubscription", "host", [0], True)  # fmt: skip
    assert d.evidence["num_threads"] == 16 and d.evidence["cpu_budget"] == 2
    assert d.step_share == pytest.approx(0.95 * (1 - 2 / 16), abs=0.01)
    (d,) = _job(threads=1, budget=1, ranks=2, workers=2, loader_cpu=180.0)
    assert d.ranks == [0, 1], "busy loader workers share the rank's budget"


@pytest.mark.parametrize(
    ("threads", "budget", "workers", "loader_cpu", "wait_ms"),
    [
        (2, 2, 0, 0.0, 5.0),  # fits
        (1, 2, 4, 20.0, 5.0),  # workers waiting on storage burn little CPU
        (16, 2, 0, 0.0, 80.0),  # the step waits for data, not for the threads
    ],
)
def test_what_is_not_thread_oversubscription(
    threads: int, budget: int, workers: int, loader_cpu: float, wait_ms: float
) -> None:
    found = _job(threads, budget, workers=workers, loader_cpu=loader_cpu, wait_ms=wait_ms)
    assert not [d for d in found if d.bottleneck == "thread_oversubscription"]


def test_a_process_the_script_started_beside_its_loader_is_no_loader_worker() -> None:
    """The host sampler sees every child of a rank; a CPU burner one rank started (the real
    bench's contention straggler) is not a loader worker of its loader without workers."""
    found = _job(1, 1, workers=0, children=1, loader_cpu=95.0)
    assert not [d for d in found if d.bottleneck == "thread_oversubscription"]
    (d,) = _job(1, 1, workers=1, children=2, loader_cpu=190.0)
    assert d.evidence["loader_workers"] == 1, "as many workers as its steps say"


def _feed(threads: int, workers_at: Any, cpu_at: Any, first: int = 9) -> list[Diagnosis]:
    """One rank of ``threads`` on 2 CPUs, steps every 100 ms for 6 s, a host reading each
    second (the sampler's; the first with step ``first``) with ``workers_at(i)`` loader
    workers at ``cpu_at(i)`` % CPU; every tick's open `thread_oversubscription` findings."""
    f = Funnel()
    t0 = 1_700_000_000 * NS
    f.observe_event(_info(0, threads=threads, budget=2, by_script=True), t0)
    opened: list[Diagnosis] = []
    for i in range(60):
        t = t0 + (i + 1) * 100_000_000
        workers = workers_at(i)
        cols = {"ts_ns": [t], "rank": [0], "step": [i], "step_time_ms": [100.0],
                "data_wait_ms": [5.0], "num_workers": [workers]}  # fmt: skip
        f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n0")), t)
        if i % 10 == first:  # the sampler's second
            host = {"ts_ns": [t], "rank": [0], "loader_workers": [workers],
                    "loader_cpu_pct": [cpu_at(i)], "proc_cpu_pct": [100.0],
                    "sys_cpu_pct": [100.0]}  # fmt: skip
            f.observe(decode_batch(encode_batch("host", host, job_id="j", node="n0")), t)
        opened += [d for d in f.tick(t) if d.state == "open"]
    return [d for d in opened if d.bottleneck == "thread_oversubscription"]


def _regrown(loader_cpu: float) -> list[Diagnosis]:
    """1 thread, no workers for 3 s, then 3 workers (as perfloop's loader rule grows them)
    that the host sampler first sees at 0 % (their start) and then measures at
    ``loader_cpu``."""
    return _feed(
        1,
        workers_at=lambda i: 0 if i < 30 else 3,
        cpu_at=lambda i: 0.0 if i < 40 else loader_cpu,  # a new worker's first reading: 0
    )


def test_workers_that_just_started_are_judged_on_their_next_readings_not_as_full_cores() -> None:
    """A new worker is not yet measured: counting each as a busy core read perfloop's own
    loader change as oversubscription (1 thread + 3 "cores" on 2 CPUs) on the real bench."""
    assert _regrown(loader_cpu=45.0) == [], "workers waiting on storage: no oversubscription"
    found = _regrown(loader_cpu=290.0)
    assert found, "3 busy workers beside 1 thread on 2 CPUs are oversubscription"
    assert found[0].evidence["loader_cores"] == pytest.approx(2.9, abs=0.01)


def test_threads_past_the_budget_on_their_own_need_no_reading_of_the_workers() -> None:
    """A loader whose worker count changes at every host reading is never measured; the
    wait for its workers' next readings must not hide 16 threads on 2 CPUs."""

    def workers_at(i: int) -> int:  # read from the first step on, a new count each reading
        return 1 + (i // 10) % 2

    found = _feed(16, workers_at, cpu_at=lambda i: 0.0, first=0)
    assert found and found[0].evidence["num_threads"] == 16
    assert _feed(2, workers_at, cpu_at=lambda i: 0.0, first=0) == [], (
        "2 threads on 2 CPUs and workers not measured yet: nothing to judge"
    )
