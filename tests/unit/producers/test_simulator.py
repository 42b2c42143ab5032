"""The simulated job publishes decodable telemetry whose data-wait follows its fault and knob."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from perfloop.catalog import Topics
from perfloop.producers import SimConfig, SimulatedJob, StepReport
from perfloop.schemas import decode_batch

SPEED = 1000.0  # 20 s of simulated time in about 20 ms


class FakePublisher:
    """Stands in for `Publisher`: keeps every message instead of sending it."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, bytes]] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.messages.append((topic, key, value))
        return True

    def columns(self, topic: str) -> dict[str, np.ndarray]:
        batches = [decode_batch(v) for t, _, v in self.messages if t == topic]
        return {c: np.concatenate([b.columns[c] for b in batches]) for c in batches[0].columns}


def _job(pub: FakePublisher, **kw: Any) -> SimulatedJob:
    cfg = SimConfig(**({"job_id": "sim-1", "ranks": 4, "speed": SPEED, "seed": 7} | kw))
    return SimulatedJob(cfg, pub)  # type: ignore[arg-type]


def test_publishes_decodable_step_and_gpu_batches_keyed_by_job() -> None:
    pub = FakePublisher()
    steps = _job(pub).run(5.0)
    assert steps > 0
    assert {t for t, _, _ in pub.messages} == {Topics.STEP, Topics.GPU}
    assert {k for _, k, _ in pub.messages} == {"sim-1"}
    for _, _, value in pub.messages:
        batch = decode_batch(value)
        assert (batch.job_id, batch.node) == ("sim-1", "sim-node-0")
    step = pub.columns(Topics.STEP)
    assert len(step["ts_ns"]) == steps * 4, "one sample per rank per step"
    assert sorted(set(step["rank"].tolist())) == [0, 1, 2, 3]
    assert sorted(set(step["step"].tolist())) == list(range(steps))
    assert np.all(np.diff(step["ts_ns"]) >= 0), "event time moves forward"
    assert (step["data_wait_ms"] <= step["step_time_ms"]).all()
    gpu = pub.columns(Topics.GPU)
    assert len(gpu["ts_ns"]) > 0
    assert ((gpu["sm_util_pct"] >= 0) & (gpu["sm_util_pct"] <= 100)).all()


def test_every_batch_has_a_fresh_sequence_number() -> None:
    pub = FakePublisher()
    _job(pub).run(3.0)
    seqs = [decode_batch(v).seq for t, _, v in pub.messages if t == Topics.STEP]
    assert seqs == list(range(1, len(seqs) + 1))


def test_data_wait_rises_after_the_fault_and_falls_with_more_workers() -> None:
    pub = FakePublisher()
    job = _job(pub, fault_at_s=5.0, num_workers=2)
    reports: list[StepReport] = []

    def boundary(step: int) -> None:
        if reports and reports[-1].elapsed_s >= 12.0 and job.num_workers == 2:
            job.set_num_workers(5)

    job.run(20.0, on_step=reports.append, step_boundary=boundary)

    cols = pub.columns(Topics.STEP)
    t = (cols["ts_ns"] - cols["ts_ns"].min()) / 1e9
    share = cols["data_wait_ms"] / cols["step_time_ms"]
    workers = cols["num_workers"]
    before = share[t < 4.5]
    starved = share[(t > 6.0) & (workers == 2)]
    healed = share[(workers == 5)]
    assert len(before) and len(starved) and len(healed)
    assert before.mean() < 0.05
    assert starved.mean() > 0.3
    assert healed.mean() < 0.05
    assert any(r.fault_active for r in reports) and not reports[0].fault_active
    assert reports[-1].num_workers == 5


def test_same_seed_gives_the_same_telemetry() -> None:
    a, b = FakePublisher(), FakePublisher()
    _job(a, seed=3).run(2.0)
    _job(b, seed=3).run(2.0)
    ca, cb = a.columns(Topics.STEP), b.columns(Topics.STEP)
    np.testing.assert_array_equal(ca["data_wait_ms"], cb["data_wait_ms"])
    np.testing.assert_array_equal(ca["step_time_ms"], cb["step_time_ms"])


def test_stop_ends_the_run_early_and_flushes() -> None:
    pub = FakePublisher()
    job = _job(pub)
    steps = job.run(3600.0, stop=lambda: job.step >= 3)
    assert steps == 3
    assert len(pub.columns(Topics.STEP)["ts_ns"]) == 3 * 4


def test_set_num_workers_accepts_numbers() -> None:
    job = _job(FakePublisher())
    job.set_num_workers(8)
    assert job.num_workers == 8
    job.set_num_workers(4.0)
    assert job.num_workers == 4 and isinstance(job.num_workers, int)
    job.set_num_workers(0)
    assert job.num_workers == 0


@pytest.mark.parametrize("value", [-1, -0.5, True, False, "4", None])
def test_set_num_workers_rejects_negatives_bools_and_text(value: Any) -> None:
    job = _job(FakePublisher(), num_workers=2)
    with pytest.raises(ValueError, match="num_workers"):
        job.set_num_workers(value)
    assert job.num_workers == 2
