"""Hangs from the ranks' own progress reports: the rank that is not in the collective the
others wait in is the culprit; a checkpoint or an evaluation is no hang, within a bound."""

from __future__ import annotations

from perfloop.schemas import Diagnosis
from perfloop.streams.funnel import DetectConfig, Funnel
from tests.unit.streams._ddp import DDPJob, S


def hangs(diags: list[Diagnosis]) -> list[Diagnosis]:
    return [d for d in diags if d.bottleneck == "hang" and d.state == "open"]


def test_the_rank_that_stopped_before_the_collective_is_the_culprit() -> None:
    job = DDPJob(3, seed=1)
    job.steps(40)
    onset = int(job.start.max() * 1e6)
    job.pause(20.0, {0: "comm", 1: "backward", 2: "comm"})
    (d,) = hangs(job.feed(Funnel(), tail_s=0.0))
    assert (d.ranks, d.rank) == ([1], 1)
    assert 4 * S <= d.ts_ns - onset <= 7 * S, "after the 4 s floor, within a report or two"
    assert "rank 1 in backward" in d.summary and d.evidence["ranks_waiting"] == 2.0


def test_a_rank_that_reports_nothing_while_the_others_wait_is_the_culprit() -> None:
    job = DDPJob(2, seed=2)
    job.steps(40)
    job.pause(12.0, {0: "comm"})  # rank 1's process is frozen: no reports
    (d,) = hangs(job.feed(Funnel(), tail_s=0.0))
    assert d.ranks == [1] and "rank 1 silent" in d.summary


def test_a_checkpoint_or_an_evaluation_is_no_hang() -> None:
    job = DDPJob(2, seed=3)
    job.steps(40)
    job.pause(30.0, {0: "checkpoint", 1: "comm"})  # rank 0 saves, rank 1 waits at the barrier
    job.steps(20)
    job.pause(30.0, {0: "eval", 1: "eval"})
    job.steps(20)
    assert not hangs(job.feed(Funnel()))


def test_a_checkpoint_past_the_bound_is_a_hang_of_its_rank() -> None:
    job = DDPJob(2, seed=4)
    job.steps(40)
    job.pause(30.0, {0: "checkpoint", 1: "comm"})
    cfg = DetectConfig().replace_key("hang.max_pause_s", 10.0)
    (d,) = hangs(job.feed(Funnel(cfg), tail_s=0.0))
    assert d.ranks == [0] and "checkpoint or evaluation" in d.summary


def test_it_resolves_when_steps_complete_again() -> None:
    job = DDPJob(2, seed=5)
    job.steps(40)
    job.pause(10.0, {0: "comm", 1: "forward"})
    job.steps(10)
    diags = job.feed(Funnel())
    (d,) = hangs(diags)
    assert [x.state for x in diags if x.diagnosis_id == d.diagnosis_id][-1] == "resolved"
