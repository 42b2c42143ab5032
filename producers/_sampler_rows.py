"""Schema-valid rows for the node sampler (`perfloop.producers.node_sampler.NodeSampler`).

A backend's readings are numbers as the hardware gave them: a counter past its field's bound, a
NaN where a reading failed, a float where the schema wants an int. Before the emitter sees a row
each value is made one the schema accepts (`clean`): clamped to its field's bounds (read once
from the `GpuSample` and `HostSample` fields: `GPU_BOUNDS`, `HOST_BOUNDS`), an int where the
field is one, left out (the field keeps its default) when NaN or infinite. `columns` does it for
a round of rows at once, as the columns of one emitter call.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import annotated_types

from perfloop.producers.gpu import GPU_SIGNALS
from perfloop.schemas.base import Event
from perfloop.schemas.telemetry import GpuSample, HostSample

__all__ = ["GPU_BOUNDS", "HOST_BOUNDS", "Bounds", "clean", "columns"]

Bounds = list[tuple[str, float, float, bool]]
"""``(field, lowest, highest, is_int)`` for each field a row may carry."""


def _bounds(model: type[Event], names: Iterable[str]) -> Bounds:
    out = []
    for name in names:
        info = model.model_fields[name]
        lo, hi = -math.inf, math.inf
        for meta in info.metadata:
            if isinstance(meta, annotated_types.Ge):
                lo = float(meta.ge)  # type: ignore[arg-type]
            elif isinstance(meta, annotated_types.Le):
                hi = float(meta.le)  # type: ignore[arg-type]
        out.append((name, lo, hi, info.annotation is int))
    return out


GPU_BOUNDS = _bounds(GpuSample, [f for fs in GPU_SIGNALS.values() for f in fs])
HOST_BOUNDS = _bounds(
    HostSample,
    [n for n in HostSample.model_fields if n not in Event.model_fields and n != "rank"],
)


def clean(row: Mapping[str, Any], bounds: Bounds) -> dict[str, Any]:
    """Schema-valid values: clamped to the field's bounds, ints as int, strings as they are;
    NaN and infinities are left out (the field keeps its default)."""
    out: dict[str, Any] = {}
    for name, lo, hi, is_int in bounds:
        v = row.get(name)
        if v is None:
            continue
        if type(v) is str:
            out[name] = v
            continue
        if is_int and type(v) is int:
            out[name] = v if lo <= v <= hi else int(max(lo, min(hi, v)))
            continue
        f = float(v)
        if not math.isfinite(f):
            continue
        if not lo <= f <= hi:
            f = max(lo, min(hi, f))
        out[name] = int(f) if is_int else f
    return out


def columns(rows: Sequence[Mapping[str, Any]], bounds: Bounds) -> dict[str, list[Any]]:
    """The rows as schema-valid columns (see `clean`); one emitter call per round."""
    cleaned = [clean(r, bounds) for r in rows]
    out: dict[str, list[Any]] = {}
    for name, _, _, is_int in bounds:
        if all(name in c for c in cleaned):
            out[name] = [c[name] for c in cleaned]
        elif any(name in c for c in cleaned):
            some = next(c[name] for c in cleaned if name in c)
            zero = "" if type(some) is str else 0 if is_int else 0.0
            out[name] = [c.get(name, zero) for c in cleaned]
    return out
