"""Predictions on the real embedded stack: the stream worker's forecasts and what came land in
`predictions`, and `prediction_accuracy` compares each with its baseline in SQL."""

from __future__ import annotations

import math
import time
import uuid

import pytest

from perfloop.producers import Publisher
from perfloop.schemas import BatchBuilder, JobInfo, JobLifecycle, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.streams.predict.history import load_history
from perfloop.warehouse import client

from .conftest import wait_for

pytestmark = pytest.mark.integration


def test_step_time_forecasts_are_realised_and_their_accuracy_is_queryable(
    stack: StackSettings,
) -> None:
    job = f"pred-{uuid.uuid4().hex[:8]}"
    # 60 s of history, 2 ranks at 10 steps/s: 100 ms steps, 150 ms from the 30th second on,
    # published as a producer does (a message per 0.5 s of steps)
    t0 = (time.time_ns() - 60 * 10**9) // 10**10 * 10**10
    pub = Publisher(stack)
    for chunk in range(120):
        steps = BatchBuilder("step", job_id=job, node="n0", producer_id="test")
        for i in range(chunk * 5, chunk * 5 + 5):
            for rank in (0, 1):
                steps.add(
                    ts_ns=t0 + i * 100_000_000 + rank * 1_000_000,
                    rank=rank,
                    step=i,
                    step_time_ms=100.0 if i < 300 else 150.0,
                    num_workers=2,
                )
        assert pub.publish(Topics.STEP, job, steps.encode())
    assert pub.flush(10) == 0

    ch = client(stack)

    def realised() -> list[tuple[float, float, float, float, float]]:
        return [
            tuple(r)
            for r in ch.query(
                "SELECT predicted, realised, ape, baseline, baseline_ape FROM prediction_accuracy "
                "WHERE job_id = {j:String} AND target = 'step_time_ms' ORDER BY step",
                parameters={"j": job},
            ).result_rows
        ]

    try:
        # a forecast every 5 s of event time once 10 one-second windows were learned
        rows = wait_for(lambda: len(r := realised()) >= 8 and r, 60, "realised predictions")
        for predicted, came, ape, baseline, baseline_ape in rows:
            assert 100.0 <= came <= 150.0, "realised: the median of a window's steps"
            assert ape == pytest.approx(abs(predicted - came) / came)
            assert baseline_ape == pytest.approx(abs(baseline - came) / came)
        assert {100.0, 150.0} <= {r[1] for r in rows}
        learned = sum(r[2] for r in rows)
        base = sum(r[4] for r in rows)
        assert learned <= base, f"learned {learned:.4f} against the baseline's {base:.4f}"
        ((made, done),) = ch.query(
            "SELECT countIf(state = 'predicted'), countIf(state = 'realised') FROM predictions "
            "WHERE job_id = {j:String} AND target = 'step_time_ms'",
            parameters={"j": job},
        ).result_rows
        assert made >= done >= len(rows)
    finally:
        ch.close()
        pub.close()


def test_the_history_of_finished_jobs_is_read_back_for_the_cross_run_models(
    stack: StackSettings,
) -> None:
    job = f"hist-{uuid.uuid4().hex[:8]}"
    t0 = time.time_ns() - 20 * 10**9
    info = JobInfo(
        ts_ns=t0,
        job_id=job,
        node="n0",
        rank=-1,
        model_params=350_000_000,
        world_size=2,
        batch_size=64,
        precision="bf16",
    )
    steps = BatchBuilder("step", job_id=job, node="n0", producer_id="test")
    for i in range(50):
        for rank in (0, 1):
            steps.add(
                ts_ns=t0 + i * 100_000_000,
                rank=rank,
                step=i,
                step_time_ms=100.0 + i % 2,
                mem_peak_bytes=(10 + rank) << 30,
            )
    end = JobLifecycle(ts_ns=t0 + 6 * 10**9, job_id=job, node="n0", rank=-1, state="finished")
    pub = Publisher(stack)
    assert pub.publish(Topics.JOB, job, encode_event(info))
    assert pub.publish(Topics.STEP, job, steps.encode())
    assert pub.publish(Topics.JOB, job, encode_event(end))
    assert pub.flush(10) == 0

    def mine() -> list[tuple[dict[str, float], float, float]]:
        # the job's tables land in separate inserts: wait until its steps have too
        got = [h for h in load_history(stack) if h[0].get("params") == 350_000_000]
        return got if got and all(math.isfinite(h[1]) for h in got) else []

    ((features, med, peak),) = wait_for(mine, 30, "the finished job and its steps in the history")
    assert features == {"params": 350e6, "world": 2.0, "batch_size": 64.0, "precision_bits": 16.0}
    assert 100.0 <= med <= 101.0
    assert peak == float(11 << 30)
