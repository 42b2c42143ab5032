"""The funnel's detectors on hand-made data-parallel jobs: each fault's signal, its onset,
rank, evidence and explanation, and the conditions that must *not* raise a diagnosis."""

from __future__ import annotations

import numpy as np
import pytest

from perfloop.schemas import GroundTruth, JobLifecycle
from perfloop.streams.funnel import Funnel, actionable
from tests.unit.streams._synth import GIB, MS, S, Synth, opened, roots


def test_healthy_job_raises_no_fault() -> None:
    job = Synth(nodes=2, per_node=4)
    job.steps(80)
    assert roots(job.feed(Funnel())) == set()


def test_straggler_opens_on_the_slow_rank_with_its_score_and_resolves() -> None:
    job = Synth()
    job.steps(90)  # the warm-up, and the steps the job's noise is learned from
    onset = job.t
    job.steps(40, compute=lambda s: [90, 90, 135, 90])
    diags = job.feed(f := Funnel())
    (d,) = opened(diags, "straggler")
    assert (d.ranks, d.rank, d.level, d.loop, d.explained_by) == ([2], 2, "network", "training", "")
    assert d.evidence["score"] == pytest.approx(1 - 1 / 1.5, abs=0.02)
    assert d.critical_path and d.step_share > 0.3
    assert abs(d.onset_ns - onset) < 700 * MS, "onset: within the first slow steps"
    assert d.ts_ns - onset < 5 * S, "slow for 3 s (noise is brief), then open"
    assert roots(diags) == {"straggler"}
    job.steps(20)
    later = job.feed(f)
    (r,) = [x for x in later if x.state == "resolved"]
    assert r.diagnosis_id == d.diagnosis_id


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_rank_that_shares_its_cpu_is_named_though_on_time_in_some_steps(seed: int) -> None:
    """CPU contention: the rank runs on time for a few steps (a time slice of its own), then
    waits a few (the other process's): a third of its steps are on time, in scattered blocks,
    while any rank falls behind now and then. It is the straggler, and only it."""
    rng = np.random.default_rng(seed)
    blocks = {"left": 0, "slow": False}

    def noise() -> np.ndarray:
        c = np.full(4, 90.0)
        if rng.random() < 0.3:
            c[rng.integers(4)] *= rng.uniform(1.1, 1.5)
        return c

    def contended(_: int) -> np.ndarray:
        c = noise()
        if not blocks["left"]:
            blocks["slow"] = not blocks["slow"]
            blocks["left"] = int(rng.integers(4, 14) if blocks["slow"] else rng.integers(3, 8))
        blocks["left"] -= 1
        if blocks["slow"]:
            c[2] = 90.0 * rng.uniform(1.3, 2.0)
        return c

    job = Synth()
    job.steps(80, compute=lambda _: noise())
    onset = job.t
    job.steps(200, compute=contended)
    found = opened(job.feed(Funnel()), "straggler")
    assert found and {tuple(d.ranks) for d in found} == {(2,)}
    assert found[0].ts_ns - onset < 10 * S


def test_straggler_without_spans_reads_compute_from_collectives() -> None:
    job = Synth(spans=False)
    job.steps(20)
    job.steps(40, compute=lambda s: [90, 90, 90, 140])
    (d,) = opened(job.feed(Funnel()), "straggler")
    assert d.ranks == [3]


def test_a_straggler_below_the_threshold_is_not_one() -> None:
    job = Synth()
    job.steps(20)
    job.steps(30, compute=lambda s: [90, 90, 99, 90])  # 10% slower: score 0.09 < 0.12
    assert opened(job.feed(Funnel()), "straggler") == []


def test_thermal_throttle_explains_the_straggler_on_its_rank() -> None:
    job = Synth()
    job.steps(20)
    onset = job.t
    job.gpu_reasons[1] = 0x20 | 0x40
    job.gpu_clock[1] = 1980 * 0.6
    job.steps(40, compute=lambda s: [90, 150, 90, 90])
    diags = job.feed(Funnel())
    (th,) = opened(diags, "thermal_throttle")
    (st,) = opened(diags, "straggler")
    assert (th.ranks, th.explained_by, th.critical_path, th.loop) == ([1], "", True, "inner")
    assert th.evidence["clock_ratio"] == pytest.approx(0.6, abs=0.01)
    assert th.ts_ns - onset < 1.5 * S
    assert (st.ranks, st.explained_by, st.critical_path) == ([1], "thermal_throttle", False)
    assert [d.bottleneck for d in actionable(diags)] == ["thermal_throttle"]


def test_a_throttled_gpu_no_rank_claims_explains_stragglers_on_its_node_only() -> None:
    job = Synth(nodes=2, per_node=2)
    job.gpu_rank[3] = -1
    job.steps(20)
    job.gpu_reasons[3] = 0x40
    job.gpu_clock[3] = 1200.0
    job.steps(40, compute=[150, 90, 90, 150])
    diags = job.feed(Funnel())
    (th,) = opened(diags, "thermal_throttle")
    assert (th.rank, th.ranks, th.nodes) == (-1, [], ["j-node-1"])
    why = {d.rank: d.explained_by for d in opened(diags, "straggler")}
    assert why == {0: "", 3: "thermal_throttle"}


def test_throttle_reason_without_a_clock_drop_is_not_a_throttle() -> None:
    job = Synth()
    job.steps(10)
    job.gpu_reasons[:] = 0x4  # power-cap bit while the clock holds: harmless
    job.steps(30)
    assert opened(job.feed(Funnel()), "power_throttle") == []


def test_power_throttle_on_every_gpu() -> None:
    job = Synth(nodes=1, per_node=2)
    job.steps(10)
    job.gpu_reasons[:] = 0x4
    job.gpu_clock[:] = 1500.0
    job.steps(20, compute=110.0)
    diags = opened(job.feed(Funnel()), "power_throttle")
    assert sorted(d.rank for d in diags) == [0, 1]
    assert all(d.level == "cluster_health" and not d.explained_by for d in diags)


def test_dataloader_starvation_is_per_node_and_is_not_comm_degradation() -> None:
    job = Synth(nodes=2, per_node=2)
    job.steps(20)
    onset = job.t
    job.steps(20, wait=[0, 0, 100, 100])  # node 1's loaders cannot keep up
    diags = job.feed(Funnel())
    (d,) = opened(diags, "dataloader_starvation")
    assert (d.ranks, d.nodes, d.level) == ([2, 3], ["j-node-1"], "host")
    assert d.evidence["data_wait_share"] == pytest.approx(100 / 200, abs=0.05)
    assert d.ts_ns - onset < 2 * S
    # node 0's ranks now wait ~100 ms in the all-reduce: that is not a network problem
    assert roots(diags) == {"dataloader_starvation"}


def test_comm_degradation_against_the_learned_baseline() -> None:
    job = Synth(comm=20.0)
    job.steps(20)
    onset = job.t
    job.steps(40, comm=80.0)
    diags = job.feed(Funnel())
    (d,) = opened(diags, "comm_degradation")
    assert d.evidence["ratio"] == pytest.approx(4.0, rel=0.1)
    assert d.evidence["baseline_ms"] == pytest.approx(20.0, rel=0.1)
    assert d.ts_ns - onset < 5 * S
    (e,) = opened(diags, "exposed_comm")  # 80 of 170 ms is communication nobody hides
    assert e.explained_by == "comm_degradation" and not e.critical_path
    assert roots(diags) == {"comm_degradation"}


def test_waiting_for_a_straggler_is_not_comm_degradation() -> None:
    job = Synth(comm=20.0)
    job.steps(20)
    job.steps(30, compute=lambda s: [90, 90, 90, 180])  # the others wait 90 ms in comm
    assert roots(job.feed(Funnel())) == {"straggler"}


def test_memory_leak_reports_growth_and_time_to_oom() -> None:
    job = Synth()
    job.steps(20)
    onset = job.t
    job.steps(15, leak=[0, 0, 0, 512 << 20])
    diags = job.feed(Funnel())
    (d,) = opened(diags, "memory_leak")
    assert (d.ranks, d.loop, d.level, d.critical_path) == ([3], "product", "memory", True)
    assert d.evidence["growth_bytes_per_step"] == pytest.approx(512 << 20)
    headroom = 80 * GIB - (job.mem[3] + 10 * GIB)
    assert d.evidence["time_to_oom_s"] > 0
    # about headroom / growth steps of ~0.1 s (when detected, the rank held less)
    assert d.evidence["time_to_oom_s"] >= headroom / (512 << 20) * 0.09
    assert d.ts_ns - onset < 2 * S


def test_oom_comes_from_the_lifecycle_and_ground_truth_is_ignored() -> None:
    job = Synth()
    job.steps(10)
    job.event(
        GroundTruth(ts_ns=job.t, job_id="j", node="n", rank=-1, scenario="x", fault="hang",
                    onset_ns=job.t, ranks=[0])
    )  # fmt: skip
    job.event(
        JobLifecycle(ts_ns=job.t, job_id="j", node="j-node-0", rank=2, state="failed",
                     exit_code=1, message="torch.OutOfMemoryError: CUDA out of memory")
    )  # fmt: skip
    job.event(JobLifecycle(ts_ns=job.t, job_id="j", node="j-node-0", rank=-1, state="failed"))
    diags = job.feed(Funnel())
    assert roots(diags) == {"oom"}
    (d,) = opened(diags, "oom")
    assert (d.ranks, d.loop, d.critical_path) == ([2], "product", True)
    assert {x.state for x in diags if x.bottleneck == "oom"} == {"open", "resolved"}


def test_hang_waits_for_the_adaptive_timeout_and_names_the_idle_rank() -> None:
    job = Synth()
    job.steps(30)  # ~100 ms steps: timeout max(1 s, 8 x p99) = 1 s
    f = Funnel()
    job.feed(f, tail_s=0)
    job.gpu_util[:] = 100.0  # blocked in the all-reduce: NCCL kernels spin
    job.gpu_util[1] = 0.0  # rank 1 never got there
    job.stall(0.6)
    assert opened(job.feed(f, tail_s=0), "hang") == []
    job.stall(1.0)
    (d,) = opened(job.feed(f, tail_s=0), "hang")
    assert (d.ranks, d.loop, d.critical_path) == ([1], "product", True)
    assert d.evidence["timeout_s"] == pytest.approx(1.0)
    job.gpu_util[:] = 90.0
    job.steps(3)
    assert [x.state for x in job.feed(f) if x.bottleneck == "hang"] == ["resolved"]


def test_hang_timeout_scales_with_the_jobs_step_time() -> None:
    job = Synth(compute=390.0)  # 0.4 s steps: timeout 8 x p99 ≈ 3.2 s
    job.steps(20)
    f = Funnel()
    job.feed(f, tail_s=0)
    job.gpu_util[:] = 100.0
    job.stall(2.5)
    assert opened(job.feed(f, tail_s=0), "hang") == []
    job.stall(1.5)
    (d,) = opened(job.feed(f, tail_s=0), "hang")
    assert d.evidence["timeout_s"] == pytest.approx(8 * 0.4, rel=0.05)
    assert d.ranks == []  # no GPU idles: the culprit is unknown


def test_a_pause_with_idle_gpus_needs_the_long_timeout() -> None:
    job = Synth()
    job.steps(30)
    f = Funnel()
    job.feed(f, tail_s=0)
    job.gpu_util[:] = 0.0  # every GPU idles: a checkpoint or an evaluation, not a hang
    job.stall(10)
    assert opened(job.feed(f, tail_s=0), "hang") == []
    job.stall(25)
    assert len(opened(job.feed(f, tail_s=0), "hang")) == 1


def test_gpu_error_from_an_xid() -> None:
    job = Synth()
    job.steps(10)
    job.gpu_xid[3] = 1
    job.steps(5)
    (d,) = opened(job.feed(Funnel()), "gpu_error")
    assert (d.ranks, d.level, d.loop, d.critical_path) == ([3], "cluster_health", "product", True)
    assert d.evidence["last_xid"] == 79


def test_cpu_saturation_explains_the_starvation_on_its_node() -> None:
    job = Synth(nodes=2, per_node=2)
    job.steps(20)
    job.cpu[1] = 99.0
    job.steps(40, wait=[0, 0, 80, 80])
    diags = job.feed(Funnel())
    (cpu,) = opened(diags, "cpu_saturation")
    (dl,) = opened(diags, "dataloader_starvation")
    assert (cpu.nodes, cpu.explained_by) == (["j-node-1"], "")
    assert dl.explained_by == "cpu_saturation"


def test_load_imbalance_when_the_slowest_rank_rotates() -> None:
    job = Synth()
    job.steps(20)

    def rotating(step: int) -> list[float]:
        c = [90.0] * 4
        c[step % 4] = 130.0
        return c

    job.steps(60, compute=rotating)
    diags = job.feed(Funnel())
    assert roots(diags) == {"load_imbalance"}
    (d,) = opened(diags, "load_imbalance")
    assert d.evidence["imbalance"] == pytest.approx(1 - 90 / 130, abs=0.03)


def test_roofline_class_is_context_only() -> None:
    job = Synth()
    job.steps(60)
    diags = [d for d in opened(job.feed(Funnel())) if d.level == "kernel"]
    assert [d.bottleneck for d in diags] == ["compute_bound"]
    assert not diags[0].critical_path and diags[0].confidence <= 0.5
