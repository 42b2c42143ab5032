"""ClickHouse's Native format at a client's protocol revision, for the embedded warehouse server.

chDB writes Native as a server does for a client that sends no ``client_protocol_version``
(revision 0): per block, the column and row counts, then per column its name, type and data.
A client that sends its revision over HTTP (clickhouse-go, so Grafana's ClickHouse plugin from
4.10.2 on; clickhouse-connect once it has probed the server) reads what a server writes for
that revision: a block-info header before each block (any revision above 0) and, from revision
54454 on, a byte after each column's type saying whether the column has a custom (sparse)
serialization (always 0 here: chDB's output has none).

`at_revision` rewrites chDB's output into that shape. It has to find where each column's data
ends, so it walks the data by the column's type (`_Type`): fixed-size values, strings,
``Nullable``, ``Array``, ``Map``, ``Tuple``, ``LowCardinality`` (its keys-version prefix, then
per granule its index type, its new keys and its indexes), ``Nested``, the geo types and the
wrappers that serialize like their argument. A type it cannot walk (``Dynamic``, ``Variant``,
``JSON``, ``Object``, ``AggregateFunction``) raises `NativeError`, which the server answers
with one line; the revision-0 answer would be misread by such a client anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BLOCK_INFO",
    "CUSTOM_SERIALIZATION",
    "WITH_LOW_CARDINALITY",
    "NativeError",
    "at_revision",
]

BLOCK_INFO = b"\x01\x00\x02\xff\xff\xff\xff\x00"
"""A block's info as a server writes it: field 1 ``is_overflows`` false, field 2 ``bucket_num``
-1, end."""
CUSTOM_SERIALIZATION = 54454
"""The first revision whose Native blocks carry a custom-serialization byte per column."""
WITH_LOW_CARDINALITY = 54405
"""The first revision that reads ``LowCardinality`` columns as such (a server turns them into
their plain type for an older client; this module does not, see `at_revision`)."""

_FIXED = {
    **dict.fromkeys(("UInt8", "Int8", "Bool", "Enum8"), 1),
    **dict.fromkeys(("UInt16", "Int16", "Enum16", "Date", "BFloat16"), 2),
    **dict.fromkeys(
        ("UInt32", "Int32", "Float32", "DateTime", "Date32", "IPv4", "Decimal32", "Time"), 4
    ),
    **dict.fromkeys(("UInt64", "Int64", "Float64", "DateTime64", "Decimal64", "Time64"), 8),
    **dict.fromkeys(("UInt128", "Int128", "Decimal128", "UUID", "IPv6"), 16),
    **dict.fromkeys(("UInt256", "Int256", "Decimal256"), 32),
    "Nothing": 1,
}
# Types that serialize exactly like their last argument.
_WRAPPERS = frozenset({"SimpleAggregateFunction"})
_GEO = {
    "Point": "Tuple(Float64, Float64)",
    "Ring": "Array(Point)",
    "LineString": "Array(Point)",
    "MultiLineString": "Array(LineString)",
    "Polygon": "Array(Ring)",
    "MultiPolygon": "Array(Polygon)",
}
_LC_INDEX_BYTES = (1, 2, 4, 8)
_LC_HAS_ADDITIONAL_KEYS = 1 << 9


class NativeError(ValueError):
    """chDB's Native output cannot be rewritten for the client's revision (one line)."""


@dataclass(frozen=True)
class _Type:
    name: str
    args: tuple[_Type, ...] = ()
    size: int = 0  # bytes per value of a fixed-size type

    @staticmethod
    def parse(text: str) -> _Type:
        text = text.strip()
        name, _, rest = text.partition("(")
        name = name.strip()
        raw = _split_args(rest[:-1]) if rest else []
        if name in _GEO:
            return _Type.parse(_GEO[name])
        if name in _WRAPPERS and raw:
            return _Type.parse(raw[-1])
        if name.startswith("Interval"):
            return _Type("Int64", size=8)
        if name == "FixedString":
            return _Type(name, size=int(raw[0]))
        if name == "Decimal":
            precision = int(raw[0])
            size = 4 if precision <= 9 else 8 if precision <= 18 else 16 if precision <= 38 else 32
            return _Type(name, size=size)
        if name in _FIXED:
            return _Type(name, size=_FIXED[name])
        if name == "String":
            return _Type(name)
        if name in ("Nullable", "Array", "LowCardinality"):
            return _Type(name, (_Type.parse(raw[0]),))
        if name == "Map":
            return _Type("Array", (_Type("Tuple", (_Type.parse(raw[0]), _Type.parse(raw[1]))),))
        if name in ("Tuple", "Nested"):
            elements = _Type("Tuple", tuple(_Type.parse(_element_type(a)) for a in raw))
            return elements if name == "Tuple" else _Type("Array", (elements,))
        raise NativeError(f"the embedded warehouse cannot send {text} columns in Native format at "
                          "a client's protocol revision; ask for another format")  # fmt: skip


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of a type (quotes and brackets respected)."""
    out, depth, quote, start = [], 0, "", 0
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'`\"":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
        i += 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def _element_type(arg: str) -> str:
    """A tuple element's type without its name (``a Int32`` → ``Int32``)."""
    head = arg.split("(", 1)[0].strip()
    if " " in head:
        name, _, typ = arg.strip().partition(" ")
        if name.strip('`"').isidentifier() or name.startswith(("`", '"')):
            return typ.strip()
    return arg


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def varuint(self) -> int:
        out = shift = 0
        while True:
            if self.pos >= len(self.data):
                raise NativeError("chDB's Native output ended inside a number")
            b = self.data[self.pos]
            self.pos += 1
            out |= (b & 0x7F) << shift
            if b < 0x80:
                return out
            shift += 7

    def uint64(self) -> int:
        value = int.from_bytes(self.take(8), "little")
        return value

    def string(self) -> bytes:
        return self.take(self.varuint())

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise NativeError("chDB's Native output ended inside a column")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.data):
            raise NativeError("chDB's Native output ended inside a column")
        self.pos += n


def _skip_prefix(r: _Reader, t: _Type) -> None:
    """The serialization's state prefix, written once before a column's data."""
    if t.name == "LowCardinality":
        r.skip(8)  # keys serialization version
    else:
        for a in t.args:
            _skip_prefix(r, a)


def _skip_data(r: _Reader, t: _Type, rows: int) -> None:
    if rows == 0:
        return
    if t.size:
        r.skip(t.size * rows)
    elif t.name == "String":
        for _ in range(rows):
            r.skip(r.varuint())
    elif t.name == "Nullable":
        r.skip(rows)
        _skip_data(r, t.args[0], rows)
    elif t.name == "Array":
        r.skip(8 * (rows - 1))
        _skip_data(r, t.args[0], r.uint64())  # the last offset: the elements of every row
    elif t.name == "Tuple":
        for a in t.args:
            _skip_data(r, a, rows)
    elif t.name == "LowCardinality":
        keys = t.args[0].args[0] if t.args[0].name == "Nullable" else t.args[0]
        done = 0
        while done < rows:
            index_type = r.uint64()
            if index_type & _LC_HAS_ADDITIONAL_KEYS:
                _skip_data(r, keys, r.uint64())
            n = r.uint64()
            r.skip(_LC_INDEX_BYTES[index_type & 0xFF] * n)
            done += n
    else:  # pragma: no cover - parse() makes only the types above
        raise NativeError(f"cannot walk {t.name}")


def at_revision(data: bytes, revision: int) -> bytes:
    """chDB's revision-0 Native ``data`` as a server writes it for a client at ``revision``:
    unchanged at 0; a block-info header per block above 0; a 0 custom-serialization byte
    after each column's type from `CUSTOM_SERIALIZATION` on. ``LowCardinality`` columns stay
    as they are (a server would turn them into their plain type below `WITH_LOW_CARDINALITY`;
    no client of this decade asks for that). Raises `NativeError` for what it cannot walk."""
    if revision <= 0 or not data:
        return data
    flag = revision >= CUSTOM_SERIALIZATION
    r, out = _Reader(data), bytearray()
    while r.pos < len(data):
        out += BLOCK_INFO
        start = r.pos
        columns, rows = r.varuint(), r.varuint()
        out += data[start : r.pos]
        for _ in range(columns):
            start = r.pos
            r.string()  # name
            typ = r.string()
            out += data[start : r.pos]
            if flag:
                out.append(0)
            start = r.pos
            if rows:
                t = _Type.parse(typ.decode())
                _skip_prefix(r, t)
                _skip_data(r, t, rows)
            out += data[start : r.pos]
    return bytes(out)
