"""Naming and sizing the collectives of a PyTorch-profiler trace (private to trace replay).

One collective call shows up in a trace as several events; which ones depends on the PyTorch
version, the backend and what was captured:

- the API call, a host op: ``c10d::allreduce_``, ``c10d::_allgather_base_``,
  ``c10d::alltoall_base_`` … (``Input Dims``/``Input type`` give its tensors; the gathering,
  scattering and all-to-all ops take their outputs first), or a functional collective such as
  ``_c10d_functional::all_gather_into_tensor`` (torch.compile, DTensor) around one;
- ``record_param_comms``: newer PyTorch gives it ``Collective name``, ``In msg nelems``,
  ``Out msg nelems``, ``dtype``, ``Group size``, ``Process Group Name`` and ``Process Group
  Ranks``; older PyTorch only its input tensors;
- the backend's work: ``nccl:all_reduce``, ``nccl:send 0->1``, ``gloo:all_gather``,
  ``mpi:…``, ``ucc:…``, ``xccl:…``, with the work's input tensors (gloo runs it on its own
  worker threads, away from the API call);
- the GPU kernel: ``ncclKernel_AllReduce_RING_LL_Sum_float`` (older NCCL, and RCCL),
  ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` (newer NCCL); ``…SendRecv…`` (point-to-point
  and all-to-all alike) and ``ncclDevKernel_Generic`` name no one collective. Newer Kineto
  copies the ``record_param_comms`` arguments onto the kernel.

`describe_span`, `said_by_args` and `said_by_kernel_name` read what one event says (a `Said`);
`HostComms` groups the host spans of one call (nested on one thread) and finds the call that
launched a kernel; `combine` merges what the events of one collective say into its row.

A missing, negative, non-integral, non-numeric or absurd (over 2**48 elements or 2**56
bytes, a group over 2**20 ranks) value is *unknown*, never an error: the row then carries
0 bytes, group size 0, an empty dtype or op ``other``, the schema's "not recorded".
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "API",
    "BACKEND",
    "PARAMS",
    "Collective",
    "HostComms",
    "ProcessGroups",
    "Said",
    "collective_op",
    "combine",
    "describe_span",
    "dtype_bytes",
    "dtype_name",
    "said_by_args",
    "said_by_kernel_name",
    "span_kind",
]

API, PARAMS, BACKEND = 0, 1, 2
"""Kinds of host span: the API call, ``record_param_comms``, the backend's work."""

_MAX_ELEMS = 1 << 48
_MAX_GROUP = 1 << 20
_MAX_BYTES = 1 << 56

# --- names --------------------------------------------------------------------------------------

# Matched in order against the name reduced to lower-case letters and digits; the first wins,
# so the specific names come before the words they contain ("allreduce" before "reduce").
_OP_RULES: tuple[tuple[str, str], ...] = (
    ("sendrecv", "other"),  # NCCL's point-to-point kernel: send, recv and all-to-all alike
    ("batchisendirecv", "other"),
    ("crossdevicereduce", "all_reduce"),  # vLLM's custom all-reduce kernels
    ("allreduce", "all_reduce"),
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("bcast", "broadcast"),
    ("barrier", "barrier"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("reduce", "reduce"),
    ("send", "send"),
    ("recv", "recv"),
)
_NOT_COLLECTIVES = frozenset(
    {
        "wait",
        "waittensor",
        "wraptensorautograd",
        "checkfornan",
        "init",
        "split",
        "commsplit",
        "abort",
    }
)
"""Names a comm span can carry that are no collective (waiting on one, setting one up)."""

_KERNEL_PREFIX = re.compile(r"^(?:nccl|rccl|mscc?l)(?:dev)?kernel_")
_NAMESPACE = re.compile(r"^(?:void\s+)?(?:[\w.]+::)+|^[a-z]*ccl:|^(?:gloo|mpi|ucc):")
_NOT_ALNUM = re.compile(r"[^a-z0-9]")
_API_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
_BACKEND_PREFIX = re.compile(r"^(?:[a-z]*ccl|gloo|mpi|ucc):")


def _key(name: str) -> str:
    """The name without backend prefix, namespace, kernel arguments and punctuation."""
    low = _NAMESPACE.sub("", name.strip().lower().split("(")[0].removeprefix("void "))
    low = _KERNEL_PREFIX.sub("", low)
    first = low.split()[0] if low.split() else ""  # "nccl:send 0->1": the peer is no part
    return _NOT_ALNUM.sub("", first)


@functools.lru_cache(maxsize=4096)  # a trace repeats a few dozen names
def collective_op(name: str) -> str:
    """Map any collective's name onto `COLLECTIVE_OPS`; ``other`` when it names none of them.

    Takes a ``Collective name`` argument, a backend title (``nccl:``, ``gloo:``, ``mpi:``,
    ``ucc:``, ``xccl:``…), a ``c10d::``/``_c10d_functional::`` op or an NCCL/RCCL kernel name.

    >>> collective_op("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)")
    'all_reduce'
    >>> collective_op("nccl:_all_gather_base"), collective_op("alltoall_base")
    ('all_gather', 'all_to_all')
    >>> collective_op("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL")
    'reduce_scatter'
    >>> collective_op("c10d::recv_any_source_"), collective_op("nccl:send 0->1")
    ('recv', 'send')
    >>> collective_op("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"), collective_op("?")
    ('other', 'other')
    """
    key = _key(name) if isinstance(name, str) else ""
    for needle, op in _OP_RULES:
        if needle in key:
            return op
    return "other"


def span_kind(name: str, args: dict[str, Any]) -> int | None:
    """`API`, `PARAMS` or `BACKEND` for a host span that belongs to a collective, else None.

    An API op counts only when its name is a collective (``c10d::check_for_nan`` is not); a
    ``record_param_comms`` or backend span only when it is not a wait or a setup.

    >>> span_kind("c10d::allreduce_", {}), span_kind("gloo:all_reduce", {})
    (0, 2)
    >>> span_kind("record_param_comms", {"Collective name": "wait"}) is None
    True
    >>> span_kind("c10d::check_for_nan", {}) is None, span_kind("aten::add", {}) is None
    (True, True)
    """
    if name == "record_param_comms":
        coll = args.get("Collective name")
        if isinstance(coll, str) and _key(coll) in _NOT_COLLECTIVES:
            return None
        return PARAMS
    if name.startswith(_API_PREFIXES):
        return API if collective_op(name) != "other" else None
    if _BACKEND_PREFIX.match(name):
        return BACKEND if _key(name) not in _NOT_COLLECTIVES else None
    return None


# --- element types ------------------------------------------------------------------------------

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


def _dtype(text: Any) -> tuple[str, int] | None:
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
    d = _dtype(dtype)
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
    d = _dtype(dtype)
    if d:
        return d[0]
    if not isinstance(dtype, str) or dtype.strip() in ("", "Scalar", "TensorList", "GenericList"):
        return ""
    return _CONTROL.sub(" ", dtype).strip()[:32]


# --- what one event says ------------------------------------------------------------------------


@dataclass(slots=True)
class Said:
    """What one event says about its collective; ``-1``, ``0`` and ``""`` mean not said.

    ``in_elems``/``out_elems`` count the elements of the rank's input and output buffers
    (of type ``dtype``); ``op`` is one of `COLLECTIVE_OPS`, ``other`` for a name that is none
    of them, ``""`` when the event names no collective.
    """

    op: str = ""
    in_elems: int = -1
    out_elems: int = -1
    dtype: str = ""
    group: str = ""
    group_size: int = 0


def _count(v: Any) -> int:
    """A plausible element count, or -1 (missing, negative, fractional, bool, text, NaN…)."""
    if type(v) is int:
        return v if 0 <= v <= _MAX_ELEMS else -1
    if type(v) is float and math.isfinite(v) and v.is_integer():
        return int(v) if 0 <= v <= _MAX_ELEMS else -1
    return -1


def _numel(shape: Any) -> int:
    if not isinstance(shape, list):
        return -1
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return -1
        n *= d
        if n > _MAX_ELEMS:
            return -1
    return n


def _tensors(dims: Any, types: Any) -> list[tuple[int, str]]:
    """``(elements, dtype)`` of each argument of a host op; ``-1`` for a non-tensor or one not
    recorded (a list of lists, or a ``TensorList`` from a profiler that kept no shapes)."""
    if not isinstance(dims, list):
        return []
    types = types if isinstance(types, list) else []
    out = []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) else ""
        dt = _dtype(t)
        if dt is not None:
            out.append((_numel(d), dt[0]))
        elif (t == "TensorList" or t == "") and isinstance(d, list) and d:
            if all(isinstance(s, list) for s in d):
                ns = [_numel(s) for s in d]
                n = sum(ns) if min(ns) >= 0 else -1
                out.append((n if n <= _MAX_ELEMS else -1, ""))
            else:
                out.append((-1, ""))
        else:
            out.append((-1, ""))
    return out


_OUTPUTS_FIRST = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})
_SAME_SHAPE = frozenset({"all_reduce", "broadcast", "reduce", "send", "recv", "barrier"})
"""Collectives whose output buffer is the size of their input."""


def _group(args: dict[str, Any]) -> tuple[str, int]:
    name = args.get("Process Group Name")
    if name is None or name == "":
        name = args.get("Process Group ID")
    ranks = args.get("Process Group Ranks")
    rank_list = _ranks(ranks)
    if isinstance(name, str) and name.strip():
        group = name.strip()
    elif type(name) is int and name >= 0:
        group = str(name)
    elif isinstance(ranks, str) and rank_list and len(ranks.strip()) <= 128:
        group = ranks.strip()
    else:
        group = ""
    size = args.get("Group size")
    if type(size) is not int or not 1 <= size <= _MAX_GROUP:
        size = len(rank_list) if rank_list and len(rank_list) <= _MAX_GROUP else 0
    return _CONTROL.sub(" ", group)[:128], size


_RANKS = re.compile(r"^\[\s*\d+(?:\s*,\s*\d+)*\s*\]$")


def _ranks(v: Any) -> list[int]:
    """The ranks of ``Process Group Ranks`` (``"[0, 1]"`` or a list); [] when not a full list
    (Kineto cuts a long one short: ``"[64, 65, …, 93, ...]"``)."""
    if isinstance(v, list):
        return v if v and all(type(r) is int and r >= 0 for r in v) else []
    if isinstance(v, str) and len(v) < 1 << 20 and _RANKS.match(v.strip()):
        return [int(r) for r in v.strip()[1:-1].split(",")]
    return []


def said_by_args(args: dict[str, Any]) -> Said:
    """What ``record_param_comms``-style arguments say (on the op itself or on a kernel).

    >>> said_by_args({"Collective name": "allreduce", "In msg nelems": 8, "Out msg nelems": 8,
    ...               "dtype": "Float", "Group size": 2, "Process Group Name": "0"})
    Said(op='all_reduce', in_elems=8, out_elems=8, dtype='float32', group='0', group_size=2)
    >>> said_by_args({"In msg nelems": -3, "Group size": "eight", "dtype": None})
    Said(op='', in_elems=-1, out_elems=-1, dtype='', group='', group_size=0)
    """
    coll = args.get("Collective name")
    if isinstance(coll, str) and coll.strip():
        op = collective_op(coll)
    else:  # a name that is no text still says "a collective", just not which
        op = "other" if "Collective name" in args else ""
    group, size = _group(args)
    return Said(
        op,
        _count(args.get("In msg nelems")),
        _count(args.get("Out msg nelems")),
        dtype_name(args.get("dtype")),
        group,
        size,
    )


def describe_span(kind: int, name: str, args: dict[str, Any]) -> Said:
    """What a host span of this `span_kind` says about its collective.

    >>> describe_span(API, "c10d::_allgather_base_",
    ...               {"Input Dims": [[64], [16], []], "Input type": ["float", "float", ""]})
    Said(op='all_gather', in_elems=16, out_elems=64, dtype='float32', group='', group_size=0)
    >>> describe_span(BACKEND, "nccl:all_reduce", {"Input Dims": [[10]], "Input type": ["half"]})
    Said(op='all_reduce', in_elems=10, out_elems=-1, dtype='float16', group='', group_size=0)
    """
    tensors = _tensors(args.get("Input Dims"), args.get("Input type"))
    dtype = next((d for _, d in tensors if d), "")
    if kind == PARAMS:
        said = said_by_args(args)
        if said.in_elems < 0 and tensors:  # older PyTorch: only its input tensors
            said.in_elems = tensors[0][0]
        said.dtype = said.dtype or dtype
        return said
    op = collective_op(name)
    if kind == BACKEND:  # the work's inputs, flattened
        known = [n for n, _ in tensors if n >= 0]
        ins = sum(known) if known and len(known) == len(tensors) else -1
        return Said(op, ins, -1, dtype)
    first = tensors[0][0] if tensors else -1
    if name.startswith("c10d::") and op in _OUTPUTS_FIRST:
        second = tensors[1][0] if len(tensors) > 1 else -1
        return Said(op, second, first, dtype)
    if name.startswith("c10d::"):  # in place: one buffer is input and output
        return Said(op, first, first, dtype)
    return Said(op, first, -1, dtype)  # functional collectives: (input, …) -> output


_KERNEL_REDUCTIONS = frozenset({"all_reduce", "reduce_scatter", "reduce"})


def said_by_kernel_name(name: str) -> Said:
    """The op a comm kernel's name gives, and its element type for the reducing collectives
    (the others move bytes: NCCL names them ``int8_t`` whatever the tensor holds).

    >>> said_by_kernel_name("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)")
    Said(op='all_reduce', in_elems=-1, out_elems=-1, dtype='bfloat16', group='', group_size=0)
    >>> said_by_kernel_name("ncclKernel_Broadcast_RING_LL_Sum_int8_t").dtype
    ''
    """
    op = collective_op(name)
    dtype = ""
    if op in _KERNEL_REDUCTIONS:
        for token in name.split("(")[0].split("_"):
            d = _dtype(token)
            if d:
                dtype = d[0]
                break
    return Said(op, dtype=dtype)


# --- process groups ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessGroups:
    """Group sizes from a trace's ``distributedInfo.pg_config``.

    ``only`` is the size every listed group has (0 when they differ or none is listed): a
    collective that names no group then still has a known size.
    """

    sizes: dict[str, int] = field(default_factory=dict)
    only: int = 0

    @classmethod
    def of(cls, info: Any) -> ProcessGroups:
        pgs = info.get("pg_config") if isinstance(info, dict) else None
        sizes: dict[str, int] = {}
        all_sizes = set()
        for pg in pgs if isinstance(pgs, list) else ():
            if not isinstance(pg, dict):
                continue
            size = pg.get("pg_size")
            if type(size) is not int or not 1 <= size <= _MAX_GROUP:
                continue
            all_sizes.add(size)
            for key in ("pg_name", "uid"):
                if isinstance(pg.get(key), str | int) and not isinstance(pg.get(key), bool):
                    sizes.setdefault(str(pg[key]), size)
        return cls(sizes, all_sizes.pop() if len(all_sizes) == 1 else 0)


# --- one collective from its events -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective's row: op, bytes, group, group size, dtype (0 / "" when unknown)."""

    op: str
    size_bytes: int
    group: str
    group_size: int
    dtype: str


def _ratio(op: str, parts: Iterable[Said]) -> int:
    """The group size an all-gather's (reduce-scatter's) two buffers imply: out/in (in/out)."""
    if op not in ("all_gather", "reduce_scatter"):
        return 0
    for p in parts:
        small, big = (p.in_elems, p.out_elems) if op == "all_gather" else (p.out_elems, p.in_elems)
        if small > 0 and big >= small and big % small == 0 and big // small <= _MAX_GROUP:
            return big // small
    return 0


def combine(parts: Sequence[Said], groups: ProcessGroups) -> Collective:
    """Merge what the events of one collective say, most authoritative first.

    The op is the first one named (``other`` only when no event names a known one); dtype,
    group and group size the first given, then the group's size from ``pg_config``, then the
    size an all-gather's or reduce-scatter's two buffers imply, then the one size all groups
    share. ``size_bytes`` is the larger of the rank's input and output buffers (the "size" of
    nccl-tests), elements × element size; an all-gather's output is its input × group size,
    a reduce-scatter's input its output × group size.

    >>> combine([Said("all_gather", 16, -1, "bfloat16")], ProcessGroups({}, 8))
    Collective(op='all_gather', size_bytes=256, group='', group_size=8, dtype='bfloat16')
    """
    op = next((p.op for p in parts if p.op and p.op != "other"), "other")
    dtype = next((p.dtype for p in parts if p.dtype), "")
    group = next((p.group for p in parts if p.group), "")
    gsize = next((p.group_size for p in parts if p.group_size > 0), 0)
    gsize = gsize or groups.sizes.get(group, 0) or _ratio(op, parts)
    if not gsize and not group:
        gsize = groups.only
    item = dtype_bytes(dtype)

    def most(side: str) -> int:
        best = -1
        for p in parts:
            n = getattr(p, side)
            b = n * (dtype_bytes(p.dtype) or item)
            if n >= 0 and (b > 0 or n == 0):
                best = max(best, b)
        return best

    ins, outs = most("in_elems"), most("out_elems")
    if op in _SAME_SHAPE:
        ins = outs = max(ins, outs)
    elif op == "all_gather" and gsize and outs < 0 <= ins:
        outs = ins * gsize
    elif op == "reduce_scatter" and gsize and ins < 0 <= outs:
        ins = outs * gsize
    size = max(ins, outs, 0)
    return Collective(op, size if size <= _MAX_BYTES else 0, group, gsize, dtype)


# --- host spans of one call ---------------------------------------------------------------------


@dataclass(slots=True)
class HostSpan:
    """One comm span of the host timeline: its times (µs), `span_kind` and what it says."""

    start: float
    end: float
    kind: int
    said: Said


@dataclass(slots=True)
class Call:
    """The host spans of one collective call: an API or ``record_param_comms`` span and every
    comm span that starts inside it on its thread (or one backend span on its own)."""

    spans: list[HostSpan]
    anchor_end: float

    def has(self, kind: int, *, named: bool = False) -> bool:
        """Whether a span of ``kind`` is in the call (one that names its collective, if
        ``named``)."""
        return any(s.kind == kind and (not named or s.said.op) for s in self.spans)

    def extent(self, kind: int | None = None) -> tuple[float, float]:
        ss = [s for s in self.spans if kind is None or s.kind == kind] or self.spans
        return min(s.start for s in ss), max(s.end for s in ss)

    def parts(self, after_params: Sequence[Said] = ()) -> list[Said]:
        """What its spans say, most authoritative first: API spans (outermost first), then
        ``record_param_comms``, then ``after_params`` (a kernel's own arguments), then backend."""
        ordered = sorted(self.spans, key=lambda s: (s.kind, s.start, -s.end))
        host = [s.said for s in ordered if s.kind != BACKEND]
        return host + list(after_params) + [s.said for s in ordered if s.kind == BACKEND]


class HostComms:
    """The collective calls of a trace's host timeline, and which one launched a kernel.

    `add` the comm spans as they stream by, then `close` once: spans nested on one thread
    become one `Call`. A backend span joins the API call it starts inside, but takes in no
    later span (gloo's ``send``, timed until its peer receives, can outlast the next call).
    """

    def __init__(self) -> None:
        self._spans: dict[Hashable, list[HostSpan]] = defaultdict(list)
        self.calls: list[Call] = []
        self._starts: dict[Hashable, list[float]] = {}
        self._index: dict[Hashable, list[int]] = {}

    def add(self, thread: Hashable, start: float, end: float, kind: int, said: Said) -> None:
        self._spans[thread].append(HostSpan(start, max(end, start), kind, said))

    def close(self) -> None:
        for thread, spans in self._spans.items():
            spans.sort(key=lambda s: (s.start, -s.end, s.kind))
            cur: Call | None = None
            mine: list[int] = []
            for s in spans:
                if cur is not None and s.start <= cur.anchor_end:
                    cur.spans.append(s)
                    if s.kind != BACKEND:
                        cur.anchor_end = max(cur.anchor_end, s.end)
                    continue
                call = Call([s], s.end if s.kind != BACKEND else -math.inf)
                cur = call if s.kind != BACKEND else None
                mine.append(len(self.calls))
                self.calls.append(call)
            self._starts[thread] = [self.calls[i].spans[0].start for i in mine]
            self._index[thread] = mine
        self._spans.clear()

    def at(self, thread: Hashable, ts: float) -> int | None:
        """Index in `calls` of the latest call on ``thread`` whose spans hold ``ts``."""
        starts = self._starts.get(thread)
        if not starts:
            return None
        j = bisect.bisect_right(starts, ts) - 1
        for k in range(j, max(j - 16, -1), -1):  # overlapping calls on one thread are rare
            i = self._index[thread][k]
            if self.calls[i].extent()[1] >= ts:
                return i
        return None

    def has(self, kind: int, *, named: bool = False) -> bool:
        """Whether some call has a span of ``kind`` (that names its collective, if ``named``)."""
        return any(c.has(kind, named=named) for c in self.calls)
