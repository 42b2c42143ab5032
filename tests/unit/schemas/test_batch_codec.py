"""Telemetry batches: what a producer encodes is what a stream decodes, and bad input is named."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest

from perfloop.schemas import (
    BatchBuilder,
    GpuSample,
    SchemaError,
    StepEvent,
    decode_batch,
    encode_batch,
)
from perfloop.schemas.codec import MAX_MESSAGE_BYTES


def _step_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "kind": "step",
        "schema_version": 1,
        "job_id": "job-1",
        "node": "n0",
        "batch_id": "b1",
        "producer_id": "p",
        "seq": 3,
        "columns": {
            "ts_ns": [10, 20],
            "rank": [0, 1],
            "step": [7, 7],
            "step_time_ms": [100.0, 120.5],
        },
    }
    doc.update(overrides)
    return doc


def _with_columns(**cols: Any) -> bytes:
    doc = _step_doc()
    doc["columns"] = {**doc["columns"], **cols}
    return json.dumps(doc).encode()  # stdlib json: also writes ints past 64 bits


def _error(data: bytes) -> str:
    with pytest.raises(SchemaError) as info:
        decode_batch(data)
    msg = str(info.value)
    assert msg and "\n" not in msg, f"message must be one line: {msg!r}"
    return msg


# -- round trip --------------------------------------------------------------------------------


def test_builder_round_trip_keeps_header_values_and_fills_defaults() -> None:
    b = BatchBuilder("step", job_id="job-1", node="n0", producer_id="sim-n0")
    b.add(ts_ns=1_000, rank=0, step=5, step_time_ms=110.0, data_wait_ms=30.0)
    b.add(ts_ns=2_000, rank=1, step=5, step_time_ms=111.5)  # data_wait_ms etc. left out
    batch = decode_batch(b.encode())

    assert (batch.kind, batch.job_id, batch.node, batch.producer_id) == (
        "step",
        "job-1",
        "n0",
        "sim-n0",
    )
    assert batch.schema_version == StepEvent.SCHEMA_VERSION
    assert len(batch) == 2
    assert batch.columns["ts_ns"].tolist() == [1_000, 2_000]
    assert batch.columns["rank"].tolist() == [0, 1]
    assert batch.columns["step"].tolist() == [5, 5]
    assert batch.columns["step_time_ms"].tolist() == [110.0, 111.5]
    assert batch.columns["data_wait_ms"].tolist() == [30.0, 0.0]
    assert batch.columns["batch_size"].tolist() == [0, 0]
    assert batch.columns["num_workers"].tolist() == [0, 0]
    assert batch.columns["ts_ns"].dtype == np.int64
    assert batch.columns["step_time_ms"].dtype == np.float64


def test_builder_empties_after_encode_and_numbers_batches_in_sequence() -> None:
    b = BatchBuilder("gpu", job_id="j", node="n", producer_id="p")
    b.add(ts_ns=1, rank=0, device=0)
    first = decode_batch(b.encode())
    assert len(b) == 0
    b.add(ts_ns=2, rank=0, device=1)
    second = decode_batch(b.encode())
    assert (first.seq, second.seq) == (1, 2)
    assert first.batch_id != second.batch_id
    assert second.columns["device"].tolist() == [1]


def test_event_ids_derive_from_batch_id_and_are_unique() -> None:
    data = encode_batch(
        "step",
        {"ts_ns": [1, 2, 3], "rank": [0, 0, 0], "step": [1, 2, 3], "step_time_ms": [1.0] * 3},
        job_id="j",
        node="n",
        batch_id="abc",
    )
    batch = decode_batch(data)
    assert batch.event_ids() == ["abc-0", "abc-1", "abc-2"]
    assert [e.event_id for e in batch.events()] == batch.event_ids()


def test_events_materialise_as_validated_models_with_defaults() -> None:
    b = BatchBuilder("gpu", job_id="j", node="n", producer_id="p")
    b.add(ts_ns=5, rank=2, device=3, sm_util_pct=97.5, power_w=300.0)
    (event,) = decode_batch(b.encode()).events()
    assert isinstance(event, GpuSample)
    assert (event.job_id, event.node, event.rank, event.device) == ("j", "n", 2, 3)
    assert event.sm_util_pct == 97.5
    assert event.power_w == 300.0
    assert event.mem_util_pct == 0.0
    assert event.temp_c == 0.0


def test_encode_batch_accepts_numpy_columns() -> None:
    n = 4
    cols = {
        "ts_ns": np.arange(n, dtype=np.int64) * 10,
        "rank": np.zeros(n, dtype=np.int64),
        "step": np.arange(n),
        "step_time_ms": np.linspace(100.0, 130.0, n),
    }
    batch = decode_batch(encode_batch("step", cols, job_id="j", node="n"))
    for name, values in cols.items():
        np.testing.assert_array_equal(batch.columns[name], values)


def test_empty_batch_decodes_to_zero_samples() -> None:
    b = BatchBuilder("step", job_id="j", node="n", producer_id="p")
    batch = decode_batch(b.encode())
    assert len(batch) == 0
    assert batch.event_ids() == []


def test_builder_rejects_unknown_kind_and_missing_required_field() -> None:
    with pytest.raises(SchemaError, match="unknown batch kind 'bogus'"):
        BatchBuilder("bogus", job_id="j", node="n", producer_id="p")
    b = BatchBuilder("step", job_id="j", node="n", producer_id="p")
    with pytest.raises(SchemaError, match="missing required field 'step_time_ms'"):
        b.add(ts_ns=1, rank=0, step=0)


def test_rejected_sample_does_not_spoil_the_batch() -> None:
    b = BatchBuilder("step", job_id="j", node="n", producer_id="p")
    b.add(ts_ns=1, rank=0, step=0, step_time_ms=100.0)
    with pytest.raises(SchemaError):
        b.add(ts_ns=2, rank=0, step=1)  # step_time_ms missing
    assert len(decode_batch(b.encode())) == 1


def test_encode_batch_rejects_unknown_kind() -> None:
    with pytest.raises(SchemaError, match="unknown batch kind"):
        encode_batch("nope", {"ts_ns": [1]}, job_id="j", node="n")


# -- bad input: envelope -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'"step"', "must be a JSON object, got str"),
        (b"{}", "no 'kind'"),
    ],
)
def test_unreadable_message_is_named(data: bytes, expected: str) -> None:
    assert expected in _error(data)


def test_unknown_kind_is_named_with_the_valid_ones() -> None:
    msg = _error(orjson.dumps(_step_doc(kind="hosts")))
    assert "'hosts'" in msg and "gpu" in msg and "step" in msg and "span" in msg


@pytest.mark.parametrize("version", [0, 3, "1", None, True])
def test_wrong_schema_version_is_rejected(version: Any) -> None:
    msg = _error(orjson.dumps(_step_doc(schema_version=version)))
    assert "schema_version" in msg and repr(version) in msg


def test_missing_schema_version_is_rejected() -> None:
    doc = _step_doc()
    del doc["schema_version"]
    assert "schema_version" in _error(orjson.dumps(doc))


def test_unknown_header_key_is_named() -> None:
    msg = _error(orjson.dumps(_step_doc(colour="blue")))
    assert "unknown header keys" in msg and "colour" in msg


@pytest.mark.parametrize("key", ["job_id", "node", "batch_id"])
@pytest.mark.parametrize("value", ["", None, 5, "MISSING"])
def test_missing_or_empty_identity_is_rejected(key: str, value: Any) -> None:
    doc = _step_doc()
    if value == "MISSING":
        del doc[key]
    else:
        doc[key] = value
    msg = _error(orjson.dumps(doc))
    assert repr(key) in msg and "non-empty string" in msg


@pytest.mark.parametrize("job_id", ["has space", "x" * 200, "semi;colon"])
def test_job_id_that_the_schema_rejects_is_rejected_at_decode(job_id: str) -> None:
    _error(orjson.dumps(_step_doc(job_id=job_id)))


# -- bad input: columns --------------------------------------------------------------------------


@pytest.mark.parametrize("columns", [None, [], {"rank": [0]}, {"ts_ns": 5}])
def test_columns_without_ts_ns_list_are_rejected(columns: Any) -> None:
    assert "'columns' must be an object with a 'ts_ns' list" in _error(
        orjson.dumps(_step_doc(columns=columns))
    )


@pytest.mark.parametrize("missing", ["rank", "step", "step_time_ms"])
def test_missing_required_column_is_named(missing: str) -> None:
    doc = _step_doc()
    del doc["columns"][missing]
    msg = _error(orjson.dumps(doc))
    assert "required column" in msg and repr(missing) in msg


def test_unknown_column_is_named() -> None:
    msg = _error(_with_columns(sm_util_pct=[1.0, 2.0]))
    assert "unknown columns" in msg and "sm_util_pct" in msg


@pytest.mark.parametrize("column", ["rank", "step_time_ms", "data_wait_ms"])
def test_ragged_column_is_named_with_both_lengths(column: str) -> None:
    msg = _error(_with_columns(**{column: [1, 2, 3]}))
    assert repr(column) in msg and "3 values" in msg and "expected 2" in msg


@pytest.mark.parametrize(
    ("column", "values", "expected"),
    [
        ("step_time_ms", ["fast", "slow"], "not numeric"),
        ("step", [None, 1], "not numeric"),
        ("step", [[1], [2]], "must be flat"),
        ("step", {"a": 1}, "must be a list"),
        ("step", "12", "must be a list"),
        ("ts_ns", [1.5, 2.5], "must hold integers"),
        ("ts_ns", [1, 2**64], "must hold integers"),  # orjson reads 2**64 as a float
    ],
)
def test_non_numeric_values_are_rejected(column: str, values: Any, expected: str) -> None:
    msg = _error(_with_columns(**{column: values}))
    assert repr(column) in msg and expected in msg


@pytest.mark.parametrize("values", [[0, 1.5], [0, True]])
def test_integer_column_rejects_non_integers_after_the_first_value(values: list[Any]) -> None:
    _error(_with_columns(step=values))


@pytest.mark.parametrize(
    ("column", "values"), [("step_time_ms", ["100", "5"]), ("step", ["1", "2"])]
)
def test_numeric_strings_are_rejected(column: str, values: list[str]) -> None:
    _error(_with_columns(**{column: values}))


def test_null_in_float_column_is_rejected_as_not_finite() -> None:
    # JSON has no NaN or Infinity literals; null is how one would sneak in.
    msg = _error(_with_columns(data_wait_ms=[1.0, None]))
    assert "'data_wait_ms'" in msg and "sample 1" in msg and "not finite" in msg


def test_nan_and_inf_literals_are_rejected() -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        data = _with_columns(step_time_ms=[100.0, 0.125]).replace(b"0.125", literal)
        assert literal in data
        _error(data)


@pytest.mark.parametrize(
    ("kind", "column", "value", "expected"),
    [
        ("step", "step_time_ms", -1.0, "below"),
        ("step", "step_time_ms", 0.0, "below >0"),
        ("step", "data_wait_ms", -0.5, "below >=0"),
        ("step", "rank", -1, "below"),
        ("step", "ts_ns", -5, "below"),
        ("step", "num_workers", 1025, "above 1024"),
        ("gpu", "sm_util_pct", 101.0, "above 100"),
        ("gpu", "sm_util_pct", -0.1, "below"),
        ("gpu", "temp_c", -51.0, "below >=-50"),
        ("gpu", "temp_c", 201.0, "above 200"),
        ("gpu", "device", 1024, "above 1023"),
        ("gpu", "power_w", -3.0, "below"),
    ],
)
def test_out_of_bounds_value_is_named_with_its_sample(
    kind: str, column: str, value: float, expected: str
) -> None:
    base = {"ts_ns": [1, 2], "rank": [0, 0]}
    base.update(
        {"step": [1, 2], "step_time_ms": [10.0, 10.0]} if kind == "step" else {"device": [0, 0]}
    )
    base[column] = [base.get(column, [0, 0])[0], value]
    msg = _error(encode_batch(kind, base, job_id="j", node="n"))
    assert repr(column) in msg and "sample 1" in msg and expected in msg


def test_bounds_are_inclusive_where_the_schema_says_so() -> None:
    cols = {"ts_ns": [0, 1], "rank": [0, 0], "device": [0, 1023]}
    cols |= {"sm_util_pct": [0.0, 100.0], "temp_c": [-50.0, 200.0]}
    batch = decode_batch(encode_batch("gpu", cols, job_id="j", node="n"))
    assert batch.columns["sm_util_pct"].tolist() == [0.0, 100.0]


def test_oversize_message_is_rejected_before_parsing() -> None:
    data = b" " * (MAX_MESSAGE_BYTES + 1)
    msg = _error(data)
    assert "exceeds" in msg and str(MAX_MESSAGE_BYTES) in msg


def test_max_bytes_is_configurable() -> None:
    data = _with_columns()
    with pytest.raises(SchemaError, match="exceeds the 10-byte limit"):
        decode_batch(data, max_bytes=10)
    assert len(decode_batch(data, max_bytes=len(data))) == 2


def test_after_warm_up_decoding_imports_nothing_more() -> None:
    """A service warms the decoder as it starts: the first job's first batch then imports no
    module (pyarrow's first conversion imports pandas where it is installed, ~0.25 s)."""
    import subprocess
    import sys

    code = """
import sys
import numpy as np
from perfloop.schemas import decode_batch, encode_batch
from perfloop.schemas.arrow_batch import warm_up
cols = {"ts_ns": np.arange(3) * 10, "rank": np.zeros(3, dtype=np.int64), "step": np.arange(3),
        "step_time_ms": np.linspace(100.0, 130.0, 3)}
warm_up()
before = set(sys.modules)
decode_batch(encode_batch("step", cols, job_id="j", node="n"))
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_encoding_never_imports_pandas() -> None:
    """A training process only encodes, on a niced thread: pyarrow's pandas import (~0.3 s
    of CPU) took that thread ~10 s beside a job keeping every CPU busy, and held back the
    job's first telemetry as long. Every kind, numpy and list columns, nullable floats left
    out (None), strings repeated enough to be dictionary-encoded: no pandas, and every batch
    decodes (in a process where decoding may import it) to what was encoded."""
    import subprocess
    import sys

    code = """
import sys
import numpy as np
from perfloop.schemas import encode_batch
from perfloop.schemas.codec import _SPECS
out = []
for kind, specs in _SPECS.items():
    for n in (1, 5, 40):
        cols = {}
        for i, c in enumerate(specs):
            if c.dtype is str:
                cols[c.name] = [("fwd", "bwd", "ünï", "opt")[j % 4] for j in range(n)]
            elif c.dtype is np.int64:
                ints = [j + 1 for j in range(n)]
                cols[c.name] = np.array(ints, dtype=np.int64) if i % 2 else ints
            else:
                vals = [float(j) + 0.5 if j % 3 or not c.nullable else None for j in range(n)]
                cols[c.name] = vals if i % 2 else np.array([1.5] * n)
        cols["ts_ns"] = [10**18 + j for j in range(n)]
        out.append((kind, cols, encode_batch(kind, cols, job_id="j", node="n")))
print("pandas" in sys.modules)
import pickle
sys.stdout.flush()
sys.stdout.buffer.write(pickle.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    flag, _, payload = proc.stdout.partition(b"\n")
    assert flag == b"False", "encoding imported pandas"
    import pickle

    batches = pickle.loads(payload)
    assert len(batches) == 3 * 6
    for kind, cols, data in batches:
        assert data[:4] == b"\xff\xff\xff\xff", f"{kind}: not sent as Arrow"
        got = decode_batch(data).columns
        for name, sent in cols.items():
            want = [np.nan if v is None else v for v in np.asarray(sent, dtype=object).tolist()]
            have = got[name][0] if isinstance(got[name], tuple) else got[name]
            assert [str(x) for x in np.asarray(have, dtype=object).tolist()] == [
                str(x) for x in want
            ], (kind, name)
