"""ProfileCapture with a real tiny model trained on CPU: a requested capture of N steps is
published as this job's telemetry (parsed by the trace-replay code) plus a summary; bad and
overlapping requests are refused; nothing that fails inside the profiler reaches training."""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest

from perfloop.exceptions import ConfigError
from perfloop.producers._capture import COMPONENT, ProfileCapture, emit_to, summarize_trace
from perfloop.producers.emitter import Emitter
from perfloop.schemas import (
    Batch,
    CapabilityReport,
    JobInfo,
    PhaseSpan,
    StepEvent,
    decode_batch,
    decode_event,
    is_batch,
)
from perfloop.schemas.topics import KIND_TOPICS
from tests.helpers import TRACES, Collect

torch = pytest.importorskip("torch")

JOB, NODE, RANK = "job-cap/1", "node-7", 3


class Model:
    """A tiny regression model and its optimizer: one training step per `step` call."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01)
        self.x, self.y = torch.randn(8, 16), torch.randn(8, 1)

    def step(self) -> float:
        loss = torch.nn.functional.mse_loss(self.net(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()


def train(cap: ProfileCapture, steps: range, request_at: dict[int, int] | None = None) -> None:
    """A training loop with a step boundary before each step; requests made at given steps."""
    model = Model()
    for step in steps:
        if request_at and step in request_at:
            cap.request(request_at[step])
        cap.step_boundary(step)
        model.step()


def _capture(tmp_path: Path, seen: list[Any], **kw: Any) -> ProfileCapture:
    return ProfileCapture(
        job_id=JOB, node=NODE, rank=RANK, emit=seen.append, out_dir=str(tmp_path), **kw
    )


def _rows(seen: list[Any]) -> list[Any]:
    """Every emitted sample and event as its pydantic event."""
    out: list[Any] = []
    for obj in seen:
        out.extend(obj.events() if isinstance(obj, Batch) else [obj])
    return out


def _summary(seen: list[Any]) -> CapabilityReport:
    assert isinstance(seen[-1], CapabilityReport), "the summary comes last"
    assert seen[-1].component == COMPONENT
    return seen[-1]


def test_a_capture_of_three_steps_is_published_as_this_jobs_telemetry(tmp_path: Path) -> None:
    seen: list[Any] = []
    cap = _capture(tmp_path, seen)
    t0 = time.time_ns()
    train(cap, range(10), request_at={2: 3})
    cap.close()
    assert not cap.busy
    rows = _rows(seen)
    spans = [r for r in rows if isinstance(r, PhaseSpan)]
    # the trace's record_function annotations, as this job's rows for the captured steps
    assert spans and {(s.job_id, s.node, s.rank) for s in spans} == {(JOB, NODE, RANK)}
    assert {s.step for s in spans} == {2, 3, 4}
    assert {s.name for s in spans} >= {"Optimizer.step#SGD.step"}
    assert all(s.depth == 1 for s in spans)  # the hooks already tile the steps (depth 0)
    assert not [r for r in rows if isinstance(r, StepEvent | JobInfo)]  # nor restated steps
    assert all(t0 <= s.ts_ns <= time.time_ns() for s in spans)  # the job's clock
    report = _summary(seen)
    assert (report.job_id, report.node, report.rank, report.available) == (JOB, NODE, RANK, True)
    d = report.details
    assert (d["steps"], d["step_count"], d["emitted_samples"]) == ("2-4", "3", str(len(spans)))
    assert float(d["profiled_ms"]) > 0
    top = [d[f"top{i}"] for i in range(1, 11)]
    # two Linear layers: two addmm calls a step
    assert any(t.startswith("aten::addmm: ") and t.endswith(" ms self, 6 calls") for t in top)
    trace = Path(d["trace"])
    assert trace.parent == tmp_path
    events = json.loads(trace.read_text())["traceEvents"]
    marks = [e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert sorted(marks) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    (summary,) = cap.summaries
    assert summary.ok and summary.steps == (2, 3, 4)


def test_full_replay_also_restates_the_steps_and_the_job(tmp_path: Path) -> None:
    seen: list[Any] = []
    cap = _capture(tmp_path, seen, full_replay=True, background=False)
    train(cap, range(6), request_at={1: 2})
    assert not cap.busy  # processed on the training thread
    rows = _rows(seen)
    steps = [r for r in rows if isinstance(r, StepEvent)]
    assert [(s.step, s.rank, s.job_id) for s in steps] == [(1, RANK, JOB), (2, RANK, JOB)]
    assert all(s.step_time_ms > 0 for s in steps)
    (info,) = [r for r in rows if isinstance(r, JobInfo)]
    assert (info.rank, info.extra["source"]) == (RANK, "trace_replay")
    depth0 = [r for r in rows if isinstance(r, PhaseSpan) and r.depth == 0]
    for s in steps:  # the depth-0 spans tile each step
        total = sum(p.duration_ms for p in depth0 if p.step == s.step)
        assert total == pytest.approx(s.step_time_ms, rel=1e-6)
    assert _summary(seen).details["steps"] == "1-2"


def test_emit_to_publishes_through_an_emitter(tmp_path: Path) -> None:
    pub = Collect()
    em = Emitter(pub, job_id=JOB, node=NODE, producer_id="test")
    cap = _capture(tmp_path, [], background=False)
    cap.emit = emit_to(em)
    train(cap, range(4), request_at={0: 2})
    em.flush()
    kinds = []
    for topic, _, value in pub.messages:
        if is_batch(value):
            b = decode_batch(value)
            assert (b.job_id, b.node, set(b.columns["rank"].tolist())) == (JOB, NODE, {RANK})
            kinds.append(b.kind)
        else:
            kinds.append(decode_event(value).KIND)
        assert topic == KIND_TOPICS[kinds[-1]]
    assert sorted(set(kinds)) == ["capability", "span"]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0, r"profiler.capture_steps=0 is outside \[1, 50\]"),
        (-2, r"=-2 is outside \[1, 50\]"),
        (51, r"=51 is outside \[1, 50\]"),
        (2.5, r"=2.5 is not a whole number"),
        ("3", r"='3' is not a whole number"),
        (True, r"=True is not a whole number"),
    ],
)
def test_bad_requests_are_refused_naming_the_value(value: Any, why: str, tmp_path: Path) -> None:
    cap = _capture(tmp_path, [])
    with pytest.raises(ConfigError, match=why):
        cap.request(value)
    assert not cap.busy


def test_a_whole_float_is_a_number_of_steps(tmp_path: Path) -> None:
    cap = _capture(tmp_path, [])
    cap.request(3.0)
    assert cap.busy


def test_a_second_request_is_refused_until_the_capture_is_published(tmp_path: Path) -> None:
    seen: list[Any] = []
    cap = _capture(tmp_path, seen)
    model = Model()
    cap.request(2)
    with pytest.raises(ConfigError, match=r"=1: a capture of 2 steps is already requested"):
        cap.request(1)
    cap.step_boundary(0)
    model.step()
    with pytest.raises(ConfigError, match=r"=4: a capture of 2 steps is running \(1 captured\)"):
        cap.request(4)
    for step in (1, 2):
        cap.step_boundary(step)
        model.step()
    cap.wait(30)
    assert not cap.busy and _summary(seen).details["steps"] == "0-1"
    cap.request(1)  # accepted once the first one is out
    train(cap, range(10, 12))
    cap.close()
    assert [s.steps for s in cap.summaries] == [(0, 1), (10,)]


def test_a_request_while_another_profiler_runs_is_refused(tmp_path: Path) -> None:
    cap = _capture(tmp_path, [])
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
        pytest.raises(ConfigError, match="another PyTorch profiler is running"),
    ):
        cap.request(2)
    assert not cap.busy


class BrokenProfiler:
    """A torch.profiler.profile that fails at one point: start, stop or export."""

    def __init__(self, fail: str, **kwargs: Any) -> None:
        self.fail = fail

    def start(self) -> None:
        if self.fail == "start":
            raise RuntimeError("Can't start the profiler: Kineto is busy")

    def stop(self) -> None:
        if self.fail == "stop":
            raise RuntimeError("Kineto lost its buffers")

    def export_chrome_trace(self, path: str) -> None:
        if self.fail == "export":
            raise OSError(28, "No space left on device")
        Path(path).write_text('{"traceEvents": [')  # "garbage": a truncated file


@pytest.mark.parametrize(
    ("fail", "why"),
    [
        ("start", "did not start at step 1: RuntimeError: Can't start the profiler"),
        ("stop", "failed at step 3: RuntimeError: Kineto lost its buffers"),
        ("export", r"steps 1-2 failed: OSError: \[Errno 28\] No space left on device"),
        ("garbage", "TraceError: .* not valid JSON"),
    ],
)
def test_failures_inside_the_profiler_never_reach_training(
    fail: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    seen: list[Any] = []
    cap = _capture(tmp_path, seen)
    monkeypatch.setattr(torch.profiler, "profile", functools.partial(BrokenProfiler, fail))
    with caplog.at_level(logging.WARNING, logger="perfloop.producers"):
        train(cap, range(6), request_at={1: 2})  # raises nothing
        cap.wait(30)
    report = _summary(seen)
    assert not report.available and report.missing == ["trace"]
    assert re.search(why, report.reason), report.reason
    assert [r.message.count("\n") for r in caplog.records] == [0]  # said once, one line
    assert not cap.busy
    monkeypatch.undo()
    cap.request(1)  # the next capture works
    train(cap, range(6, 8))
    cap.close()
    assert _summary(seen).available


def test_an_emit_that_raises_is_reported_not_raised(tmp_path: Path, caplog: Any) -> None:
    calls: list[Any] = []

    def emit(obj: Any) -> None:
        calls.append(obj)
        if isinstance(obj, Batch):
            raise ValueError("broker gone")

    cap = ProfileCapture(job_id=JOB, node=NODE, rank=RANK, emit=emit, out_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="perfloop.producers"):
        train(cap, range(5), request_at={0: 2})
        cap.close()
    (summary,) = cap.summaries
    assert not summary.ok and "emit failed: ValueError: broker gone" in summary.error
    assert isinstance(calls[-1], CapabilityReport) and not calls[-1].available


def test_close_publishes_a_capture_cut_short(tmp_path: Path) -> None:
    seen: list[Any] = []
    cap = _capture(tmp_path, seen)
    train(cap, range(3), request_at={1: 10})  # training ends after 2 of the 10 steps
    cap.close()
    assert _summary(seen).details["steps"] == "1-2" and not cap.busy


def test_the_summary_self_times_are_torchs(tmp_path: Path) -> None:
    """Self times from the exported trace equal the profiler's own key averages."""
    model = Model()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model.step()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    ops, kernels = summarize_trace(path, top=5)
    theirs = {e.key: e for e in prof.key_averages()}
    assert len(ops) == 5 and kernels == ()
    for op in ops:
        assert op.self_ms == pytest.approx(theirs[op.name].self_cpu_time_total / 1000, abs=1e-6)
        # a call that re-enters its own operator (a redispatch) is one call to the summary;
        # the profiler's key averages count it once too, but now and then twice (seen in CI:
        # aten::mse_loss_backward 2 against 4, its self time equal)
        assert theirs[op.name].count in (op.calls, 2 * op.calls), op


def test_the_summary_ranks_gpu_kernels_of_a_real_trace() -> None:
    paths = sorted((TRACES / "hta" / "critical_path").rglob("*.json.gz"))
    if not paths:
        pytest.skip("the shared traces are not here")
    ops, kernels = summarize_trace(paths[0], top=3)
    assert len(ops) == 3 and len(kernels) == 3
    assert kernels[0].self_ms >= kernels[1].self_ms >= kernels[2].self_ms > 0
    assert "sgemm" in kernels[0].name
