"""`perfloop report` as a user runs it, on the real embedded stack: a two-rank job published
through the producers' publisher (steps, spans, collectives with a late rank, GPU samples, a
diagnosis and a kept change) becomes one self-contained page with its plots and figures; an
unknown job is one line and exit 1."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest

from perfloop.producers import Publisher
from perfloop.report import PLOT_IDS
from perfloop.schemas import (
    ActuationResult,
    BatchBuilder,
    Diagnosis,
    JobInfo,
    JobLifecycle,
    encode_event,
)
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings

from .conftest import perfloop_cli, query, wait_for

pytestmark = pytest.mark.integration

NS = 10**9
STEPS = 100


def _publish(stack: StackSettings, job: str, t0: int) -> None:
    """Two ranks on two nodes, 100 steps of 100 ms from 1 s after the start; rank 1 is 30 ms
    late at each step's all-reduce from step 50 on; one H100 per node."""
    pub = Publisher(stack)
    try:
        events = [JobLifecycle(ts_ns=t0, job_id=job, node="n0", rank=-1, state="started")]
        for r, node in enumerate(("n0", "n1")):
            events.append(JobInfo(
                ts_ns=t0, job_id=job, node=node, rank=r, model_name="Net", world_size=2,
                parallelism="ddp", precision="bf16", gpu_name="NVIDIA H100 80GB HBM3",
                gpu_count=1, cpu_count=16, extra={"flops_per_step": "2e12"},
            ))  # fmt: skip
            steps = BatchBuilder("step", job_id=job, node=node, producer_id="test")
            spans = BatchBuilder("span", job_id=job, node=node, producer_id="test")
            colls = BatchBuilder("collective", job_id=job, node=node, producer_id="test")
            gpu = BatchBuilder("gpu", job_id=job, node=node, producer_id="test")
            for i in range(STEPS):
                end = t0 + NS + (i + 1) * 100_000_000
                late = 30.0 if i >= 50 else 0.0
                steps.add(ts_ns=end, rank=r, step=i, step_time_ms=100.0, data_wait_ms=10.0,
                          samples=32, tokens=4096)  # fmt: skip
                for phase, start, ms in (("data_wait", 0, 10.0), ("forward", 10, 30.0),
                                         ("backward", 40, 40.0)):  # fmt: skip
                    spans.add(ts_ns=end - 100_000_000 + start * 1_000_000, rank=r, step=i,
                              phase=phase, name=phase, duration_ms=ms)  # fmt: skip
                colls.add(
                    ts_ns=end - 40_000_000 + int((late if r == 1 else 0.0) * 1e6), rank=r,
                    step=i, op="all_reduce", size_bytes=1 << 20, group="0", group_size=2,
                    duration_ms=5.0 + (late if r == 0 else 0.0),
                )  # fmt: skip
            for k in range(110):
                gpu.add(ts_ns=t0 + k * 100_000_000, rank=r, device=0, sm_util_pct=90.0,
                        power_w=400.0, mem_used_bytes=40 << 30, mem_total_bytes=80 << 30,
                        energy_mj=1_000_000 + k * 40_000)  # fmt: skip
            for topic, b in ((Topics.STEP, steps), (Topics.SPAN, spans), (Topics.SPAN, colls),
                             (Topics.GPU, gpu)):  # fmt: skip
                assert pub.publish(topic, job, b.encode())
        events.append(Diagnosis(
            ts_ns=t0 + 7 * NS, job_id=job, node="n0", rank=-1, diagnosis_id=f"d-{job}",
            bottleneck="straggler", level="network", loop="training", state="open",
            onset_ns=t0 + 6 * NS, step_share=0.3, confidence=0.9, critical_path=True, ranks=[1],
            summary="rank 1 arrives late",
        ))  # fmt: skip
        for status, t, step in (("applied", 4, 30), ("kept", 7, 60)):
            events.append(ActuationResult(
                ts_ns=t0 + t * NS, job_id=job, node="n0", rank=0, command_id=f"c-{job}",
                status=status, knob="dataloader.num_workers", value=2, step=step,
                evidence={"before_ms": 120.0, "after_ms": 100.0, "ratio": 0.83}
                if status == "kept" else {},
            ))  # fmt: skip
        events.append(
            JobLifecycle(ts_ns=t0 + 12 * NS, job_id=job, node="n0", rank=-1, state="finished")
        )
        for e in events:
            topic = {"diagnosis": Topics.DIAGNOSES, "actuation": Topics.ACTUATIONS}.get(
                e.KIND, Topics.JOB
            )
            assert pub.publish(topic, job, encode_event(e))
        assert pub.flush(10) == 0
    finally:
        pub.close()


@pytest.fixture(scope="module")
def published(stack: StackSettings) -> tuple[str, int]:
    """The two-rank job of `_publish`, its rows in the warehouse: its id and start (ns)."""
    job = f"report-{uuid.uuid4().hex[:8]}"
    t0 = (time.time_ns() - 20 * NS) // NS * NS
    _publish(stack, job, t0)
    counts = (
        "SELECT (SELECT count() FROM steps WHERE job_id = {j:String}), "
        "(SELECT count() FROM collectives WHERE job_id = {j:String}), "
        "(SELECT count() FROM gpu_samples WHERE job_id = {j:String}), "
        "(SELECT count() FROM spans WHERE job_id = {j:String}), "
        "(SELECT count() FROM diagnoses WHERE diagnosis_id = {d:String}), "
        "(SELECT count() FROM actuations WHERE job_id = {j:String}), "
        "(SELECT countIf(state = 'finished') FROM job_lifecycle WHERE job_id = {j:String})"
    )
    want = (2 * STEPS, 2 * STEPS, 220, 6 * STEPS, 1, 2, 1)
    wait_for(lambda: query(stack, counts, j=job, d=f"d-{job}")[0] == want, 30, "the job's rows")
    return job, t0


def test_report_of_a_published_job_has_its_plots_and_figures(
    stack_env_vars: dict[str, str], published: tuple[str, int], tmp_path: Path
) -> None:
    job, _ = published
    out = tmp_path / "report.html"
    env = stack_env_vars | {"PERFLOOP_PRICE_PER_GPU_HOUR": "4"}
    run = perfloop_cli("report", job, "-o", str(out), env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote {out}: 12.0 s of 2 rank(s), goodput 66.5 %, MFU 2.0 %")
    page = out.read_text()
    for div in set(PLOT_IDS) - {"plot-predictions"}:  # forecasts need the worker's history
        assert f'<div id="{div}" class="plotly-graph-div"' in page, div
    assert not re.search(r"<script[^>]*\bsrc=", page)
    for text in ("8 USD", "energy per step", "straggler_wait", "dataloader.num_workers",
                 "kept", "rank 1 arrives late", "What each diagnosis costs"):  # fmt: skip
        assert text in page, text
    assert "latest on average: rank 1 (15.0 ms a step)" in page  # 30 ms in half its steps

    unknown = perfloop_cli("report", f"{job}-nope", "-o", str(tmp_path / "x.html"), env=env)
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert unknown.stderr.count("\n") == 1
    assert unknown.stderr.startswith(f"perfloop: unknown job '{job}-nope'")
    assert not (tmp_path / "x.html").exists()


def test_an_ended_job_s_accounting_lands_in_the_warehouse(
    stack: StackSettings, published: tuple[str, int]
) -> None:
    """The stack's accountant stores what the report computes, once the job's end is seen:
    the same figures, priced at the default 2.5 USD per GPU-hour; the wall time's categories
    sum to it; the job's diagnosis priced; a job that ends again is accounted for again."""
    from perfloop.report import make_report
    from perfloop.settings import ReportSettings

    job, t0 = published
    sql = (
        "SELECT state, wall_s, ranks, gpus, goodput, productive_s + data_wait_s + "
        "straggler_wait_s + hang_s + restart_s + checkpoint_s + eval_s + warmup_s + startup_s "
        "+ idle_s, mfu, price_per_hour, cost, currency, energy_wh, diagnosis_bottlenecks, "
        "diagnosis_costs, toUnixTimestamp64Nano(lifecycle_end), samples_per_s "
        "FROM job_accounting FINAL WHERE job_id = {j:String}"
    )
    wait_for(lambda: query(stack, sql, j=job), 60, "the job's accounting row")
    (state, wall, ranks, gpus, goodput, parts, mfu_, price, cost, cur, wh, kinds, costs, end,
     sps) = query(stack, sql, j=job)[0]  # fmt: skip
    report = make_report(ReportSettings(**_warehouse_of(stack)), job).summary
    assert (state, ranks, gpus, cur) == ("finished", 2, 2, "USD")
    assert wall == pytest.approx(12.0) and parts == pytest.approx(wall)
    assert goodput == pytest.approx(report.time.goodput) and 0.6 < goodput < 0.7
    assert mfu_ == pytest.approx(report.figure("MFU").value)
    assert sps == pytest.approx(report.figure("samples/s").value)
    assert wh == pytest.approx(report.figure("energy").value)
    assert price == pytest.approx(5.0)  # 2 GPUs at 2.5 an hour
    assert cost == pytest.approx(5.0 * 12.0 / 3600)
    # the published straggler, costed as the report costs it (what the stream worker
    # diagnosed on the same steps lands when it lands: before the accounting or after it)
    straggler = next(d for d in report.diagnoses if d.bottleneck == "straggler")
    assert costs[kinds.index("straggler")] == pytest.approx(straggler.total) and straggler.total > 0
    assert end == t0 + 12 * NS

    # The job resumes under the same id and ends again: a second accounting, the latest kept.
    later = t0 + 15 * NS
    pub = Publisher(stack)
    try:
        for dt, state, code in ((0, "started", None), (NS, "failed", 1)):
            e = JobLifecycle(ts_ns=later + dt, job_id=job, node="n0", rank=-1, state=state,
                             exit_code=code)  # fmt: skip
            assert pub.publish(Topics.JOB, job, encode_event(e))
        assert pub.flush(10) == 0
    finally:
        pub.close()
    wait_for(lambda: query(stack, sql, j=job)[0][0] == "failed", 60, "the job's second accounting")
    again = query(stack, sql, j=job)[0]
    assert again[1] == pytest.approx(16.0)  # from the first start to the second end


def _warehouse_of(stack: StackSettings) -> dict[str, object]:
    return {"home": stack.home, "clickhouse_port": stack.clickhouse_port,
            "kafka_port": stack.kafka_port}  # fmt: skip
