"""The funnel's detectors on hand-made pipelines (ranks that send and receive point to
point): a pipeline's sends and receives are not exposed comm, a stage cut heavier than the
others is its load imbalance, a stage slowed from outside is its straggler against its own
past, and what must *not* raise either."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.streams.funnel import Funnel
from tests.unit.streams._synth import S, Synth, opened, roots


@pytest.mark.parametrize(("name", "exposed"), [("comm", True), ("recv", False), ("send", False)])
def test_a_pipelines_sends_and_receives_are_not_exposed_comm(name: str, exposed: bool) -> None:
    # 80 of ~170 ms of every step in communication: a collective no rank hides is exposed
    # comm; a pipeline's point-to-point waits (its bubble) are not, whatever their share
    job = Synth(comm=80.0, comm_name=name)
    job.steps(60)
    diags = job.feed(Funnel())
    assert len(opened(diags, "exposed_comm")) == exposed
    assert not (roots(diags) - {"exposed_comm"})


@pytest.mark.parametrize("spans", [True, False])
@pytest.mark.parametrize(("name", "pipeline"), [("comm", False), ("recv", True)])
def test_a_pipelines_heavier_stage_is_its_load_imbalance(
    name: str, pipeline: bool, spans: bool
) -> None:
    # rank 3 computes twice what the others do, every step: among data-parallel peers it is
    # the straggler they wait for; a pipeline's stages (ranks that send and receive point to
    # point) do different work by design, so a heavier stage is no straggler, but the whole
    # pipeline runs at its pace: a load imbalance on that stage (with spans or from its
    # collectives alone), a third of each step lost (1 - mean/max: 1 - 112.5/180)
    job = Synth(comm_name=name, spans=spans)
    job.steps(20)
    onset = job.t
    job.steps(60, compute=lambda s: [90, 90, 90, 180])
    diags = job.feed(Funnel())
    assert {r for d in opened(diags, "straggler") for r in d.ranks} == (set() if pipeline else {3})
    imbalanced = opened(diags, "load_imbalance")
    if not pipeline:
        assert not imbalanced
        return
    (d,) = imbalanced
    assert d.ranks == [3]
    assert d.evidence["imbalance"] == pytest.approx(0.375, abs=0.03)
    assert d.evidence["stage_compute_ms"] == pytest.approx(180, rel=0.05)
    assert d.onset_ns >= onset - 3 * S and d.ts_ns - onset < 10 * S


@pytest.mark.parametrize(
    "compute",
    [
        pytest.param(lambda s: [90, 99, 90, 95], id="a-stage-10pct-heavier"),
        pytest.param(lambda s: [180 if r == s % 4 else 90 for r in range(4)], id="rotating"),
        pytest.param(lambda s: [180 if s % 3 == 0 else 90, 90, 90, 90], id="one-step-in-three"),
    ],
)
def test_a_pipeline_near_balance_or_with_passing_spikes_is_no_load_imbalance(compute: Any) -> None:
    # stages ~10 % apart (a real partition is never exact), the heaviest rank changing from
    # step to step, or one rank heavy in a third of the steps: nothing to move between stages
    job = Synth(comm_name="recv")
    job.steps(20)
    job.steps(80, compute=compute)
    diags = job.feed(Funnel())
    assert not opened(diags, "load_imbalance") and not opened(diags, "straggler")


def test_a_pipelines_heavier_stage_names_all_its_replicas() -> None:
    # two stages of two data-parallel replicas each (ranks 0, 2 and 1, 3): the heavier
    # stage's replicas are named together
    job = Synth(comm_name="recv")
    job.steps(20)
    job.steps(60, compute=lambda s: [90, 170, 90, 180])
    (d,) = opened(job.feed(Funnel()), "load_imbalance")
    assert d.ranks == [1, 3]


@pytest.mark.parametrize("spans", [True, False])
@pytest.mark.parametrize(
    ("after", "ratio", "others"),
    [([90, 180, 90, 100], 2.0, 1.0), ([112, 300, 90, 100], 3.33, 1.24)],
    ids=["alone", "a-neighbour-a-little-too"],
)
def test_a_pipeline_rank_slowed_from_outside_is_its_straggler(
    spans: bool, after: list[int], ratio: float, others: float
) -> None:
    # the stages differ by the cut (rank 3 computes 100 ms, the others 90, from the start);
    # once each rank's own baseline is known, rank 1's compute doubles (another process on
    # its CPU), or triples while its neighbour's rises by a quarter (the slow rank's work
    # takes from it): rank 1, and only it, is the straggler, against its own past; a stage
    # that became heavy is no load imbalance of the cut
    job = Synth(comm_name="recv", spans=spans)
    job.steps(90, compute=lambda s: [90, 90, 90, 100])
    onset = job.t
    job.steps(60, compute=after)
    diags = job.feed(Funnel())
    (d,) = opened(diags, "straggler")
    assert d.ranks == [1] and d.evidence["pipeline"] == 1
    assert d.evidence["ratio"] == pytest.approx(ratio, rel=0.1)
    assert d.evidence["baseline_compute_ms"] == pytest.approx(90, rel=0.05)
    assert d.evidence["others_ratio"] == pytest.approx(others, abs=0.06)
    assert d.onset_ns >= onset - 1 * S and d.ts_ns - onset < 10 * S
    assert not opened(diags, "load_imbalance")


@pytest.mark.parametrize(
    "compute",
    [
        pytest.param(lambda s: [135, 135, 135, 150], id="every-stage-slower"),
        pytest.param(lambda s: [126, 180, 90, 100], id="one-2x-a-neighbour-1.4x"),
        pytest.param(lambda s: [90, 108, 90, 100], id="one-rank-20pct-slower"),
        pytest.param(lambda s: [90, 180 if s % 3 == 0 else 90, 90, 100], id="one-step-in-three"),
    ],
)
def test_a_pipeline_slowing_down_alike_or_a_little_has_no_straggler(compute: Any) -> None:
    # every stage 1.5x slower (a busier machine, a new phase: nobody's), one rank twice as
    # slow while its neighbour is 1.4x (more than a quarter of its rise: a shared cause),
    # one rank 20 % slower
    # (below the 25 % a stage must slow by), or one rank slow in a third of the steps only
    job = Synth(comm_name="recv")
    job.steps(90, compute=lambda s: [90, 90, 90, 100])
    job.steps(80, compute=compute)
    diags = job.feed(Funnel())
    assert not opened(diags, "straggler")
    # the stages are uneven now: only the rank that computes most may be called heavy
    assert all(d.ranks == [1] for d in opened(diags, "load_imbalance"))


@pytest.mark.parametrize(
    ("wait", "comm", "named"),
    [
        pytest.param([10, 60, 5, 10], 40.0, True, id="one-rank-waits-pipeline-slower"),
        pytest.param([45, 60, 40, 45], 40.0, False, id="every-rank-waits-more"),
        pytest.param([10, 60, 5, 10], 10.0, False, id="one-rank-waits-pipeline-not-slower"),
    ],
)
def test_a_pipeline_rank_whose_threads_wait_for_a_cpu_is_its_straggler(
    wait: list[float], comm: float, named: bool
) -> None:
    # another process joins rank 1's CPU: rank 1 computes as fast as before (it takes the CPU
    # back whenever it wakes to compute) but its threads wait for a CPU 60 % of a core
    # against 10 % before, and the pipeline's transfers through it slow every step by 30 %:
    # rank 1 is the straggler, by its wait. The same wait on every rank is a busier machine
    # (nobody's); a rank that waits while the pipeline keeps its pace costs nothing
    job = Synth(comm_name="recv")
    job.steps(90, compute=lambda s: [90, 90, 90, 100])
    onset = job.t
    job.run_delay[:] = wait
    job.steps(60, compute=lambda s: [90, 90, 90, 100], comm=comm)
    diags = job.feed(Funnel())
    stragglers = opened(diags, "straggler")
    assert not opened(diags, "load_imbalance")
    if not named:
        assert not stragglers
        return
    (d,) = stragglers
    assert d.ranks == [1] and d.evidence["pipeline"] == 1
    assert d.evidence["run_delay_pct"] == 60 and d.evidence["baseline_run_delay_pct"] == 10
    assert d.evidence["others_run_delay_pct"] == 10
    assert d.evidence["ratio"] == pytest.approx(1.0, abs=0.05)
    assert "wait for a CPU 60% of a core" in d.summary
    assert d.onset_ns >= onset - 1 * S and d.ts_ns - onset < 10 * S


def test_a_neighbour_computing_more_while_a_rank_waits_for_a_cpu_is_no_second_straggler() -> None:
    # rank 1 waits for its CPU (named by that wait); then what its CPU no longer runs lands
    # on rank 2's, whose compute rises 1.6x: the one cause is rank 1's crowded CPU, one
    # straggler. A rank whose compute rises with nobody held for a wait is named (the test
    # above with its wait left alone)
    job = Synth(comm_name="recv")
    job.steps(90, compute=lambda s: [90, 90, 90, 100])
    job.run_delay[:] = [10, 60, 5, 10]
    job.steps(40, compute=lambda s: [90, 90, 90, 100], comm=40.0)
    job.steps(40, compute=lambda s: [90, 90, 144, 100], comm=40.0)
    diags = job.feed(Funnel())
    assert {r for d in opened(diags, "straggler") for r in d.ranks} == {1}
