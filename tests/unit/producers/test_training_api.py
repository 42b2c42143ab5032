"""The explicit training API: Monitor, Callback/CallbackSet, the Recorder's tiling, job info."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from perfloop.producers.training import (
    Callback,
    CallbackSet,
    Monitor,
    Recorder,
    SpanRecord,
    StepRecord,
    describe_job,
    launcher_world,
)
from perfloop.schemas import decode_batch, decode_event, is_batch

MS = 1_000_000


class FakePublisher:
    """Keeps every message; decodes them with the real codec."""

    def __init__(self, fail: bool = False) -> None:
        self.messages: list[tuple[str, str, bytes]] = []
        self.fail = fail

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        if self.fail:
            raise RuntimeError("broker on fire")
        self.messages.append((topic, key, value))
        return True

    def rows(self, kind: str) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = defaultdict(list)
        for _, _, v in self.messages:
            if not is_batch(v):
                continue
            b = decode_batch(v)
            if b.kind == kind:
                for c, a in b.columns.items():
                    cols[c].extend(a.tolist())
        return cols

    def events(self, kind: str) -> list[Any]:
        out = []
        for _, _, v in self.messages:
            if is_batch(v):
                continue
            e = decode_event(v)
            if kind == e.KIND:
                out.append(e)
        return out


def _spin(ms: float) -> None:
    end = time.perf_counter_ns() + int(ms * MS)
    while time.perf_counter_ns() < end:
        pass


def _monitor(pub: FakePublisher, **kw: Any) -> Monitor:
    return Monitor(job_id="j1", node="n0", rank=0, publisher=pub, **kw)


def test_steps_and_phases_are_published_and_spans_tile_each_step() -> None:
    pub = FakePublisher()
    mon = _monitor(pub)
    for i in range(3):
        with mon.step(batch_size=16, tokens=16 * 128):
            with mon.phase("data_wait"):
                _spin(1)
            _spin(0.5)  # unattributed: an "other" span
            with mon.phase("forward"), mon.phase("attention"):  # nested: depth 1, user
                _spin(0.5)
            with mon.phase("backward"):
                _spin(1)
            mon.report(loss=2.0 - i, lr=0.1, grad_norm=1.5)
    mon.close()
    steps = pub.rows("step")
    assert steps["step"] == [0, 1, 2]
    assert steps["batch_size"] == [16] * 3 and steps["samples"] == [16] * 3
    assert steps["tokens"] == [2048] * 3 and steps["loss"] == [2.0, 1.0, 0.0]
    assert steps["lr"] == [0.1] * 3 and steps["grad_norm"] == [1.5] * 3
    assert all(r > 0 for r in steps["rss_bytes"])
    assert all(dw >= 1.0 for dw in steps["data_wait_ms"])
    spans = pub.rows("span")
    for i, step_ms in enumerate(steps["step_time_ms"]):
        top = [
            d
            for s, d, depth in zip(spans["step"], spans["duration_ms"], spans["depth"], strict=True)
            if s == i and depth == 0
        ]
        assert sum(top) == pytest.approx(step_ms, rel=1e-9)
    named = set(zip(spans["phase"], spans["name"], spans["depth"], strict=True))
    assert ("user", "attention", 1) in named and ("user", "other", 0) in named
    assert {("data_wait", "data_wait", 0), ("forward", "forward", 0)} <= named


def test_rows_leave_while_the_loop_runs_from_one_worker_thread() -> None:
    """The pipeline's one worker drains the recorder and flushes the emitter on the publish
    interval: a running loop's steps are published before it ends, and no thread of the
    emitter's own wakes up beside it."""
    import threading

    pub = FakePublisher()
    mon = _monitor(pub, flush_interval_s=0.05)
    try:
        names = {t.name for t in threading.enumerate()}
        assert "perfloop-pipeline" in names and "perfloop-emitter" not in names
        deadline = time.monotonic() + 10
        i = 0
        while not pub.rows("step").get("step") and time.monotonic() < deadline:
            with mon.step():
                _spin(1)
            i += 1
            time.sleep(0.01)
        published = pub.rows("step")["step"]
        assert published and published == list(range(len(published)))  # in order, from 0
    finally:
        mon.close()
    assert pub.rows("step")["step"] == list(range(i))  # and the rest at close


def test_lifecycle_job_info_and_stats() -> None:
    pub = FakePublisher()
    with _monitor(pub) as mon:
        mon.job_info(batch_size=32, precision="bf16", command="python train.py")
        with mon.step():
            pass
    states = [e.state for e in pub.events("lifecycle")]
    assert states == ["started", "finished"]
    (info,) = pub.events("job_info")
    assert (info.batch_size, info.precision, info.command) == (32, "bf16", "python train.py")
    assert info.cpu_count > 0 and info.world_size >= 1
    (stats,) = pub.events("producer")
    assert stats.samples >= 1 and stats.producer_id


def test_an_exception_in_the_loop_ends_the_job_as_failed() -> None:
    pub = FakePublisher()
    with pytest.raises(ValueError), _monitor(pub):
        raise ValueError("bad batch")
    last = pub.events("lifecycle")[-1]
    assert (last.state, last.exit_code) == ("failed", 1) and "bad batch" in last.message


def test_never_raises_into_the_loop() -> None:
    pub = FakePublisher(fail=True)
    mon = _monitor(pub)  # even the "started" event fails to publish
    for _ in range(3):
        with mon.step(batch_size=4):
            with mon.phase("forward"):
                pass
            mon.report(loss=float("nan"), lr=-1.0, grad_norm=float("inf"), colour="blue")
    mon.close()
    assert mon.steps == 3
    assert mon.errors >= 2  # the publish failures and the unknown figure, each counted


def test_bad_figures_become_nulls_not_rejected_batches() -> None:
    pub = FakePublisher()
    mon = _monitor(pub)
    with mon.step(batch_size=-3):
        mon.report(loss=float("nan"), lr=-1.0, grad_norm=float("inf"), grad_accum_steps=0)
    with mon.step(), mon.phase("bad\nname\x00" + "x" * 200):
        pass
    mon.close()
    steps = pub.rows("step")  # decode_batch validates every bound
    assert steps["batch_size"][0] == 0 and steps["grad_accum_steps"][0] == 1
    assert np.isnan(steps["loss"][0]) and np.isnan(steps["lr"][0])  # null decodes to NaN
    names = pub.rows("span")["name"]
    assert any(n.startswith("bad name") and len(n) == 128 for n in names)


def test_callbacks_see_steps_and_phases_and_cannot_break_the_loop() -> None:
    seen: list[tuple[str, Any]] = []

    class Watch(Callback):
        def on_step_begin(self, step: int) -> None:
            seen.append(("begin", step))

        def on_step_end(self, record: StepRecord) -> None:
            seen.append(("end", record.step))

        def on_phase_begin(self, phase: str, name: str) -> None:
            seen.append(("phase", name))

        def on_phase_end(self, span: SpanRecord) -> None:
            seen.append(("span", span.name))

    class Broken(Callback):
        def on_step_end(self, record: StepRecord) -> None:
            raise RuntimeError("callback bug")

    pub = FakePublisher()
    mon = _monitor(pub, callbacks=[Watch(), Broken()])
    for _ in range(2):
        with mon.step(), mon.phase("optimizer"):
            pass
    mon.close()
    assert seen[:4] == [("begin", 0), ("phase", "optimizer"), ("span", "optimizer"), ("end", 0)]
    assert ("end", 1) in seen  # Watch still runs after Broken raised on step 0
    assert mon.errors == 2 and mon.steps == 2


def test_the_step_boundary_follows_the_step_end_and_the_close_precedes_the_last_events() -> None:
    """``on_step_boundary`` comes after every ``on_step_end`` of its step, before the next step
    begins; ``on_close`` comes once, before the final lifecycle is published, and
    ``on_train_end`` after it."""
    pub = FakePublisher()
    seen: list[tuple[str, Any]] = []

    class Watch(Callback):
        def on_step_begin(self, step: int) -> None:
            seen.append(("begin", step))

        def on_step_end(self, record: StepRecord) -> None:
            seen.append(("end", record.step))

        def on_step_boundary(self, record: StepRecord) -> None:
            seen.append(("boundary", record.step))

        def on_close(self, state: str) -> None:
            seen.append(("close", [e.state for e in pub.events("lifecycle")]))

        def on_train_end(self, state: str) -> None:
            seen.append(("train_end", [e.state for e in pub.events("lifecycle")]))

    class Broken(Callback):
        def on_step_boundary(self, record: StepRecord) -> None:
            raise RuntimeError("callback bug")

    mon = _monitor(pub, callbacks=[Watch(), Broken()])
    for _ in range(2):
        with mon.step():
            pass
    mon.close()
    mon.close()
    assert seen == [
        ("begin", 0), ("end", 0), ("boundary", 0),
        ("begin", 1), ("end", 1), ("boundary", 1),
        ("close", ["started"]), ("train_end", ["started", "finished"]),
    ]  # fmt: skip
    assert mon.errors == 2, "a failing boundary callback is counted, the loop goes on"
    assert CallbackSet([Watch()]).wanted >= {"on_step_boundary", "on_close"}


def test_callback_set_only_calls_hooks_someone_overrides() -> None:
    class OnStep(Callback):
        def on_step_end(self, record: StepRecord) -> None:
            pass

    cs = CallbackSet([Callback()])
    assert cs.wanted == frozenset()
    cs.append(OnStep())
    assert cs.wanted == {"on_step_end"}
    assert CallbackSet([cs]).wanted == {"on_step_end"}


def test_recorder_glues_coalesces_and_nests() -> None:
    rec = Recorder(None, wall_offset_ns=0, glue_ns=50_000, coalesce_ns=200_000)
    rec.span("forward", "forward", 0, 2 * MS)
    rec.span("forward", "forward", 2 * MS + 100_000, 3 * MS)  # 100 µs apart: one span
    rec.span("comm", "comm", 2_500_000, 2_800_000)  # inside what is recorded: nested
    rec.span("backward", "backward", 3 * MS + 30_000, 5 * MS)  # 30 µs glue → forward
    r0 = rec.end_step(8 * MS)  # 3 ms gap → other
    assert r0 is not None
    assert r0.phase_ms == {"forward": 3.03, "backward": 1.97, "other": 3.0}
    assert "data_wait" not in r0.phase_ms
    rec.span("data_wait", "data_wait", 8 * MS + 10_000, 9 * MS)  # contiguous: starts at 8
    r1 = rec.end_step(10 * MS)
    assert r1 is not None and r1.step == 1 and r1.step_time_ms == 2.0
    assert r1.phase_ms == {"data_wait": 1.0, "other": 1.0}


def test_recorder_explicit_mode_keeps_spans_outside_steps_out_of_them() -> None:
    rec = Recorder(None, contiguous=False, wall_offset_ns=0)
    rec.span("eval", "eval", 0, MS)  # outside a step: kept, tiles nothing
    assert rec.end_step(2 * MS) is None  # no step open
    rec.open_step(3 * MS)
    rec.span("forward", "forward", 3 * MS, 4 * MS)
    r = rec.end_step(5 * MS)
    assert r is not None and r.step_time_ms == 2.0 and r.phase_ms == {"forward": 1.0, "other": 1.0}


def test_job_info_describes_a_torch_model() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 2))
    opt = torch.optim.AdamW(model.parameters())
    d = describe_job(model=model, optimizer=opt)
    assert d["model_name"] == "Sequential" and d["model_params"] == 10 * 20 + 20 + 20 * 2 + 2
    assert (d["optimizer"], d["precision"], d["framework"]) == ("AdamW", "fp32", "torch")
    assert d["parallelism"] in ("none", "dp")


def test_launcher_world_reads_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    assert launcher_world() == {
        "rank": 5,
        "world_size": 8,
        "local_rank": 1,
        "local_world_size": 4,
        "nodes": 2,
    }


def test_importing_the_api_does_not_import_torch() -> None:
    code = "import sys, perfloop.producers.training; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
