"""The detectors' step ring (`JobState`): how many steps it keeps follows the job's world, so
a small job stepping fast loses no step while its ranks' batches come a publish interval
apart, and a large job keeps 64 steps a rank as before. A step, and a rank that reports steps,
are waited for 2 s of the job's steps behind the newest (at least 32 steps, at most half the
ring): then an incomplete step is given up (never judged) and a silent rank no longer holds
the others' steps back."""

from __future__ import annotations

import numpy as np
import pytest

from perfloop.streams.detection._state_parts import MAX_STEPS, STEPS, ring_depth
from perfloop.streams.detection.job_state import JobState

NS = 1_000_000_000
T0 = 1_700_000_000 * NS


def _steps(job: JobState, rank: int, first: int, n: int, rate: float, step_ms: float) -> None:
    """One batch: ``n`` steps of ``rank`` from step ``first``, ``rate`` steps a second."""
    step = np.arange(first, first + n, dtype=np.int64)
    ts = T0 + (step * NS / rate).astype(np.int64)
    cols = {
        "ts_ns": ts,
        "rank": np.full(n, rank, dtype=np.int64),
        "step": step,
        "step_time_ms": np.full(n, step_ms),
        "data_wait_ms": np.zeros(n),
        "mem_allocated_bytes": np.zeros(n, dtype=np.int64),
        "mem_reserved_bytes": np.zeros(n, dtype=np.int64),
        "mem_peak_bytes": np.zeros(n, dtype=np.int64),
    }
    job.ingest("step", "n0", cols, int(ts[-1]))


def test_depth_follows_the_world() -> None:
    assert ring_depth(1) == ring_depth(32) == MAX_STEPS
    assert [ring_depth(w) for w in (33, 64, 128, 256, 4096)] == [256, 256, 128, STEPS, STEPS]


def test_a_fast_two_rank_job_whose_batches_come_a_second_apart_loses_no_step() -> None:
    """200 steps a second, one batch a second per rank, rank 1's always judged after rank 0's
    came: at 64 steps a ring, the steps 32 behind rank 0's newest were given up unjudged."""
    job = JobState("j")
    complete = 0
    for second in range(3):
        _steps(job, 0, 200 * second, 200, rate=200.0, step_ms=5.0)
        complete += job.complete_steps()  # a tick between the two batches
        _steps(job, 1, 200 * second, 200, rate=200.0, step_ms=5.0)
        complete += job.complete_steps()
    assert complete == 600
    assert job.horizon() == 256  # 2 s of 5 ms steps is 400: half the ring
    assert len(job.window(16)["step"]) == 16


@pytest.mark.parametrize(("step_ms", "waited"), [(10.0, 200), (1000.0, 32)])
def test_a_rank_that_stopped_is_waited_for_2_s_of_steps(step_ms: float, waited: int) -> None:
    """10 ms steps: 200 steps; 1 s steps: 32 (not 256: a silent rank would hold the others'
    steps back for minutes)."""
    job = JobState("j")
    rate = 1000.0 / step_ms
    _steps(job, 0, 0, 10, rate=rate, step_ms=step_ms)
    _steps(job, 1, 0, 5, rate=rate, step_ms=step_ms)
    assert job.complete_steps() == 5
    assert job.horizon() == waited
    _steps(job, 0, 10, waited - 6, rate=rate, step_ms=step_ms)  # rank 1 sends nothing more
    assert job.complete_steps() == 0  # rank 1 is 4 + waited - 1 behind: its steps may come
    _steps(job, 0, waited + 4, 1, rate=rate, step_ms=step_ms)
    assert job.complete_steps() == waited  # now it is not waited for: 5 .. waited + 4


def test_the_ring_keeps_its_newest_steps_when_ranks_come() -> None:
    job = JobState("j")
    step_ms = {0: 10.0, 1: 12.0}
    for rank in (0, 1):
        _steps(job, rank, 0, 300, rate=100.0, step_ms=step_ms[rank])
    assert job.complete_steps() == 300
    assert job.depth == MAX_STEPS
    _steps(job, 299, 300, 1, rate=100.0, step_ms=30.0)  # a 300-rank job after all
    assert job.world == 300 and job.depth == STEPS
    win = job.window(16)
    assert list(win["step"]) == list(range(284, 300))  # the newest complete steps, in order
    assert (win["st"][:, 0] == 10.0).all() and (win["st"][:, 1] == 12.0).all()
    assert np.isnan(win["st"][:, 299]).all()
    assert (job.step_no[job.step_no >= 0] > 300 - STEPS).all()


def test_a_snapshot_restores_the_depth_it_was_taken_at() -> None:
    job = JobState("j")
    for rank in (0, 1):
        _steps(job, rank, 0, 100, rate=100.0, step_ms=10.0 + rank)
    job.complete_steps()
    back = JobState.from_state(job.to_state())
    assert back.depth == MAX_STEPS and back.arrival.wait.shape[0] == MAX_STEPS
    assert list(back.window(16)["step"]) == list(job.window(16)["step"])
    _steps(back, 0, 100, 1, rate=100.0, step_ms=10.0)
    _steps(back, 1, 100, 1, rate=100.0, step_ms=11.0)
    assert back.complete_steps() == 1


def test_a_snapshot_of_a_64_step_ring_is_read_as_one() -> None:
    """Snapshots taken before the depth followed the world hold 64-step arrays."""
    job = JobState("j")
    _steps(job, 0, 0, 10, rate=100.0, step_ms=10.0)
    job._resize(STEPS)
    doc = job.to_state()
    back = JobState.from_state(doc)
    assert back.depth == STEPS and back.arrival.count.shape[0] == STEPS
    _steps(back, 0, 10, 100, rate=100.0, step_ms=10.0)
    assert back.complete_steps() > 0
    assert back.step_no.max() == 109
