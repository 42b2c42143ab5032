"""The rows a `Recorder` hands to the emitter: their columns, and a step's figures cleaned.

Spans and collective calls are kept on the training thread as tuples in `SPAN_COLUMNS` and
`COLLECTIVE_COLUMNS` order and turned into columns (`as_columns`) when handed over. A step's
figures, as a script or the hooks reported them, become a step row with `step_row`: every
optional column of `StepEvent` present (`STEP_DEFAULTS`), values clamped to what it accepts,
a bad value dropped rather than raised (`clean_float`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "COLLECTIVE_COLUMNS",
    "SPAN_COLUMNS",
    "STEP_DEFAULTS",
    "as_columns",
    "clean_float",
    "step_row",
]


SPAN_COLUMNS = ("ts_ns", "rank", "step", "phase", "name", "duration_ms", "depth")
COLLECTIVE_COLUMNS = (
    "ts_ns",
    "rank",
    "step",
    "op",
    "size_bytes",
    "group",
    "group_size",
    "duration_ms",
    "dtype",
)
STEP_DEFAULTS: dict[str, Any] = {
    "batch_size": 0,
    "num_workers": 0,
    "epoch": 0,
    "samples": 0,
    "tokens": 0,
    "grad_accum_steps": 1,
    "loss": None,
    "grad_norm": None,
    "lr": None,
    "mem_allocated_bytes": 0,
    "mem_reserved_bytes": 0,
    "mem_peak_bytes": 0,
    "rss_bytes": 0,
}
"""Every column of a step row that a step's figures fill, with its value when not reported."""


_FLOAT_FIELDS = {"loss": False, "grad_norm": True, "lr": True}  # name → must be >= 0
_INT_LIMITS = {"grad_accum_steps": 1 << 16, "num_workers": 1024}


def clean_float(v: Any, nonneg: bool = False) -> float | None:
    """``v`` as a finite float (>= 0 with ``nonneg``), else None.

    >>> clean_float(float("nan")), clean_float(-1.0, nonneg=True), clean_float(2)
    (None, None, 2.0)
    """
    if v is None:
        return None
    f = v if type(v) is float else _float_or_none(v)
    if f is None or f != f or f in (math.inf, -math.inf) or (nonneg and f < 0):
        return None
    return f


def step_row(
    fields: dict[str, Any], resolve: Callable[[Any], float | None] | None = None
) -> dict[str, Any]:
    """A step row with every optional column, values clamped to what `StepEvent` accepts.

    >>> r = step_row({"batch_size": 8, "loss": float("inf"), "grad_accum_steps": 0})
    >>> r["batch_size"], r["samples"], r["loss"], r["grad_accum_steps"]
    (8, 8, None, 1)
    """
    row = dict(STEP_DEFAULTS)
    for k, v in fields.items():
        if k not in row:
            continue
        nonneg = _FLOAT_FIELDS.get(k)
        if nonneg is not None:
            if isinstance(v, (list, tuple)):  # values to average (micro-batch losses)
                vals = [clean_float(resolve(x) if resolve else x) for x in v]
                vals = [x for x in vals if x is not None]
                v = sum(vals) / len(vals) if vals else None
            row[k] = clean_float(v, nonneg)
        elif type(v) is int and 0 <= v < _INT_LIMITS.get(k, 1 << 62):
            row[k] = v
        else:
            row[k] = _count(v, _INT_LIMITS.get(k, 1 << 62))
    if row["grad_accum_steps"] < 1:
        row["grad_accum_steps"] = 1
    if not row["samples"] and row["batch_size"]:
        row["samples"] = row["batch_size"] * row["grad_accum_steps"]
    return row


def as_columns(names: tuple[str, ...], rows: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    """Rows (tuples in ``names`` order) as one list per column.

    >>> as_columns(("step", "depth"), [(0, 0), (0, 1)])
    {'step': [0, 0], 'depth': [0, 1]}
    """
    return {n: list(c) for n, c in zip(names, zip(*rows, strict=True), strict=True)}


def _float_or_none(v: Any, *, nonneg: bool = False) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(f) or (nonneg and f < 0):
        return None
    return f


def _count(v: Any, hi: int = 1 << 62) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return 0
    return min(max(n, 0), hi)
