"""Control events: one JSON object each, decoded to the same frozen model or a named error."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from perfloop.schemas import (
    ActuationResult,
    Command,
    Event,
    Recommendation,
    SchemaError,
    decode_event,
    encode_event,
)


def _recommendation(**kw: Any) -> Recommendation:
    fields: dict[str, Any] = dict(
        ts_ns=1_700_000_000_000_000_000,
        job_id="job-1",
        node="n0",
        rank=-1,
        knob="dataloader.num_workers",
        from_value=2,
        to_value=5,
        loop="fast",
        expected_gain_pct=41.5,
        confidence=0.9,
        rationale="ranks wait for input 55% of each step",
        evidence={"data_wait_share": 0.55, "ranks": 4.0},
    )
    return Recommendation(**(fields | kw))


def _command(**kw: Any) -> Command:
    fields: dict[str, Any] = dict(
        ts_ns=10,
        job_id="job-1",
        node="n0",
        rank=-1,
        rec_id="r1",
        seq=42,
        knob="dataloader.num_workers",
        from_value=2,
        value=5,
        expires_ts_ns=20,
        signature="ab" * 32,
    )
    return Command(**(fields | kw))


def _result(**kw: Any) -> ActuationResult:
    fields: dict[str, Any] = dict(
        ts_ns=11,
        job_id="job-1",
        node="n0",
        rank=-1,
        command_id="c1",
        status="applied",
        knob="dataloader.num_workers",
        value=5,
        step=300,
    )
    return ActuationResult(**(fields | kw))


def _error(data: bytes) -> str:
    with pytest.raises(SchemaError) as info:
        decode_event(data)
    msg = str(info.value)
    assert msg and "\n" not in msg, f"message must be one line: {msg!r}"
    return msg


def _doc(event: Event, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(encode_event(event))
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    "event",
    [
        _recommendation(),
        _recommendation(from_value="lz4", to_value="zstd", loop="slow", evidence={}),
        _recommendation(from_value=0.5, to_value=True),
        _command(),
        _command(from_value=None, value=0.25, loop="slow", key_id="k2"),
        _result(),
        _result(status="rejected", reason="signature does not verify", value=None, step=0),
        _result(status="rolled_back", reason="it hurt", value=2, evidence={"ratio": 1.4}),
    ],
    ids=lambda e: type(e).__name__,
)
def test_round_trip_returns_an_equal_event_of_the_same_kind(event: Event) -> None:
    back = decode_event(encode_event(event))
    assert type(back) is type(event)
    assert back == event


def test_encoded_event_carries_its_kind() -> None:
    assert orjson.loads(encode_event(_command()))["kind"] == "command"
    assert orjson.loads(encode_event(_result()))["kind"] == "actuation"
    assert orjson.loads(encode_event(_recommendation()))["kind"] == "recommendation"


def test_knob_values_keep_their_type_through_the_wire() -> None:
    for value in (5, 5.5, "zstd", True, False):
        back = decode_event(encode_event(_command(value=value)))
        assert isinstance(back, Command)
        assert back.value == value and type(back.value) is type(value)


def test_defaults_are_filled_when_left_out() -> None:
    doc = _doc(_command())
    for key in ("schema_version", "event_id", "rec_id", "from_value", "loop", "key_id"):
        del doc[key]
    cmd = decode_event(orjson.dumps(doc))
    assert isinstance(cmd, Command)
    assert (cmd.schema_version, cmd.rec_id, cmd.from_value, cmd.loop, cmd.key_id) == (
        1,
        "",
        None,
        "fast",
        "default",
    )
    assert len(cmd.event_id) == 32


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe garbage", "not valid JSON"),
        (b"[]", "must be a JSON object, got list"),
        (b"3", "must be a JSON object, got int"),
        (b"{}", "unknown kind None"),
        (b'{"kind": "launch"}', "unknown kind 'launch'"),
        (b'{"kind": 7}', "unknown kind 7"),
        (b'{"kind": "step"}', "unknown kind 'step'"),  # a batch kind is not an event kind
    ],
)
def test_unreadable_event_is_named(data: bytes, expected: str) -> None:
    assert expected in _error(data)


def test_unknown_kind_lists_the_valid_ones() -> None:
    msg = _error(b'{"kind": "launch"}')
    assert all(k in msg for k in ("actuation", "command", "recommendation"))


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_wrong_schema_version_is_rejected(version: Any) -> None:
    msg = _error(orjson.dumps(_doc(_command(), schema_version=version)))
    assert "schema_version" in msg and repr(version) in msg


def test_oversize_event_is_rejected() -> None:
    with pytest.raises(SchemaError, match="exceeds the 100-byte limit"):
        decode_event(encode_event(_recommendation()), max_bytes=100)
    assert "exceeds" in _error(b" " * ((1 << 20) + 1))


@pytest.mark.parametrize(
    ("event", "changes", "field"),
    [
        (_command(), {"seq": 0}, "seq"),
        (_command(), {"seq": "next"}, "seq"),
        (_command(), {"knob": ""}, "knob"),
        (_command(), {"loop": "medium"}, "loop"),
        (_command(), {"expires_ts_ns": -1}, "expires_ts_ns"),
        (_command(), {"job_id": ""}, "job_id"),
        (_command(), {"job_id": "has space"}, "job_id"),
        (_command(), {"rank": -2}, "rank"),
        (_command(), {"ts_ns": -1}, "ts_ns"),
        (_command(), {"value": [1, 2]}, "value"),
        (_command(), {"signature": "x" * 129}, "signature"),
        (_command(), {"colour": "blue"}, "colour"),
        (_recommendation(), {"confidence": 1.5}, "confidence"),
        (_recommendation(), {"evidence": {"share": "high"}}, "evidence"),
        (_result(), {"status": "maybe"}, "status"),
        (_result(), {"command_id": ""}, "command_id"),
        (_result(), {"step": -1}, "step"),
    ],
)
def test_invalid_field_is_named(event: Event, changes: dict[str, Any], field: str) -> None:
    msg = _error(orjson.dumps(_doc(event, **changes)))
    assert msg.startswith(f"{event.KIND} event: {field}")


@pytest.mark.parametrize("missing", ["ts_ns", "job_id", "node", "rank", "seq", "value"])
def test_missing_required_field_is_named(missing: str) -> None:
    doc = _doc(_command())
    del doc[missing]
    msg = _error(orjson.dumps(doc))
    assert missing in msg and "required" in msg.lower()


def test_nan_gain_is_rejected() -> None:
    doc = orjson.dumps(_doc(_recommendation())).replace(b"41.5", b"NaN")
    _error(doc)
    with pytest.raises(ValueError):
        _recommendation(expected_gain_pct=float("nan"))


def test_a_v1_ack_still_decodes_and_an_unknown_status_is_refused() -> None:
    doc = _doc(_result(), schema_version=1)
    del doc["evidence"]
    back = decode_event(orjson.dumps(doc))
    assert isinstance(back, ActuationResult)
    assert (back.schema_version, back.status, back.evidence) == (1, "applied", {})
    assert "status" in _error(orjson.dumps(_doc(_result(), status="undone")))
