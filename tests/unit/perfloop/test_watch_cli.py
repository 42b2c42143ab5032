"""``perfloop watch``'s lines: one per event, with each kind's essentials; ``--json``
round-trips through the codec; bad arguments are one line and exit 2."""

from __future__ import annotations

import argparse
import time

import pytest

from perfloop.cli.parser import build_parser, main
from perfloop.cli.watch import describe, parse_kinds, stamp, watch_command
from perfloop.client import KINDS
from perfloop.schemas import (
    ActuationResult,
    Approval,
    CapabilityReport,
    CollectiveOp,
    Command,
    ConfigChange,
    Decision,
    Diagnosis,
    Event,
    GpuSample,
    GroundTruth,
    HostSample,
    JobInfo,
    JobLifecycle,
    KernelSummary,
    PhaseChange,
    PhaseSpan,
    Prediction,
    ProducerStats,
    RankProgress,
    Recommendation,
    StepEvent,
    decode_event,
    encode_event,
)

NOW = time.time_ns()
BASE = {"ts_ns": NOW, "job_id": "job-1", "node": "n0"}

EVENTS: list[tuple[Event, list[str]]] = [
    (
        Diagnosis(**BASE, rank=-1, diagnosis_id="d1", bottleneck="dataloader_starvation",
                  level="host", loop="training", state="open", onset_ns=NOW, step_share=0.38,
                  confidence=0.9, critical_path=True, ranks=[0, 1],
                  evidence={"data_wait_share": 0.38}),
        ["open dataloader_starvation (host) 38% of each step", "critical path", "ranks 0,1",
         "data_wait_share=0.38"],
    ),
    (
        Recommendation(**BASE, rank=-1, event_id="r" * 32, knob="dataloader.num_workers",
                       from_value=0, to_value=4, loop="fast", expected_gain_pct=31.0,
                       confidence=0.82, rationale="the loader starves the step"),
        ["dataloader.num_workers 0 → 4", "expected +31%", "confidence 0.82", "r" * 32,
         ": the loader starves the step"],
    ),
    (
        Approval(**BASE, rank=-1, rec_id="r1", verdict="approve", author="ann@box", knob="k",
                 from_value=1, to_value=2, rec_ts_ns=NOW),
        ["approve rec r1: k 1 → 2 by ann@box"],
    ),
    (
        Decision(**BASE, rank=-1, rec_id="r1", command_id="c1", knob="k", from_value=1,
                 to_value=2, tier="auto", outcome="issued", reason="within bounds"),
        ["issued k 1 → 2 (tier auto, by actuator), rec r1, command c1: within bounds"],
    ),
    (
        Command(**BASE, rank=-1, rec_id="r1", seq=3, knob="k", from_value=1, value=2,
                expires_ts_ns=NOW),
        ["seq 3: k 1 → 2 (fast loop), rec r1"],
    ),
    (
        ActuationResult(**BASE, rank=0, command_id="c1", status="applied", knob="k", value=2,
                        step=212),
        ["applied k = 2 at step 212"],
    ),
    (
        ActuationResult(**BASE, rank=0, command_id="c1", status="rolled_back", knob="k",
                        value=1, reason="3% slower", evidence={"speedup": 0.97}),
        ["rolled_back k = 1: 3% slower; speedup=0.97"],
    ),
    (
        ConfigChange(**BASE, rank=-1, target="streams", key="thresholds.x", value=0.7,
                     author="ann", reason="too noisy"),
        ["streams thresholds.x = 0.7 for * by ann: too noisy"],
    ),
    (
        Prediction(**BASE, rank=-1, prediction_id="p", model="StepTimeForecaster",
                   target="step_time_ms", value=101.5, realised=99.0, step=8),
        ["predicted step_time_ms = 101.5 (realised 99)", "step 8", "by StepTimeForecaster"],
    ),
    (
        PhaseChange(**BASE, rank=-1, level="run", phase="steady", previous="warmup",
                    since_ns=NOW, source="spans", step=40),
        ["run warmup → steady at step 40 (from spans)"],
    ),
    (JobLifecycle(**BASE, rank=-1, state="failed", exit_code=1, message="OOM"),
     ["failed (exit 1): OOM"]),
    (
        JobInfo(**BASE, rank=0, model_name="gpt2", world_size=8, nodes=2, precision="bf16",
                gpu_count=4, gpu_name="H100"),
        ["gpt2", "world 8 on 2 node(s)", "bf16", "4× H100"],
    ),
    (
        CapabilityReport(**BASE, rank=-1, component="nvml", available=False, missing=["gpu"],
                         reason="no NVIDIA driver"),
        ["nvml unavailable, missing gpu: no NVIDIA driver"],
    ),
    (
        RankProgress(**BASE, rank=1, step=40, phase="comm", op="all_reduce",
                     since_ns=NOW - 4 * 10**9, step_start_ns=NOW - 5 * 10**9),
        ["step 40 in comm all_reduce for 4.0 s"],
    ),
    (
        GroundTruth(**BASE, rank=-1, scenario="straggler", fault="straggler", onset_ns=NOW,
                    ranks=[3]),
        ["straggler (straggler) on ranks 3"],
    ),
    (ProducerStats(**BASE, rank=0, producer_id="p1", published=10, dropped=1),
     ["p1: 10 published", "1 dropped"]),
    (StepEvent(**BASE, rank=2, step=7, step_time_ms=101.25, data_wait_ms=3.5, loss=2.5),
     ["step 7 101.2 ms, data wait 3.5 ms, loss 2.5"]),
    (PhaseSpan(**BASE, rank=0, step=7, phase="forward", name="forward", duration_ms=12.5),
     ["step 7 forward/forward 12.50 ms"]),
    (GpuSample(**BASE, rank=0, device=1, sm_util_pct=90.0, power_w=500.0, temp_c=70.0),
     ["device 1: sm 90%", "500 W"]),
    (HostSample(**BASE, rank=0, proc_cpu_pct=150.0, loader_workers=2),
     ["cpu 150%", "loader workers 2"]),
    (
        CollectiveOp(**BASE, rank=0, step=1, op="all_reduce", size_bytes=1 << 20,
                     duration_ms=2.0),
        ["step 1 all_reduce 1,048,576 B in 2.00 ms"],
    ),
    (
        KernelSummary(**BASE, rank=0, step=5, stream=7, kernel_class="gemm", count=12,
                      busy_ms=4.5),
        ["step 5 stream 7 gemm: 12× 4.50 ms"],
    ),
]  # fmt: skip


def test_every_kind_a_follower_hands_out_has_a_line() -> None:
    assert {ev.KIND for ev, _ in EVENTS} == set(KINDS)


@pytest.mark.parametrize(("ev", "shown"), EVENTS, ids=lambda x: getattr(x, "KIND", ""))
def test_a_line_holds_time_job_rank_kind_and_essentials(ev: Event, shown: list[str]) -> None:
    line = describe(ev, now_ns=NOW)
    assert "\n" not in line
    stamp_, job, rank, kind = line.split()[:4]
    assert stamp_ == stamp(NOW, NOW) and job == "job-1" and kind == ev.KIND
    assert rank == ("job" if ev.rank < 0 else f"r{ev.rank}")
    for part in shown:
        assert part in line, f"{part!r} not in {line!r}"


def test_the_time_is_local_with_the_date_when_not_today() -> None:
    t = time.mktime((2026, 11, 5, 10, 42, 7, 0, 0, -1))
    ns = int(t) * 10**9 + 311_000_000
    assert stamp(ns, now_ns=ns + 3600 * 10**9) == "10:42:07.311"
    assert stamp(ns, now_ns=ns + 2 * 86400 * 10**9) == "11-05 10:42:07.311"


@pytest.mark.parametrize(("ev", "_shown"), EVENTS, ids=lambda x: getattr(x, "KIND", ""))
def test_json_lines_are_the_events_as_the_codec_writes_them(ev: Event, _shown: list[str]) -> None:
    from perfloop.cli.watch import _json_line

    line = _json_line(ev)
    assert "\n" not in line and line.encode() == encode_event(ev)
    if ev.KIND in {"diagnosis", "recommendation", "actuation", "decision"}:
        assert decode_event(line.encode()) == ev


def test_kinds_repeat_or_come_comma_separated() -> None:
    assert parse_kinds(None) is None and parse_kinds([]) is None
    assert parse_kinds(["diagnosis, step", "actuation"]) == ["diagnosis", "step", "actuation"]
    args = build_parser().parse_args(
        ["watch", "--job", "a", "--job", "b", "--kind", "diagnosis,step", "--since", "10m",
         "--json"]
    )  # fmt: skip
    assert (args.job, args.kind, args.since, args.json) == (["a", "b"], ["diagnosis,step"],
                                                            "10m", True)  # fmt: skip


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**({"job": None, "kind": None, "since": None, "json": False} | kw))


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"since": "yesterday"}, "since 'yesterday' is neither a duration"),
        ({"kind": ["diagnoses"]}, "unknown event kind 'diagnoses'; valid: "),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    kw: dict[str, object], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert watch_command(_args(**kw)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"perfloop: {said}") and err.count("\n") == 1


def test_no_broker_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PERFLOOP_KAFKA_PORT", str(port))
    monkeypatch.delenv("PERFLOOP_KAFKA_BOOTSTRAP", raising=False)
    assert main(["watch"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"perfloop: Kafka broker at 127.0.0.1:{port} is unreachable")
    assert err.count("\n") == 1
