"""`perfloop export`'s Chrome trace: every step, span and collective of each rank, on threads a
viewer can draw (nested on each thread), and the format's rules checked."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from perfloop.cli._export_trace import COMM_TID, check_trace, chrome_trace
from perfloop.cli.export import step_range
from tests.helpers import devtools_read, needs_devtools

MS = 1_000_000


def _job() -> dict:
    steps, spans, colls = [], [], []
    for rank in (0, 1):
        t = 1_000 * MS + rank * MS  # the ranks' clocks differ a little
        for step in range(3):
            steps.append((rank, "n0", step, t + 10 * MS, 10.0, 1.0, 32, 0, 0.5))
            spans += [
                (rank, step, t, 1.0, "data_wait", "", 0),
                (rank, step, t + MS, 3.0, "forward", "", 0),
                (rank, step, t + 4 * MS, 5.0, "backward", "", 0),
                (rank, step, t + 6 * MS, 3.0, "comm", "", 1),  # nested in the backward
                (rank, step, t + 9 * MS, 1.0, "optimizer", "", 0),
            ]
            # two DDP buckets whose all-reduces overlap
            colls += [
                (rank, step, t + 5 * MS, 3.0, "all_reduce", 4096, "world", 2, "float32"),
                (rank, step, t + 6 * MS, 3.0, "all_reduce", 8192, "world", 2, "float32"),
            ]
            t += 10 * MS
    gpu = [(0, "n0", 0, 1_005 * MS, 50.0, 2**30, 200.0)]
    host = [(1, "n0", 1_005 * MS, 180.0, 2**29)]
    return {"steps": steps, "spans": spans, "collectives": colls, "gpu": gpu, "host": host}


def test_every_step_span_and_collective_of_every_rank_is_in_the_trace() -> None:
    trace = chrome_trace("j", **_job())
    assert check_trace(trace) == {"events": len(trace["traceEvents"]), "steps": 6, "ranks": 2}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in xs if e["cat"] == "step") == [
        f"step {s}" for s in (0, 0, 1, 1, 2, 2)
    ]
    assert sum(e["cat"] == "collective" for e in xs) == 12
    assert sum(e["cat"] not in ("step", "collective") for e in xs) == 30
    first = min(e["ts"] for e in xs)
    assert first == 0.0 and trace["otherData"]["start_unix_ns"] == 1_000 * MS
    step0 = next(e for e in xs if e["name"] == "step 0" and e["pid"] == 0)
    assert (step0["ts"], step0["dur"], step0["args"]["loss"]) == (0.0, 10_000.0, 0.5)


def test_overlapping_collectives_go_on_threads_of_their_own() -> None:
    trace = chrome_trace("j", **_job())
    tids = {e["tid"] for e in trace["traceEvents"] if e.get("cat") == "collective"}
    assert tids == {COMM_TID, COMM_TID + 1}
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"]
             if e["name"] == "thread_name"}  # fmt: skip
    assert (0, "collectives 2") in names and (1, "phases") in names


def test_counters_carry_gpu_and_process_figures() -> None:
    counters = [e for e in chrome_trace("j", **_job())["traceEvents"] if e["ph"] == "C"]
    assert {(e["pid"], e["name"]) for e in counters} == {(0, "gpu 0"), (1, "process")}
    assert counters[0]["args"]["mem_used_gib"] == 1.0


@pytest.mark.parametrize(
    ("events", "said"),
    [
        ([{"ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 10},
          {"ph": "X", "pid": 0, "tid": 1, "ts": 5, "dur": 10}], "without nesting"),
        ([{"ph": "X", "pid": 0, "tid": 1, "ts": -1, "dur": 1}], "is not a time"),
        ([{"ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": -2}], "dur"),
        ([{"ph": "Q", "pid": 0}], "no known ph"),
        ([{"ph": "C", "pid": 0, "ts": 0, "args": {"x": "high"}}], "not numbers"),
    ],
)  # fmt: skip
def test_what_a_viewer_would_refuse_is_named(events: list[dict], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        check_trace({"traceEvents": events})


def test_step_ranges() -> None:
    assert step_range("3..8") == (3, 8) and step_range(" 4 ") == (4, 4)
    assert step_range("10..") == (10, 2**63 - 1)
    for bad in ("a..b", "5..2", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            step_range(bad)


@needs_devtools
def test_chrome_devtools_reads_every_step_span_and_collective(tmp_path: Path) -> None:
    """Chrome DevTools' own trace engine (not perfloop's check) finds each rank as a process
    with its named threads, and every step, span and collective on them, where they were."""
    trace = chrome_trace("j", **_job())
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    read = devtools_read(path)
    threads = {(t["pid"], t["name"]): t["entries"] for t in read["threads"]}
    for rank in (0, 1):
        steps = threads[(rank, "steps")]
        assert [e[1] for e in steps] == ["step 0", "step 1", "step 2"]
        assert all(e[3] == 10_000 for e in steps)  # 10 ms each, in microseconds
        phases = [e[0] for e in threads[(rank, "phases")]]
        assert phases == ["data_wait", "forward", "backward", "comm", "optimizer"] * 3
        colls = threads[(rank, "collectives")] + threads[(rank, "collectives 2")]
        assert len(colls) == 6 and {e[1] for e in colls} == {"all_reduce"}
    drawn = sum(len(t["entries"]) for t in read["threads"])
    assert drawn == sum(e["ph"] == "X" for e in trace["traceEvents"])
