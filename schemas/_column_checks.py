"""Checking the columns of a decoded telemetry batch: types, lengths, bounds and strings.

Private to the codec (`perfloop.schemas.codec`). `check_column` checks a JSON column and
`check_arrow_column` one of an Arrow batch, each against its `Column`: exact types (no bools,
strings or nulls pass as numbers), one value per sample, finite floats (NaN only where the
field is nullable), the model's bounds, and strings' lengths and characters. `values_ok` checks
the bounds of every numeric column of a batch at once; when it says no (or is unsure),
`check_each` goes column by column to name the first bad sample in a `SchemaError`.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

from perfloop.schemas._batch_columns import Column
from perfloop.schemas.exceptions import SchemaError

__all__ = ["check_arrow_column", "check_column", "check_each", "values_ok"]


def _bad(kind: str, col: str, arr: np.ndarray, mask: np.ndarray, why: str) -> SchemaError:
    i = int(np.argmax(mask))
    return SchemaError(f"{kind} batch: column {col!r} sample {i} = {arr[i]!r} {why}")


_INT_TYPES = frozenset({int})
_FLOAT_TYPES = frozenset({int, float})
_NULLABLE_TYPES = frozenset({int, float, type(None)})
_CONTROL = re.compile(r"[\x00-\x1f]")


def _check_strings(kind: str, c: Column, raw: list[Any], types: set[type]) -> np.ndarray:
    if types - {str}:
        bad = next(v for v in raw if type(v) is not str)
        i = raw.index(bad)
        raise SchemaError(f"{kind} batch: column {c.name!r} sample {i} = {bad!r} is not a string")
    _check_distinct(kind, c, raw, set(raw))
    arr = np.empty(len(raw), dtype=object)
    arr[:] = raw
    return arr


def _check_distinct(kind: str, c: Column, raw: list[Any], distinct: set[Any]) -> None:
    """String columns are low-cardinality (phase, span and op names): check each distinct
    value once, and look for the first sample holding a bad one only to name it."""
    for v in distinct:
        if type(v) is not str:
            raise SchemaError(
                f"{kind} batch: column {c.name!r} sample {raw.index(v)} = {v!r} is not a string"
            )
        if len(v) > c.max_len:
            i = raw.index(v)
            raise SchemaError(
                f"{kind} batch: column {c.name!r} sample {i} is {len(v)} characters long; "
                f"the limit is {c.max_len}"
            )
        if len(v) < c.min_len:
            raise SchemaError(f"{kind} batch: column {c.name!r} sample {raw.index(v)} is empty")
        if _CONTROL.search(v):
            raise SchemaError(
                f"{kind} batch: column {c.name!r} sample {raw.index(v)} = {v[:64]!r} "
                "holds control characters"
            )


def check_column(kind: str, c: Column, raw: Any, n: int, *, values: bool = True) -> np.ndarray:
    if not isinstance(raw, list):
        raise SchemaError(
            f"{kind} batch: column {c.name!r} must be a list, got {type(raw).__name__}"
        )
    if len(raw) != n:
        raise SchemaError(f"{kind} batch: column {c.name!r} has {len(raw)} values, expected {n}")
    # Exact JSON types, checked at C speed: no bools, strings or nulls pass as numbers.
    types = set(map(type, raw))
    if list in types or dict in types:
        raise SchemaError(f"{kind} batch: column {c.name!r} must be flat (one value per sample)")
    if c.dtype is str:
        return _check_strings(kind, c, raw, types)
    if c.dtype is np.int64 and not types <= _INT_TYPES:
        bad = sorted(t.__name__ for t in types - _INT_TYPES)
        if types <= _FLOAT_TYPES:
            raise SchemaError(f"{kind} batch: column {c.name!r} must hold integers, got float")
        raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: holds {bad}")
    allowed = _NULLABLE_TYPES if c.nullable else _FLOAT_TYPES
    if c.dtype is np.float64 and not types <= allowed:
        bad = sorted(t.__name__ for t in types - allowed)
        if bad == ["NoneType"]:
            i = raw.index(None)
            raise SchemaError(f"{kind} batch: column {c.name!r} sample {i} is null, not finite")
        raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: holds {bad}")
    try:
        arr = np.asarray(raw, dtype=c.dtype)  # null → NaN for nullable float columns
    except (TypeError, ValueError, OverflowError) as e:
        raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: {e}") from None
    return _check_values(kind, c, arr) if values else arr


def check_arrow_column(
    kind: str, c: Column, value: Any, n: int, *, values: bool = True
) -> np.ndarray:
    """One column of an Arrow batch (`decode_arrow`'s form), checked as `check_column`
    checks a JSON one (numeric values too unless ``values`` is false)."""
    if isinstance(value, tuple):  # strings: (object array, distinct values)
        arr, distinct = value
        if c.dtype is not str:
            raise SchemaError(f"{kind} batch: column {c.name!r} is not numeric: holds ['str']")
        if len(arr) != n:
            raise SchemaError(
                f"{kind} batch: column {c.name!r} has {len(arr)} values, expected {n}"
            )
        _check_distinct(kind, c, arr.tolist(), distinct)
        return arr  # type: ignore[no-any-return]
    if len(value) != n:
        raise SchemaError(f"{kind} batch: column {c.name!r} has {len(value)} values, expected {n}")
    if c.dtype is str:
        bad = value[0].item() if len(value) else None
        raise SchemaError(f"{kind} batch: column {c.name!r} sample 0 = {bad!r} is not a string")
    if c.dtype is np.int64 and value.dtype.kind != "i":
        raise SchemaError(f"{kind} batch: column {c.name!r} must hold integers, got float")
    if not values:
        return value.astype(c.dtype, copy=False)  # type: ignore[no-any-return]
    if c.dtype is np.float64 and not c.nullable and np.isnan(value).any():
        i = int(np.argmax(np.isnan(value)))
        raise SchemaError(f"{kind} batch: column {c.name!r} sample {i} is null, not finite")
    return _check_values(kind, c, value.astype(c.dtype, copy=False))


def _check_values(kind: str, c: Column, arr: np.ndarray) -> np.ndarray:
    """The bounds of a numeric column (finite floats, the model's ge/gt/le)."""
    if c.dtype is np.float64:
        bad_mask = np.isinf(arr) if c.nullable else ~np.isfinite(arr)
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


@functools.cache
def _bounds(columns: tuple[Column, ...]) -> tuple[np.ndarray, ...]:
    """Per-column bounds of same-typed numeric columns, for `values_ok`: the lowest value
    allowed, the value that must be exceeded (strict bounds), the highest value allowed (each
    a column vector, open where the column has none) and the non-nullable columns."""
    if columns[0].dtype is np.float64:
        low, high = -np.inf, np.inf
    else:
        low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    dtype = columns[0].dtype
    lo = np.array([c.lo if c.lo is not None and not c.lo_strict else low for c in columns], dtype)
    above = np.array([c.lo if c.lo is not None and c.lo_strict else low for c in columns], dtype)
    hi = np.array([c.hi if c.hi is not None else high for c in columns], dtype)
    required = np.array([not c.nullable for c in columns])
    return lo[:, None], above[:, None], hi[:, None], required


def values_ok(columns: list[Column], arrays: dict[str, np.ndarray]) -> bool:
    """Whether every numeric column of a batch is within its bounds (and floats finite,
    NaN only where nullable), in a few array operations for all columns at once instead of a
    few per column. False also when unsure: the caller then checks column by column, which
    names the first bad sample."""
    for dtype in (np.float64, np.int64):
        group = tuple(c for c in columns if c.dtype is dtype)
        if not group:
            continue
        m = np.stack([arrays[c.name] for c in group])
        lo, above, hi, required = _bounds(group)
        if (m < lo).any() or (m <= above).any() or (m > hi).any():
            return False
        if dtype is np.float64 and (np.isinf(m).any() or np.isnan(m[required]).any()):
            return False
    return True


def check_each(kind: str, check: Any, columns: list[Column], cols: dict[str, Any], n: int) -> None:
    """Check ``columns`` one by one, values included: raises for the first bad one, naming
    its bad sample (the slow path behind `values_ok`)."""
    for c in columns:
        check(kind, c, cols[c.name], n)
