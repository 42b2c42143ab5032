"""The columns of each telemetry batch kind, read once from its sample model.

Private to the codec (`perfloop.schemas.codec`, which re-exports `BATCH_KINDS`). A batch
carries its samples column by column; `SPECS` holds, per kind, one `Column` per field of the
sample model (the envelope fields travel once, in the header): its type (int64, float64 or
string), its default (`MISSING` when the field is required), the bounds and length limits the
model declares, and whether it is nullable. Encoding, decoding and the exported JSON Schema all
read them from here, so a field added to a model is a column everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import annotated_types
import numpy as np

from perfloop.schemas.base import Event
from perfloop.schemas.telemetry import (
    CollectiveOp,
    GpuSample,
    HostSample,
    KernelSummary,
    PhaseSpan,
    StepEvent,
)

__all__ = ["BATCH_KINDS", "MISSING", "SPECS", "Column", "columns_of"]

BATCH_KINDS: dict[str, type[Event]] = {
    m.KIND: m for m in (GpuSample, HostSample, StepEvent, PhaseSpan, CollectiveOp, KernelSummary)
}
_ENVELOPE = ("schema_version", "event_id", "job_id", "node")


@dataclass(frozen=True, slots=True, eq=False)  # one instance per column: hashed by identity
class Column:
    """One column of a batch kind, as its sample model declares the field."""

    name: str
    dtype: type[Any]  # np.int64, np.float64 or str
    default: Any
    lo: float | None
    lo_strict: bool
    hi: float | None
    nullable: bool = False  # float | None: null travels as JSON null, decodes to NaN
    max_len: int = 0  # strings only
    min_len: int = 0


MISSING = object()
"""The default of a required column: a sample must give it."""


def columns_of(model: type[Event]) -> tuple[Column, ...]:
    """The columns of a batch of ``model``: every field but the envelope, in order."""
    cols = []
    for name, info in model.model_fields.items():
        if name in _ENVELOPE:
            continue
        ann = info.annotation
        nullable = ann == (float | None)
        dtype: type[Any]
        if ann is int:
            dtype = np.int64
        elif ann is float or nullable:
            dtype = np.float64
        elif ann is str:
            dtype = str
        else:  # pragma: no cover - a schema author's mistake, caught by the unit tests
            raise TypeError(f"{model.KIND}.{name}: batch columns must be int, float or str")
        lo = hi = None
        lo_strict = False
        max_len = min_len = 0
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Ge):
                lo = float(meta.ge)  # type: ignore[arg-type]
            elif isinstance(meta, annotated_types.Gt):
                lo, lo_strict = float(meta.gt), True  # type: ignore[arg-type]
            elif isinstance(meta, annotated_types.Le):
                hi = float(meta.le)  # type: ignore[arg-type]
            elif isinstance(meta, annotated_types.MaxLen):
                max_len = meta.max_length
            elif isinstance(meta, annotated_types.MinLen):
                min_len = meta.min_length
        if ann is str and not max_len:
            max_len = 4096
        default = MISSING if info.is_required() else info.default
        cols.append(Column(name, dtype, default, lo, lo_strict, hi, nullable, max_len, min_len))
    return tuple(cols)


SPECS: dict[str, tuple[Column, ...]] = {k: columns_of(m) for k, m in BATCH_KINDS.items()}
