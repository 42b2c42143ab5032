"""Wire format: batched columnar telemetry (Arrow IPC or JSON) and single control events (JSON).

A telemetry message carries many samples of one node and one kind, column by column. In JSON::

    {"kind": "step", "schema_version": 2, "job_id": "j1", "node": "n0",
     "batch_id": "9f…", "producer_id": "sim-n0", "seq": 17,
     "columns": {"ts_ns": [...], "rank": [...], "step": [...], "step_time_ms": [...], ...}}

and, by default, as one Arrow IPC stream with the same header as JSON in its schema metadata
(``perfloop.batch``) and the same columns typed int64, float64 (null where a nullable field was
not reported) and UTF-8 strings (`perfloop.schemas.arrow_batch`): no Python object per sample
on either side, ~5× faster to decode than JSON (bench/codec.py). `decode_batch` reads both
(an Arrow stream starts with ``0xFFFFFFFF``, JSON with ``{``), so producers in any language
can send JSON; `encode_batch` writes Arrow unless ``wire="json"``.

Every column has one value per sample; a column whose field has a default may be left out.
Sample ``i`` has event id ``f"{batch_id}-{i}"``, so ids stay unique without being shipped.
Decoding checks the envelope, the column set, the lengths, the types and the bounds declared
on the sample model, all vectorised with numpy, and raises `SchemaError` naming the first
problem. String columns (phase names, collective ops) are checked for type, length and control
characters; a nullable float column (``loss``) carries JSON ``null`` and decodes to NaN.
A batch of an older supported ``schema_version`` decodes with the newer columns at their
defaults. Job-level events (job info, lifecycle, capability reports, producer self-metrics,
ground truth) and control events (recommendations, commands, results) are rare and travel one
JSON object per message, with their ``kind``.

Two parts live in their own modules, private to this package: each batch kind's columns, read
from its sample model (`BATCH_KINDS`, re-exported here, and the column specs), in
`perfloop.schemas._batch_columns`; the checks of a decoded batch's columns (types, lengths,
bounds, strings) in `perfloop.schemas._column_checks`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from perfloop.schemas._batch_columns import BATCH_KINDS, MISSING, SPECS, Column
from perfloop.schemas._column_checks import (
    check_arrow_column,
    check_column,
    check_each,
    values_ok,
)
from perfloop.schemas.analysis import ConfigChange, Diagnosis, PhaseChange, Prediction
from perfloop.schemas.arrow_batch import decode_arrow, encode_arrow, is_arrow
from perfloop.schemas.base import JOB_ID_PATTERN, Event, new_event_id
from perfloop.schemas.control import ActuationResult, Approval, Command, Decision, Recommendation
from perfloop.schemas.exceptions import SchemaError
from perfloop.schemas.job import (
    CapabilityReport,
    GroundTruth,
    JobInfo,
    JobLifecycle,
    ProducerStats,
    RankProgress,
)

__all__ = [
    "BATCH_KINDS",
    "EVENT_KINDS",
    "MAX_MESSAGE_BYTES",
    "WIRE_FORMATS",
    "Batch",
    "BatchBuilder",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
    "is_batch",
]

MAX_MESSAGE_BYTES = 4 << 20
WIRE_FORMATS = ("arrow", "json")
"""How a batch travels: an Arrow IPC stream (binary, the default) or a JSON object."""
EVENT_KINDS: dict[str, type[Event]] = {
    m.KIND: m
    for m in (
        JobInfo,
        JobLifecycle,
        CapabilityReport,
        ProducerStats,
        GroundTruth,
        RankProgress,
        Recommendation,
        Command,
        ActuationResult,
        Approval,
        Decision,
        PhaseChange,
        Diagnosis,
        ConfigChange,
        Prediction,
    )
}
# The column specs under the names this module and `perfloop.schemas.export` read them by.
_SPECS = SPECS
_MISSING = MISSING
_JOB_ID = re.compile(JOB_ID_PATTERN)
_HEADER_KEYS = frozenset(
    {"kind", "schema_version", "job_id", "node", "batch_id", "producer_id", "seq", "columns"}
)


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
        nullable = {c.name for c in _SPECS[self.kind] if c.nullable}
        for i, eid in enumerate(self.event_ids()):
            values = {n: _item(self.columns[n][i], n in nullable) for n in names}
            yield model(
                job_id=self.job_id,
                node=self.node,
                event_id=eid,
                schema_version=self.schema_version,
                **values,
            )


def _item(v: Any, nullable: bool) -> Any:
    v = v.item() if isinstance(v, np.generic) else v
    return None if nullable and v != v else v  # NaN stands for null


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
            if v is _MISSING:
                raise SchemaError(f"{self.kind} sample is missing required field {name!r}")
        for name, v in row:  # all or nothing: a rejected sample leaves no partial row
            self._rows[name].append(v)

    def extend(self, **columns: Sequence[Any] | np.ndarray) -> None:
        """Append many samples at once, column by column (the fast path for numpy producers).

        Every column given must have the same length; columns left out take their default.

        >>> b = BatchBuilder("gpu", job_id="j1", node="n0", producer_id="p")
        >>> b.extend(ts_ns=np.array([1, 2]), rank=[0, 0], device=[0, 1])
        >>> len(b)
        2
        """
        unknown = set(columns) - set(self._rows)
        if unknown:
            raise SchemaError(f"{self.kind} samples have unknown fields {sorted(unknown)}")
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise SchemaError(f"{self.kind} columns have different lengths {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        for c in self._spec:
            if c.name not in columns and c.default is _MISSING:
                raise SchemaError(f"{self.kind} samples are missing required field {c.name!r}")
        for c in self._spec:
            v = columns.get(c.name)
            col = self._rows[c.name]
            if v is None:
                col.extend([c.default] * n)
            elif isinstance(v, np.ndarray):
                col.extend(v.tolist())
            else:
                col.extend(v)

    def take(self) -> dict[str, list[Any]]:
        """Hand over the pending samples, column by column, and start a new batch."""
        rows, self._rows = self._rows, {c.name: [] for c in self._spec}
        return rows

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
    wire: str = "arrow",
) -> bytes:
    """Encode columns of samples (lists or numpy arrays) as one batch message, as an Arrow
    IPC stream (``wire="arrow"``, the default) or as JSON (``wire="json"``).

    Never raises for the values: columns Arrow's types cannot hold (a string among numbers, a
    float in an integer column) go as JSON, so the consumer refuses them with the reason
    instead of the producer failing. Check the values with `decode_batch` where it matters.
    """
    if kind not in BATCH_KINDS:
        raise SchemaError(f"unknown batch kind {kind!r}; valid: {sorted(BATCH_KINDS)}")
    if wire not in WIRE_FORMATS:
        raise SchemaError(f"unknown wire format {wire!r}; valid: {list(WIRE_FORMATS)}")
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
    if wire == "arrow":
        header = {k: v for k, v in doc.items() if k != "columns"}
        try:
            return encode_arrow(header, columns, {c.name: c.dtype for c in _SPECS[kind]})
        except SchemaError:
            pass  # values Arrow's types cannot hold: sent as JSON, refused by name downstream
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def _versions(model: type[Event]) -> str:
    lo, hi = model.MIN_SCHEMA_VERSION, model.SCHEMA_VERSION
    return str(hi) if lo == hi else f"{lo}..{hi}"


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

    >>> decode_batch(b"{}")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    perfloop.schemas.exceptions.SchemaError: batch has no 'kind'; valid kinds: [...]
    """
    arrow = is_arrow(data)
    if arrow:
        if len(data) > max_bytes:
            raise SchemaError(f"batch of {len(data)} bytes exceeds the {max_bytes}-byte limit")
        doc, arrow_cols = decode_arrow(data)
        doc["columns"] = arrow_cols
    else:
        doc = _load_object(data, max_bytes, "batch")
    kind = doc.get("kind")
    if kind not in _SPECS:
        what = f"unknown kind {kind!r}" if "kind" in doc else "no 'kind'"
        raise SchemaError(f"batch has {what}; valid kinds: {sorted(_SPECS)}")
    version = doc.get("schema_version")
    model = BATCH_KINDS[kind]
    if type(version) is not int or not (
        model.MIN_SCHEMA_VERSION <= version <= model.SCHEMA_VERSION
    ):
        raise SchemaError(
            f"{kind} batch has schema_version {version!r}; supported: {_versions(model)}"
        )
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
    if not isinstance(cols, dict) or not isinstance(
        cols.get("ts_ns"), np.ndarray if arrow else list
    ):
        raise SchemaError(f"{kind} batch: 'columns' must be an object with a 'ts_ns' list")
    spec = _SPECS[kind]
    unknown = set(cols) - {c.name for c in spec}
    if unknown:
        raise SchemaError(f"{kind} batch: unknown columns {sorted(unknown)}")
    n = len(cols["ts_ns"])
    arrays: dict[str, np.ndarray] = {}
    check = check_arrow_column if arrow else check_column
    numeric: list[Column] = []
    for c in spec:
        if c.name in cols:
            try:
                arrays[c.name] = check(kind, c, cols[c.name], n, values=False)
            except SchemaError:  # a bad value in an earlier column is named first
                check_each(kind, check, numeric, cols, n)
                raise
            if c.dtype is not str:
                numeric.append(c)
        elif c.default is _MISSING:
            raise SchemaError(f"{kind} batch: required column {c.name!r} is missing")
        elif c.dtype is str:
            arrays[c.name] = np.full(n, c.default, dtype=object)
        else:
            fill = np.nan if c.default is None else c.default
            arrays[c.name] = np.full(n, fill, dtype=c.dtype)
    if numeric and not values_ok(numeric, arrays):
        check_each(kind, check, numeric, cols, n)
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


def is_batch(data: bytes) -> bool:
    """Whether a message is a telemetry batch (Arrow, or JSON with columns), not an event."""
    return is_arrow(data) or b'"columns"' in data


def encode_event(event: Event) -> bytes:
    """Encode one control event as a JSON object carrying its ``kind``."""
    doc = event.model_dump()
    doc["kind"] = event.KIND
    return orjson.dumps(doc)


def decode_event(data: bytes, *, max_bytes: int = 1 << 20) -> Event:
    """Decode and validate one control event; raise `SchemaError` naming what is wrong."""
    if is_arrow(data):
        raise SchemaError("event must be a JSON object; got an Arrow telemetry batch")
    doc = _load_object(data, max_bytes, "event")
    kind = doc.pop("kind", None)
    model = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise SchemaError(f"event has unknown kind {kind!r}; valid kinds: {sorted(EVENT_KINDS)}")
    version = doc.get("schema_version", 1)
    if type(version) is not int or not (
        model.MIN_SCHEMA_VERSION <= version <= model.SCHEMA_VERSION
    ):
        raise SchemaError(
            f"{kind} event has schema_version {doc.get('schema_version')!r}; "
            f"supported: {_versions(model)}"
        )
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "event"
        raise SchemaError(f"{kind} event: {loc}: {err['msg']} (got {err.get('input')!r})") from None
