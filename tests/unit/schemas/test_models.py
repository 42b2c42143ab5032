"""The event models themselves: frozen, closed to unknown fields, with units and defaults."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from perfloop.schemas import (
    ActuationResult,
    Command,
    Event,
    GpuSample,
    Recommendation,
    StepEvent,
    new_event_id,
    now_ns,
)

_VALID: list[tuple[type[Event], dict[str, Any]]] = [
    (StepEvent, dict(rank=0, step=1, step_time_ms=100.0)),
    (GpuSample, dict(rank=0, device=0)),
    (
        Recommendation,
        dict(
            rank=-1,
            knob="k",
            from_value=1,
            to_value=2,
            loop="fast",
            expected_gain_pct=1.0,
            confidence=0.5,
            rationale="",
        ),
    ),
    (Command, dict(rank=-1, seq=1, knob="k", value=2, expires_ts_ns=5)),
    (ActuationResult, dict(rank=-1, command_id="c", status="applied")),
]

_VALID_BY_MODEL = dict(_VALID)


def _make(model: type[Event], **kw: Any) -> Event:
    fields = dict(ts_ns=1, job_id="job-1", node="n0") | dict(_VALID_BY_MODEL[model]) | kw
    return model(**fields)


@pytest.mark.parametrize("model", [m for m, _ in _VALID], ids=lambda m: m.__name__)
def test_events_are_frozen(model: type[Event]) -> None:
    event = _make(model)
    with pytest.raises(pydantic.ValidationError):
        event.job_id = "other"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        event.ts_ns = 2  # type: ignore[misc]
    assert event.job_id == "job-1"


@pytest.mark.parametrize("model", [m for m, _ in _VALID], ids=lambda m: m.__name__)
def test_extra_fields_are_forbidden(model: type[Event]) -> None:
    with pytest.raises(pydantic.ValidationError, match="extra"):
        _make(model, surprise=1)


@pytest.mark.parametrize("model", [m for m, _ in _VALID], ids=lambda m: m.__name__)
def test_every_event_is_versioned_and_gets_a_fresh_id(model: type[Event]) -> None:
    a, b = _make(model), _make(model)
    assert a.schema_version == model.SCHEMA_VERSION >= model.MIN_SCHEMA_VERSION >= 1
    assert len(a.event_id) == 32 and a.event_id != b.event_id


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "job\n1"])
def test_job_id_must_be_a_short_token(bad: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        _make(StepEvent, job_id=bad)


def test_job_id_accepts_the_documented_characters() -> None:
    assert _make(StepEvent, job_id="team/run-1.2:a@b+c_d").job_id == "team/run-1.2:a@b+c_d"


@pytest.mark.parametrize(
    ("model", "changes"),
    [
        (StepEvent, {"step_time_ms": 0.0}),
        (StepEvent, {"step_time_ms": float("inf")}),
        (StepEvent, {"data_wait_ms": -1.0}),
        (StepEvent, {"rank": -1}),  # a step belongs to one rank
        (GpuSample, {"sm_util_pct": 101.0}),
        (GpuSample, {"power_w": float("nan")}),
        (GpuSample, {"device": 1024}),
        (Command, {"seq": 0}),
        (Recommendation, {"confidence": -0.1}),
        (Recommendation, {"expected_gain_pct": float("inf")}),
        (ActuationResult, {"status": "done"}),
        (ActuationResult, {"rank": -2}),
    ],
)
def test_out_of_bounds_fields_are_rejected(model: type[Event], changes: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        _make(model, **changes)


def test_data_wait_share_is_a_fraction_capped_at_one() -> None:
    step = _make(StepEvent, step_time_ms=200.0, data_wait_ms=50.0)
    assert isinstance(step, StepEvent)
    assert step.data_wait_share == 0.25
    over = _make(StepEvent, step_time_ms=100.0, data_wait_ms=150.0)
    assert isinstance(over, StepEvent)
    assert over.data_wait_share == 1.0


def test_gpu_sample_readings_default_to_zero() -> None:
    g = _make(GpuSample)
    assert isinstance(g, GpuSample)
    assert (g.sm_util_pct, g.power_w, g.mem_used_bytes, g.sm_clock_mhz) == (0.0, 0.0, 0, 0.0)


def test_helpers_give_unique_ids_and_nanosecond_time() -> None:
    assert new_event_id() != new_event_id()
    t = now_ns()
    assert isinstance(t, int) and t > 1_600_000_000 * 10**9
