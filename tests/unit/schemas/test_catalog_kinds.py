"""The full telemetry catalog: string and nullable columns, versions, job events, JSON Schema."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pydantic
import pytest

from perfloop.cli import main
from perfloop.schemas import (
    BATCH_KINDS,
    EVENT_KINDS,
    WIRE_FORMATS,
    BatchBuilder,
    CapabilityReport,
    GpuSample,
    GroundTruth,
    JobInfo,
    PhaseSpan,
    ProducerStats,
    SchemaError,
    StepEvent,
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    export_json_schemas,
    is_batch,
)


def _span_columns(**over: Any) -> dict[str, Any]:
    cols: dict[str, Any] = {
        "ts_ns": [1, 2, 3],
        "rank": [0, 0, 1],
        "step": [4, 4, 4],
        "phase": ["forward", "user", "backward"],
        "name": ["forward", "tokenize", "backward"],
        "duration_ms": [10.0, 1.5, 20.0],
    }
    cols.update(over)
    return cols


def _decode_error(kind: str, cols: dict[str, Any]) -> str:
    with pytest.raises(SchemaError) as info:
        # JSON: a producer in any language can send such values; Arrow types would not hold them
        decode_batch(encode_batch(kind, cols, job_id="j", node="n", wire="json"))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_string_columns_round_trip() -> None:
    batch = decode_batch(encode_batch("span", _span_columns(), job_id="j", node="n"))
    assert batch.columns["name"].tolist() == ["forward", "tokenize", "backward"]
    assert batch.columns["depth"].tolist() == [0, 0, 0]  # default filled
    events = list(batch.events())
    assert isinstance(events[1], PhaseSpan) and events[1].name == "tokenize"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (7, "is not a string"),
        (None, "is not a string"),
        ("", "is empty"),
        ("x" * 129, "129 characters long"),
        ("bad\nname", "control characters"),
    ],
)
def test_bad_strings_are_named(value: Any, why: str) -> None:
    msg = _decode_error("span", _span_columns(name=["forward", value, "backward"]))
    assert "'name'" in msg and "sample 1" in msg and why in msg


def test_nullable_loss_travels_as_null_and_comes_back_as_none() -> None:
    cols = {
        "ts_ns": [1, 2],
        "rank": [0, 0],
        "step": [1, 2],
        "step_time_ms": [50.0, 51.0],
        "loss": [2.5, None],
    }
    assert b"null" in encode_batch("step", cols, job_id="j", node="n", wire="json")
    for wire in WIRE_FORMATS:
        batch = decode_batch(encode_batch("step", cols, job_id="j", node="n", wire=wire))
        assert batch.columns["loss"][0] == 2.5 and math.isnan(batch.columns["loss"][1])
        a, b = batch.events()
        assert isinstance(a, StepEvent) and a.loss == 2.5 and isinstance(b, StepEvent)
        assert b.loss is None and b.grad_norm is None


def test_null_in_a_non_nullable_float_column_is_refused() -> None:
    cols = {"ts_ns": [1], "rank": [0], "step": [1], "step_time_ms": [None]}
    assert "null" in _decode_error("step", cols)


def test_an_older_supported_version_decodes_with_new_columns_at_defaults() -> None:
    doc = {
        "kind": "gpu",
        "schema_version": 1,
        "job_id": "j",
        "node": "n",
        "batch_id": "b",
        "columns": {"ts_ns": [1], "rank": [0], "device": [0], "power_w": [250.0]},
    }
    batch = decode_batch(orjson.dumps(doc))
    assert batch.schema_version == 1
    (ev,) = batch.events()
    assert isinstance(ev, GpuSample)
    assert ev.power_w == 250.0 and ev.power_limit_w == 0.0 and ev.schema_version == 1


@pytest.mark.parametrize("version", [0, 3])
def test_versions_outside_the_range_are_refused_with_the_range(version: int) -> None:
    doc = {"kind": "gpu", "schema_version": version, "job_id": "j", "node": "n", "batch_id": "b"}
    with pytest.raises(SchemaError, match=r"supported: 1\.\.2"):
        decode_batch(orjson.dumps(doc))
    with pytest.raises(pydantic.ValidationError, match="schema_version"):
        GpuSample(ts_ns=1, job_id="j", node="n", rank=0, device=0, schema_version=version)


def test_builder_extend_takes_numpy_columns_and_checks_them() -> None:
    b = BatchBuilder("kernel", job_id="j", node="n", producer_id="p")
    b.extend(
        ts_ns=np.array([1, 2]),
        rank=[0, 0],
        step=[3, 3],
        stream=[7, -1],
        kernel_class=["gemm", "all"],
        count=np.array([5, 9]),
        busy_ms=np.array([1.5, 2.0]),
    )
    assert len(b) == 2
    with pytest.raises(SchemaError, match="different lengths"):
        b.extend(
            ts_ns=[1],
            rank=[0, 1],
            step=[1],
            stream=[0],
            kernel_class=["x"],
            count=[1],
            busy_ms=[1.0],
        )
    with pytest.raises(SchemaError, match="missing required field 'busy_ms'"):
        b.extend(ts_ns=[1], rank=[0], step=[1], stream=[0], kernel_class=["x"], count=[1])
    with pytest.raises(SchemaError, match="unknown fields"):
        b.extend(ts_ns=[1], bogus=[1])
    assert len(b) == 2  # a refused extend leaves nothing behind
    batch = decode_batch(b.encode())
    assert batch.columns["kernel_class"].tolist() == ["gemm", "all"]


@pytest.mark.parametrize(
    "event",
    [
        JobInfo(ts_ns=1, job_id="j", node="n", rank=0, world_size=16, extra={"a": "b"}),
        CapabilityReport(
            ts_ns=1,
            job_id="j",
            node="n",
            rank=-1,
            component="nvml",
            available=False,
            missing=["gpu"],
            reason="no driver",
        ),
        ProducerStats(ts_ns=1, job_id="j", node="n", rank=0, producer_id="p", rates_hz={"gpu": 10}),
        GroundTruth(
            ts_ns=1,
            job_id="j",
            node="n",
            rank=-1,
            scenario="mixed",
            fault="hang",
            onset_ns=5,
            ranks=[1, 2],
        ),
    ],
)
def test_job_events_round_trip(event: Any) -> None:
    assert decode_event(encode_event(event)) == event


def test_a_job_event_with_a_bad_field_is_named_in_one_line() -> None:
    doc = orjson.loads(encode_event(JobInfo(ts_ns=1, job_id="j", node="n", rank=0)))
    doc["world_size"] = 0
    with pytest.raises(SchemaError, match=r"job_info event: world_size: .*greater than or equal"):
        decode_event(orjson.dumps(doc))


def test_export_writes_a_schema_per_kind_that_validates_real_messages(tmp_path: Path) -> None:
    files = export_json_schemas(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())["kinds"]
    assert set(index) == set(BATCH_KINDS) | set(EVENT_KINDS)
    assert len(files) == len(BATCH_KINDS) * 2 + len(EVENT_KINDS) + 1
    batch_schema = json.loads((tmp_path / index["span"]["batch"]).read_text())
    cols = batch_schema["properties"]["columns"]
    assert set(cols["required"]) == {"ts_ns", "rank", "step", "phase", "name", "duration_ms"}
    assert cols["properties"]["duration_ms"]["items"]["minimum"] == 0
    assert batch_schema["properties"]["schema_version"]["maximum"] == 1
    # What the schema calls required is exactly what the decoder refuses to go without.
    for name in cols["required"]:
        partial = {k: v for k, v in _span_columns().items() if k != name}
        if name == "ts_ns":
            continue
        assert name in _decode_error("span", partial)
    event_schema = json.loads((tmp_path / index["job_info"]["event"]).read_text())
    assert event_schema["properties"]["kind"] == {"const": "job_info"}
    assert "world_size" in event_schema["properties"]


def test_schemas_export_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schemas", "export", str(tmp_path / "out")]) == 0
    assert "JSON Schema files" in capsys.readouterr().out
    assert (tmp_path / "out" / "batch" / "step.v2.json").is_file()
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["schemas", "export", str(blocker / "sub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("perfloop: cannot write schemas") and err.count("\n") == 1


def test_values_arrow_cannot_hold_travel_as_json_and_are_refused_by_name() -> None:
    cols = {"ts_ns": [1, 2], "rank": [0, "1"], "step": [1, 2], "step_time_ms": [5.0, 6.0]}
    data = encode_batch("step", cols, job_id="j", node="n")  # never raises at the producer
    assert data.startswith(b"{")
    with pytest.raises(SchemaError, match="column 'rank' is not numeric"):
        decode_batch(data)


def test_a_batch_is_arrow_by_default_and_json_on_request() -> None:
    cols = {"ts_ns": [1, 2], "rank": [0, 1], "step": [1, 2], "step_time_ms": [5.0, 6.0]}
    arrow = encode_batch("step", cols, job_id="j", node="n", batch_id="b")
    text = encode_batch("step", cols, job_id="j", node="n", batch_id="b", wire="json")
    assert arrow[:4] == b"\xff\xff\xff\xff" and text[:1] == b"{"
    assert is_batch(arrow) and is_batch(text)
    a, t = decode_batch(arrow), decode_batch(text)
    assert (a.kind, a.job_id, a.batch_id) == (t.kind, t.job_id, t.batch_id) == ("step", "j", "b")
    for name, col in t.columns.items():  # NaN (not reported) in both
        np.testing.assert_array_equal(a.columns[name], col, err_msg=name)
    with pytest.raises(SchemaError, match="unknown wire format 'xml'"):
        encode_batch("step", cols, job_id="j", node="n", wire="xml")


def _arrow(table: pa.Table, header: dict[str, Any] | None) -> bytes:
    meta = None if header is None else {b"perfloop.batch": orjson.dumps(header)}
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


_HEADER = {"kind": "step", "schema_version": 2, "job_id": "j", "node": "n", "batch_id": "b"}
_GOOD = {
    "ts_ns": pa.array([1, 2]),
    "rank": pa.array([0, 1]),
    "step": pa.array([1, 2]),
    "step_time_ms": pa.array([5.0, 6.0]),
}
BAD_ARROW: dict[str, tuple[bytes, str]] = {
    "junk after the magic": (b"\xff\xff\xff\xff" + b"x" * 40, "not a valid Arrow stream"),
    "no header": (_arrow(pa.table(_GOOD), None), "no perfloop.batch header"),
    "unknown kind": (_arrow(pa.table(_GOOD), {**_HEADER, "kind": "nope"}), "unknown kind"),
    "float rank": (
        _arrow(pa.table({**_GOOD, "rank": pa.array([0.5, 1.0])}), _HEADER),
        "column 'rank' must hold integers",
    ),
    "null rank": (
        _arrow(pa.table({**_GOOD, "rank": pa.array([None, 1], pa.int64())}), _HEADER),
        "column 'rank' holds nulls",
    ),
    "null step time": (
        _arrow(pa.table({**_GOOD, "step_time_ms": pa.array([None, 1.0])}), _HEADER),
        "column 'step_time_ms' sample 0 is null",
    ),
    "string step": (
        _arrow(pa.table({**_GOOD, "step": pa.array(["1", "2"])}), _HEADER),
        "column 'step' is not numeric",
    ),
    "list column": (
        _arrow(pa.table({**_GOOD, "step": pa.array([[1], [2]])}), _HEADER),
        "must be numbers or strings",
    ),
    "huge unsigned": (
        _arrow(pa.table({**_GOOD, "step": pa.array([2**63, 1], pa.uint64())}), _HEADER),
        "above int64",
    ),
    "unknown column": (
        _arrow(pa.table({**_GOOD, "bogus": pa.array([1, 2])}), _HEADER),
        "unknown columns ['bogus']",
    ),
    "negative step time": (
        _arrow(pa.table({**_GOOD, "step_time_ms": pa.array([-5.0, 6.0])}), _HEADER),
        "column 'step_time_ms' sample 0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ARROW))
def test_bad_arrow_batches_are_refused_with_one_line(case: str) -> None:
    data, why = BAD_ARROW[case]
    with pytest.raises(SchemaError) as e:
        decode_batch(data)
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_arrow_stream_of_several_record_batches_decodes_as_one() -> None:
    header = {**_HEADER, "kind": "span", "schema_version": 1}
    spans = {
        "ts_ns": pa.array([1, 2]),
        "rank": pa.array([0, 1]),
        "step": pa.array([1, 1]),
        "phase": pa.array(["forward", "backward"]).dictionary_encode(),
        "name": pa.array(["f", "b"]),
        "duration_ms": pa.array([1.0, 2.0]),
    }
    table = pa.table(spans).replace_schema_metadata({b"perfloop.batch": orjson.dumps(header)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        for part in table.to_batches(max_chunksize=1):  # two record batches of one row
            w.write_batch(part)
    split = decode_batch(bytes(sink.getvalue().to_pybytes()))
    whole = decode_batch(_arrow(table, header))
    assert len(split) == len(whole) == 2 and split.columns["phase"].tolist() == [
        "forward",
        "backward",
    ]
    for name, arr in whole.columns.items():
        assert split.columns[name].tolist() == arr.tolist(), name


def test_bad_strings_in_an_arrow_batch_are_named() -> None:
    spans = {
        "ts_ns": pa.array([1, 2, 3]),
        "rank": pa.array([0, 0, 0]),
        "step": pa.array([1, 1, 1]),
        "phase": pa.array(["forward", "bad\nname", "forward"]).dictionary_encode(),
        "name": pa.array(["f", "b", "f"]),
        "duration_ms": pa.array([1.0, 2.0, 3.0]),
    }
    header = {**_HEADER, "kind": "span", "schema_version": 1}
    with pytest.raises(SchemaError, match="column 'phase' sample 1 = 'bad\\\\nname' holds control"):
        decode_batch(_arrow(pa.table(spans), header))
