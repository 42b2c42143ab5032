"""Trace replay against real PyTorch-profiler traces, checked by an independent computation.

Every trace in ``../shared/data/traces`` (see its SOURCES.md) is replayed into a collecting
publisher; what it emits is decoded with the wire codec and compared with what this file
computes from the whole JSON loaded at once, with different algorithms: a linear scan for
the step of each event and a boundary sweep for interval unions.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import itertools
import json
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from perfloop.cli.replay import replay_command
from perfloop.producers import replay as replay_mod
from perfloop.producers.replay import (
    TraceError,
    default_job_id,
    replay_trace,
    tile_step,
)
from perfloop.schemas import JobInfo, decode_batch, decode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ProducerSettings
from tests import helpers
from tests.helpers import ALL_TRACES, TRACES, interval_union, load_trace

ALL = ALL_TRACES
NS = next((p for p in ALL if "ns_resolution_trace" in str(p)), None)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.name[:24]}"


class Collect(helpers.Collect):
    """A publisher that keeps every message (what the emitter would hand to Kafka)."""

    def rows(self) -> dict[str, list[dict[str, Any]]]:
        """Every emitted sample, decoded and validated by the codec, by kind."""
        out: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for topic, _, value in self.messages:
            if topic == Topics.JOB:
                ev = decode_event(value)
                out[ev.KIND].append(ev.model_dump())
                continue
            b = decode_batch(value)
            for i in range(len(b)):
                out[b.kind].append({c: _py(b.columns[c][i]) for c in b.columns})
        return out


def _py(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


# --- the independent computation ---------------------------------------------------------------


@functools.cache
def reference(path: Path) -> dict[str, Any]:
    """Steps, and per step the GPU activities' count and busy time, from the whole file."""
    doc = load_trace(path)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    steps = {}
    for e in events:
        name, cat = str(e.get("name", "")), str(e.get("cat", ""))
        if e.get("ph") == "X" and name.startswith("ProfilerStep#") and not cat.startswith("gpu"):
            steps[int(name.split("#")[1])] = (e["ts"], e["ts"] + e["dur"])
    whole = not steps
    if whole:
        timed = [e for e in events if e.get("ph") == "X" and "ts" in e]
        steps = {0: (min(e["ts"] for e in timed), max(e["ts"] + e.get("dur", 0) for e in timed))}

    def step_of(t: float) -> int | None:
        best = None
        for n, (s, e) in steps.items():
            if s <= t <= e and (best is None or s > steps[best][0]):
                best = n
        return best

    runtime = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    per_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        corr = e.get("args", {}).get("correlation")
        n = step_of(runtime[corr]) if corr in runtime else step_of(e["ts"])
        if n is not None:
            per_step[n].append(e)
    gpu = {}
    for n in steps:
        ks = per_step.get(n, [])
        by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for k in ks:
            by_stream[k["args"].get("stream", k.get("tid"))].append((k["ts"], k["ts"] + k["dur"]))
        gpu[n] = {
            "count": len(ks),
            "busy_us": interval_union([(k["ts"], k["ts"] + k["dur"]) for k in ks]),
            "streams": {s: (len(iv), interval_union(iv)) for s, iv in by_stream.items()},
            "events": ks,
        }
    return {"doc": doc, "events": events, "steps": steps, "whole": whole, "gpu": gpu}


@functools.cache
def replayed(path: Path) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    pub = Collect()
    try:
        result = replay_trace(path, pub, job_id="test-job")
    except TraceError:
        pub = Collect()
        result = replay_trace(path, pub, job_id="test-job", whole_trace=True)
    return result, pub.rows()


def _close(a: float, b: float, tol: float = 1e-6) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


# --- every trace ------------------------------------------------------------------------------


def test_the_shared_traces_are_there() -> None:
    assert len(ALL) >= 9, f"expected the HTA traces under {TRACES}"


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_every_trace_replays_with_the_reference_steps(path: Path) -> None:
    ref = reference(path)
    result, rows = replayed(path)
    if ref["whole"]:
        # No ProfilerStep: the default refuses with one line; whole_trace replays it as step 0.
        with pytest.raises(TraceError, match=r"no ProfilerStep#N span"):
            replay_trace(path, Collect(), job_id="test-job")
        assert result.whole_trace and rows.get("step", []) == []
    else:
        got = {r["step"]: r for r in rows["step"]}
        assert sorted(got) == sorted(ref["steps"])
        for n, (s, e) in ref["steps"].items():
            assert _close(got[n]["step_time_ms"], (e - s) / 1000.0)
            assert got[n]["rank"] == result.rank
    [info] = rows["job_info"]
    dist = ref["doc"].get("distributedInfo", {}) if isinstance(ref["doc"], dict) else {}
    assert info["rank"] == dist.get("rank", 0) and info["world_size"] == dist.get("world_size", 1)


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_per_step_gpu_busy_time_and_counts_match_the_reference(path: Path) -> None:
    ref = reference(path)
    _, rows = replayed(path)
    kernels = rows.get("kernel", [])
    if not any(g["count"] for g in ref["gpu"].values()):
        assert kernels == []  # CPU-only (and CUPTI-counter-only) traces publish no summaries
        return
    totals = {r["step"]: r for r in kernels if r["stream"] == -1 and r["kernel_class"] == "all"}
    assert sorted(totals) == sorted(ref["steps"])
    for n, g in ref["gpu"].items():
        assert totals[n]["count"] == g["count"], f"step {n}"
        assert _close(totals[n]["busy_ms"], g["busy_us"] / 1000.0), f"step {n}"
        streams = {r["stream"]: r for r in kernels if r["step"] == n and r["kernel_class"] == "all"}
        assert {s for s in streams if s >= 0} == set(g["streams"])
        for s, (count, busy_us) in g["streams"].items():
            assert streams[s]["count"] == count
            assert _close(streams[s]["busy_ms"], busy_us / 1000.0)
        # The classes split each step's activities exactly once.
        by_class = [
            r
            for r in kernels
            if r["step"] == n and r["stream"] == -1 and r["kernel_class"] != "all"
        ]
        assert sum(r["count"] for r in by_class) == g["count"]
        assert all(r["busy_ms"] <= totals[n]["busy_ms"] + 1e-9 for r in by_class)


@pytest.mark.parametrize("path", ALL, ids=_id)
def test_depth_zero_spans_tile_each_step(path: Path) -> None:
    ref = reference(path)
    _, rows = replayed(path)
    spans = rows["span"]
    for n, (s, e) in ref["steps"].items():
        tiles = sorted(
            (r["ts_ns"], r["duration_ms"], r["phase"])
            for r in spans
            if r["step"] == n and r["depth"] == 0
        )
        assert tiles, f"step {n} has no depth-0 span"
        assert _close(sum(d for _, d, _ in tiles), (e - s) / 1000.0)
        for (t0, d0, _), (t1, _, _) in itertools.pairwise(tiles):
            assert abs(t0 + round(d0 * 1e6) - t1) <= 2  # contiguous, no overlap
    annotations = [
        ev
        for ev in ref["events"]
        if ev.get("cat") == "user_annotation"
        and not str(ev.get("name")).startswith("ProfilerStep#")
        and any(a <= ev["ts"] <= b for a, b in ref["steps"].values())
    ]
    assert len([r for r in spans if r["depth"] == 1]) == len(annotations)


# --- facts published about these traces ------------------------------------------------------


@pytest.mark.skipif(NS is None, reason="ns_resolution_trace missing")
def test_ns_resolution_trace_matches_hta_published_counts() -> None:
    assert NS is not None
    _, rows = replayed(NS)
    totals = {
        r["step"]: r["count"]
        for r in rows["kernel"]
        if r["stream"] == -1 and r["kernel_class"] == "all"
    }
    assert totals == {101: 1219, 102: 1219, 103: 1219, 104: 1219, 105: 1219}
    # HTA's 4,876 GPU kernels are those launched before the last ProfilerStep starts (its
    # parser drops the last step unless include_last_profiler_step): steps 101-104 here.
    assert sum(totals[n] for n in (101, 102, 103, 104)) == 4876
    optimizer = [r for r in rows["span"] if r["name"] == "Optimizer.step#SGD.step"]
    assert len(optimizer) == 5 and {r["phase"] for r in optimizer} == {"optimizer"}
    assert {r["depth"] for r in optimizer} == {1}
    # ns-resolution timestamps keep their sub-microsecond part: step 101 starts at
    # 1712195495502094.5 µs (the trace has absolute times, no baseTimeNanoseconds).
    starts = {r["ts_ns"] for r in rows["kernel"] if r["step"] == 101}
    assert starts == {1712195495502094500}
    phases = {r["phase"] for r in rows["span"] if r["depth"] == 0}
    assert {"forward", "backward", "optimizer"} <= phases


def _trace(part: str) -> Path:
    found = [p for p in ALL if part in str(p)]
    if not found:
        pytest.skip(f"{part} trace missing")
    return found[0]


def test_collectives_carry_the_sizes_the_trace_recorded() -> None:
    path = _trace("nccl_parser_config")
    ref = reference(path)
    _, rows = replayed(path)
    itemsize = {"Float": 4, "Long": 8, "Int": 4, "Half": 2, "BFloat16": 2}
    expected = sorted(
        (
            k["args"]["Collective name"],
            max(k["args"]["In msg nelems"], k["args"]["Out msg nelems"])
            * itemsize[k["args"]["dtype"]],
        )
        for g in ref["gpu"].values()
        for k in g["events"]
        if k["name"].startswith("ncclKernel")
    )
    got = sorted((r["op"], r["size_bytes"]) for r in rows["collective"])
    names = {"allreduce": "all_reduce", "broadcast": "broadcast"}
    assert got == sorted((names[op], size) for op, size in expected)
    assert {(r["group"], r["group_size"]) for r in rows["collective"]} == {("0", 2)}


def test_cpu_only_gloo_trace() -> None:
    path = _trace("cpu_only")
    ref = reference(path)
    result, rows = replayed(path)
    assert result.rank == 34
    assert rows.get("kernel", []) == []
    [(start, end)] = ref["steps"].values()
    gloo = [
        e for e in ref["events"] if e.get("name") == "gloo:all_reduce" and start <= e["ts"] <= end
    ]
    assert len(rows["collective"]) == len(gloo) > 0
    for r, e in zip(
        sorted(rows["collective"], key=lambda r: r["ts_ns"]),
        sorted(gloo, key=lambda e: e["ts"]),
        strict=True,
    ):
        assert r["op"] == "all_reduce"
        assert r["size_bytes"] == e["args"]["Input Dims"][0][0] * 4  # float
        assert _close(r["duration_ms"], e["dur"] / 1000.0)
    assert "comm" in {r["phase"] for r in rows["span"] if r["depth"] == 0}


def test_amd_trace_kernels_are_attributed_through_hip_launches() -> None:
    path = _trace("amd_trace")
    _, rows = replayed(path)
    classes = {r["kernel_class"] for r in rows["kernel"] if r["stream"] == -1}
    assert {"gemm", "memcpy", "elementwise"} <= classes  # Cijk_* Tensile kernels are GEMMs
    [info] = rows["job_info"]
    assert info["gpu_name"] == "AMD Radeon Graphics"


@pytest.mark.slow  # tracemalloc makes every allocation several times slower (~5 s)
def test_replay_memory_stays_far_below_the_trace_size() -> None:
    def size(p: Path) -> int:
        with gzip.open(p) if p.suffix == ".gz" else open(p, "rb") as f:
            return sum(len(chunk) for chunk in iter(lambda: f.read(1 << 20), b""))

    largest = max(ALL, key=size)
    decompressed = size(largest)

    class Drop:
        def publish(self, topic: str, key: str, value: bytes) -> bool:
            return True

    tracemalloc.start()
    try:
        replay_trace(largest, Drop(), job_id="mem", whole_trace=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decompressed > 10 << 20
    assert peak < decompressed * 0.15, f"peak {peak} bytes for {decompressed} bytes of JSON"


# --- attribution, on a hand-made trace in the old (PyTorch 1.8) schema ----------------------------


def test_gpu_work_counts_for_the_step_that_launched_it(tmp_path: Path) -> None:
    def op(name: str, ts: float, dur: float, cat: str = "Operator") -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}

    def launch(ts: float, corr: int) -> dict[str, Any]:
        e = op("cudaLaunchKernel", ts, 2, "Runtime")
        e["args"] = {"correlation": corr}
        return e

    def kernel(name: str, ts: float, dur: float, stream: int, corr: int) -> dict[str, Any]:
        e = op(name, ts, dur, "Kernel")
        e["args"] = {"stream": stream, "correlation": corr, "device": 0}
        return e

    events = [
        kernel("volta_sgemm_128x64_nn", 150, 20, 7, corr=2),  # runs during step 2 ...
        op("ProfilerStep#2", 100, 100),
        launch(90, 2),  # ... but step 1 launched it
        kernel("elementwise_kernel", 20, 20, 7, corr=1),
        launch(10, 1),
        kernel("cudnn::bn_fw_tr_1C11", 30, 20, 8, corr=3),  # overlaps the first on stream 8
        launch(30, 3),
        kernel("Memcpy HtoD", 120, 10, 7, corr=99),  # its launch was lost: its own time counts
        {**kernel("Memcpy HtoD", 120, 10, 7, corr=99), "cat": "Memcpy"},
        op("ProfilerStep#1", 0, 100),
        kernel("reduce_kernel", 260, 10, 7, corr=4),
        launch(250, 4),  # launched after the last step: left out
        op("autograd::engine::evaluate_function: AddmmBackward0", 60, 30),
        op("Optimizer.step#SGD.step", 92, 6),
    ]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"traceEvents": events}))
    pub = Collect()
    result = replay_trace(path, pub, job_id="old")
    rows = pub.rows()
    assert result.unattributed_gpu_events == 1
    busy = {
        (r["step"], r["stream"], r["kernel_class"]): (r["count"], r["busy_ms"])
        for r in rows["kernel"]
    }
    assert busy[1, -1, "all"] == (3, 0.050)  # [20, 50] and [150, 170] µs
    assert busy[1, 7, "all"] == (2, 0.040)
    assert busy[1, 8, "norm"] == (1, 0.020)
    assert busy[1, -1, "gemm"] == (1, 0.020)
    assert busy[2, -1, "all"] == (2, 0.010)  # two copies at [120, 130]: counted, union once
    assert busy[2, -1, "memcpy"] == (2, 0.010)
    tiles = [
        (r["phase"], r["duration_ms"])
        for r in sorted(rows["span"], key=lambda r: r["ts_ns"])
        if r["step"] == 1 and r["depth"] == 0
    ]
    assert tiles == [
        ("forward", 0.060),
        ("backward", 0.030),
        ("user", 0.002),
        ("optimizer", 0.006),
        ("user", 0.002),
    ]
    assert [r["step"] for r in rows["step"]] == [1, 2] and result.rank == 0


def test_a_cpu_trace_recorded_here_with_torch_profiler(
    tmp_path: Path, fake_publisher: list[Collect], capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(128, 32), torch.randn(128, 1))
    path = tmp_path / "cpu.pt.trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for i, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=16)):
            if i == 6:
                break
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            prof.step()
    pub = Collect()
    result = replay_trace(path, pub, job_id="cpu")
    rows = pub.rows()
    assert sorted(r["step"] for r in rows["step"]) == [2, 3, 4]
    assert result.gpu_events == 0 and "kernel" not in rows
    for n in (2, 3, 4):
        phases = {r["phase"] for r in rows["span"] if r["step"] == n and r["depth"] == 0}
        assert {"data_wait", "forward", "backward", "optimizer"} <= phases
    assert all(r["data_wait_ms"] > 0 for r in rows["step"])
    # New traces carry baseTimeNanoseconds: their times are Unix times, from just now.
    assert abs(time.time_ns() - rows["step"][-1]["ts_ns"]) < 300 * 10**9
    # ... and the command keeps a recent trace's times (it lines up with live telemetry).
    assert replay_command(_args(path), ProducerSettings()) == 0
    assert "shifted" not in capsys.readouterr().out
    [pub] = fake_publisher
    cli_rows = pub.rows()
    assert [r["ts_ns"] for r in cli_rows["step"]] == [r["ts_ns"] for r in rows["step"]]
    assert "time_shift_ns" not in cli_rows["job_info"][0]["extra"]


# --- tiling --------------------------------------------------------------------------------------


def test_tiles_cover_the_step_once_whatever_the_marks() -> None:
    import random

    import numpy as np

    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(0, 15)
        s = np.array([rng.uniform(-5, 100) for _ in range(n)])
        e = s + np.array([rng.uniform(0, 40) for _ in range(n)])
        ph = np.array([rng.randrange(7) for _ in range(n)], dtype=np.int8)
        tiles = tile_step(0.0, 100.0, s, e, ph)
        assert tiles[0][0] == 0.0 and tiles[-1][1] == 100.0
        for (_, b0, p0, n0), (a1, _, p1, n1) in itertools.pairwise(tiles):
            assert b0 == a1 and (p0, n0) != (p1, n1)


def test_a_blocking_collective_inside_the_forward_is_comm() -> None:
    import numpy as np

    from perfloop.producers._kineto import PHASES

    codes = np.array([PHASES.index(p) for p in ("forward", "comm", "data_wait")], dtype=np.int8)
    tiles = tile_step(0.0, 10.0, np.array([1.0, 3.0, 0.0]), np.array([8.0, 4.0, 1.0]), codes)
    assert [(a, b, p) for a, b, p, _ in tiles] == [
        (0.0, 1.0, "data_wait"),
        (1.0, 3.0, "forward"),
        (3.0, 4.0, "comm"),
        (4.0, 8.0, "forward"),
        (8.0, 10.0, "user"),
    ]


# --- the command ------------------------------------------------------------------------------


def test_default_job_id_is_shared_by_the_ranks_of_one_job() -> None:
    assert default_job_id("a/sampled_rank-0.json.gz") == default_job_id("sampled_rank-1.json.gz")
    assert default_job_id("x/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz").startswith("replay-")
    assert default_job_id("weird name!.json") == "replay-weird_name"


@pytest.fixture
def fake_publisher(monkeypatch: pytest.MonkeyPatch) -> list[Collect]:
    made: list[Collect] = []

    def factory(settings: object) -> Collect:
        made.append(Collect())
        return made[-1]

    monkeypatch.setattr("perfloop.producers.publisher.Publisher", factory)
    return made


def _args(
    *traces: Path, job_id: str | None = "cli-job", require_steps: bool = False
) -> argparse.Namespace:
    return argparse.Namespace(
        job_id=job_id, node=None, traces=[str(t) for t in traces], require_steps=require_steps
    )


def test_bad_files_fail_with_one_line_each_and_the_others_still_replay(
    tmp_path: Path, fake_publisher: list[Collect], capsys: pytest.CaptureFixture[str]
) -> None:
    good = _trace("trace_filter")
    notjson = tmp_path / "notjson.json"
    notjson.write_text("<html>oops</html>")
    truncated = tmp_path / "truncated.json.gz"
    truncated.write_bytes(good.read_bytes()[:20_000])
    noevents = tmp_path / "noevents.json"
    noevents.write_text('{"schemaVersion": 1, "distributedInfo": {"rank": 0}}')
    nosteps = tmp_path / "nosteps.json"
    nosteps.write_text('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1}]}')
    bad = [notjson, truncated, noevents, nosteps]

    code = replay_command(
        _args(notjson, good, truncated, noevents, nosteps, require_steps=True), ProducerSettings()
    )

    out, err = capsys.readouterr()
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == len(bad) + 1  # one per bad file, then the tally
    for path, line in zip(bad, lines, strict=False):
        assert str(path) in line and line.startswith("perfloop: replay: ")
    assert "Traceback" not in err
    assert "4 of 5 trace(s) failed" in lines[-1]
    [pub] = fake_publisher
    rows = pub.rows()
    assert {r["step"] for r in rows["step"]} == {551, 552}  # the good file replayed
    assert {r["rank"] for r in rows["kernel"]} == {0}
    assert "cli-job" in out and str(good) in out


def test_two_ranks_share_the_job_and_keep_their_rank(
    fake_publisher: list[Collect], capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = sorted(p for p in ALL if "trace_filter" in str(p))
    assert len(ranks) == 2
    assert replay_command(_args(*ranks, job_id=None), ProducerSettings()) == 0
    [pub] = fake_publisher
    assert {key for _, key, _ in pub.messages} == {default_job_id(ranks[0])}
    rows = pub.rows()
    assert {(r["rank"], r["step"]) for r in rows["step"]} == {
        (0, 551),
        (0, 552),
        (1, 551),
        (1, 552),
    }
    infos = [JobInfo.model_validate(r) for r in rows["job_info"]]
    assert [i.rank for i in infos] == [0, 1]
    # Old traces are moved to now (raw tables expire rows 30 days after their time), every
    # rank by the same amount so that they stay aligned.
    shifts = {int(i.extra["time_shift_ns"]) for i in infos}
    assert len(shifts) == 1 and shifts.pop() > 365 * 86_400 * 10**9  # these are from 2023
    last = max(r["ts_ns"] for r in rows["step"])
    assert abs(time.time_ns() - last) < 120 * 10**9
    ends = {(r["rank"], r["step"]): r["ts_ns"] for r in rows["step"]}
    ref = [reference(p)["steps"][551][1] for p in ranks]
    assert abs((ends[1, 551] - ends[0, 551]) - round((ref[1] - ref[0]) * 1000)) <= 2


def test_an_invalid_job_id_is_a_config_error(fake_publisher: list[Collect]) -> None:
    from perfloop.exceptions import ConfigError

    with pytest.raises(ConfigError, match="invalid job id"):
        replay_command(_args(ALL[0], job_id="no spaces allowed"), ProducerSettings())
    assert fake_publisher == []


def test_module_exports() -> None:
    assert set(replay_mod.__all__) >= {"replay_trace", "index_trace", "default_job_id"}


def test_a_trace_without_profiler_steps_replays_whole_by_default(
    fake_publisher: list[Collect], capsys: pytest.CaptureFixture[str]
) -> None:
    (nosteps,) = [p for p in ALL if "simple_add" in str(p)]
    assert replay_command(_args(nosteps), ProducerSettings()) == 0
    out = capsys.readouterr().out
    assert "whole trace as step 0" in out
    [pub] = fake_publisher
    rows = pub.rows()
    assert rows.get("step", []) == []  # no ProfilerStep: no step rows, but its kernels
    assert {r["step"] for r in rows["kernel"]} == {0}
