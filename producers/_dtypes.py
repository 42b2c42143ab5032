"""Element types in a PyTorch-profiler trace: the name torch gives each and its size in bytes.

Private to trace replay. A profiler's ``Input type`` (``Float``, ``c10::BFloat16``, ``long
int``…), a ``record_param_comms`` ``dtype`` and the type in an NCCL kernel's name (``f32``,
``bf16``, ``int8_t``…) all spell one element type; `lookup_dtype` reads any of them,
`dtype_name` gives torch's name and `dtype_bytes` the size of one element. Re-exported by
`perfloop.producers._collectives`, which sizes collectives with them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["dtype_bytes", "dtype_name", "lookup_dtype"]

_DTYPE_TABLE: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    # torch name, bytes, spellings (lower-case, without "c10::", "torch.", spaces, "_", "<>")
    ("float32", 4, ("float", "float32", "f32")),
    ("float64", 8, ("double", "float64", "f64")),
    ("float16", 2, ("half", "float16", "f16")),
    ("bfloat16", 2, ("bfloat16", "bf16", "nvbfloat16", "hipbfloat16", "rcclbfloat16")),
    ("int8", 1, ("char", "signedchar", "int8", "int8t", "i8")),
    ("uint8", 1, ("byte", "unsignedchar", "uint8", "uint8t", "u8")),
    ("int16", 2, ("short", "shortint", "int16", "int16t", "i16")),
    ("uint16", 2, ("uint16", "uint16t", "unsignedshort", "unsignedshortint", "u16")),
    ("int32", 4, ("int", "int32", "int32t", "i32")),
    ("uint32", 4, ("uint32", "uint32t", "unsignedint", "unsigned", "u32")),
    ("int64", 8, ("long", "longint", "longlong", "longlongint", "int64", "int64t", "i64")),
    ("uint64", 8, ("uint64", "uint64t", "unsignedlong", "unsignedlongint", "u64")),
    ("bool", 1, ("bool",)),
    ("complex32", 4, ("complexhalf", "complex32")),
    ("complex64", 8, ("complexfloat", "complex64")),
    ("complex128", 16, ("complexdouble", "complex128")),
    ("float8_e4m3fn", 1, ("float8e4m3fn", "f8e4m3", "fp8e4m3")),
    ("float8_e5m2", 1, ("float8e5m2", "f8e5m2", "fp8e5m2")),
    ("float8_e4m3fnuz", 1, ("float8e4m3fnuz",)),
    ("float8_e5m2fnuz", 1, ("float8e5m2fnuz",)),
    ("float8_e8m0fnu", 1, ("float8e8m0fnu",)),
    ("float4_e2m1fn_x2", 1, ("float4e2m1fnx2",)),  # two values packed in each element
    ("qint8", 1, ("qint8",)),
    ("quint8", 1, ("quint8",)),
    ("qint32", 4, ("qint32",)),
    ("quint4x2", 1, ("quint4x2",)),
    ("quint2x4", 1, ("quint2x4",)),
    ("bits8", 1, ("bits8", "bits1x8", "bits2x4", "bits4x2")),
    ("bits16", 2, ("bits16",)),
)
_DTYPES: dict[str, tuple[str, int]] = {
    spelling: (canon, size) for canon, size, spellings in _DTYPE_TABLE for spelling in spellings
}
_DTYPE_NOISE = re.compile(r"c10::|torch\.|at::|[\s_<>]")
_CONTROL = re.compile(r"[\x00-\x1f]+")


def lookup_dtype(text: Any) -> tuple[str, int] | None:
    """Torch's name and the bytes of one element for a spelling of an element type; ``None``
    for a value that is no string or a spelling no type has.

    >>> lookup_dtype("c10::BFloat16"), lookup_dtype("int8_t"), lookup_dtype("Scalar")
    (('bfloat16', 2), ('int8', 1), None)
    """
    if not isinstance(text, str):
        return None
    return _DTYPES.get(_DTYPE_NOISE.sub("", text.lower()))


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of a profiler dtype name (``Float``, ``c10::BFloat16``…); 0 if unknown.

    >>> dtype_bytes("Float"), dtype_bytes("c10::BFloat16"), dtype_bytes("signed char")
    (4, 2, 1)
    >>> dtype_bytes("long int"), dtype_bytes("c10::complex<float>"), dtype_bytes("?")
    (8, 8, 0)
    """
    d = lookup_dtype(dtype)
    return d[1] if d else 0


def dtype_name(dtype: Any) -> str:
    """A profiler, NCCL or C++ element type as torch names it (``float32``, ``bfloat16``…).

    An unknown name comes back cleaned (no control characters, at most 32 characters); a
    value that is no string, or a placeholder (``Scalar``, ``TensorList``), comes back empty.

    >>> dtype_name("Float"), dtype_name("c10::BFloat16"), dtype_name("unsigned char")
    ('float32', 'bfloat16', 'uint8')
    >>> dtype_name("Float8_e4m3fn"), dtype_name("Qfloat9"), dtype_name(3)
    ('float8_e4m3fn', 'Qfloat9', '')
    """
    d = lookup_dtype(dtype)
    if d:
        return d[0]
    if not isinstance(dtype, str) or dtype.strip() in ("", "Scalar", "TensorList", "GenericList"):
        return ""
    return _CONTROL.sub(" ", dtype).strip()[:32]
