"""The binary form of a telemetry batch: one Arrow IPC stream (`perfloop.schemas.codec`).

A batch's header (kind, schema version, job, node, batch id, producer id, sequence number)
travels as JSON in the schema metadata under ``perfloop.batch``; its columns are the sample
model's fields, as in the JSON form: int64 for integers, float64 for floats (null where a
nullable field was not reported), and UTF-8 strings, dictionary-encoded where they repeat.
Numbers travel as their bytes, so neither the producer nor any consumer makes a Python object
per sample: encoding and decoding cost a small fraction of JSON's (see bench/codec.py).

This module only converts between bytes and header + numpy columns; `decode_batch` checks
them exactly as it checks a JSON batch (column set, lengths, types, bounds, strings).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from perfloop.schemas.exceptions import SchemaError

__all__ = [
    "MAGIC",
    "arrow_rows",
    "decode_arrow",
    "encode_arrow",
    "header_of",
    "is_arrow",
    "warm_up",
]

MAGIC = b"\xff\xff\xff\xff"
"""How an Arrow IPC stream starts (a JSON batch starts with ``{``)."""
_HEADER_KEY = b"perfloop.batch"


def is_arrow(data: bytes) -> bool:
    return data[:4] == MAGIC


def arrow_rows(data: bytes) -> int:
    """The rows of an Arrow batch without checking it (1 if it cannot be read)."""
    try:
        return sum(b.num_rows for b in pa.ipc.open_stream(data))
    except (pa.ArrowException, OSError, ValueError):
        return 1


def header_of(data: bytes) -> dict[str, Any] | None:
    """The header of an Arrow batch, read without its columns (None if it has none)."""
    try:
        return _header(pa.ipc.open_stream(data).schema)
    except (pa.ArrowException, OSError, ValueError):
        return None


def _header(schema: pa.Schema) -> dict[str, Any] | None:
    raw = (schema.metadata or {}).get(_HEADER_KEY)
    try:
        header = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        return None
    return header if isinstance(header, dict) else None


def _numbers(arr: np.ndarray) -> pa.Array:
    """A contiguous int64 or float64 array as an Arrow array over the same bytes."""
    arr = np.ascontiguousarray(arr)
    t = pa.int64() if arr.dtype == np.int64 else pa.float64()
    return pa.Array.from_buffers(t, len(arr), [None, pa.py_buffer(arr)])


def _utf8(values: Sequence[str]) -> pa.Array:
    """Python strings as an Arrow string array (offsets and UTF-8 bytes)."""
    n = len(values)
    joined = "".join(values)
    if joined.isascii():  # a byte a character: the lengths are the strings'
        data, lengths = joined.encode("ascii"), map(len, values)
    else:
        parts = [v.encode() for v in values]
        data, lengths = b"".join(parts), map(len, parts)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(lengths, dtype=np.int32, count=n), out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


_INT = frozenset({int})
_FLOAT = frozenset({float, int, type(None)})


def _clean(values: Sequence[Any] | np.ndarray, dtype: Any) -> pa.Array | None:
    """The column built from its buffers, or None when its values need pyarrow's conversion
    (None in an integer column, a string among numbers, a numpy scalar, …).

    Built this way pyarrow never asks whether a value is a pandas object, and so never imports
    pandas: in a training process, where perfloop's niced thread encodes the batches, that
    import (~0.3 s of CPU, ~50 MB) took ~10 s of wall time beside a job keeping every CPU busy,
    and the job's first 10 s of telemetry waited for it."""
    if isinstance(values, np.ndarray):
        if dtype is str or values.dtype.kind not in "iuf":
            return None
        return _numbers(values.astype(dtype, copy=False))
    types = set(map(type, values))
    if dtype is str:
        if types - {str}:
            return None
        arr = _utf8(values)
        return arr.dictionary_encode() if len(arr) > 16 else arr
    if dtype is np.int64:
        return None if types - _INT else _numbers(np.array(values, dtype=np.int64))
    # None (a nullable field not reported) becomes NaN: what a null float decodes to
    return None if types - _FLOAT else _numbers(np.array(values, dtype=np.float64))


def _array(values: Sequence[Any] | np.ndarray, dtype: Any) -> pa.Array:
    with contextlib.suppress(OverflowError, ValueError, TypeError):
        built = _clean(values, dtype)
        if built is not None:
            return built
    if dtype is str:
        arr = pa.array(values, type=pa.string())
        return arr.dictionary_encode() if len(arr) > 16 else arr
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
        return pa.array(values.astype(dtype, copy=False))
    # lists (and object arrays): pyarrow converts them; None stays null
    return pa.array(values, type=pa.int64() if dtype is np.int64 else pa.float64())


def encode_arrow(
    header: Mapping[str, Any],
    columns: Mapping[str, Sequence[Any] | np.ndarray],
    dtypes: Mapping[str, Any],
) -> bytes:
    """One batch as an Arrow IPC stream; ``dtypes`` maps each column to np.int64, np.float64
    or str (an unknown column is written as pyarrow infers it, for the decoder to refuse)."""
    names = list(columns)
    try:
        arrays = [
            _array(columns[n], dtypes[n]) if n in dtypes else pa.array(columns[n]) for n in names
        ]
        meta = {_HEADER_KEY: orjson.dumps(dict(header))}
        table = pa.Table.from_arrays(arrays, names=names, metadata=meta)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{header.get('kind')} batch cannot be encoded: {e}") from None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _strings(col: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, set[Any]]:
    """A string column as an object array, and its distinct values."""
    parts, distinct = [], set()
    for chunk in col.chunks if isinstance(col, pa.ChunkedArray) else (col,):
        if pa.types.is_dictionary(chunk.type):
            values = chunk.dictionary.to_pylist()
            distinct.update(values)
            parts.append(np.array(values, dtype=object)[chunk.indices.to_numpy()])
        else:
            plain = np.array(chunk.to_pylist(), dtype=object)
            distinct.update(plain.tolist())
            parts.append(plain)
    if not parts:
        return np.empty(0, dtype=object), distinct
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), distinct


_TYPE_CLASS: dict[pa.DataType, str] = {}


def _type_class(t: pa.DataType) -> str:
    """What a column of Arrow type ``t`` is to a batch: "str", "float", "int", "uint64", or
    the reason it is refused ("dict:<value type>" or "other:<type>"). Remembered per type."""
    got = _TYPE_CLASS.get(t)
    if got is None:
        value = t.value_type if pa.types.is_dictionary(t) else t
        if pa.types.is_string(value) or pa.types.is_large_string(value):
            got = "str"
        elif pa.types.is_dictionary(t):
            got = f"dict:{value}"
        elif pa.types.is_floating(t):
            got = "float"
        elif pa.types.is_uint64(t):
            got = "uint64"
        elif pa.types.is_integer(t):
            got = "int"
        else:
            got = f"other:{t}"
        _TYPE_CLASS[t] = got
    return got


def warm_up() -> None:
    """Convert once, so that what pyarrow imports on its first conversion (pandas, where it is
    installed: ~0.25 s of CPU) is imported now. A service calls it as it starts: otherwise
    the first batch of the first job pays it, and a service yielding the CPUs to that job
    (group nice 19) takes many seconds of wall time to get that CPU. Never raises."""
    with contextlib.suppress(Exception):
        pa.array([0.0]).to_numpy(zero_copy_only=False)


def decode_arrow(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and the columns of an Arrow batch: numeric columns as numpy arrays (float
    nulls as NaN, integer nulls refused), string columns as ``(object array, distinct
    values)`` for the string checks.

    Raise `SchemaError` if the bytes are not a readable Arrow stream with a header.
    """
    try:
        reader = pa.ipc.open_stream(data)
        batches = list(reader)
    except (pa.ArrowException, OSError, ValueError) as e:
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise SchemaError(f"batch is not a valid Arrow stream: {text}") from None
    header = _header(reader.schema)
    if header is None:
        raise SchemaError("Arrow batch has no perfloop.batch header in its schema metadata")
    # one record batch (what `encode_arrow` writes): its arrays; else the chunked columns
    data_ = batches[0] if len(batches) == 1 else pa.Table.from_batches(batches, reader.schema)
    cols: dict[str, Any] = {}
    kind = header.get("kind")
    for name, col in zip(data_.schema.names, data_.columns, strict=True):
        what = _type_class(col.type)
        if what == "str":
            if col.null_count:
                raise SchemaError(f"{kind} batch: column {name!r} holds nulls, not strings")
            cols[name] = _strings(col)
        elif what == "float":
            # a copy: the buffers are the message's, read-only; a batch's arrays are its own
            cols[name] = col.to_numpy(zero_copy_only=False).astype(np.float64)
        elif what in ("int", "uint64"):
            if col.null_count:
                raise SchemaError(f"{kind} batch: column {name!r} holds nulls, not integers")
            if what == "uint64" and len(col) and pc.max(col).as_py() >= 1 << 63:
                raise SchemaError(f"{kind} batch: column {name!r} holds a value above int64")
            cols[name] = col.to_numpy(zero_copy_only=False).astype(np.int64)
        else:
            t = what.split(":", 1)[1]
            raise SchemaError(f"{kind} batch: column {name!r} must be numbers or strings, got {t}")
    return header, cols
