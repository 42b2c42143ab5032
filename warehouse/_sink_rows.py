"""Rows for the warehouse from one message of each topic (the sink's decoding half, no I/O).

`rows_from_message` turns a telemetry batch, a job/control/analysis event or a windows message
into the columns of its table; `rows_from_dead_letter` turns a message of ``perfloop.dlq``
into a ``dead_letters`` row. Both raise `SchemaError` with a one-line reason for bad input,
and never anything else for any bytes.

The high-rate messages — telemetry batches and windows — become an Arrow record batch
(`pyarrow.RecordBatch`: numpy columns without copies, time as ``timestamp[ns, UTC]``, a
message's constant strings as one-entry dictionaries), inserted as ``FORMAT Arrow``, so no
per-sample Python object is made on their way to the warehouse. The rare ones — events and
dead letters — stay Python lists (`Rows`), whose maps and nullable fields the client types by
the table. Every table gets its parts from one of the two.

Windows messages (``perfloop.windows``) are Arrow IPC streams (v3,
`perfloop.schemas.windows`) or the older JSON columns (``{"kind": "windows", "v": 2,
"columns": {...}}``, `WINDOW_COLUMNS`); anything else on that topic is rejected with the
reason.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from perfloop.kafka import reason_class
from perfloop.schemas import SchemaError, decode_batch, decode_event
from perfloop.schemas.arrow_batch import header_of
from perfloop.schemas.arrow_batch import is_arrow as is_arrow_batch
from perfloop.schemas.base import JOB_ID_PATTERN
from perfloop.schemas.topics import KIND_TOPICS, Topics
from perfloop.schemas.windows import (
    MAX_WINDOWS_BYTES,
    WINDOW_COLUMNS,
    check_windows,
    decode_windows,
    is_arrow,
)
from perfloop.warehouse.tables import DEAD_LETTER_PAYLOAD_BYTES, KIND_TABLES, TABLES

__all__ = [
    "WINDOW_COLUMNS",
    "Part",
    "Rows",
    "message_id",
    "rows_from_dead_letter",
    "rows_from_message",
]

Rows = dict[str, list[Any]]
Part = Rows | pa.RecordBatch
"""What one message adds to its table: Arrow columns (batches, windows) or lists (events)."""


# windows column -> table column, where they differ
_WINDOW_RENAMES = {"ts_ns": "ts", "window_end_ns": "window_end", "closed_ns": "closed"}
_JOB_ID = re.compile(JOB_ID_PATTERN)
_NULLABLE = frozenset({"loss", "grad_norm", "lr"})
_BATCH_TOPICS = frozenset({Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN})
_INT64_MAX = np.iinfo(np.int64).max


def message_id(data: bytes) -> str:
    """An id for a message without one of its own: the hash of its bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _str(v: Any) -> str:
    return "" if v is None else str(v)


def part_rows(part: Part) -> int:
    """The number of rows of a part."""
    return part.num_rows if isinstance(part, pa.RecordBatch) else len(part["ts"])


_TS = pa.timestamp("ns", tz="UTC")


def _time(ns: np.ndarray) -> pa.Array:
    return pa.array(ns, type=_TS)


_IDS_IN_PYTHON = 512
"""Below this many samples, a batch's event ids are formatted in Python: two Arrow compute
calls cost more than the strings themselves."""


def _event_ids(batch_id: str, n: int) -> pa.Array:
    """The ids `Batch.event_ids` names: "<batch id>-<index>"."""
    if n < _IDS_IN_PYTHON:
        return pa.array([f"{batch_id}-{i}" for i in range(n)], pa.string())
    seq = pc.cast(pa.array(np.arange(n, dtype=np.int64)), pa.string())
    return pc.binary_join_element_wise(f"{batch_id}-", seq, "")


def _repeat(value: str, n: int) -> pa.DictionaryArray:
    """``value`` ``n`` times, as a one-entry dictionary (no string is copied per row)."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value]))


# -- telemetry batches ---------------------------------------------------------------------


def _telemetry(data: bytes, topic: str) -> tuple[str, pa.RecordBatch, str]:
    batch = decode_batch(data)
    table = KIND_TABLES[batch.kind]
    if table not in TABLES[topic]:
        raise SchemaError(f"a {table} batch does not belong on {topic}")
    n = len(batch)
    cols: dict[str, pa.Array] = {
        "ts": _time(batch.columns["ts_ns"]),
        "event_id": _event_ids(batch.batch_id, n),
        "job_id": _repeat(batch.job_id, n),
        "node": _repeat(batch.node, n),
    }
    for name, arr in batch.columns.items():
        if name == "ts_ns":
            continue
        if arr.dtype == object:
            cols[name] = pa.array(arr, type=pa.string())
        else:  # NaN in a nullable column stands for "not reported": store NULL
            cols[name] = pa.array(arr, from_pandas=name in _NULLABLE)
    return table, pa.RecordBatch.from_pydict(cols), batch.batch_id


# -- windows v2 ----------------------------------------------------------------------------


def _bad(what: str) -> SchemaError:
    return SchemaError(f"windows message: {what}")


def _window_column(name: str, kind: str, values: Any, n: int) -> np.ndarray:
    if not isinstance(values, list):
        raise _bad(f"column {name!r} must be a list, got {type(values).__name__}")
    if len(values) != n:
        raise _bad(f"column {name!r} has {len(values)} values, 'ts_ns' has {n}")
    try:
        arr = np.asarray(values)
    except (ValueError, OverflowError):
        raise _bad(f"column {name!r} is not a flat list of {kind} values") from None
    if n and arr.ndim != 1:
        raise _bad(f"column {name!r} is not a flat list of {kind} values")
    if kind == "str":
        if n and (arr.dtype.kind != "U" or not all(type(v) is str for v in values)):
            raise _bad(f"column {name!r} must hold strings")
        return arr.astype(object) if n else np.empty(0, dtype=object)
    if kind == "int":
        if n and arr.dtype.kind not in "iu":
            raise _bad(f"column {name!r} must hold integers (got {arr.dtype.name} values)")
        if n and arr.dtype.kind == "u" and int(arr.max()) > _INT64_MAX:
            raise _bad(f"column {name!r} holds a value above {_INT64_MAX}")
        return arr.astype(np.int64)
    # float: numbers, with null standing for "undefined" (orjson writes NaN as null)
    if arr.dtype.kind == "O":
        if any(v is not None and type(v) not in (int, float) for v in values):
            raise _bad(f"column {name!r} must hold numbers or null")
        return np.asarray(values, dtype=np.float64)
    if n and arr.dtype.kind not in "iuf":
        raise _bad(f"column {name!r} must hold numbers (got {arr.dtype.name} values)")
    return arr.astype(np.float64)


def _windows(data: bytes) -> tuple[str, pa.RecordBatch, str]:
    if is_arrow(data):
        return _windows_v3(data)
    if len(data) > MAX_WINDOWS_BYTES:
        raise _bad(f"{len(data)} bytes exceed the {MAX_WINDOWS_BYTES}-byte limit")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise _bad(f"not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "windows":
        raise _bad('must be a JSON object with "kind": "windows"')
    if doc.get("v") != 2:
        if "rows" in doc:
            raise _bad("the v1 row format is no longer accepted; send v 2 columns")
        raise _bad(f"has v {doc.get('v')!r}; supported: 2")
    extra = set(doc) - {"kind", "v", "columns"}
    if extra:
        raise _bad(f"unknown keys {sorted(extra)}")
    cols = doc.get("columns")
    if not isinstance(cols, dict):
        raise _bad("'columns' must be an object of equal-length lists")
    missing = [k for k in WINDOW_COLUMNS if k not in cols]
    if missing:
        raise _bad(f"missing columns {missing}")
    unknown = set(cols) - set(WINDOW_COLUMNS)
    if unknown:
        raise _bad(f"unknown columns {sorted(unknown)}; valid: {list(WINDOW_COLUMNS)}")
    ts = cols["ts_ns"]
    n = len(ts) if isinstance(ts, list) else -1
    arrays = {k: _window_column(k, kind, cols[k], n) for k, kind in WINDOW_COLUMNS.items()}
    strings = {
        k: list(set(arrays[k].tolist())) for k, kind in WINDOW_COLUMNS.items() if kind == "str"
    }
    check_windows(arrays, strings)
    msg = message_id(data)
    out: dict[str, pa.Array] = {"event_id": _repeat(msg, n)}
    for k, arr in arrays.items():
        if k.endswith("_ns"):
            out[_WINDOW_RENAMES[k]] = _time(arr)
        elif arr.dtype == object:
            out[k] = pa.array(arr, type=pa.string())
        else:
            out[k] = pa.array(arr)
    return "windows", pa.RecordBatch.from_pydict(out), msg


def _windows_v3(data: bytes) -> tuple[str, pa.RecordBatch, str]:
    batch = decode_windows(data)
    msg = message_id(data)
    out: dict[str, pa.Array] = {"event_id": _repeat(msg, batch.num_rows)}
    for name, col in zip(batch.schema.names, batch.columns, strict=True):
        if name.endswith("_ns"):
            out[_WINDOW_RENAMES[name]] = col.cast(pa.timestamp("ns", tz="UTC"))
        else:
            out[name] = col
    return "windows", pa.RecordBatch.from_pydict(out), msg


# -- events --------------------------------------------------------------------------------


def _recommendation(row: dict[str, Any]) -> None:
    row["rec_id"] = row["event_id"]
    row["from_value"], row["to_value"] = _str(row["from_value"]), _str(row["to_value"])


def _command(row: dict[str, Any]) -> None:
    row["command_id"] = row["event_id"]
    row["from_value"], row["value"] = _str(row["from_value"]), _str(row["value"])
    row["expires_ts"] = row.pop("expires_ts_ns")


def _actuation(row: dict[str, Any]) -> None:
    row["value"] = _str(row["value"])


def _approval(row: dict[str, Any]) -> None:
    row["from_value"], row["to_value"] = _str(row["from_value"]), _str(row["to_value"])
    row["rec_ts"] = row.pop("rec_ts_ns")


def _decision(row: dict[str, Any]) -> None:
    row["from_value"], row["to_value"] = _str(row["from_value"]), _str(row["to_value"])


def _ground_truth(row: dict[str, Any]) -> None:
    row["onset"] = row.pop("onset_ns")
    end = row.pop("end_ns")
    row["end"] = end or None


def _progress(row: dict[str, Any]) -> None:
    row["since"] = row.pop("since_ns")
    row["step_start"] = row.pop("step_start_ns")


def _phase(row: dict[str, Any]) -> None:
    row["since"] = row.pop("since_ns")
    row["next_ts"] = row.pop("next_ts_ns") or None


def _diagnosis(row: dict[str, Any]) -> None:
    row["onset"] = row.pop("onset_ns")


def _prediction(row: dict[str, Any]) -> None:
    row["for_ts"] = row.pop("for_ts_ns") or None


def _config(row: dict[str, Any]) -> None:
    # A string value is stored as it is; a number, a bool or a list as JSON.
    value = row["value"]
    row["value"] = value if isinstance(value, str) else orjson.dumps(value).decode()


_EVENT_SHAPES: dict[str, Callable[[dict[str, Any]], None]] = {
    "recommendation": _recommendation,
    "command": _command,
    "actuation": _actuation,
    "approval": _approval,
    "decision": _decision,
    "ground_truth": _ground_truth,
    "progress": _progress,
    "phase": _phase,
    "diagnosis": _diagnosis,
    "prediction": _prediction,
    "config": _config,
}


def _event(data: bytes, topic: str) -> tuple[str, Rows, str]:
    ev = decode_event(data)
    if KIND_TOPICS[ev.KIND] != topic:
        raise SchemaError(f"{ev.KIND} event does not belong on {topic}")
    row = ev.model_dump()
    row["ts"] = row.pop("ts_ns")
    row.pop("schema_version")
    shape = _EVENT_SHAPES.get(ev.KIND)
    if shape is not None:
        shape(row)
    return KIND_TABLES[ev.KIND], {k: [v] for k, v in row.items()}, ev.event_id


def rows_from_message(topic: str, data: bytes) -> tuple[str, Part, str]:
    """The table, its columns and the message's dedup id for one message of ``topic``.

    Raise `SchemaError` if the message is bad or does not belong on ``topic``. The dedup id
    is the batch id (telemetry), the event id (events) or the hash of the bytes (windows): a
    message sent twice carries the same one.

    >>> rows_from_message("perfloop.windows", b'{"kind": "windows", "rows": []}')
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    perfloop.schemas.exceptions.SchemaError: windows message: the v1 row format is no ...
    """
    if topic == Topics.WINDOWS:
        return _windows(data)
    if topic in _BATCH_TOPICS:
        return _telemetry(data, topic)
    if topic == Topics.DLQ:
        raise SchemaError(f"{topic} messages are dead letters, see rows_from_dead_letter")
    if topic not in TABLES:
        raise SchemaError(f"topic {topic!r} has no table; valid: {sorted(TABLES)}")
    return _event(data, topic)


# -- dead letters --------------------------------------------------------------------------


def _origin(data: bytes, key: str) -> tuple[str, str, int]:
    """``(job_id, node, rank)`` of a rejected message where it can be read, else ('', '', -1)."""
    job, node, rank = "", "", -1
    doc: Any = None
    if is_arrow_batch(data):  # a telemetry batch: its header names the job and node
        doc = header_of(data)
    elif len(data) <= 1 << 20:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            doc = None
    if isinstance(doc, dict):
        j, n, r = doc.get("job_id"), doc.get("node"), doc.get("rank")
        job = j if isinstance(j, str) and _JOB_ID.fullmatch(j) else ""
        node = n if isinstance(n, str) and 0 < len(n) <= 255 else ""
        rank = r if type(r) is int and -1 <= r <= 1 << 20 else -1
    if not job and _JOB_ID.fullmatch(key):
        job = key  # messages are keyed by job id
    return job, node, rank


def rows_from_dead_letter(
    value: bytes | None,
    key: bytes | None,
    headers: Sequence[tuple[str, bytes | None]] | None,
    *,
    timestamp_ms: int | None,
    partition: int,
    offset: int,
) -> tuple[str, Rows, str]:
    """The ``dead_letters`` row of one ``perfloop.dlq`` message (``partition``/``offset``
    are its own place on the DLQ; the source's come from the headers `dlq_headers` writes).

    The payload is kept up to `DEAD_LETTER_PAYLOAD_BYTES`; ``payload_bytes`` is its size.
    Headers that are missing or unreadable leave their columns empty (-1 for numbers).

    >>> t, rows, _ = rows_from_dead_letter(
    ...     b'{"job_id": "j1", "rank": 3}', b"j1",
    ...     [("perfloop.reason", b"bad rank 7"), ("perfloop.source.topic", b"t"),
    ...      ("perfloop.source.partition", b"2"), ("perfloop.source.offset", b"41")],
    ...     timestamp_ms=1000, partition=0, offset=5)
    >>> t, rows["job_id"], rows["rank"], rows["offset"], rows["reason_class"]
    ('dead_letters', ['j1'], [3], [41], ['bad rank N'])
    """
    data = value or b""
    h = {k: (v or b"").decode("utf-8", "replace") for k, v in headers or []}
    reason = h.get("perfloop.reason", "")
    key_text = (key or b"").decode("utf-8", "replace")

    def number(name: str) -> int:
        text = h.get(name, "")
        return int(text) if re.fullmatch(r"-?\d{1,18}", text) else -1

    job, node, rank = _origin(data, key_text)
    ts_ns = timestamp_ms * 1_000_000 if timestamp_ms and timestamp_ms > 0 else time.time_ns()
    # Its own id: the same dead letter read twice has the same one; another has another
    # even where an emptied broker reuses the DLQ's offsets (its time and bytes differ).
    ident = hashlib.blake2b(digest_size=16)
    ident.update(f"{partition}:{offset}:{timestamp_ms}:".encode())
    ident.update(orjson.dumps(sorted(h.items())))
    ident.update(data)
    dedup = ident.hexdigest()
    row = {
        "ts": ts_ns,
        "event_id": dedup,
        "job_id": job,
        "node": node,
        "rank": rank,
        "topic": h.get("perfloop.source.topic", ""),
        "partition": number("perfloop.source.partition"),
        "offset": number("perfloop.source.offset"),
        "reason": reason,
        "reason_class": reason_class(reason) if reason else "",
        "key": key_text[:1024],
        "payload": data[:DEAD_LETTER_PAYLOAD_BYTES],
        "payload_bytes": len(data),
        "headers": h,
    }
    return "dead_letters", {k: [v] for k, v in row.items()}, dedup
