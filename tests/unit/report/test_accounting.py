"""The report's accounting: where each rank's wall time went (each cause where it belongs,
the categories summing to the wall time), MFU, energy and money as a user would check them
by hand."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from perfloop.models.devices import device
from perfloop.report.accounting import (
    CATEGORIES,
    Prices,
    Spans,
    Steps,
    diagnosis_costs,
    energy_joules,
    hourly_price,
    mfu,
    time_accounting,
)
from perfloop.report.collectives import Collectives, collective_waits, lateness
from perfloop.report.data import JobData
from perfloop.report.summary import Figure, Peaks, summarise

NS = 10**9
MS = 10**6


def _steps(ms: list[float], *, rank: int = 0, first_start: int = NS, numbers=None) -> Steps:
    """Back-to-back steps of one rank starting at ``first_start``."""
    ends = first_start + np.cumsum(np.asarray(ms) * MS).astype(np.int64)
    return Steps.of(
        rank=[rank] * len(ms),
        step=numbers if numbers is not None else range(len(ms)),
        end_ns=ends,
        step_ms=ms,
        data_wait_ms=[0.0] * len(ms),
    )


def _joined(a: Steps, b: Steps) -> Steps:
    cols = ("rank", "step", "end_ns", "step_ms", "data_wait_ms")
    return Steps.of(**{k: np.concatenate([getattr(a, k), getattr(b, k)]) for k in cols})


def _total(t) -> int:
    return sum(t.rank_ns.values())


def test_the_two_rank_job_is_accounted_cause_by_cause(make_job: Callable[..., JobData]) -> None:
    job = make_job()
    s = summarise(job, Prices(2.5, 0.05))
    t = s.time
    assert (t.wall_ns, t.ranks) == (12 * NS, 2)
    assert _total(t) == 2 * 12 * NS  # exactly
    # summed over both ranks: 1 s of start-up each; 3 warm-up steps each; 10 ms of data wait
    # in each of the other 97 steps; rank 0 waits 30 ms at steps 50..99; rank 0's 0.5 s
    # checkpoint after its last step; the rest of the final second idle
    expected = {
        "startup": 2 * NS,
        "warmup": 2 * 3 * 100 * MS,
        "data_wait": 2 * 97 * 10 * MS,
        "straggler_wait": 50 * 30 * MS,
        "checkpoint": 500 * MS,
        "idle": 1500 * MS,
    }
    for c, ns in expected.items():
        assert t.rank_ns[c] == ns, c
    assert t.rank_ns["productive"] == 2 * 10 * NS - sum(
        expected[c] for c in ("warmup", "data_wait", "straggler_wait")
    )
    assert t.rank_ns["hang"] == t.rank_ns["restart"] == t.rank_ns["eval"] == 0
    assert t.seconds("straggler_wait") == pytest.approx(0.75)  # the mean over the ranks
    assert t.goodput == pytest.approx(15.96 / 24)


def test_mfu_follows_the_flops_the_step_time_and_the_catalogs_peak(
    make_job: Callable[..., JobData],
) -> None:
    s = summarise(make_job(), Prices(2.5, 0.05))
    peak = device("h100").peak("bf16")  # the job's GPU and precision
    assert s.figure("MFU").value == pytest.approx(2e12 / 0.1 / peak)
    assert s.figure("MFU over wall time").value == pytest.approx(2e12 * 100 / 12 / peak)
    assert "job info flops_per_step" in s.figure("MFU").note
    # the command line's count wins over the job's; a peak setting over the catalog
    given = summarise(make_job(), Prices(2.5, 0.05), flops_per_step=1e12, peaks=Peaks(1e15))
    assert given.figure("MFU").value == pytest.approx(1e12 / 0.1 / 1e15)
    assert mfu(3e12, 0.01, 1e15) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="step time > 0"):
        mfu(1.0, 0.0, 1.0)


def test_mfu_says_what_it_needs_when_it_cannot_be_computed(
    make_job: Callable[..., JobData],
) -> None:
    cpu_info = {"world_size": 1, "precision": "fp32", "cpu_count": 4, "extra": {}}
    job = make_job(info=cpu_info, gpus=[], gpu_energy=[])
    s = summarise(job, Prices(2.5, 0.05))
    assert s.figure("MFU").value is None
    assert "flops_per_step" in s.figure("MFU").note and "--flops-per-step" in s.figure("MFU").note
    s = summarise(job, Prices(2.5, 0.05), flops_per_step=1e9)
    assert s.figure("MFU").value is None and "PERFLOOP_CPU_PEAK_FLOPS" in s.figure("MFU").note
    s = summarise(job, Prices(2.5, 0.05), flops_per_step=1e9, peaks=Peaks(cpu=1e11))
    assert s.figure("MFU").value == pytest.approx(1e9 / 0.1 / 1e11)
    assert s.figure("energy per step").text() == "n/a"
    assert "no GPU samples" in s.figure("energy per step").note
    unknown = make_job(info={**make_job().info, "gpu_name": "NVIDIA A10G"})
    note = summarise(unknown, Prices(1, 1)).figure("MFU").note
    assert "no catalog entry" in note and "PERFLOOP_PEAK_FLOPS" in note


def test_energy_per_step_from_the_nvml_counters(make_job: Callable[..., JobData]) -> None:
    s = summarise(make_job(), Prices(2.5, 0.05))
    assert s.figure("energy").value == pytest.approx(10_000 / 3600)  # 2 GPUs × 5 kJ, in Wh
    assert s.figure("energy per step").value == pytest.approx(100.0)  # J over 100 steps
    assert energy_joules(0, 0, 250.0, 4.0) == 1000.0  # no counter: mean power × time
    assert energy_joules(5_000, 5_000, 250.0, 4.0) == 1000.0  # a counter that did not move


@pytest.mark.parametrize("gpu_hour", [2.5, 5.0, 0.0])
def test_money_follows_the_configured_price(
    make_job: Callable[..., JobData], gpu_hour: float
) -> None:
    s = summarise(make_job(), Prices(gpu_hour, 0.05, "EUR"))
    per_hour = 2 * gpu_hour  # two GPUs
    cost = per_hour * 12 / 3600
    assert s.price_per_hour == s.figure("price per hour").value == pytest.approx(per_hour)
    assert s.figure("cost").value == pytest.approx(cost)
    assert s.figure("cost per step").value == pytest.approx(cost / 100)
    assert s.figure("cost per million tokens").value == pytest.approx(cost / 819_200 * 1e6)
    assert s.figure("cost of badput").value == pytest.approx(cost * (1 - 15.96 / 24))
    assert s.figure("cost").unit == "EUR"
    (d,) = s.diagnoses  # still open: from its onset (6 s) to the job's end (12 s)
    assert (d.bottleneck, d.is_open, d.share) == ("straggler", True, pytest.approx(0.3))
    assert d.per_hour == pytest.approx(0.3 * per_hour)
    assert d.total == pytest.approx(0.3 * per_hour * 6 / 3600)


def test_a_job_without_gpus_is_priced_by_its_cpus() -> None:
    assert hourly_price(0, 8, Prices(3.0, 0.04)) == pytest.approx(0.32)
    assert hourly_price(4, 8, Prices(3.0, 0.04)) == pytest.approx(12.0)
    rows = [
        {"diagnosis_id": "d", "bottleneck": "hang", "state": s, "ts_ns": t * 3600 * NS,
         "onset_ns": 0, "step_share": share}
        for s, t, share in (("open", 1, 0.2), ("resolved", 2, 0.4))
    ]  # fmt: skip
    (c,) = diagnosis_costs(rows, 10.0, 99 * 3600 * NS)
    assert not c.is_open and c.hours == pytest.approx(2.0)  # resolved: onset → resolution
    assert c.per_hour == pytest.approx(3.0) and c.total == pytest.approx(6.0)  # mean share 0.3


def test_a_step_far_beyond_the_median_counts_as_a_hang_and_a_slow_one_does_not() -> None:
    ms = [100.0] * 20 + [200.0] + [100.0] * 5 + [8100.0] + [100.0] * 5
    t = time_accounting(_steps(ms), start_ns=0, end_ns=NS + int(sum(ms) * MS), warmup_steps=0)
    assert t.rank_ns["hang"] == 8000 * MS  # beyond the median of the hung step
    assert t.rank_ns["productive"] == (int(sum(ms)) - 8000) * MS
    diag = time_accounting(_steps([100.0] * 30), start_ns=0, end_ns=5 * NS, warmup_steps=0,
                           hangs=[(2 * NS, 10 * NS)])  # fmt: skip
    assert diag.rank_ns["hang"] == 3 * NS  # a hang diagnosis: to the end of the wall time


def test_restarts_count_the_gap_and_the_steps_done_again() -> None:
    # steps 0..9, a 2 s gap, then 5..14 again from a checkpoint at step 5
    first = _steps([100.0] * 10, first_start=NS)
    again = _steps([100.0] * 10, first_start=4 * NS, numbers=range(5, 15))
    steps = _joined(first, again)
    t = time_accounting(steps, start_ns=0, end_ns=5 * NS, warmup_steps=0)
    assert t.rank_ns["restart"] == 2 * NS + 5 * 100 * MS  # the gap and steps 5..9 done again
    assert t.rank_ns["productive"] == 15 * 100 * MS
    # a second `started` event inside a gap: the gap is a restart
    gap = _steps([100.0] * 10, first_start=NS)
    later = Steps.of(rank=[0], step=[10], end_ns=[4 * NS], step_ms=[100.0])
    both = _joined(gap, later)
    t = time_accounting(both, start_ns=0, end_ns=5 * NS, warmup_steps=0, starts=[(0, 3 * NS)])
    assert t.rank_ns["restart"] == 4 * NS - 100 * MS - 2 * NS


def test_checkpoints_and_evaluations_win_over_the_steps_they_fall_in() -> None:
    spans = Spans.of(rank=[0, 0], start_ns=[NS + 200 * MS, 3 * NS], duration_ms=[300.0, 400.0],
                     phase=["checkpoint", "eval"])  # fmt: skip
    t = time_accounting(_steps([100.0] * 10), start_ns=0, end_ns=4 * NS, spans=spans,
                        warmup_steps=0)  # fmt: skip
    assert t.rank_ns["checkpoint"] == 300 * MS and t.rank_ns["eval"] == 400 * MS
    assert t.rank_ns["productive"] == 700 * MS
    assert _total(t) == t.wall_ns


def test_a_job_without_steps_spent_its_wall_time_starting_up() -> None:
    empty = Steps.of(rank=[], step=[], end_ns=[], step_ms=[])
    t = time_accounting(empty, start_ns=5, end_ns=10 * NS)
    assert t.ranks == 1 and t.rank_ns["startup"] == 10 * NS - 5 and _total(t) == t.wall_ns
    assert set(t.rank_ns) == set(CATEGORIES)


def test_waits_and_lateness_compare_durations_never_clocks() -> None:
    # two collectives per step; rank 2's clock is 1 h off and changes nothing
    c = Collectives.of(
        rank=[0, 0, 1, 1, 2, 2],
        step=[7] * 6,
        start_ns=[0, 10, 25, 30, 3600 * NS + 5, 3600 * NS + 40],
        duration_ms=[50.0, 40.0, 25.0, 20.0, 45.0, 10.0],
    )
    assert collective_waits(c).tolist() == [25.0, 30.0, 0.0, 10.0, 20.0, 0.0]
    ranks, steps, ms = lateness(c)
    assert ranks.tolist() == [0, 1, 2] and steps.tolist() == [7]
    assert ms[:, 0].tolist() == [0.0, 25.0, 30.0]  # the most behind the first at either one
    alone = Collectives.of(rank=[0], step=[1], start_ns=[0], duration_ms=[9.0])
    assert collective_waits(alone).tolist() == [0.0]


def test_figures_read_as_numbers_a_person_would_write() -> None:
    assert Figure("x", None, "J").text() == "n/a"
    assert Figure("g", 0.6134, "%").text() == "61.3 %"
    assert Figure("n", 930.0).text() == "930"
    assert Figure("c", 0.000248, "USD").text() == "0.000248 USD"
    assert Figure("t", 1234.5678, "s").text() == "1,235 s"
