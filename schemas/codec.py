"""Wire format: batched columnar telemetry and single control events, as JSON (orjson).

A telemetry message carries many samples of one node and one kind, column by column::

    {"kind": "step", "schema_version": 1, "job_id": "j1", "node": "n0",
     "batch_id": "9f…", "producer_id": "sim-n0", "seq": 17,
     "columns": {"ts_ns": [...], "rank": [...], "step": [...], "step_time_ms": [...], ...}}

Every column has one value per sample; a column whose field has a default may be left out.
Sample ``i`` has event id ``f"{batch_id}-{i}"``, so ids stay unique without being shipped.
Decoding checks the envelope, the column set, the lengths, the types and the bounds declared
on the sample model, all vectorised with numpy, and raises `SchemaError` naming the first
problem. Control events (recommendations, commands, results) are one JSON object each, with
their ``kind``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import annotated_types
import numpy as np
import orjson
from pydantic import ValidationError

from perfloop.schemas.base import JOB_ID_PATTERN, Event, new_event_id
from perfloop.schemas.control import ActuationResult, Command, Recommendation
from perfloop.schemas.exceptions import SchemaError
from perfloop.schemas.telemetry import GpuSample, StepEvent

__all__ = [
    "BATCH_KINDS",
    "EVENT_KINDS",
    "MAX_MESSAGE_BYTES",
    "Batch",
    "BatchBuilder",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
]

MAX_MESSAGE_BYTES = 4 << 20
BATCH_KINDS: dict[str, type[Event]] = {m.KIND: m for m in (GpuSample, StepEvent)}
EVENT_KINDS: dict[str, type[Event]] = {
    m.KIND: m for m in (Recommendation, Command, ActuationResult)
}
_ENVELOPE = ("schema_version", "event_id", "job_id", "node")
_JOB_ID = re.compile(JOB_ID_PATTERN)
_HEADER_KEYS = frozenset(
    {"kind", "schema_version", "job_id", "node", "batch_id", "producer_id", "seq", "columns"}
)


@dataclass(frozen=True, slots=True)
class _Column:
    name: str
    dtype: type[np.generic]
    default: Any
    lo: float | None
    lo_strict: bool
    hi: float | None


def _columns_of(model: type[Event]) -> tuple[_Column, ...]:
    cols = []
    for name, info in model.model_fields.items():
        if name in _ENVELOPE:
            continue
        dtype = np.int64 if info.annotation is int else np.float64
        lo = hi = None
        lo_strict = False
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Ge):
                lo = float(meta.ge)  # type: ignore[arg-type]
            elif isinstance(meta, annotated_types.Gt):
                lo, lo_strict = float(meta.gt), True  # type: ignore[arg-type]
            elif isinstance(meta, annotated_types.Le):
                hi = float(meta.le)  # type: ignore[arg-type]
        default = None if info.is_required() else info.default
        cols.append(_Column(name, dtype, default, lo, lo_strict, hi))
    return tuple(cols)


_SPECS: dict[str, tuple[_Column, ...]] = {k: _columns_of(m) for k, m in BATCH_KINDS.items()}


@dataclass(frozen=True, slots=True)
class Batch:
    """A decoded telemetry batch: header fields and one numpy array per column."""

    kind: str
    schema_version: int
    job_id: str
    node: str
    batch_id: str
    producer_id: str
    seq: int
    columns: dict[str, np.ndarray] = field(repr=False)

    def __len__(self) -> int:
        return len(self.columns["ts_ns"])

    def event_ids(self) -> list[str]:
        """The per-sample event ids, derived from the batch id."""
        return [f"{self.batch_id}-{i}" for i in range(len(self))]

    def events(self) -> Iterator[Event]:
        """Materialise each sample as its pydantic event (slow path, for tests and tools)."""
        model = BATCH_KINDS[self.kind]
        names = list(self.columns)
        for i, eid in enumerate(self.event_ids()):
            values = {n: self.columns[n][i].item() for n in names}
            yield model(job_id=self.job_id, node=self.node, event_id=eid, **values)


class BatchBuilder:
    """Accumulates samples of one kind from one node and encodes them as one message.

    >>> b = BatchBuilder("step", job_id="j1", node="n0", producer_id="p")
    >>> b.add(ts_ns=1, rank=0, step=0, step_time_ms=100.0, data_wait_ms=5.0)
    >>> len(b), len(decode_batch(b.encode()))
    (1, 1)
    """

    def __init__(self, kind: str, *, job_id: str, node: str, producer_id: str) -> None:
        if kind not in _SPECS:
            raise SchemaError(f"unknown batch kind {kind!r}; valid: {sorted(_SPECS)}")
        self.kind, self.job_id, self.node, self.producer_id = kind, job_id, node, producer_id
        self._spec = _SPECS[kind]
        self._rows: dict[str, list[Any]] = {c.name: [] for c in self._spec}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._rows["ts_ns"])

    def add(self, **values: Any) -> None:
        """Append one sample; fields left out take their schema default."""
        row = [(c.name, values.get(c.name, c.default)) for c in self._spec]
        for name, v in row:
            if v is None:
                raise SchemaError(f"{self.kind} sample is missing required field {name!r}")
        for name, v in row:  # all or nothing: a rejected sample leaves no partial row
            self._rows[name].append(v)

    def encode(self) -> bytes:
        """Encode the pending samples as one message and start a new batch."""
        self._seq += 1
        data = encode_batch(
            self.kind,
            self._rows,
            job_id=self.job_id,
            node=self.node,
            producer_id=self.producer_id,
            seq=self._seq,
        )
        self._rows = {c.name: [] for c in self._spec}
        return data


def encode_batch(
    kind: str,
    columns: Mapping[str, Sequence[Any] | np.ndarray],
    *,
    job_id: str,
    node: str,
    producer_id: str = "",
    seq: int = 0,
    batch_id: str | None = None,
) -> bytes:
    """Encode columns of samples (lists or numpy arrays) as one batch message."""
    if kind not in BATCH_KINDS:
        raise SchemaError(f"unknown batch kind {kind!r}; valid: {sorted(BATCH_KINDS)}")
    doc = {
        "kind": kind,
        "schema_version": BATCH_KINDS[kind].SCHEMA_VERSION,
        "job_id": job_id,
        "node": node,
        "batch_id": batch_id or new_event_id(),
        "producer_id": producer_id,
        "seq": seq,
        "columns": dict(columns),
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def _bad(kind: str, col: str, arr: np.ndarray, mask: np.ndarray, why: str) -> SchemaError:
    i = int(np.argmax(mask))
    return SchemaError(f"{kind} batch: column {col!r} sample {i} = {arr[i]!r} {why}")


_INT_TYPES = frozenset({int})
_FLOAT_TYPES = frozenset({int, float})


def _check_column(kind: str, c: _Column, raw: Any, n: int) -> np.ndarray:
    if not isinstance(raw, list):
        raise SchemaError(
            f"{kind} batch: column {c.name!r} must be a list, got {type(raw).__name__}"
        )
    if len(raw) != n:
        raise SchemaError(f"{kind} batch: column {c.name!r} has {len(raw)} values, expected {n}")
    # Exact JSON types, checked at C speed: no bools, strings or nulls pass as numbers.
    types = set(map(type, raw))
    if list in types or dict in types:
        raise SchemaError(f"{kind} batch: column {c.name!r} must be flat (one number per sample)")
    if c.dtype is np.int64 and not types <= _INT_TYPES:
        bad = sorted(t.__name__ for t in types - _INT_TYPES)
        if types <= _FLOAT_TYPES:
            raise SchemaError(f"{kind} batch: column {c.name!r} must hold integers, got float")
        raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: holds {bad}")
    if c.dtype is np.float64 and not types <= _FLOAT_TYPES:
        bad = sorted(t.__name__ for t in types - _FLOAT_TYPES)
        if bad == ["NoneType"]:
            i = raw.index(None)
            raise SchemaError(f"{kind} batch: column {c.name!r} sample {i} is null, not finite")
        raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: holds {bad}")
    try:
        arr = np.asarray(raw, dtype=c.dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: {e}") from None
    if c.dtype is np.float64:
        bad_mask = ~np.isfinite(arr)
        if bad_mask.any():
            raise _bad(kind, c.name, arr, bad_mask, "is not finite")
    if c.lo is not None:
        bad_mask = arr <= c.lo if c.lo_strict else arr < c.lo
        if bad_mask.any():
            raise _bad(
                kind, c.name, arr, bad_mask, f"is below {'>' if c.lo_strict else '>='}{c.lo:g}"
            )
    if c.hi is not None:
        bad_mask = arr > c.hi
        if bad_mask.any():
            raise _bad(kind, c.name, arr, bad_mask, f"is above {c.hi:g}")
    return arr


def _load_object(data: bytes, max_bytes: int, what: str) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise SchemaError(f"{what} of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise SchemaError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise SchemaError(f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc


def decode_batch(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Batch:
    """Decode and validate one telemetry batch message; raise `SchemaError` if it is bad.

    >>> decode_batch(b"{}")
    Traceback (most recent call last):
    ...
    perfloop.schemas.exceptions.SchemaError: batch has no 'kind'; valid kinds: ['gpu', 'step']
    """
    doc = _load_object(data, max_bytes, "batch")
    kind = doc.get("kind")
    if kind not in _SPECS:
        what = f"unknown kind {kind!r}" if "kind" in doc else "no 'kind'"
        raise SchemaError(f"batch has {what}; valid kinds: {sorted(_SPECS)}")
    version = doc.get("schema_version")
    supported = BATCH_KINDS[kind].SCHEMA_VERSION
    if version != supported:
        raise SchemaError(f"{kind} batch has schema_version {version!r}; supported: {supported}")
    extra = set(doc) - _HEADER_KEYS
    if extra:
        raise SchemaError(f"{kind} batch has unknown header keys {sorted(extra)}")
    header: dict[str, Any] = {}
    for key in ("job_id", "node", "batch_id"):
        v = doc.get(key)
        if not isinstance(v, str) or not v or len(v) > 255:
            raise SchemaError(f"{kind} batch: {key!r} must be a non-empty string, got {v!r}")
        header[key] = v
    if not _JOB_ID.fullmatch(header["job_id"]):
        raise SchemaError(
            f"{kind} batch: job_id {header['job_id'][:140]!r} must be 1-128 characters "
            "of [A-Za-z0-9._:/@+-]"
        )
    cols = doc.get("columns")
    if not isinstance(cols, dict) or not isinstance(cols.get("ts_ns"), list):
        raise SchemaError(f"{kind} batch: 'columns' must be an object with a 'ts_ns' list")
    spec = _SPECS[kind]
    unknown = set(cols) - {c.name for c in spec}
    if unknown:
        raise SchemaError(f"{kind} batch: unknown columns {sorted(unknown)}")
    n = len(cols["ts_ns"])
    arrays: dict[str, np.ndarray] = {}
    for c in spec:
        if c.name in cols:
            arrays[c.name] = _check_column(kind, c, cols[c.name], n)
        elif c.default is None:
            raise SchemaError(f"{kind} batch: required column {c.name!r} is missing")
        else:
            arrays[c.name] = np.full(n, c.default, dtype=c.dtype)
    seq = doc.get("seq", 0)
    return Batch(
        kind=kind,
        schema_version=version,
        job_id=header["job_id"],
        node=header["node"],
        batch_id=header["batch_id"],
        producer_id=str(doc.get("producer_id", "")),
        seq=seq if isinstance(seq, int) else 0,
        columns=arrays,
    )


def encode_event(event: Event) -> bytes:
    """Encode one control event as a JSON object carrying its ``kind``."""
    doc = event.model_dump()
    doc["kind"] = event.KIND
    return orjson.dumps(doc)


def decode_event(data: bytes, *, max_bytes: int = 1 << 20) -> Event:
    """Decode and validate one control event; raise `SchemaError` naming what is wrong."""
    doc = _load_object(data, max_bytes, "event")
    kind = doc.pop("kind", None)
    model = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise SchemaError(f"event has unknown kind {kind!r}; valid kinds: {sorted(EVENT_KINDS)}")
    version = doc.get("schema_version", 1)
    if type(version) is not int or version != model.SCHEMA_VERSION:
        raise SchemaError(
            f"{kind} event has schema_version {doc.get('schema_version')!r}; "
            f"supported: {model.SCHEMA_VERSION}"
        )
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "event"
        raise SchemaError(f"{kind} event: {loc}: {err['msg']} (got {err.get('input')!r})") from None
