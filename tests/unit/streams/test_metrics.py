"""The stream tier's Prometheus metrics: what a real engine produced, exposed as text the
Prometheus parser reads back; the cardinality budget; expiry; rollbacks and pending approvals;
and the HTTP endpoint the worker serves them on."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from perfloop.evaluation import RunSpec, simulate
from perfloop.schemas import ActuationResult, Decision, Prediction, decode_batch, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings
from perfloop.streams._metrics_http import MetricsEndpoint
from perfloop.streams.engine import Outputs, StreamEngine
from perfloop.streams.metrics import (
    CATALOG,
    EXPORTED_NAMES,
    OOM_WARNING_S,
    Family,
    StreamMetrics,
    prometheus_families,
)
from perfloop.streams.windows import COLUMNS

NS = 1_000_000_000
T0 = 1_800_000_000 * NS


class _Snapshot:
    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Any]:
        return prometheus_families(self.families)


def exposition(families: list[Family]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The families as Prometheus text, parsed back: sample name → labels → value."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    text = generate_latest(registry).decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def windows(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Closed-window columns (as `WindowSet.advance` gives them) from row dicts."""
    base = {"ts_ns": T0, "window_end_ns": T0 + 10 * NS, "window_s": 10.0, "hop_s": 10.0,
            "node": "n0", "device": -1, "count": 10, "mean": 0.0, "min": 0.0, "max": 0.0,
            "p50": 0.0, "p95": 0.0, "p99": 0.0, "rate_per_s": 1.0, "slope_per_s": 0.0,
            "closed_ns": T0}  # fmt: skip
    full = [{**base, **r} for r in rows]
    strings = ("job_id", "node", "metric")
    return {
        c: np.asarray([r[c] for r in full], dtype=object if c in strings else None) for c in COLUMNS
    }


def step_rows(job: str, ranks: int, step_ms: float = 100.0) -> list[dict[str, Any]]:
    rows = []
    for r in range(ranks):
        rows.append({"job_id": job, "rank": r, "metric": "step_time_ms", "p50": step_ms + r,
                     "rate_per_s": 1000.0 / step_ms})  # fmt: skip
        rows.append({"job_id": job, "rank": r, "metric": "phase.forward_share", "mean": 0.4})
    return rows


# -- a real engine's output --------------------------------------------------------------------
@pytest.fixture(scope="module")
def straggler_run() -> tuple[StreamMetrics, StreamEngine, int]:
    """A simulated 4-rank job with a straggler (rank 1) through a real engine, its outputs
    taken in as the worker takes them; the metrics snapshot is taken mid-run."""
    messages, _ = simulate(RunSpec("straggler", 3, nodes=1, ranks_per_node=4, duration_s=30))
    eng = StreamEngine(StreamsSettings())
    metrics = StreamMetrics()
    wall, opened = 0, False
    for i, (topic, value) in enumerate(messages):
        if topic != Topics.JOB:
            wall = max(wall, int(decode_batch(value).columns["ts_ns"].max()) + 300_000_000)
        eng.ingest(topic, value, wall_ns=wall, offset=i)
        if i % 4 == 0:
            out = eng.tick(wall)
            metrics.observe(out, wall)
            opened |= any(d.bottleneck == "straggler" and d.state == "open" for d in out.diagnoses)
            if opened and i > len(messages) * 0.7:
                break
    assert opened, "the simulated straggler was diagnosed"
    return metrics, eng, wall


def test_a_real_engines_state_is_exposed_as_prometheus_text(
    straggler_run: tuple[StreamMetrics, StreamEngine, int],
) -> None:
    metrics, eng, wall = straggler_run
    metrics.worker(samples=eng.stats["samples"], messages=eng.stats["messages"],
                   dead_letters={Topics.STEP: 2}, lag_messages=5)  # fmt: skip
    got = exposition(metrics.snapshot(wall, recent=eng.steps.recent))
    assert set(got) <= EXPORTED_NAMES
    (job,) = {dict(k)["job_id"] for k in got["perfloop_job_ranks"]}
    step = {dict(k)["rank"]: v for k, v in got["perfloop_step_time_seconds"].items()}
    assert set(step) == {"0", "1", "2", "3"} and all(0.05 < v < 1 for v in step.values())
    assert all(v > 0 for v in got["perfloop_steps_per_second"].values())
    phases = {dict(k)["phase"] for k in got["perfloop_phase_share"]}
    assert {"forward", "backward"} <= phases
    assert got["perfloop_gpu_sm_utilization_ratio"] and got["perfloop_data_wait_share"]
    late = {dict(k)["rank"]: v for k, v in got["perfloop_straggler_lateness_seconds"].items()}
    assert max(late, key=lambda r: late[r]) == "1", late  # the straggler is the latest rank
    assert (
        got["perfloop_diagnosis_open"][
            (("bottleneck", "straggler"), ("job_id", job), ("level", "network"))
        ]
        >= 1
    )
    assert got["perfloop_job_ranks"][(("job_id", job),)] == 4
    assert got["perfloop_job_state"][(("job_id", job), ("state", "steady"))] == 1
    assert got["perfloop_worker_samples_total"][()] == eng.stats["samples"]
    assert got["perfloop_worker_dead_letters_total"][(("topic", Topics.STEP),)] == 2
    assert got["perfloop_worker_lag_messages"][()] == 5
    assert got["perfloop_metrics_series_dropped"][()] == 0


def test_the_catalog_names_what_a_snapshot_holds() -> None:
    assert all(n.startswith("perfloop_") for n in CATALOG)
    assert (
        "perfloop_rollbacks_total" in EXPORTED_NAMES and "perfloop_rollbacks" not in EXPORTED_NAMES
    )


def test_a_ranks_gpus_combine_and_rss_shows_where_it_is_windowed() -> None:
    m = StreamMetrics()
    rows = [
        {"job_id": "j", "rank": 0, "device": d, "metric": "sm_util_pct", "mean": util}
        for d, util in ((0, 80.0), (1, 60.0))
    ] + [
        {"job_id": "j", "rank": 0, "device": d, "metric": "mem_used_bytes", "max": mem}
        for d, mem in ((0, 2e9), (1, 3e9))
    ]
    rows.append({"job_id": "j", "rank": 0, "metric": "proc_rss_bytes", "max": 5e8})
    rows.append({"job_id": "j", "rank": 1, "metric": "step_time_ms", "p50": float("nan")})
    rows.append({"job_id": "j", "rank": 0, "metric": "power_w", "mean": 300.0})  # not exported
    rows.append({"job_id": "j", "rank": 0, "metric": "sm_util_pct", "mean": 1.0, "window_s": 1.0,
                 "hop_s": 1.0})  # another window: not the one the series come from  # fmt: skip
    m.observe(Outputs(windows=windows(rows)), T0)
    got = exposition(m.snapshot(T0))
    rank0 = (("job_id", "j"), ("node", "n0"), ("rank", "0"))
    assert got["perfloop_gpu_sm_utilization_ratio"] == {rank0: pytest.approx(0.7)}
    assert got["perfloop_gpu_mem_used_bytes"] == {rank0: 3e9}
    assert got["perfloop_rss_bytes"] == {rank0: 5e8}
    assert "perfloop_step_time_seconds" not in got  # NaN: nothing known
    assert not any("power" in name for name in got)


# -- the budget --------------------------------------------------------------------------------
def test_past_the_budget_the_largest_jobs_fold_into_per_job_series() -> None:
    m = StreamMetrics(max_series=150)
    rows = step_rows("big", 40) + step_rows("small", 2)
    m.observe(Outputs(windows=windows(rows)), T0)
    fams = m.snapshot(T0)
    got = exposition(fams)
    total = sum(len(f.samples) for f in fams)
    assert total <= 150 and got["perfloop_metrics_series"][()] == total
    big = {dict(k)["rank"]: v for k, v in got["perfloop_step_time_seconds"].items()
           if dict(k)["job_id"] == "big"}  # fmt: skip
    assert big == {"all": pytest.approx(0.139)}  # the slowest rank's
    small = {
        dict(k)["rank"] for k in got["perfloop_step_time_seconds"] if dict(k)["job_id"] == "small"
    }
    assert small == {"0", "1"}
    share = got["perfloop_phase_share"][
        (("job_id", "big"), ("node", "all"), ("phase", "forward"), ("rank", "all"))
    ]
    assert share == pytest.approx(0.4)
    # 40 ranks x 3 families folded into 3 series
    assert got["perfloop_metrics_series_dropped"][()] == 40 * 3 - 3
    assert got["perfloop_metrics_jobs_folded"][()] == 1


def test_far_past_the_budget_the_least_recently_seen_jobs_are_left_out() -> None:
    m = StreamMetrics(max_series=100)
    for i in range(30):
        m.observe(Outputs(windows=windows(step_rows(f"j{i:02d}", 2))), T0 + i * NS)
    got = exposition(m.snapshot(T0 + 30 * NS))
    jobs = {dict(k)["job_id"] for k in got["perfloop_job_ranks"]}
    assert jobs and len(jobs) < 30 and "j29" in jobs and "j00" not in jobs
    assert sum(len(v) for v in got.values()) <= 100
    assert got["perfloop_metrics_series_dropped"][()] > 0


def test_a_job_gone_quiet_is_removed_after_the_grace_and_an_oom_warning_after_a_minute() -> None:
    m = StreamMetrics(grace_s=300)
    m.observe(Outputs(windows=windows(step_rows("j", 2))), T0)
    warn = Prediction(ts_ns=T0, job_id="j", node="n0", rank=1, prediction_id="p",
                      model="TimeToOOM", target="time_to_oom_s", value=90.0)  # fmt: skip
    m.observe(Outputs(predictions=[warn]), T0)
    got = exposition(m.snapshot(T0 + NS))
    assert got["perfloop_time_to_oom_seconds"] == {
        (("job_id", "j"), ("node", "n0"), ("rank", "1")): 90.0
    }
    later = exposition(m.snapshot(T0 + int((OOM_WARNING_S + 1) * NS)))
    assert "perfloop_time_to_oom_seconds" not in later and later["perfloop_step_time_seconds"]
    gone = exposition(m.snapshot(T0 + 301 * NS))
    assert "perfloop_step_time_seconds" not in gone and gone["perfloop_worker_jobs"][()] == 0


# -- actuations --------------------------------------------------------------------------------
def _result(command: str, status: str, rank: int) -> ActuationResult:
    return ActuationResult(ts_ns=T0, job_id="j", node="n0", rank=rank, command_id=command,
                           status=status, knob="dataloader.num_workers", value=2)  # fmt: skip


def _decision(rec: str, outcome: str, ts_ns: int = T0) -> Decision:
    return Decision(ts_ns=ts_ns, job_id="j", node="actuator", rank=-1, rec_id=rec,
                    knob="dataloader.num_workers", to_value=4, tier="approve",
                    outcome=outcome)  # fmt: skip


def test_a_rollback_counts_once_per_command_and_approvals_pend_until_decided() -> None:
    m = StreamMetrics(pending_ttl_s=900)
    for ev in (_result("c1", "applied", 0), _result("c1", "rolled_back", 0),
               _result("c1", "rolled_back", 1), _result("c2", "kept", 0),
               _decision("r1", "pending"), _decision("r2", "pending", T0 + 60 * NS),
               _decision("r2", "issued")):  # fmt: skip
        m.observe_event(ev, T0 + 60 * NS)
    got = exposition(m.snapshot(T0 + 120 * NS))
    assert got["perfloop_rollbacks_total"] == {(("job_id", "j"),): 1.0}
    assert got["perfloop_pending_approvals"] == {(("job_id", "j"),): 1.0}
    assert got["perfloop_pending_approval_age_seconds"][(("job_id", "j"),)] == 120.0
    pends = exposition(m.snapshot(T0 + 850 * NS))  # past the grace: kept while it pends
    assert pends["perfloop_pending_approvals"] == {(("job_id", "j"),): 1.0}
    assert "perfloop_pending_approvals" not in exposition(m.snapshot(T0 + 901 * NS))


# -- the endpoint ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_endpoint_serves_snapshots_taken_on_the_ticking_thread() -> None:
    port = _free_port()
    eng = StreamEngine(StreamsSettings(metrics_port=port))
    ep = MetricsEndpoint(eng.settings, eng)
    assert ep.start() and ep.url == f"http://127.0.0.1:{port}/metrics"
    stop = threading.Event()
    pending = encode_event(_decision("r1", "pending", time.time_ns()))

    def loop() -> None:  # the worker's event loop: messages and ticks
        ep.message(Topics.ACTUATIONS, pending, time.time_ns(), time.time_ns() - NS // 2)
        rows = step_rows("j", 2)
        ep.tick(Outputs(windows=windows(rows)), time.time_ns())
        while not stop.wait(0.05):
            ep.tick(Outputs(), time.time_ns())

    t = threading.Thread(target=loop)
    t.start()
    try:
        with urllib.request.urlopen(ep.url, timeout=10) as r:
            text = r.read().decode()
    finally:
        stop.set()
        t.join()
        ep.stop()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"perfloop_step_time_seconds", "perfloop_pending_approvals"} <= names
    assert {"perfloop_worker_ingest_delay_seconds", "process_resident_memory_bytes"} <= names
    assert 'perfloop_pending_approvals{job_id="j"} 1.0' in text


def test_a_port_in_use_is_one_line_and_no_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        eng = StreamEngine(StreamsSettings(metrics_port=port))
        with caplog.at_level(logging.WARNING, logger="perfloop.streams.metrics"):
            assert not MetricsEndpoint(eng.settings, eng).start()
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"cannot serve on 127.0.0.1:{port}" in line and "PERFLOOP_METRICS_PORT" in line
    assert not MetricsEndpoint(StreamsSettings(metrics_port=0), eng).start()


def test_a_failing_update_is_logged_once_and_the_worker_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = StreamEngine(StreamsSettings())
    ep = MetricsEndpoint(eng.settings, eng)
    bad = Outputs(windows={"ts_ns": np.array([1])})  # no columns: a bug upstream
    with caplog.at_level(logging.WARNING, logger="perfloop.streams.metrics"):
        ep.tick(bad, T0)
        ep.tick(bad, T0)
        ep.message(Topics.ACTUATIONS, b"{", T0, -1)
    assert len(caplog.records) == 2  # one line per kind of failure
