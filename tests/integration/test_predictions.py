"""Predictions on the real embedded stack: the stream worker's forecasts and what came land in
`predictions`, and `prediction_accuracy` compares each with its baseline in SQL."""

from __future__ import annotations

import time
import uuid

import pytest

from perfloop.catalog import Topics
from perfloop.producers import Publisher
from perfloop.schemas import BatchBuilder, JobInfo, JobLifecycle, encode_event
from perfloop.settings import StackSettings
from perfloop.streams._history import load_history
from perfloop.warehouse import client

from .conftest import wait_for

pytestmark = pytest.mark.integration


def test_step_time_forecasts_are_realised_and_beat_the_baseline_in_sql(
    stack: StackSettings,
) -> None:
    job = f"pred-{uuid.uuid4().hex[:8]}"
    steps = BatchBuilder("step", job_id=job, node="n0", producer_id="test")
    # 40 s of history, 2 ranks at 10 steps/s; steps alternate 90 / 110 ms (a loader that
    # stalls every other step): a moving average forecasts ~100, the learned model learns it.
    t0 = (time.time_ns() - 40 * 10**9) // 10**10 * 10**10
    for i in range(400):
        for rank in (0, 1):
            steps.add(
                ts_ns=t0 + i * 100_000_000 + rank * 1_000_000,
                rank=rank,
                step=i,
                step_time_ms=110.0 if i % 2 else 90.0,
                num_workers=2,
            )
    pub = Publisher(stack)
    assert pub.publish(Topics.STEP, job, steps.encode())
    assert pub.flush(10) == 0

    ch = client(stack)

    def realised() -> int:
        return int(
            ch.query(
                "SELECT count() FROM prediction_accuracy "
                "WHERE job_id = {j:String} AND target = 'step_time_ms'",
                parameters={"j": job},
            ).result_rows[0][0]
        )

    try:
        # every completed step from the 10th on is forecast, and realised by its successor
        wait_for(lambda: realised() >= 350, 60, "realised step-time predictions")
        ((made, done),) = ch.query(
            "SELECT countIf(state = 'predicted'), countIf(state = 'realised') FROM predictions "
            "WHERE job_id = {j:String} AND target = 'step_time_ms'",
            parameters={"j": job},
        ).result_rows
        assert made >= done >= 350
        ((mape, base, worst_realised),) = ch.query(
            "SELECT avg(ape), avg(baseline_ape), max(abs(realised - if(step % 2, 110, 90))) "
            "FROM prediction_accuracy WHERE job_id = {j:String} AND target = 'step_time_ms' "
            "AND step >= 100",
            parameters={"j": job},
        ).result_rows[0:1]
        assert worst_realised == pytest.approx(0.0), "realised = the step's median time"
        assert base > 0.08, "the moving average misses the alternation by ~10 %"
        assert mape < 0.02 < base, f"learned {mape:.4f} against the baseline's {base:.4f}"
    finally:
        ch.close()


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
        return [h for h in load_history(stack) if h[0].get("params") == 350_000_000]

    ((features, med, peak),) = wait_for(mine, 30, "the finished job in the history")
    assert features == {"params": 350e6, "world": 2.0, "batch_size": 64.0, "precision_bits": 16.0}
    assert 100.0 <= med <= 101.0
    assert peak == float(11 << 30)
