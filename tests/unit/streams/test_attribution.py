"""Straggler attribution on DDP jobs as the hooks report them: the rank the others wait for
at the all-reduce is named, never the ranks that wait; checkpoints, evaluations and data
waits are not compute; a saturated node does not hide a rank slowed on its own CPUs."""

from __future__ import annotations

import numpy as np
import pytest

from perfloop.schemas import Diagnosis, JobInfo
from perfloop.streams.funnel import Funnel, actionable
from perfloop.streams.steps import StepAnalysis
from tests.unit.streams._ddp import T0, DDPJob


def opened(diags: list[Diagnosis], bottleneck: str) -> list[Diagnosis]:
    return [d for d in diags if d.state == "open" and d.bottleneck == bottleneck]


def named(diags: list[Diagnosis], bottleneck: str = "straggler") -> set[int]:
    return {r for d in opened(diags, bottleneck) for r in d.ranks}


@pytest.mark.parametrize(("ranks", "slow"), [(2, 1), (3, 0), (4, 2)])
def test_the_rank_the_others_wait_for_is_named_not_the_ranks_that_wait(
    ranks: int, slow: int
) -> None:
    job = DDPJob(ranks, seed=ranks)
    job.steps(20)
    extra = np.zeros(ranks)
    extra[slow] = 40.0  # as in the issue: one rank 40 ms slower a step
    job.steps(60, extra_ms=extra)
    diags = job.feed(Funnel())
    assert named(diags) == {slow}
    (d,) = opened(diags, "straggler")
    assert d.critical_path and not d.explained_by and d in actionable([d])
    assert d.evidence["lateness_ms"] == pytest.approx(40.0, rel=0.25)
    assert "wait" in d.summary


def test_before_the_change_the_waiting_rank_looked_slowest() -> None:
    """The evidence the old detector read: rank 0, which waits, has the longest backward."""
    job = DDPJob(2)
    job.steps(20, extra_ms=[0.0, 40.0])
    spans = [b for _, b in job.items if getattr(b, "kind", "") == "span"]
    bwd = np.zeros(2)
    for b in spans:
        c = b.columns
        sel = (c["phase"] == "backward") & (c["depth"] == 0)
        np.add.at(bwd, c["rank"][sel], c["duration_ms"][sel])
    assert bwd[0] > bwd[1] + 20 * 20


def test_two_slow_ranks_of_four_are_both_named() -> None:
    job = DDPJob(4, seed=7)
    job.steps(20)
    job.steps(60, slow=[1.0, 1.6, 1.0, 1.6])
    assert named(job.feed(Funnel())) == {1, 3}


def _gpu_job(job: DDPJob) -> None:
    """Job info saying each rank drives a GPU (CPU saturation is a GPU job's bottleneck)."""
    for r in range(job.world):
        job.event(JobInfo(ts_ns=T0, job_id=job.job, node=job.node(r // job.per_node), rank=r,
                          world_size=job.world, gpu_count=1))  # fmt: skip


@pytest.mark.parametrize("gpus", [False, True])
def test_cpu_contention_on_one_rank_is_a_straggler_even_on_a_saturated_node(gpus: bool) -> None:
    job = DDPJob(2, seed=3)
    if gpus:
        _gpu_job(job)
    job.steps(20)
    job.cpu[:] = 100.0  # the other process and both ranks keep every CPU busy
    job.steps(60, slow=[1.0, 1.8], wait=[1.0, 1.8])  # everything of rank 1 is slower
    diags = job.feed(Funnel())
    assert named(diags) == {1}
    (d,) = opened(diags, "straggler")
    assert d.explained_by == "" and d.critical_path
    # a CPU job keeps its CPUs busy by design: no saturation to report
    assert named(diags, "cpu_saturation") == ({0, 1} if gpus else set())


def test_a_saturated_node_explains_stragglers_when_all_its_ranks_straggle() -> None:
    job = DDPJob(4, nodes=2, seed=5)
    _gpu_job(job)
    job.steps(20)
    job.cpu[1] = 100.0
    job.steps(60, slow=[1.0, 1.0, 1.7, 1.7])  # node 1 holds ranks 2 and 3
    diags = job.feed(Funnel())
    stragglers = opened(diags, "straggler")
    assert {r for d in stragglers for r in d.ranks} == {2, 3}
    assert all(d.explained_by == "cpu_saturation" for d in diags if d.bottleneck == "straggler"
               and d.state != "resolved" and d.ts_ns > stragglers[0].ts_ns + 2 * 10**9)  # fmt: skip


def test_a_healthy_job_with_checkpoints_and_evaluations_has_no_straggler() -> None:
    job = DDPJob(2, seed=11, noise=0.06)

    def ckpt(step: int) -> list[float]:  # rank 0 saves every 15 steps, 600 ms
        return [600.0, 0.0] if step % 15 == 14 else [0.0, 0.0]

    def evaluation(step: int) -> list[float]:  # rank 0 evaluates every 25 steps
        return [900.0, 0.0] if step % 25 == 24 else [0.0, 0.0]

    job.steps(120, checkpoint=ckpt, evaluate=evaluation)
    diags = job.feed(Funnel())
    assert not opened(diags, "straggler") and not opened(diags, "load_imbalance")


def test_a_rank_that_waits_for_data_is_starved_not_a_straggler() -> None:
    job = DDPJob(2, seed=2)
    job.steps(20)
    job.steps(60, wait=[1.0, 40.0])
    diags = job.feed(Funnel())
    assert not named(diags)
    assert 1 in named(diags, "dataloader_starvation")


def test_step_analysis_lateness_counts_the_comm_nested_in_backward() -> None:
    job = DDPJob(2, delay_ms=0)
    job.steps(25, extra_ms=[0.0, 40.0])
    sa = StepAnalysis(settle_s=0.0)
    for wall, item in sorted(job.items, key=lambda x: x[0]):
        sa.observe(item, wall)
        sa.tick(wall)
    records = sa.recent(job.job)
    assert len(records) >= 20
    assert all(r.slowest_rank == 1 for r in records[-20:])
    assert sa.scores(job.job)[1] > sa.scores(job.job)[0]
