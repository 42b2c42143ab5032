"""Row shapes the sink builds for each topic, and every kind of bad input it must reject."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

from perfloop.kafka import dlq_headers
from perfloop.schemas import (
    ConfigChange,
    Diagnosis,
    PhaseChange,
    SchemaError,
    decode_batch,
    encode_batch,
    encode_event,
)
from perfloop.schemas.topics import Topics
from perfloop.schemas.windows import encode_windows
from perfloop.warehouse._sink_rows import (
    WINDOW_COLUMNS,
    rows_from_dead_letter,
    rows_from_message,
)
from perfloop.warehouse.migrations import MIGRATIONS
from perfloop.warehouse.tables import DEAD_LETTER_PAYLOAD_BYTES

T = 1_700_000_000_000_000_000


def lists(part: Any) -> dict[str, list[Any]]:
    """An Arrow part as Python lists, times as integer nanoseconds."""
    out = {}
    for name, col in zip(part.schema.names, part.columns, strict=True):
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.int64())
        out[name] = col.to_pylist()
    return out


def _table_columns(table: str) -> set[str]:
    """Every column of ``table`` after all migrations (parsed from the DDL)."""
    cols: set[str] = set()
    for m in MIGRATIONS:
        for stmt in m.statements:
            if stmt.startswith(f"CREATE TABLE IF NOT EXISTS {table} ("):
                cols |= set(re.findall(r"^\s{4}(\w+) ", stmt.split("ENGINE")[0], re.M))
            elif stmt.startswith(f"ALTER TABLE {table}\n"):
                cols |= set(re.findall(r"ADD COLUMN IF NOT EXISTS (\w+) ", stmt))
    assert cols, table
    return cols


def windows_doc(n: int = 3, **override: Any) -> dict[str, Any]:
    cols: dict[str, Any] = {
        "ts_ns": [T + i * 1_000_000_000 for i in range(n)],
        "window_end_ns": [T + (i + 1) * 1_000_000_000 for i in range(n)],
        "window_s": [1.0] * n,
        "hop_s": [1.0] * n,
        "job_id": ["job-1"] * n,
        "node": ["n0"] * n,
        "rank": list(range(n)),
        "device": [-1] * n,
        "metric": ["step_time_ms"] * n,
        "count": [10] * n,
        "mean": [100.0 + i for i in range(n)],
        "min": [90.0] * n,
        "max": [120.0] * n,
        "p50": [99.0] * n,
        "p95": [110.0] * n,
        "p99": [119.0] * n,
        "rate_per_s": [10.0] * n,
        "slope_per_s": ([None] + [0.5] * (n - 1))[:n],  # undefined slope travels as null
        "closed_ns": [T + (i + 2) * 1_000_000_000 for i in range(n)],
    }
    cols.update(override)
    return {"kind": "windows", "v": 2, "columns": cols}


def test_windows_v2_rows_fill_the_windows_table() -> None:
    table, part, msg_id = rows_from_message(Topics.WINDOWS, orjson.dumps(windows_doc()))
    assert table == "windows"
    rows = lists(part)
    assert set(rows) <= _table_columns("windows")
    assert rows["ts"] == [T, T + 10**9, T + 2 * 10**9]
    assert rows["window_end"][0] == T + 10**9 and rows["closed"][2] == T + 4 * 10**9
    assert rows["rank"] == [0, 1, 2] and rows["device"] == [-1, -1, -1]
    assert rows["mean"] == [100.0, 101.0, 102.0]
    assert math.isnan(rows["slope_per_s"][0]) and rows["slope_per_s"][1] == 0.5
    assert rows["event_id"] == [msg_id] * 3
    assert "inserted" not in rows  # the warehouse stamps it at insert time


def test_a_telemetry_batch_becomes_arrow_columns_of_its_table() -> None:
    data = encode_batch(
        "step",
        {
            "ts_ns": [T, T + 5],
            "rank": [0, 1],
            "step": [7, 7],
            "step_time_ms": [100.0, 101.5],
            "loss": [2.5, None],  # not reported on rank 1
        },
        job_id="job-1",
        node="n0",
        batch_id="b1",
    )
    table, part, dedup = rows_from_message(Topics.STEP, data)
    assert (table, dedup) == ("steps", "b1")
    rows = lists(part)
    assert set(rows) <= _table_columns("steps"), set(rows) - _table_columns("steps")
    assert rows["ts"] == [T, T + 5] and rows["step"] == [7, 7]
    assert rows["event_id"] == decode_batch(data).event_ids() == ["b1-0", "b1-1"]
    assert rows["job_id"] == ["job-1", "job-1"] and rows["node"] == ["n0", "n0"]
    assert rows["loss"] == [2.5, None]  # NULL, not NaN, in the warehouse
    assert rows["step_time_ms"] == [100.0, 101.5] and rows["grad_accum_steps"] == [1, 1]


def test_string_columns_of_a_batch_keep_their_values() -> None:
    cols = {"ts_ns": [T, T], "rank": [0, 0], "step": [1, 1], "duration_ms": [1.0, 2.0]}
    data = encode_batch(
        "span", cols | {"phase": ["forward", "backward"], "name": ["fwd", "bwd"]},
        job_id="j", node="n",
    )  # fmt: skip
    table, part, _ = rows_from_message(Topics.SPAN, data)
    rows = lists(part)
    assert table == "spans" and rows["phase"] == ["forward", "backward"]
    assert rows["name"] == ["fwd", "bwd"]


def test_windows_message_id_is_its_content() -> None:
    a = orjson.dumps(windows_doc())
    assert rows_from_message(Topics.WINDOWS, a)[2] == rows_from_message(Topics.WINDOWS, a)[2]
    b = orjson.dumps(windows_doc(mean=[1.0, 2.0, 3.0]))
    assert rows_from_message(Topics.WINDOWS, a)[2] != rows_from_message(Topics.WINDOWS, b)[2]


def test_an_empty_windows_message_has_no_rows() -> None:
    _, part, _ = rows_from_message(Topics.WINDOWS, orjson.dumps(windows_doc(0)))
    assert part.num_rows == 0


BAD_WINDOWS: dict[str, tuple[bytes, str]] = {
    "not json": (b"{nope", "not valid JSON"),
    "not an object": (b"[1, 2]", '"kind": "windows"'),
    "other kind": (orjson.dumps({"kind": "step", "v": 2, "columns": {}}), '"kind": "windows"'),
    "v1 rows": (orjson.dumps({"kind": "windows", "rows": [{"ts_ns": 1}]}), "v1 row format"),
    "v3": (orjson.dumps(windows_doc() | {"v": 3}), "v 3; supported: 2"),
    "extra key": (orjson.dumps(windows_doc() | {"x": 1}), "unknown keys ['x']"),
    "columns not an object": (
        orjson.dumps({"kind": "windows", "v": 2, "columns": []}),
        "'columns' must be an object",
    ),
    "missing column": (
        orjson.dumps({"kind": "windows", "v": 2, "columns": {"ts_ns": [1]}}),
        "missing columns ['window_end_ns'",
    ),
    "unknown column": (orjson.dumps(windows_doc(sum=[1, 2, 3])), "unknown columns ['sum']"),
    "ragged": (orjson.dumps(windows_doc(mean=[1.0])), "'mean' has 1 values, 'ts_ns' has 3"),
    "scalar column": (orjson.dumps(windows_doc(rank=0)), "'rank' must be a list"),
    "float rank": (orjson.dumps(windows_doc(rank=[0.5, 1, 2])), "'rank' must hold integers"),
    "null count": (orjson.dumps(windows_doc(count=[None, 1, 2])), "'count' must hold integers"),
    "string mean": (orjson.dumps(windows_doc(mean=["1", 2.0, 3.0])), "'mean' must hold numbers"),
    "bool p50": (orjson.dumps(windows_doc(p50=[True, False, True])), "'p50' must hold numbers"),
    "nested": (orjson.dumps(windows_doc(max=[[1.0], [2.0], [3.0]])), "'max' is not a flat list"),
    "number as metric": (orjson.dumps(windows_doc(metric=["m", 1, "m"])), "must hold strings"),
    "empty metric": (orjson.dumps(windows_doc(metric=["m", "", "m"])), "'metric' value ''"),
    "control chars": (orjson.dumps(windows_doc(node=["a\nb"] * 3)), "'node' value 'a\\nb'"),
    "bad job id": (orjson.dumps(windows_doc(job_id=["a b"] * 3)), "job_id 'a b' must be"),
    "negative count": (orjson.dumps(windows_doc(count=[1, -1, 1])), "'count' row 1 = -1"),
    "rank below -1": (orjson.dumps(windows_doc(rank=[0, -2, 1])), "'rank' row 1 = -2"),
    "zero window": (orjson.dumps(windows_doc(window_s=[0.0] * 3)), "'window_s' row 0"),
    "null hop": (orjson.dumps(windows_doc(hop_s=[None] * 3)), "'hop_s' row 0"),
    "end before start": (
        orjson.dumps(windows_doc(window_end_ns=[T, T, T])),
        "'window_end_ns' row 0",
    ),
    "huge int": (orjson.dumps(windows_doc(ts_ns=[2**63] * 3)), "'ts_ns' holds a value above"),
    "oversized": (b'{"kind": "windows", "pad": "' + b"x" * (9 << 20) + b'"}', "byte limit"),
}


@pytest.mark.parametrize("case", sorted(BAD_WINDOWS))
def test_bad_windows_messages_are_rejected_with_their_reason(case: str) -> None:
    data, reason = BAD_WINDOWS[case]
    with pytest.raises(SchemaError) as e:
        rows_from_message(Topics.WINDOWS, data)
    assert reason in str(e.value), str(e.value)
    assert str(e.value).startswith("windows message: ")
    assert "\n" not in str(e.value)


def _event_row(topic: str, event: Any) -> tuple[str, dict[str, Any], str]:
    table, cols, dedup = rows_from_message(topic, encode_event(event))
    assert all(len(v) == 1 for v in cols.values())
    assert set(cols) <= _table_columns(table), set(cols) - _table_columns(table)
    return table, {k: v[0] for k, v in cols.items()}, dedup


def test_phase_changes_land_in_phases() -> None:
    ev = PhaseChange(
        ts_ns=T, job_id="j", node="n", rank=-1, level="run", phase="steady",
        previous="warmup", since_ns=T - 5, source="spans", step=40, duration_ms=12.5,
    )  # fmt: skip
    table, row, dedup = _event_row(Topics.PHASES, ev)
    assert table == "phases" and dedup == ev.event_id
    assert (row["since"], row["next_ts"], row["ts"]) == (T - 5, None, T)
    assert (row["level"], row["phase"], row["previous"], row["step"]) == (
        "run",
        "steady",
        "warmup",
        40,
    )
    predicted = ev.model_copy(update={"next_phase": "eval", "next_ts_ns": T + 9})
    assert _event_row(Topics.PHASES, predicted)[1]["next_ts"] == T + 9


def test_diagnoses_keep_ranks_nodes_and_evidence() -> None:
    ev = Diagnosis(
        ts_ns=T, job_id="j", node="n", rank=3, diagnosis_id="d1", bottleneck="straggler",
        level="network", loop="training", state="open", onset_ns=T - 7, step_share=0.3,
        confidence=0.9, critical_path=True, ranks=[3, 5], nodes=["n1"],
        evidence={"score": 0.8, "lateness_ms": 40.0}, explained_by="thermal_throttle",
    )  # fmt: skip
    table, row, _ = _event_row(Topics.DIAGNOSES, ev)
    assert table == "diagnoses"
    assert row["onset"] == T - 7 and row["ranks"] == [3, 5] and row["nodes"] == ["n1"]
    assert row["evidence"] == {"score": 0.8, "lateness_ms": 40.0}
    assert row["critical_path"] is True and row["explained_by"] == "thermal_throttle"


@pytest.mark.parametrize(
    ("value", "stored"),
    [(0.7, "0.7"), (3, "3"), (True, "true"), ("fast", "fast"), ([[1.0, 2.5]], "[[1.0,2.5]]")],
)
def test_config_changes_store_their_value_as_text(value: Any, stored: str) -> None:
    ev = ConfigChange(
        ts_ns=T, job_id="ops", node="cli", rank=-1, target="streams",
        key="detect.straggler.score_threshold", value=value, author="me", reason="why",
    )  # fmt: skip
    table, row, _ = _event_row(Topics.CONTROL, ev)
    assert table == "config_changes"
    assert row["value"] == stored and row["key"] == "detect.straggler.score_threshold"
    assert (row["target"], row["applies_to"], row["author"]) == ("streams", "*", "me")


BAD_EVENTS: dict[str, tuple[str, bytes, str]] = {
    "phase on the diagnoses topic": (
        Topics.DIAGNOSES,
        encode_event(
            PhaseChange(
                ts_ns=1,
                job_id="j",
                node="n",
                rank=0,
                level="step",
                phase="fwd",
                since_ns=1,
                source="gpu",
            )
        ),
        "phase event does not belong on perfloop.diagnoses",
    ),
    "config without a key": (
        Topics.CONTROL,
        orjson.dumps(
            {
                "kind": "config",
                "ts_ns": 1,
                "job_id": "j",
                "node": "n",
                "rank": -1,
                "target": "streams",
                "value": 1,
            }
        ),
        "config event: key: Field required",
    ),
    "diagnosis with an unknown level": (
        Topics.DIAGNOSES,
        orjson.dumps(
            {
                "kind": "diagnosis",
                "ts_ns": 1,
                "job_id": "j",
                "node": "n",
                "rank": 0,
                "diagnosis_id": "d",
                "bottleneck": "hang",
                "level": "gpu",
                "loop": "inner",
                "state": "open",
                "onset_ns": 1,
                "step_share": 0.1,
                "confidence": 1.0,
                "critical_path": True,
            }
        ),
        "diagnosis event: level:",
    ),
    "unknown kind": (Topics.PHASES, b'{"kind": "nope"}', "unknown kind 'nope'"),
    "not json": (Topics.PHASES, b"\xff\xfe", "not valid JSON"),
    "telemetry on the wrong topic": (
        Topics.GPU,
        encode_batch(
            "step",
            {"ts_ns": [1], "rank": [0], "step": [1], "step_time_ms": [5.0]},
            job_id="j",
            node="n",
        ),
        "does not belong on perfloop.telemetry.gpu",
    ),
    "telemetry garbage": (Topics.STEP, b"garbage", "not valid JSON"),
    "a topic without a table": ("perfloop.unknown", b"{}", "has no table"),
}


@pytest.mark.parametrize("case", sorted(BAD_EVENTS))
def test_bad_events_and_batches_are_rejected_with_their_reason(case: str) -> None:
    topic, data, reason = BAD_EVENTS[case]
    with pytest.raises(SchemaError) as e:
        rows_from_message(topic, data)
    assert reason in str(e.value), str(e.value)


def test_a_dead_letter_keeps_its_reason_source_and_origin() -> None:
    bad = encode_batch(
        "step",
        {"ts_ns": [1], "rank": [0], "step": [1], "step_time_ms": [5.0]},
        job_id="job-7",
        node="n3",
    )
    reason = "step batch: column 'rank' sample 12 = 9 is out of range"
    headers = dlq_headers(reason, Topics.STEP, 2, 41)
    table, cols, dedup = rows_from_dead_letter(
        bad, b"job-7", headers, timestamp_ms=1_700_000_000_123, partition=0, offset=5
    )
    row = {k: v[0] for k, v in cols.items()}
    assert table == "dead_letters" and set(row) <= _table_columns("dead_letters")
    assert row["ts"] == 1_700_000_000_123_000_000 and row["event_id"] == dedup
    assert (row["topic"], row["partition"], row["offset"]) == (Topics.STEP, 2, 41)
    assert (row["job_id"], row["node"], row["rank"]) == ("job-7", "n3", -1)
    assert row["reason"] == reason and "sample N" in row["reason_class"]
    assert row["payload"] == bad and row["payload_bytes"] == len(bad)
    assert row["headers"]["perfloop.source.offset"] == "41"
    # The same dead letter read again has the same id; another one does not.
    again = rows_from_dead_letter(bad, b"job-7", headers, timestamp_ms=1_700_000_000_123,
                                  partition=0, offset=5)  # fmt: skip
    other = rows_from_dead_letter(bad, b"job-7", headers, timestamp_ms=1_700_000_000_999,
                                  partition=0, offset=5)  # fmt: skip
    assert again[2] == dedup != other[2]


def test_a_dead_letter_without_headers_or_origin_still_lands() -> None:
    big = b"\x00\xff" * DEAD_LETTER_PAYLOAD_BYTES
    _, cols, _ = rows_from_dead_letter(big, None, None, timestamp_ms=None, partition=1, offset=2)
    row = {k: v[0] for k, v in cols.items()}
    assert (row["job_id"], row["node"], row["rank"]) == ("", "", -1)
    assert (row["topic"], row["partition"], row["offset"], row["reason"]) == ("", -1, -1, "")
    assert len(row["payload"]) == DEAD_LETTER_PAYLOAD_BYTES and row["payload_bytes"] == len(big)
    assert row["ts"] > 0 and row["headers"] == {}


def test_dead_letters_are_not_decoded_as_messages() -> None:
    with pytest.raises(SchemaError):
        rows_from_message(Topics.DLQ, b"{}")


def test_window_columns_are_the_documented_contract() -> None:
    assert list(WINDOW_COLUMNS)[:2] == ["ts_ns", "window_end_ns"]
    assert {"closed_ns", "hop_s", "device"} <= set(WINDOW_COLUMNS)


# -- windows v3: Arrow IPC ------------------------------------------------------------------


def windows_columns(n: int = 3) -> dict[str, np.ndarray]:
    doc = windows_doc(n)["columns"]
    out = {}
    for name, kind in WINDOW_COLUMNS.items():
        if kind == "str":
            out[name] = np.array(doc[name], dtype=object)
        elif kind == "float":
            out[name] = np.array([np.nan if v is None else v for v in doc[name]], dtype=float)
        else:
            out[name] = np.array(doc[name], dtype=np.int64)
    return out


def arrow_message(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def test_windows_v3_round_trip_the_same_rows_as_v2() -> None:
    cols = windows_columns()
    ((key, value),) = encode_windows(cols, b"job-1")
    assert key == b"job-1" and value[:4] == b"\xff\xff\xff\xff"
    table, part, msg_id = rows_from_message(Topics.WINDOWS, value)
    _, v2, _ = rows_from_message(Topics.WINDOWS, orjson.dumps(windows_doc()))
    rows, rows_v2 = lists(part), lists(v2)
    assert table == "windows" and set(rows) == set(rows_v2)
    for name in rows:
        if name == "event_id":
            assert rows[name] == [msg_id] * 3
        elif name == "slope_per_s":
            assert math.isnan(rows[name][0]) and rows[name][1:] == rows_v2[name][1:]
        else:
            assert rows[name] == rows_v2[name], name


def test_windows_v3_splits_a_large_job_into_messages() -> None:
    cols = {k: np.concatenate([v] * 1000) for k, v in windows_columns().items()}
    msgs = encode_windows(cols, b"job-1")
    sizes = [rows_from_message(Topics.WINDOWS, v)[1].num_rows for _, v in msgs]
    assert sizes == [2000, 1000]


def _v3(**change: Any) -> bytes:
    """A valid v3 message with columns replaced (name → pyarrow array, or None to drop)."""
    ((_, value),) = encode_windows(windows_columns(), b"k")
    table = pa.ipc.open_stream(value).read_all()
    for name, col in change.items():
        i = table.schema.get_field_index(name)
        table = table.remove_column(i) if col is None else table.set_column(i, name, col)
    return arrow_message(table.replace_schema_metadata(table.schema.metadata))


def _dict(values: list[Any]) -> pa.Array:
    return pa.array(values).dictionary_encode()


BAD_V3: dict[str, tuple[bytes, str]] = {
    "junk": (b"\xff\xff\xff\xff" + b"junk" * 10, "not a valid Arrow stream"),
    "no metadata": (
        arrow_message(pa.ipc.open_stream(_v3()).read_all().replace_schema_metadata(None)),
        "perfloop.kind = windows",
    ),
    "missing column": (_v3(mean=None), "missing ['mean']"),
    "float rank": (_v3(rank=pa.array([0.5, 1.0, 2.0])), "'rank' must be int64"),
    "null count": (_v3(count=pa.array([None, 1, 2], pa.int64())), "'count' holds nulls"),
    "negative count": (_v3(count=pa.array([1, -1, 1])), "'count' row 1 = -1"),
    "end before start": (_v3(window_end_ns=pa.array([T, T, T])), "'window_end_ns' row 0"),
    "plain strings": (_v3(node=pa.array(["n0"] * 3)), "'node' must be dictionary"),
    "empty metric": (_v3(metric=_dict(["m", "", "m"])), "'metric' value ''"),
    "control chars": (_v3(node=_dict(["a\nb"] * 3)), "'node' value 'a\\nb'"),
    "bad job id": (_v3(job_id=_dict(["a b"] * 3)), "job_id 'a b' must be"),
    "oversized": (b"\xff\xff\xff\xff" + b"\0" * (9 << 20), "byte limit"),
}


@pytest.mark.parametrize("case", sorted(BAD_V3))
def test_bad_v3_windows_messages_are_rejected_with_their_reason(case: str) -> None:
    data, reason = BAD_V3[case]
    with pytest.raises(SchemaError) as e:
        rows_from_message(Topics.WINDOWS, data)
    assert reason in str(e.value), str(e.value)
    assert str(e.value).startswith("windows message: ") and "\n" not in str(e.value)


def test_null_statistics_in_v3_are_stored_as_nan() -> None:
    _, part, _ = rows_from_message(
        Topics.WINDOWS, _v3(p99=pa.array([None, 2.0, 3.0], pa.float64()))
    )
    p99 = lists(part)["p99"]
    assert math.isnan(p99[0]) and p99[1:] == [2.0, 3.0]
