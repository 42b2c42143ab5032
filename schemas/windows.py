"""The ``perfloop.windows`` message, v3: closed windows as one Arrow IPC stream.

The stream worker publishes the windows it closes, per job, in messages of at most
`ROWS_PER_MESSAGE` rows (`encode_windows`); the sink validates them and turns them into the
``windows`` table's columns (`decode_windows`). A v3 message is an Arrow IPC stream (readable
by any Arrow library) whose schema carries the metadata ``perfloop.kind = windows`` and
``perfloop.v = 3`` and whose columns are `WINDOW_COLUMNS`: times in ns (int64), sizes and
statistics as float64 (NaN where undefined), ranks, devices and counts as int64, and the
strings (job, node, metric) dictionary-encoded. Numbers travel as their bytes: the worker
encodes and the sink decodes a row in well under a microsecond, where JSON (the v2 format,
still read) cost ~3 µs a row, most of it formatting and parsing floats.

`decode_windows` raises `SchemaError` with a one-line reason for anything else, and never
anything else for any bytes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa

from perfloop.schemas import SchemaError
from perfloop.schemas.base import JOB_ID_PATTERN

__all__ = [
    "MAX_WINDOWS_BYTES",
    "ROWS_PER_MESSAGE",
    "WINDOW_COLUMNS",
    "check_windows",
    "decode_windows",
    "encode_windows",
    "is_arrow",
]

WINDOW_COLUMNS: dict[str, str] = {
    "ts_ns": "int",
    "window_end_ns": "int",
    "window_s": "float",
    "hop_s": "float",
    "job_id": "str",
    "node": "str",
    "rank": "int",
    "device": "int",
    "metric": "str",
    "count": "int",
    "mean": "float",
    "min": "float",
    "max": "float",
    "p50": "float",
    "p95": "float",
    "p99": "float",
    "rate_per_s": "float",
    "slope_per_s": "float",
    "closed_ns": "int",
}
"""The windows columns and their kinds; floats may be undefined (NaN, or null in v2)."""

ROWS_PER_MESSAGE = 2000
"""Rows per message at most (about 200 bytes a row: far below the default request size)."""
MAX_WINDOWS_BYTES = 8 << 20
_METADATA = {b"perfloop.kind": b"windows", b"perfloop.v": b"3"}
_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.dictionary(pa.int32(), pa.string())}
_SCHEMA = pa.schema([(n, _TYPES[k]) for n, k in WINDOW_COLUMNS.items()], metadata=_METADATA)
_ARROW_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message starts with it
_JOB_ID = re.compile(JOB_ID_PATTERN)
_CONTROL = re.compile(r"[\x00-\x1f]")


def _bad(what: str) -> SchemaError:
    return SchemaError(f"windows message: {what}")


def is_arrow(data: bytes) -> bool:
    """Whether ``data`` starts like an Arrow IPC stream (v3) rather than JSON (v2)."""
    return data[:4] == _ARROW_MAGIC


def _strings(values: np.ndarray) -> pa.DictionaryArray:
    return pa.array(values, type=pa.string()).dictionary_encode()


def encode_windows(cols: dict[str, np.ndarray], key: bytes) -> list[tuple[bytes, bytes]]:
    """Closed windows of one job as ``(key, value)`` messages of at most `ROWS_PER_MESSAGE`.

    >>> import numpy as np
    >>> cols = {n: np.zeros(3, dtype=object if k == "str" else float if k == "float" else
    ...         np.int64) for n, k in WINDOW_COLUMNS.items()}
    >>> for n in ("job_id", "node", "metric"):
    ...     cols[n][:] = "x"
    >>> cols["window_end_ns"][:] = 1; cols["window_s"][:] = cols["hop_s"][:] = 1.0
    >>> [(k, len(decode_windows(v))) for k, v in encode_windows(cols, b"x")]
    [(b'x', 3)]
    """
    n = len(cols["ts_ns"])
    out = []
    for i in range(0, n, ROWS_PER_MESSAGE):
        arrays = []
        for name, kind in WINDOW_COLUMNS.items():
            part = cols[name][i : i + ROWS_PER_MESSAGE]
            if kind == "str":
                arrays.append(_strings(part))
            else:
                arrays.append(pa.array(part, type=_TYPES[kind]))
        batch = pa.RecordBatch.from_arrays(arrays, schema=_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, _SCHEMA) as writer:
            writer.write_batch(batch)
        out.append((key, sink.getvalue().to_pybytes()))
    return out


def check_windows(c: dict[str, np.ndarray], strings: dict[str, list[Any]]) -> None:
    """Raise `SchemaError` for a value no window can have (``strings``: each string column's
    distinct values)."""
    checks = (
        ("ts_ns", c["ts_ns"] >= 0, "must be ≥ 0"),
        ("closed_ns", c["closed_ns"] >= 0, "must be ≥ 0"),
        ("window_end_ns", c["window_end_ns"] > c["ts_ns"], "must be after ts_ns"),
        ("window_s", np.isfinite(c["window_s"]) & (c["window_s"] > 0), "must be > 0"),
        ("hop_s", np.isfinite(c["hop_s"]) & (c["hop_s"] > 0), "must be > 0"),
        ("rank", c["rank"] >= -1, "must be ≥ -1"),
        ("device", (c["device"] >= -1) & (c["device"] < 1 << 31), "must be -1 or a device"),
        ("count", c["count"] >= 0, "must be ≥ 0"),
    )
    for name, ok, rule in checks:
        if not ok.all():
            i = int(np.argmin(ok))
            raise _bad(f"column {name!r} row {i} = {c[name][i].item()!r} {rule}")
    for name, limit in (("job_id", 128), ("node", 255), ("metric", 128)):
        for v in strings[name]:
            if not isinstance(v, str):
                raise _bad(f"column {name!r} must hold strings, got {v!r}")
            if not v or len(v) > limit or _CONTROL.search(v):
                raise _bad(f"column {name!r} value {v[:64]!r} must be 1-{limit} printable chars")
            if name == "job_id" and not _JOB_ID.fullmatch(v):
                raise _bad(f"job_id {v[:64]!r} must be 1-128 characters of [A-Za-z0-9._:/@+-]")


def decode_windows(data: bytes) -> pa.RecordBatch:
    """Validate a v3 windows message; return its rows as one record batch of `WINDOW_COLUMNS`
    (strings dictionary-encoded, undefined floats NaN).

    >>> decode_windows(b"\\xff\\xff\\xff\\xffjunk")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    perfloop.schemas.exceptions.SchemaError: windows message: not a valid Arrow stream: ...
    """
    if len(data) > MAX_WINDOWS_BYTES:
        raise _bad(f"{len(data)} bytes exceed the {MAX_WINDOWS_BYTES}-byte limit")
    try:
        table = pa.ipc.open_stream(data).read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise _bad(f"not a valid Arrow stream: {first}") from None
    meta = table.schema.metadata or {}
    if meta.get(b"perfloop.kind") != b"windows":
        raise _bad("the Arrow schema's metadata must say perfloop.kind = windows")
    if meta.get(b"perfloop.v") != b"3":
        raise _bad(f"has v {meta.get(b'perfloop.v')!r}; supported: 3 (Arrow), 2 (JSON)")
    names = table.schema.names
    if names != list(WINDOW_COLUMNS):
        missing = [n for n in WINDOW_COLUMNS if n not in names]
        extra = [n for n in names if n not in WINDOW_COLUMNS]
        raise _bad(f"columns must be {list(WINDOW_COLUMNS)}; missing {missing}, unknown {extra}")
    c: dict[str, np.ndarray] = {}
    strings: dict[str, list[Any]] = {}
    for name, kind in WINDOW_COLUMNS.items():
        col = table.column(name)
        if not col.type.equals(_TYPES[kind]):
            raise _bad(f"column {name!r} must be {_TYPES[kind]}, got {col.type}")
        if kind != "float" and col.null_count:
            raise _bad(f"column {name!r} holds nulls")
        if kind == "str":
            strings[name] = [v for chunk in col.chunks for v in chunk.dictionary.to_pylist()]
        else:  # floats: null reads as NaN (undefined)
            c[name] = col.to_numpy()
    check_windows(c, strings)
    for name, kind in WINDOW_COLUMNS.items():  # the table's floats are not nullable
        if kind == "float" and table.column(name).null_count:
            i = table.schema.get_field_index(name)
            table = table.set_column(i, name, pa.chunked_array([pa.array(c[name])]))
    if not table.num_rows:
        return pa.RecordBatch.from_pylist([], schema=_SCHEMA)
    return table.combine_chunks().to_batches()[0]
