"""Step analysis of real PyTorch-profiler traces, checked against an independent computation.

Each rank's trace in ``../shared/data/traces`` is replayed in-process by the producers' replay
code into a collecting publisher; its messages are decoded with the wire codec and fed to
`StepAnalysis` as the stream engine would. This file computes the same figures straight from
the trace JSON, loaded whole, with its own algorithms: a linear scan for each event's step, GPU
work counted for the step whose ``ProfilerStep`` window holds its launch (the runtime call with
the same correlation id; the activity's own start when the launch is missing), and interval
unions by sweeping sorted boundaries with a depth counter.

- busy: union of the step's GPU activities; idle = max(0, step − busy);
- straggler: a rank's arrival is its step end minus the time its host was blocked in
  collective calls (``nccl:…``, ``c10d::…``, ``record_param_comms`` spans, less what a
  ``data_load`` span covers); lateness is arrival − the median arrival of the step's ranks.

The multi-rank set is every folder holding traces of two or more ranks of one job
(``hta/trace_filter``: ranks 0 and 1 of a 128-rank job, steps 551-552).
"""

from __future__ import annotations

import functools
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfloop.producers.replay import TraceError, replay_trace
from perfloop.schemas import decode_batch
from perfloop.schemas.codec import Batch
from perfloop.schemas.topics import Topics
from perfloop.streams.steps import StepAnalysis, StepRecord
from tests.helpers import ALL_TRACES, TRACES, Collect, interval_union, load_trace

ALL = ALL_TRACES
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
HOST_CATS = {"cpu_op", "user_annotation"}
COMM_CALLS = ("nccl:", "gloo:", "c10d::", "record_param_comms")
WALL = 5_000_000_000
SCALE = 0.2  # StepAnalysis' default straggler_full_share

pytestmark = pytest.mark.skipif(not ALL, reason=f"no traces under {TRACES}")


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.name[:24]}"


# --- the independent computation ---------------------------------------------------------------


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


@functools.cache
def reference(path: Path) -> dict[str, Any]:
    """Per step: window (µs), GPU busy by launch and clipped to the window, comm-blocked time."""
    doc = load_trace(path)
    events = [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    steps: dict[int, tuple[float, float]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if name.startswith("ProfilerStep#") and e.get("cat") in HOST_CATS:
            n, s, t = int(name.split("#")[1]), e["ts"], e["ts"] + e.get("dur", 0)
            s0, t0 = steps.get(n, (s, t))
            steps[n] = (min(s0, s), max(t0, t))  # one step on two threads: its whole extent

    def step_of(t: float) -> int | None:
        best = None
        for n, (s, e) in steps.items():
            if s <= t <= e and (best is None or s > steps[best][0]):
                best = n
        return best

    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    gpu: dict[int, list[tuple[float, float]]] = defaultdict(list)
    every_gpu: list[tuple[float, float]] = []
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        iv = (e["ts"], e["ts"] + e.get("dur", 0))
        every_gpu.append(iv)
        corr = e.get("args", {}).get("correlation")
        n = step_of(launch[corr]) if corr in launch else step_of(e["ts"])
        if n is not None:
            gpu[n].append(iv)
    comm = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in HOST_CATS and str(e["name"]).startswith(COMM_CALLS)
    ]
    loads = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in HOST_CATS and "data_load" in str(e["name"])
    ]
    out = {}
    for n, (s, t) in steps.items():
        c, w = _clip(comm, s, t), _clip(loads, s, t)
        out[n] = {
            "start_us": s,
            "end_us": t,
            "step_ms": (t - s) / 1e3,
            "busy_ms": interval_union(gpu[n]) / 1e3 if gpu[n] else None,
            "window_busy_ms": interval_union(_clip(every_gpu, s, t)) / 1e3,
            # comm time not under a data load
            "comm_ms": (interval_union(c + w) - interval_union(w)) / 1e3,
        }
    dist = doc.get("distributedInfo") or {}
    return {"rank": dist.get("rank", 0), "steps": out, "has_gpu": bool(every_gpu)}


# --- the stream-tier side ------------------------------------------------------------------------


def _batches(path: Path, job_id: str) -> list[Batch]:
    pub = Collect()
    try:
        replay_trace(path, pub, job_id=job_id)
    except TraceError:  # no ProfilerStep: GPU summaries of one "step 0", no step event
        pub = Collect()
        replay_trace(path, pub, job_id=job_id, whole_trace=True)
    return [decode_batch(v) for t, _, v in pub.messages if t != Topics.JOB]


def _analyse(paths: list[Path], *, reverse: bool = False) -> tuple[StepAnalysis, dict[str, Any]]:
    sa = StepAnalysis()
    batches = [b for p in paths for b in _batches(p, "trace-job")]
    for b in reversed(batches) if reverse else batches:
        sa.observe(b, WALL)
    metrics = sa.tick(WALL + 2 * 10**9)  # past the settle time: every step completes
    return sa, metrics


def _by_step(sa: StepAnalysis) -> dict[int, StepRecord]:
    return {r.step: r for r in sa.recent("trace-job")}


def _multi_rank_sets() -> list[list[Path]]:
    folders: dict[Path, list[Path]] = defaultdict(list)
    for p in ALL:
        folders[p.parent].append(p)
    return [
        sorted(ps)
        for ps in folders.values()
        if len(ps) >= 2 and len({reference(p)["rank"] for p in ps}) == len(ps)
    ]


MULTI = _multi_rank_sets()


def _close(a: float, b: float, tol_ms: float = 2e-3) -> bool:
    return abs(a - b) <= tol_ms


def test_the_multi_rank_traces_are_there() -> None:
    assert [[p.name for p in ps] for ps in MULTI] == [
        ["sampled_rank-0.json.gz", "sampled_rank-1.json.gz"]
    ]


@pytest.mark.parametrize("paths", MULTI, ids=lambda ps: ps[0].parent.name)
@pytest.mark.parametrize("reverse", [False, True], ids=["in_order", "reversed"])
def test_busy_idle_and_stragglers_of_a_multi_rank_job(paths: list[Path], reverse: bool) -> None:
    refs = {reference(p)["rank"]: reference(p)["steps"] for p in paths}
    sa, metrics = _analyse(paths, reverse=reverse)
    got = _by_step(sa)
    common = sorted(set.intersection(*(set(s) for s in refs.values())))
    assert sorted(got) == common and len(common) >= 2
    scores: dict[int, list[float]] = defaultdict(list)
    for n in common:
        rec = got[n]
        assert sorted(rec.ranks.tolist()) == sorted(refs) and rec.missing_ranks == ()
        arrival = {}
        for i, rank in enumerate(rec.ranks.tolist()):
            ref = refs[rank][n]
            # The GPU work of these traces stays inside its step: busy by launch = window union.
            assert _close(ref["busy_ms"], ref["window_busy_ms"])
            assert _close(rec.step_ms[i], ref["step_ms"]), (n, rank)
            assert _close(rec.busy_ms[i], ref["busy_ms"]), (n, rank)
            assert _close(rec.idle_ms[i], max(0.0, ref["step_ms"] - ref["busy_ms"])), (n, rank)
            assert rec.idle_ms[i] > 0.3 * rec.step_ms[i]  # these ranks idle for a third of a step
            assert _close(rec.phase_ms[i, 3], ref["comm_ms"]), (n, rank)  # PHASE_NAMES[3]: comm
            arrival[rank] = ref["end_us"] / 1e3 - ref["comm_ms"]
        median = statistics.median(arrival.values())
        lateness = {r: a - median for r, a in arrival.items()}
        slowest = max(lateness, key=lambda r: lateness[r])
        assert rec.slowest_rank == slowest, f"step {n}"
        for i, rank in enumerate(rec.ranks.tolist()):
            assert _close(rec.lateness_ms[i], lateness[rank]), (n, rank)
        step_median = statistics.median(refs[r][n]["step_ms"] for r in refs)
        for r, late in lateness.items():
            scores[r].append(min(1.0, max(0.0, late / (SCALE * step_median))))
    # The aggregated score is the mean of the per-step scores; the straggler ranks first.
    expected = {r: sum(v) / len(v) for r, v in scores.items()}
    assert sa.scores("trace-job") == pytest.approx(expected, abs=1e-5)  # µs rounding
    assert max(expected, key=lambda r: expected[r]) == got[common[-1]].slowest_rank
    # The metrics the windows receive are the same figures, one row per rank and step.
    rows = {
        (int(r), int(s), m): v
        for r, s, m, v in zip(
            metrics["rank"], metrics["step"], metrics["metric"], metrics["value"], strict=True
        )
    }
    for n in common:
        for rank in refs:
            ref = refs[rank][n]
            assert _close(rows[rank, n, "gpu_busy_ms"], ref["busy_ms"])
            assert _close(rows[rank, n, "gpu_idle_ms"], ref["step_ms"] - ref["busy_ms"])
            assert rows[rank, n, "idle_share"] == pytest.approx(
                1 - ref["busy_ms"] / ref["step_ms"], abs=1e-5
            )
    assert set(metrics["job_id"]) == {"trace-job"}


SINGLE = [p for p in ALL if not any(p in ps for ps in MULTI)]


@pytest.mark.parametrize("path", SINGLE, ids=_id)
def test_busy_and_idle_of_every_single_rank_trace(path: Path) -> None:
    ref = reference(path)
    sa, metrics = _analyse([path])
    got = _by_step(sa)
    assert sorted(got) == sorted(ref["steps"])
    if not ref["steps"]:  # kernel summaries without a step event have no step time to relate to
        assert sa.dropped_steps == 0 and len(metrics["value"]) == 0  # waits for its step event
        later = sa.tick(WALL + 11 * 10**9)  # ... until the timeout (10 s): then it is dropped
        assert sa.dropped_steps == 1 and len(later["value"]) == 0 and sa.recent("trace-job") == []
        return
    for n, r in ref["steps"].items():
        rec = got[n]
        assert rec.ranks.tolist() == [ref["rank"]]
        assert _close(rec.step_ms[0], r["step_ms"])
        if not ref["has_gpu"]:  # a CPU-only trace: no GPU figures at all
            assert np.isnan(rec.busy_ms[0]) and np.isnan(rec.idle_ms[0])
            continue
        busy = r["busy_ms"] or 0.0
        assert _close(rec.busy_ms[0], busy), f"step {n}"
        # GPU work launched in a step may run past its end (the GPU runs behind the host):
        # idle is then 0, never negative.
        assert _close(rec.idle_ms[0], max(0.0, r["step_ms"] - busy)), f"step {n}"
        assert np.isnan(rec.lateness_ms[0]) and rec.slowest_rank == -1  # one rank: no straggler
    assert "lateness_ms" not in set(metrics["metric"])
