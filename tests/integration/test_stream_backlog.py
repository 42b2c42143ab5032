"""Acceptance: a backlog drained at full speed on the real stack loses nothing and is diagnosed
as if it had been read live.

About 100 s of a simulated 1x4 job with data-loader starvation, its event times ending 20 s
ago, are published in one burst; the stream worker reads them far faster than they were made.
Every step sample must land in a 1 s ``step_time_ms`` window (none dropped as late: the
sources of a partition still being read are not silent), and the starvation must be in the
``diagnoses`` table at its event time (the analyses run on the job's event-time clock).
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Producer

from perfloop.producers.scenarios import scenario_config
from perfloop.producers.simulator import SimConfig, SimulatedJob
from perfloop.schemas import GroundTruth, decode_batch, decode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.warehouse import client
from tests.helpers import Collect

from .conftest import wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000
DURATION_S = 100.0


def _job(job: str) -> tuple[list[tuple[str, str, bytes]], int, GroundTruth]:
    """The job's messages as a live producer publishes them (one per node and kind every
    0.25 s), its step samples and its fault."""
    steps = max(1, int(250 // SimConfig(job_id=job).nominal_step_ms))
    cfg = scenario_config(
        "dataloader_starvation",
        job_id=job,
        nodes=1,
        ranks_per_node=4,
        duration_s=DURATION_S,
        seed=3,
        t0_ns=time.time_ns() - int((DURATION_S + 20) * NS),
        speed=1e6,
        publish_interval_ms=1e-6,
        chunk_steps=steps,
    )
    pub = Collect()
    SimulatedJob(cfg, pub).run(DURATION_S)
    n_steps = sum(len(decode_batch(v)) for t, _, v in pub.messages if t == Topics.STEP)
    (truth,) = [
        e for t, _, v in pub.messages if t == Topics.JOB for e in [decode_event(v)]
        if isinstance(e, GroundTruth)
    ]  # fmt: skip
    return pub.messages, n_steps, truth


def test_a_backlog_read_at_full_speed_loses_no_sample_and_is_diagnosed(
    stack: StackSettings,
) -> None:
    job = f"it-backlog-{uuid.uuid4().hex[:8]}"
    messages, n_steps, truth = _job(job)
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 20})
    for topic, key, value in messages:
        p.produce(topic, key=key.encode(), value=value)
        p.poll(0)
    assert p.flush(30) == 0

    ch = client(stack)
    try:

        def windowed() -> int:
            return int(
                ch.query(
                    "SELECT sum(count) FROM windows_latest WHERE job_id = {j:String} "
                    "AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1",
                    parameters={"j": job},
                ).result_rows[0][0]
                or 0
            )

        try:
            wait_for(lambda: windowed() >= n_steps, 60, "every step sample in a 1 s window")
        except AssertionError as e:
            raise AssertionError(f"{e}: {windowed()} of {n_steps} step samples") from None
        assert windowed() == n_steps, "each step sample counted once"

        def opened() -> list[tuple[int, int]]:
            rows = ch.query(
                "SELECT toUnixTimestamp64Nano(ts), toUnixTimestamp64Nano(onset) FROM diagnoses "
                "WHERE job_id = {j:String} AND bottleneck = 'dataloader_starvation' "
                "AND state = 'open' AND explained_by = ''",
                parameters={"j": job},
            ).result_rows
            return [(int(a), int(b)) for a, b in rows]

        (ts, _onset), *_ = wait_for(opened, 30, "the starvation's diagnosis")
    finally:
        ch.close()
    latency_s = (ts - truth.onset_ns) / NS
    assert 0 <= latency_s <= 5, f"opened {latency_s:.1f} s of event time after the fault's onset"
