"""NVML at its lowest level, for `perfloop.producers.gpu.NvmlBackend` and the power limits.

What every NVML call site shares: the error codes that mean a signal is *unsupported* on a
device (`UNSUPPORTED`: never asked again) or that the device is *lost* (`LOST`: dropped), the
field ids read through ``nvmlDeviceGetFieldValues``, a fast view of those field values
(`field_values`, `field_value`), a handle's identity (`handle_key`: how an XID event finds its
device) and an error's text on one line (`err_text`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import pynvml

__all__ = [
    "FIELD_NVLINK_COUNT",
    "FIELD_NVLINK_RX",
    "FIELD_NVLINK_TX",
    "FIELD_PCIE_RX",
    "FIELD_PCIE_TX",
    "LOST",
    "UNSUPPORTED",
    "XID_EVENT",
    "E",
    "NVMLError",
    "err_text",
    "field_value",
    "field_values",
    "handle_key",
]

# Captured at import: tests replace pynvml functions, never its error classes or constants.
NVMLError = pynvml.NVMLError
E = pynvml
UNSUPPORTED = frozenset(
    {
        E.NVML_ERROR_NOT_SUPPORTED,
        E.NVML_ERROR_FUNCTION_NOT_FOUND,
        E.NVML_ERROR_NO_PERMISSION,
        E.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        E.NVML_ERROR_NOT_FOUND,
        E.NVML_ERROR_INVALID_ARGUMENT,
        E.NVML_ERROR_DEPRECATED,
    }
)
"""Error codes that mean a call will never work on this device: it is not asked again."""
LOST = frozenset({E.NVML_ERROR_GPU_IS_LOST, E.NVML_ERROR_RESET_REQUIRED})
"""Error codes that mean the device itself is gone: it is not sampled again."""
FIELD_PCIE_TX, FIELD_PCIE_RX = (
    E.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
    E.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
)
FIELD_NVLINK_TX = E.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FIELD_NVLINK_RX = E.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
FIELD_NVLINK_COUNT = E.NVML_FI_DEV_NVLINK_LINK_COUNT
XID_EVENT = E.nvmlEventTypeXidCriticalError


def err_text(e: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def handle_key(handle: Any) -> int | None:
    """The address behind a device handle: the same device gives the same key."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class _Value(ctypes.Union):
    _fields_ = (
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    )


class _FieldValue(ctypes.Structure):
    """pynvml's ``c_nvmlFieldValue_t`` layout as a plain ctypes structure: reading it is a
    descriptor lookup, where pynvml's printable structure runs Python on every attribute."""

    _fields_ = (
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_int),
        ("nvmlReturn", ctypes.c_int),
        ("value", _Value),
    )


_FAST_FIELDS = ctypes.sizeof(_FieldValue) == ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
_VALUE_READERS = {
    E.NVML_VALUE_TYPE_DOUBLE: lambda v: v.dVal,
    E.NVML_VALUE_TYPE_UNSIGNED_INT: lambda v: v.uiVal,
    E.NVML_VALUE_TYPE_UNSIGNED_LONG: lambda v: v.ulVal,
    E.NVML_VALUE_TYPE_SIGNED_LONG_LONG: lambda v: v.sllVal,
    E.NVML_VALUE_TYPE_SIGNED_INT: lambda v: v.siVal,
    E.NVML_VALUE_TYPE_UNSIGNED_SHORT: lambda v: v.usVal,
}


def field_values(handle: Any, ids: Sequence[Any]) -> Any:
    """``nvmlDeviceGetFieldValues``, answered as fast plain structures where the layout allows."""
    values = pynvml.nvmlDeviceGetFieldValues(handle, list(ids))
    if _FAST_FIELDS and isinstance(values, ctypes.Array):
        return (_FieldValue * len(values)).from_buffer(values)
    return values  # pragma: no cover - a pynvml whose layout differs


def field_value(fv: Any) -> float:
    """The value of one field as a float, whatever NVML type it carries."""
    v = fv.value
    read = _VALUE_READERS.get(fv.valueType)
    return float(read(v) if read is not None else v.ullVal)
