"""The simulated job publishes decodable telemetry of every kind, per node, whose dynamics
follow its faults and knobs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from perfloop.exceptions import ConfigError
from perfloop.producers import Fault, SimConfig, SimulatedJob, StepReport
from perfloop.producers.simulator import PHASES, THROTTLE_SW_POWER_CAP
from perfloop.schemas import decode_batch, decode_event
from perfloop.schemas.topics import Topics

FAST = 1e6  # pacing never sleeps
T0 = 1_700_000_000_000_000_000


class FakePublisher:
    """Stands in for `Publisher`: keeps every message instead of sending it."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, bytes]] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.messages.append((topic, key, value))
        return True

    def batches(self, kind: str) -> list[Any]:
        out = [decode_batch(v) for t, _, v in self.messages if t != Topics.JOB]
        return [b for b in out if b.kind == kind]

    def columns(self, kind: str) -> dict[str, np.ndarray]:
        batches = self.batches(kind)
        return {c: np.concatenate([b.columns[c] for b in batches]) for c in batches[0].columns}

    def events(self) -> list[Any]:
        return [decode_event(v) for t, _, v in self.messages if t == Topics.JOB]


def _job(pub: FakePublisher, **kw: Any) -> SimulatedJob:
    cfg = SimConfig(**({"job_id": "sim-1", "ranks_per_node": 4, "speed": FAST, "seed": 7} | kw))
    return SimulatedJob(cfg, pub)  # type: ignore[arg-type]


def test_every_kind_is_published_per_node_and_keyed_by_job() -> None:
    pub = FakePublisher()
    steps = _job(pub, nodes=2, ranks_per_node=3).run(5.0)
    assert steps > 0
    assert {t for t, _, _ in pub.messages} == {
        Topics.STEP,
        Topics.GPU,
        Topics.HOST,
        Topics.SPAN,
        Topics.JOB,
    }
    assert {k for _, k, _ in pub.messages} == {"sim-1"}
    for kind in ("step", "span", "collective", "gpu", "host"):
        for batch in pub.batches(kind):
            node = int(batch.node.rsplit("-", 1)[1])
            assert batch.node == f"sim-1-node-{node}" and batch.producer_id == f"sim-{batch.node}"
            ranks = set(batch.columns["rank"].tolist())
            assert ranks <= set(range(3 * node, 3 * node + 3)), "a node batches only its ranks"
    step = pub.columns("step")
    assert len(step["ts_ns"]) == steps * 6, "one sample per rank per step"
    assert sorted(set(step["step"].tolist())) == list(range(steps))
    for rank in range(6):
        mine = step["rank"] == rank
        assert np.all(np.diff(step["ts_ns"][mine]) > 0), "each rank's steps move forward"
    assert (step["data_wait_ms"] <= step["step_time_ms"]).all()
    spans = pub.columns("span")
    assert len(spans["ts_ns"]) == 5 * len(step["ts_ns"])
    assert set(spans["phase"].tolist()) == set(PHASES)
    assert len(pub.columns("collective")["ts_ns"]) == len(step["ts_ns"])
    gpu = pub.columns("gpu")
    assert len(gpu["ts_ns"]) == 6 * 50, "every rank every 100 ms"
    assert ((gpu["sm_util_pct"] >= 0) & (gpu["sm_util_pct"] <= 100)).all()
    assert len(pub.columns("host")["ts_ns"]) == 6 * 5
    kinds = [(e.KIND, e.rank) for e in pub.events()]
    assert kinds.count(("job_info", 0)) == 1 and len([k for k in kinds if k[0] == "job_info"]) == 6
    assert [e.state for e in pub.events() if e.KIND == "lifecycle" and e.rank == -1] == [
        "started",
        "finished",
    ]


def test_phases_of_a_step_add_up_to_its_step_time() -> None:
    pub = FakePublisher()
    _job(pub, nodes=2, ranks_per_node=2).run(3.0)
    step, spans = pub.columns("step"), pub.columns("span")
    total = spans["duration_ms"].reshape(-1, 5).sum(axis=1)
    order = np.lexsort((spans["rank"][::5], spans["step"][::5]))
    by_step = np.lexsort((step["rank"], step["step"]))
    np.testing.assert_allclose(total[order], step["step_time_ms"][by_step], atol=0.01)
    # ranks meet at the all-reduce: each step ends within the optimizer's jitter on all ranks
    ends = step["ts_ns"][by_step].reshape(-1, 4)
    assert (ends.max(axis=1) - ends.min(axis=1)).max() < 2e6


def test_every_batch_has_a_fresh_sequence_number() -> None:
    pub = FakePublisher()
    _job(pub, chunk_steps=1).run(3.0)
    seqs = [b.seq for b in pub.batches("step")]
    assert seqs == list(range(1, len(seqs) + 1))


def test_data_wait_rises_after_the_fault_and_falls_with_more_workers() -> None:
    pub = FakePublisher()
    job = _job(pub, faults=(Fault("dataloader_starvation", onset_s=5.0),), num_workers=2)
    reports: list[StepReport] = []

    def boundary(step: int) -> None:
        if reports and reports[-1].elapsed_s >= 12.0 and job.num_workers == 2:
            job.set_num_workers(5)

    job.run(20.0, on_step=reports.append, step_boundary=boundary)

    cols = pub.columns("step")
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


def test_same_seed_and_time_base_give_the_same_telemetry() -> None:
    a, b, c = FakePublisher(), FakePublisher(), FakePublisher()
    _job(a, seed=3, t0_ns=T0).run(2.0)
    _job(b, seed=3, t0_ns=T0).run(2.0)
    _job(c, seed=4, t0_ns=T0).run(2.0)
    for kind in ("step", "span", "gpu", "host"):
        ca, cb = a.columns(kind), b.columns(kind)
        for col in ca:
            np.testing.assert_array_equal(ca[col], cb[col], err_msg=f"{kind}.{col}")
    assert not np.array_equal(a.columns("step")["step_time_ms"], c.columns("step")["step_time_ms"])


def test_stop_ends_the_run_at_a_step_boundary_and_flushes() -> None:
    pub = FakePublisher()
    job = _job(pub, chunk_steps=1)
    steps = job.run(3600.0, stop=lambda: job.step >= 3)
    assert steps == 3 and job.state == "stopped"
    assert len(pub.columns("step")["ts_ns"]) == 3 * 4
    last = [e for e in pub.events() if e.KIND == "lifecycle" and e.rank == -1][-1]
    assert (last.state, last.exit_code) == ("killed", 130)


def test_set_num_workers_accepts_numbers() -> None:
    job = _job(FakePublisher())
    job.set_num_workers(8)
    assert job.num_workers == 8
    job.set_num_workers(4.0)
    assert job.num_workers == 4 and isinstance(job.num_workers, int)
    job.set_num_workers(0)
    assert job.num_workers == 0


@pytest.mark.parametrize("value", [-1, -0.5, True, False, "4", None, 5000])
def test_set_num_workers_rejects_negatives_bools_text_and_huge(value: Any) -> None:
    job = _job(FakePublisher(), num_workers=2)
    with pytest.raises(ValueError, match="num_workers"):
        job.set_num_workers(value)
    assert job.num_workers == 2


def test_a_lower_power_limit_lowers_clocks_and_slows_compute() -> None:
    pub = FakePublisher()
    job = _job(pub, ranks_per_node=2)
    assert set(job.knob_handlers()) == {
        "dataloader.num_workers",
        "dataloader.prefetch_factor",
        "gpu.power_limit_w",
    }

    def boundary(step: int) -> None:
        if job.clock_s >= 5.0 and job.power_limit_w == 700.0:
            job.knob_handlers()["gpu.power_limit_w"](350)

    job.run(10.0, step_boundary=boundary)
    gpu, spans = pub.columns("gpu"), pub.columns("span")
    capped = gpu["power_limit_w"] == 350.0
    assert capped.any() and (~capped).any()
    assert (gpu["sm_clock_mhz"][~capped] == 1980).all()
    assert gpu["sm_clock_mhz"][capped].max() < 1700
    assert (gpu["throttle_reasons"][capped] & THROTTLE_SW_POWER_CAP).all()
    assert gpu["power_w"][capped].max() <= 350.0
    fwd = spans["phase"] == "forward"
    t_cap = gpu["ts_ns"][capped].min()
    # simulated durations (the model's output, not a wall-clock measurement): a lower cap
    # lowers the clock, so the same forward pass takes longer
    slow = spans["duration_ms"][fwd & (spans["ts_ns"] > t_cap)].mean()
    assert slow > 1.1 * spans["duration_ms"][fwd & (spans["ts_ns"] < t_cap)].mean()
    with pytest.raises(ValueError, match="power_limit_w"):
        job.set_power_limit_w(5000)


def test_prefetch_factor_is_a_knob_with_bounds() -> None:
    job = _job(FakePublisher())
    job.knob_handlers()["dataloader.prefetch_factor"](4)
    assert job.prefetch_factor == 4
    with pytest.raises(ValueError, match="prefetch_factor"):
        job.set_prefetch_factor(0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"nodes": 0}, "nodes must be ≥ 1"),
        ({"ranks_per_node": 0}, "ranks_per_node must be ≥ 1"),
        ({"speed": 0.0}, "speed must be > 0"),
        ({"rate": -5.0}, "rate must be > 0"),
        ({"faults": (Fault("straggler", 1.0, ranks=(9,)),)}, r"names ranks \[9\]"),
    ],
)
def test_bad_configs_are_one_line_config_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig(job_id="j", **kw)


def test_a_single_rank_job_has_no_collectives() -> None:
    pub = FakePublisher()
    _job(pub, ranks_per_node=1).run(2.0)
    assert not pub.batches("collective")
    # every 5th span is the comm phase; its simulated duration is zero without peers
    assert (pub.columns("span")["duration_ms"][3::5] < 1e-9).all(), "no comm phase"
