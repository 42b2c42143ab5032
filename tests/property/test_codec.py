"""Codec round trip under hypothesis: any valid columns come back exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import annotated_types
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.schemas import BATCH_KINDS, WIRE_FORMATS, SchemaError, decode_batch, encode_batch

_ENVELOPE = {"schema_version", "event_id", "job_id", "node"}


@dataclass(frozen=True)
class _Field:
    """One column as the pydantic model declares it (read here, not from the codec)."""

    name: str
    is_int: bool
    default: Any
    lo: float | None
    lo_strict: bool
    hi: float | None
    is_str: bool = False
    nullable: bool = False
    max_len: int = 0


def _fields(kind: str) -> list[_Field]:
    out = []
    for name, info in BATCH_KINDS[kind].model_fields.items():
        if name in _ENVELOPE:
            continue
        lo = hi = None
        lo_strict = False
        max_len = 4096
        for m in info.metadata:
            if isinstance(m, annotated_types.Ge):
                lo = float(m.ge)
            elif isinstance(m, annotated_types.Gt):
                lo, lo_strict = float(m.gt), True
            elif isinstance(m, annotated_types.Le):
                hi = float(m.le)
            elif isinstance(m, annotated_types.MaxLen):
                max_len = m.max_length
        default = _REQUIRED if info.is_required() else info.default
        out.append(
            _Field(
                name,
                info.annotation is int,
                default,
                lo,
                lo_strict,
                hi,
                is_str=info.annotation is str,
                nullable=info.annotation == (float | None),
                max_len=max_len,
            )
        )
    return out


_REQUIRED = object()
_SPECS = {kind: _fields(kind) for kind in BATCH_KINDS}

# Enough examples to find edge cases, few enough to keep the suite fast.
FAST = settings(max_examples=60, deadline=None)


def _column_strategy(kind: str, name: str) -> st.SearchStrategy[Any]:
    """Values the schema accepts for one column, read from the model's declared bounds."""
    spec = {c.name: c for c in _SPECS[kind]}[name]
    if spec.is_str:
        chars = st.characters(min_codepoint=0x20, blacklist_categories=("Cs",))
        return st.text(chars, min_size=1, max_size=min(spec.max_len, 20))
    if spec.is_int:
        lo = int(spec.lo) if spec.lo is not None else -(2**62)
        hi = int(spec.hi) if spec.hi is not None else 2**62
        return st.integers(lo, hi)
    floats = st.floats(
        min_value=spec.lo if spec.lo is not None else -1e12,
        max_value=spec.hi if spec.hi is not None else 1e12,
        exclude_min=spec.lo_strict,
        allow_nan=False,
        allow_infinity=False,
    )
    return st.one_of(st.none(), floats) if spec.nullable else floats


@st.composite
def batches(draw: st.DrawFn) -> tuple[str, dict[str, list[Any]], set[str]]:
    """A kind, valid columns for it, and which optional columns were left out."""
    kind = draw(st.sampled_from(sorted(BATCH_KINDS)))
    n = draw(st.integers(0, 40))
    cols: dict[str, list[Any]] = {}
    left_out: set[str] = set()
    for c in _SPECS[kind]:
        if c.default is not _REQUIRED and c.name != "ts_ns" and draw(st.booleans()):
            left_out.add(c.name)
            continue
        cols[c.name] = draw(st.lists(_column_strategy(kind, c.name), min_size=n, max_size=n))
    return kind, cols, left_out


job_ids = st.from_regex(r"[A-Za-z0-9._:/@+-]{1,64}", fullmatch=True)


@FAST
@given(
    batches(),
    job_ids,
    st.text(min_size=1, max_size=40),
    st.integers(0, 2**31),
    st.sampled_from(WIRE_FORMATS),
)
def test_round_trip_preserves_every_value(
    b: tuple[str, dict[str, list[Any]], set[str]], job_id: str, node: str, seq: int, wire: str
) -> None:
    kind, cols, left_out = b
    data = encode_batch(kind, cols, job_id=job_id, node=node, producer_id="p", seq=seq, wire=wire)
    batch = decode_batch(data)

    assert (batch.kind, batch.job_id, batch.node, batch.seq) == (kind, job_id, node, seq)
    n = len(cols["ts_ns"])
    assert len(batch) == n
    assert set(batch.columns) == {c.name for c in _SPECS[kind]}
    nan = float("nan")
    for c in _SPECS[kind]:
        got = batch.columns[c.name].tolist()
        want = [c.default] * n if c.name in left_out else cols[c.name]
        if c.nullable:  # null travels as JSON null and decodes to NaN
            got = [None if v != v else v for v in got]
            want = [None if v is None or v != v else v for v in want]
            assert nan not in want
        assert got == want, c.name
    assert batch.event_ids() == [f"{batch.batch_id}-{i}" for i in range(n)]
    assert len(set(batch.event_ids())) == n


@FAST
@given(batches(), job_ids)
def test_decoded_samples_are_valid_events(
    b: tuple[str, dict[str, list[Any]], set[str]], job_id: str
) -> None:
    kind, cols, _ = b
    batch = decode_batch(encode_batch(kind, cols, job_id=job_id, node="n"))
    events = list(batch.events())
    assert len(events) == len(batch)
    for i, e in enumerate(events):
        assert isinstance(e, BATCH_KINDS[kind])
        assert e.ts_ns == cols["ts_ns"][i]


@FAST
@given(batches(), st.data(), st.sampled_from(WIRE_FORMATS))
def test_one_out_of_range_value_fails_the_batch(
    b: tuple[str, dict[str, list[Any]], set[str]], data: st.DataObject, wire: str
) -> None:
    kind, cols, _ = b
    bounded = [
        c
        for c in _SPECS[kind]
        if c.name in cols and not c.is_str and (c.lo is not None or c.hi is not None)
    ]
    if not cols["ts_ns"] or not bounded:
        return
    c = data.draw(st.sampled_from(bounded))
    i = data.draw(st.integers(0, len(cols["ts_ns"]) - 1))
    if c.hi is not None and (c.lo is None or data.draw(st.booleans())):
        bad: float = c.hi + 1
    else:
        assert c.lo is not None
        bad = c.lo if c.lo_strict else c.lo - 1
    cols[c.name][i] = int(bad) if c.is_int else float(bad)
    if c.nullable:  # a null next to the bad value must not hide it
        cols[c.name] = [0.0 if v is None and j != i else v for j, v in enumerate(cols[c.name])]
    with pytest.raises(SchemaError, match=f"column '{c.name}' sample {i} "):
        decode_batch(encode_batch(kind, cols, job_id="j", node="n", wire=wire))


@FAST
@given(batches(), st.data(), st.sampled_from(WIRE_FORMATS))
def test_with_bad_values_in_several_columns_the_first_column_is_named(
    b: tuple[str, dict[str, list[Any]], set[str]], data: st.DataObject, wire: str
) -> None:
    """All columns' values are checked at once; the error still names the first bad column
    (in the schema's order) and its bad sample, as checking column by column would."""
    kind, cols, _ = b
    n = len(cols["ts_ns"])
    numeric = [c for c in _SPECS[kind] if c.name in cols and not c.is_str]
    if not n or not numeric:
        return
    chosen = data.draw(st.lists(st.sampled_from(numeric), min_size=1, max_size=3, unique=True))
    bad_at = {}
    for c in chosen:
        i = data.draw(st.integers(0, n - 1))
        # JSON has no infinity: a nullable float's inf is written as null, which it accepts
        choices = ["inf"] if not c.is_int and not (c.nullable and wire == "json") else []
        choices += ["above"] if c.hi is not None else []
        choices += ["below"] if c.lo is not None else []
        if not c.is_int and not c.nullable:
            choices.append("nan")
        if not choices:
            continue
        how = data.draw(st.sampled_from(choices))
        value: float = {
            "inf": float("inf"),
            "nan": float("nan"),
            "above": (c.hi or 0) + 1,
            "below": (c.lo or 0) - (0 if c.lo_strict else 1),
        }[how]
        cols[c.name] = [0.0 if v is None else v for v in cols[c.name]]  # nulls stay out
        cols[c.name][i] = int(value) if c.is_int else float(value)
        bad_at[c.name] = i
    if not bad_at:
        return
    first = next(c.name for c in _SPECS[kind] if c.name in bad_at)
    with pytest.raises(SchemaError, match=f"column '{first}' sample {bad_at[first]} "):
        decode_batch(encode_batch(kind, cols, job_id="j", node="n", wire=wire))


def _any_value() -> st.SearchStrategy[Any]:
    """Anything a buggy script may put in a column: right and wrong types, edge numbers."""
    return st.one_of(
        st.integers(-(2**63), 2**63 - 1),
        st.floats(),
        st.none(),
        st.booleans(),
        st.text(max_size=8),
        st.sampled_from(["fwd", "bwd", "opt"]),
    )


@FAST
@given(st.data())
def test_columns_built_from_buffers_decode_as_pyarrows_own_conversion(
    data: st.DataObject,
) -> None:
    """The encoder builds clean columns from their bytes (no pandas import in a training
    process); whatever the values, a batch decodes (or is refused, or falls back to JSON)
    exactly as when pyarrow converts the values itself."""
    import numpy as np

    from perfloop.schemas import arrow_batch

    kind = data.draw(st.sampled_from(sorted(BATCH_KINDS)))
    n = data.draw(st.integers(0, 24))
    cols: dict[str, Any] = {}
    for c in _SPECS[kind]:
        clean = data.draw(st.booleans())
        values = data.draw(
            st.lists(
                _column_strategy(kind, c.name) if clean else _any_value(), min_size=n, max_size=n
            )
        )
        if clean and not c.is_str and None not in values and data.draw(st.booleans()):
            values = np.array(values, dtype=np.int64 if c.is_int else np.float64)
        cols[c.name] = values

    def outcome() -> Any:
        try:
            msg = encode_batch(kind, cols, job_id="j", node="n", batch_id="b")
        except Exception as e:  # the JSON fallback cannot hold it either
            return ("raised", type(e).__name__)
        try:
            got = decode_batch(msg).columns
        except SchemaError as e:
            return ("refused", str(e))
        return ("ok", msg[:4], repr({k: v.tolist() if hasattr(v, "tolist") else v
                                     for k, v in got.items()}))  # fmt: skip

    built = outcome()
    clean = arrow_batch._clean
    arrow_batch._clean = lambda values, dtype: None  # type: ignore[assignment]
    try:
        converted = outcome()
    finally:
        arrow_batch._clean = clean
    assert built == converted
