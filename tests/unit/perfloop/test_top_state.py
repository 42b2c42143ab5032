"""What ``perfloop top`` shows, from the events it is fed: a simulated job's ranks (step time,
phase shares, GPU and CPU use) from its real decoded batches, and the loop's events (open
diagnoses, recommendations and the actuator's decisions, commands with their acks and
verdicts), each counted once however often it comes."""

from __future__ import annotations

import statistics

import pytest

from perfloop.cli._jobs_rows import ChangeSummary, DiagnosisSummary, JobRow
from perfloop.cli._top_lines import Seen
from perfloop.cli._top_state import TopState
from perfloop.schemas import (
    ActuationResult,
    Command,
    ConfigChange,
    Decision,
    Diagnosis,
    GroundTruth,
    JobLifecycle,
    PhaseSpan,
    Recommendation,
    StepEvent,
    decode_batch,
    encode_batch,
)
from tests.helpers import simulate

NS = 1_000_000_000
T0 = 1_800_000_000 * NS
JOB = "j1"


def _step(rank: int, step: int, ms: float = 100.0, wait: float = 0.0) -> StepEvent:
    return StepEvent(ts_ns=T0 + step * 100_000_000, job_id=JOB, node="n0", rank=rank, step=step,
                     step_time_ms=ms, data_wait_ms=wait)  # fmt: skip


def _diagnosis(state: str, **kw: object) -> Diagnosis:
    fields: dict[str, object] = dict(
        ts_ns=T0, job_id=JOB, node="n0", rank=-1, diagnosis_id="d1",
        bottleneck="dataloader_starvation", level="host", loop="training", state=state,
        onset_ns=T0 - 5 * NS, step_share=0.4, confidence=0.9, critical_path=True, ranks=[0, 1],
        summary="the ranks wait for input 40% of each step",
    )  # fmt: skip
    return Diagnosis(**(fields | kw))  # type: ignore[arg-type]


def test_a_simulated_jobs_ranks_from_its_decoded_batches() -> None:
    cfg, messages = simulate("straggler", 20.0)
    s = TopState()
    for m in messages:
        s.apply(m)
    (truth,) = [m for m in messages if isinstance(m, GroundTruth)]
    job = cfg.job_id
    summary = s.summary(job)
    assert (summary.state, summary.exit_code, summary.ranks, summary.nodes) == ("finished", 0, 4, 1)
    assert summary.model == cfg.model_name
    assert summary.step_ms is not None and summary.steps_per_s is not None
    # every step of every rank is about one step time: steps/s is its inverse, give or take
    assert summary.steps_per_s == pytest.approx(1000 / summary.step_ms, rel=0.2)
    lines = s.rank_lines(job)
    assert [r.rank for r in lines] == [0, 1, 2, 3]
    for r in lines:
        assert r.step > 100 and r.step_ms is not None and r.last_ms is not None
        assert sum(r.shares.values()) == pytest.approx(1.0, abs=1e-4)
        assert r.gpu_util_pct is not None and r.cpu_pct is not None
    # the straggler computes longer; the others wait for it in the all-reduce
    comm = {r.rank: r.shares["comm"] for r in lines}
    (slow,) = truth.ranks
    assert comm[slow] == min(comm.values())
    assert statistics.median(comm.values()) > 3 * comm[slow]


def test_a_step_or_span_in_the_seed_and_live_counts_once() -> None:
    s = TopState()
    for step in range(5):
        s.add_step(JOB, "n0", 0, T0 + step * NS, step, 100.0)
        s.add_span(JOB, "n0", 0, step, "forward", 30.0, seeded=True)
        s.add_span(JOB, "n0", 0, step, "backward", 60.0, seeded=True)
    before = s.rank_lines(JOB)
    live = {"ts_ns": [T0 + 4 * NS], "rank": [0], "step": [4], "step_time_ms": [100.0]}
    s.apply(decode_batch(encode_batch("step", live, job_id=JOB, node="n0")))
    s.apply(PhaseSpan(ts_ns=T0 + 4 * NS, job_id=JOB, node="n0", rank=0, step=4,
                      phase="forward", name="forward", duration_ms=30.0))  # fmt: skip
    assert s.rank_lines(JOB) == before
    (r,) = before
    assert r.shares == pytest.approx(
        {"data_wait": 0, "forward": 0.3, "backward": 0.6, "comm": 0, "optimizer": 0, "other": 0.1}
    )
    assert r.steps_per_s == pytest.approx(1.0)


def test_without_spans_the_data_wait_comes_from_the_steps() -> None:
    s = TopState()
    for step in range(4):
        s.apply(_step(0, step, ms=100.0, wait=40.0))
    (r,) = s.rank_lines(JOB)
    assert r.shares["data_wait"] == pytest.approx(0.4)
    assert r.shares["other"] == pytest.approx(0.6)
    s.apply(_step(1, 0, ms=100.0))  # no spans and no wait: no shares to show
    assert s.rank_lines(JOB)[1].shares == {}


def test_only_the_last_seconds_of_steps_count() -> None:
    s = TopState(recent_s=30)
    for step in range(100):  # 10 s of 100 ms steps, then 31 s of 200 ms
        s.add_step(JOB, "n0", 0, T0 + step * NS // 10, step, 100.0)
    for i in range(1, 156):
        s.add_step(JOB, "n0", 0, T0 + 10 * NS + i * NS // 5, 100 + i, 200.0)
    assert s.summary(JOB).step_ms == 200.0
    assert s.rank_lines(JOB)[0].steps_per_s == pytest.approx(5.0)


def test_gpu_and_cpu_of_the_node_when_not_of_the_rank() -> None:
    s = TopState()
    s.apply(_step(0, 1))
    s.add_gpu(JOB, "n0", -1, 0, T0, 80.0, 40, 100, 300.0)
    s.add_gpu(JOB, "n0", -1, 1, T0, 60.0, 20, 100, 250.0)
    s.add_host(JOB, "n0", -1, T0, 150.0, loader_cpu_pct=35.0)
    (r,) = s.rank_lines(JOB)
    assert (r.gpu_util_pct, r.gpu_mem_pct, r.cpu_pct, r.loader_cpu_pct) == pytest.approx(
        (70.0, 30.0, 150.0, 35.0)
    )
    s.add_gpu(JOB, "n0", 0, 0, T0, 99.0, 50, 100, 300.0)
    s.add_host(JOB, "n0", 0, T0, 101.0)
    (r,) = s.rank_lines(JOB)
    assert (r.gpu_util_pct, r.gpu_mem_pct, r.cpu_pct) == pytest.approx((99.0, 50.0, 101.0))


def test_a_diagnosis_is_shown_while_open() -> None:
    s = TopState()
    s.apply(_diagnosis("open"))
    s.apply(_diagnosis("open", diagnosis_id="d2", bottleneck="compute_bound", level="kernel",
                       critical_path=False, step_share=0.9, ranks=[]))  # fmt: skip
    assert [d.bottleneck for d in s.diagnoses(JOB)] == ["dataloader_starvation", "compute_bound"]
    s.apply(_diagnosis("update", step_share=0.5, ranks=[0, 1, 2]))
    d = s.diagnoses(JOB)[0]
    assert (d.step_share, d.ranks, d.onset_ns) == (0.5, (0, 1, 2), T0 - 5 * NS)
    assert d.text() == "dataloader_starvation r0-2 50%"
    s.apply(_diagnosis("resolved"))
    assert [d.bottleneck for d in s.diagnoses(JOB)] == ["compute_bound"]


def test_a_change_goes_from_sent_to_its_verdict_and_never_back() -> None:
    s = TopState()
    cmd = Command(ts_ns=T0, job_id=JOB, node="actuator", rank=-1, rec_id="r1", seq=7,
                  knob="dataloader.num_workers", from_value=0, value=4,
                  expires_ts_ns=T0 + NS)  # fmt: skip
    s.apply(cmd)
    assert s.changes(JOB)[0].status == "sent"
    assert s.changes(JOB)[0].text() == "dataloader.num_workers 0→4 pending"

    def ack(status: str, rank: int, **kw: object) -> ActuationResult:
        return ActuationResult(ts_ns=T0 + NS, job_id=JOB, node="n0", rank=rank,
                               command_id=cmd.event_id, status=status, knob=cmd.knob, value=4,
                               **kw)  # type: ignore[arg-type]  # fmt: skip

    s.apply(ack("applied", 0, step=41))
    s.apply(ack("kept", 0, step=61, reason="it helped",
                evidence={"before_ms": 130.2, "after_ms": 96.4, "p_value": 0.0004}))  # fmt: skip
    s.apply(ack("applied", 1, step=42))  # another rank's late ack
    (c,) = s.changes(JOB)
    assert (c.status, c.step, c.before_ms, c.after_ms, c.reason) == (
        "kept", 41, 130.2, 96.4, "it helped"
    )  # fmt: skip
    assert c.text() == "dataloader.num_workers 0→4 kept"
    s.apply(cmd)  # the command again (the seed, then live): how far it got stays
    assert s.changes(JOB)[0].status == "kept"
    # an ack of a command sent before `top` looked shows what the ack says
    s.apply(ActuationResult(ts_ns=T0, job_id=JOB, node="n0", rank=0, command_id="old",
                            status="rolled_back", knob="torch.num_threads", value=8))  # fmt: skip
    assert s.job_lines(T0)[0].last_change == "dataloader.num_workers 0→4 kept"
    assert s.changes(JOB)[1].text() == "torch.num_threads ?→8 rolled back"


def test_a_recommendation_and_what_the_actuator_decided() -> None:
    s = TopState()
    rec = Recommendation(ts_ns=T0, job_id=JOB, node="streams", rank=-1, knob="torch.num_threads",
                         from_value=32, to_value=2, loop="fast", expected_gain_pct=40.0,
                         confidence=0.8, rationale="8 threads per CPU")  # fmt: skip
    s.apply(Decision(ts_ns=T0, job_id=JOB, node="a", rank=-1, rec_id=rec.event_id,
                     tier="auto", outcome="issued"))  # fmt: skip  # before its rec: nothing
    s.apply(rec)
    (r,) = s.recommendations(JOB)
    assert (r.knob, r.from_value, r.to_value, r.outcome) == ("torch.num_threads", "32", "2", "")
    s.apply(Decision(ts_ns=T0 + 1, job_id=JOB, node="a", rank=-1, rec_id=rec.event_id,
                     tier="approve", outcome="pending"))  # fmt: skip
    s.apply(rec)  # seen again: keeps the decision
    assert s.recommendations(JOB)[0].outcome == "pending"


def test_the_jobs_seen_running_ones_first() -> None:
    s = TopState()
    s.seed_jobs([
        JobRow("old", "finished", 4, 1, 98.0, 10.0, T0 - 900 * NS, T0 - 600 * NS, exit_code=0,
               last_change=ChangeSummary("dataloader.num_workers", "2", "4", "kept", T0)),
        JobRow("quiet", "running", 2, 1, 50.0, 20.0, T0 - 300 * NS, T0 - 100 * NS,
               diagnoses=(DiagnosisSummary("hang", "cluster_health", (1,), 1.0, True, "",
                                           "d-hang"),)),
    ])  # fmt: skip
    s.apply(JobLifecycle(ts_ns=T0 - 2 * NS, job_id=JOB, node="n0", rank=-1, state="started"))
    s.apply(_step(0, 1))
    s.apply(Seen("other", T0 - 10 * NS))
    s.apply(ConfigChange(ts_ns=T0, job_id="ops", node="cli", rank=-1, target="streams",
                         key="detect.x", value=1))  # fmt: skip  # names its issuer, no job
    lines = s.job_lines(T0)
    assert [(x.job_id, x.state) for x in lines] == [
        (JOB, "running"), ("other", "running"), ("quiet", "silent"), ("old", "finished")
    ]  # fmt: skip
    old, quiet = lines[3], lines[2]
    assert (old.step_ms, old.steps_per_s, old.exit_code) == (98.0, 10.0, 0)  # from the seed
    assert old.last_change == "dataloader.num_workers 2→4 kept"
    assert [d.bottleneck for d in quiet.diagnoses] == ["hang"]
    s.apply(_diagnosis("resolved", job_id="quiet", diagnosis_id="d-hang", bottleneck="hang"))
    assert s.diagnoses("quiet") == []
    s.job("not-yet")  # asked for with --job before it starts
    assert s.summary("not-yet", T0).state == "waiting"
    s.apply(JobLifecycle(ts_ns=T0, job_id=JOB, node="n0", rank=0, state="failed", exit_code=1))
    assert (s.summary(JOB, T0).state, s.summary(JOB, T0).exit_code) == ("failed", 1)
