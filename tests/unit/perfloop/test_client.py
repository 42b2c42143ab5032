"""The typed client's pure parts: what ``since`` means, which kinds and jobs a follower
selects, and how one message becomes the events it hands out (real encoded messages)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from perfloop.client import (
    DEFAULT_KINDS,
    KINDS,
    TELEMETRY_KINDS,
    Selection,
    parse_since,
    since_ns,
)
from perfloop.exceptions import ConfigError
from perfloop.schemas import (
    ConfigChange,
    Diagnosis,
    JobLifecycle,
    ProducerStats,
    Recommendation,
    SchemaError,
    StepEvent,
    encode_batch,
    encode_event,
)
from perfloop.schemas.topics import Topics

NOW = 1_800_000_000 * 10**9
S = 10**9


@pytest.mark.parametrize(
    ("text", "ago_s"),
    [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1.5h", 5400), (" 10M ", 600)],
)
def test_a_duration_is_that_long_before_now(text: str, ago_s: float) -> None:
    assert parse_since(text, now_ns=NOW) == NOW - int(ago_s * S)


def test_now_and_iso_times() -> None:
    assert parse_since("now", now_ns=NOW) == NOW
    assert parse_since("2026-11-05T10:00:00Z") == int(
        datetime(2026, 11, 5, 10, tzinfo=UTC).timestamp() * S
    )
    assert parse_since("2026-11-05T12:00:00+02:00") == parse_since("2026-11-05T10:00:00Z")
    assert parse_since("2026-11-05T10:00:00.250Z") - parse_since("2026-11-05T10:00:00Z") == (
        250_000_000
    )
    # without a zone: local time, as a person means it
    assert parse_since("2026-11-05 10:00") == int(datetime(2026, 11, 5, 10).timestamp() * S)


@pytest.mark.parametrize("text", ["", "10", "10x", "-5m", "yesterday", "m10", "2026-13-01"])
def test_anything_else_is_one_line_naming_it(text: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_since(text, now_ns=NOW)
    assert repr(text) in str(e.value) and "\n" not in str(e.value)
    assert "30s, 10m, 2h, 1d" in str(e.value)


def test_since_takes_times_durations_and_nanoseconds() -> None:
    assert since_ns(None) is None
    assert since_ns(123) == 123
    assert since_ns(timedelta(minutes=1), now_ns=NOW) == NOW - 60 * S
    assert since_ns(datetime(2026, 11, 5, 10, tzinfo=UTC)) == parse_since("2026-11-05T10:00Z")
    assert since_ns("2h", now_ns=NOW) == NOW - 7200 * S
    for bad in (-1, True, 1.5, [1]):
        with pytest.raises(ConfigError):
            since_ns(bad)  # type: ignore[arg-type]


def test_the_default_kinds_are_the_single_events_but_producer_stats() -> None:
    assert "producer" not in DEFAULT_KINDS and "diagnosis" in DEFAULT_KINDS
    assert not set(TELEMETRY_KINDS) & set(DEFAULT_KINDS)
    assert set(KINDS) == set(DEFAULT_KINDS) | set(TELEMETRY_KINDS) | {"producer"}
    sel = Selection()
    assert sel.jobs is None and sel.kinds == DEFAULT_KINDS
    assert Topics.WINDOWS not in sel.topics and Topics.STEP not in sel.topics
    assert {Topics.DIAGNOSES, Topics.RECOMMENDATIONS, Topics.ACTUATIONS} <= set(sel.topics)


def test_kinds_by_name_or_class_and_a_bad_one_lists_the_valid() -> None:
    assert Selection(kinds=[Diagnosis, "recommendation", "diagnosis"]).kinds == (
        "diagnosis",
        "recommendation",
    )
    assert Selection(kinds=["step"]).topics == [Topics.STEP]
    with pytest.raises(ConfigError, match="unknown event kind 'diagnoses'; valid: actuation, "):
        Selection(kinds=["diagnoses"])
    with pytest.raises(ConfigError, match="no event kinds"):
        Selection(kinds=[])
    with pytest.raises(ConfigError, match="job ids"):
        Selection(jobs=[""])


def _diag(job: str) -> Diagnosis:
    return Diagnosis(
        ts_ns=NOW, job_id=job, node="n0", rank=-1, diagnosis_id="d1", bottleneck="straggler",
        level="network", loop="training", state="open", onset_ns=NOW - S, step_share=0.3,
        confidence=0.9, critical_path=True, ranks=[3], evidence={"score": 0.8},
    )  # fmt: skip


def test_a_message_becomes_the_selected_events_of_the_selected_jobs() -> None:
    sel = Selection(jobs="j1", kinds=["diagnosis", "lifecycle", "config"])
    assert sel.wants_key(b"j1") and sel.wants_key(b"*") and sel.wants_key(None)
    assert not sel.wants_key(b"j2")
    mine, other = _diag("j1"), _diag("j2")
    assert sel.events(Topics.DIAGNOSES, encode_event(mine)) == [mine]
    assert sel.events(Topics.DIAGNOSES, encode_event(other)) == []
    # the job topic carries several kinds: only those asked for come out
    started = JobLifecycle(ts_ns=NOW, job_id="j1", node="n0", rank=0, state="started")
    stats = ProducerStats(ts_ns=NOW, job_id="j1", node="n0", rank=0, producer_id="p")
    assert sel.events(Topics.JOB, encode_event(started)) == [started]
    assert sel.events(Topics.JOB, encode_event(stats)) == []
    # a config change counts for the jobs it applies to, whoever issued it
    for applies_to, wanted in (("*", True), ("j1", True), ("j2", False)):
        change = ConfigChange(ts_ns=NOW, job_id="ops", node="cli", rank=-1, target="streams",
                              key="thresholds.x", value=1.0, applies_to=applies_to)  # fmt: skip
        assert sel.events(Topics.CONTROL, encode_event(change)) == ([change] if wanted else [])


def test_a_telemetry_batch_becomes_one_event_per_sample() -> None:
    sel = Selection(jobs=["j1"], kinds=["step"])
    cols = {"ts_ns": [NOW, NOW + S], "rank": [0, 1], "step": [7, 7],
            "step_time_ms": [101.5, 99.0], "data_wait_ms": [3.0, 4.0]}  # fmt: skip
    for wire in ("arrow", "json"):
        data = encode_batch("step", cols, job_id="j1", node="n0", wire=wire)
        events = sel.events(Topics.STEP, data)
        assert [type(e) for e in events] == [StepEvent, StepEvent]
        assert [(e.rank, e.step, e.step_time_ms) for e in events] == [(0, 7, 101.5), (1, 7, 99.0)]
        other_job = encode_batch("step", cols, job_id="j2", node="n0", wire=wire)
        assert sel.events(Topics.STEP, other_job) == []
    # kinds sharing a topic: spans are not steps
    span = encode_batch("span", {"ts_ns": [NOW], "rank": [0], "step": [1], "phase": ["forward"],
                                 "name": ["forward"], "duration_ms": [5.0]},
                        job_id="j1", node="n0")  # fmt: skip
    assert Selection(kinds=["collective"]).events(Topics.SPAN, span) == []
    assert len(Selection(kinds=["span"]).events(Topics.SPAN, span)) == 1


@pytest.mark.parametrize(
    ("topic", "value"),
    [
        (Topics.DIAGNOSES, b"{not json"),
        (Topics.DIAGNOSES, b'{"kind": "nope"}'),
        (Topics.RECOMMENDATIONS, b'{"kind": "recommendation", "ts_ns": -1}'),
        (Topics.STEP, b'{"kind": "step", "columns": 3}'),
    ],
)
def test_a_bad_message_raises_a_schema_error_for_the_follower_to_skip(
    topic: str, value: bytes
) -> None:
    with pytest.raises(SchemaError):
        Selection(kinds=[*DEFAULT_KINDS, "step"]).events(topic, value)


def test_a_recommendation_keeps_its_id_across_the_wire() -> None:
    rec = Recommendation(ts_ns=NOW, job_id="j1", node="n0", rank=-1, knob="k", from_value=1,
                         to_value=2, loop="fast", expected_gain_pct=10.0, confidence=0.5,
                         rationale="r")  # fmt: skip
    [back] = Selection(kinds=["recommendation"]).events(Topics.RECOMMENDATIONS, encode_event(rec))
    assert back.event_id == rec.event_id and back.KIND == "recommendation"
