"""Columns of warehouse rows as numpy arrays: integers (nanoseconds, ranks, counts) and
floats, for the report's pure modules."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["I64", "floats", "ints"]

I64 = np.int64


def ints(values: Any) -> np.ndarray:
    """``values`` as 64-bit integers: integers exactly (nanosecond times need all their
    digits), other numbers rounded.

    >>> ints([1_800_000_000_000_000_001]).tolist(), ints([2.6, 1e9]).tolist()
    ([1800000000000000001], [3, 1000000000])
    """
    arr = np.asarray(values)
    if arr.dtype.kind in "iub":
        return arr.astype(I64)
    return np.asarray(np.round(arr.astype(np.float64)), dtype=I64)


def floats(values: Any) -> np.ndarray:
    """``values`` as 64-bit floats."""
    return np.asarray(values, dtype=np.float64)
