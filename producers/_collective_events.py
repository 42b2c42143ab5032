"""What one event of a collective call says about it: the collective, its buffers, its group.

Private to trace replay. The events of one call (see `perfloop.producers._collectives`) each
say part of the story: `collective_op` maps any collective's name (API op, ``record_param_comms``
argument, backend title, NCCL/RCCL kernel) onto `COLLECTIVE_OPS`; `span_kind` tells which host
spans belong to a collective (`API`, `PARAMS` or `BACKEND`); `said_by_args`, `describe_span`
and `said_by_kernel_name` read what one event says into a `Said`, ``-1``, ``0`` and ``""``
where it says nothing or nothing plausible.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from perfloop.producers._dtypes import dtype_name, lookup_dtype

__all__ = [
    "API",
    "BACKEND",
    "MAX_GROUP",
    "PARAMS",
    "Said",
    "collective_op",
    "describe_span",
    "said_by_args",
    "said_by_kernel_name",
    "span_kind",
]

API, PARAMS, BACKEND = 0, 1, 2
"""Kinds of host span: the API call, ``record_param_comms``, the backend's work."""

_MAX_ELEMS = 1 << 48
MAX_GROUP = 1 << 20
"""The largest plausible group: a larger size is unknown."""

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
        dt = lookup_dtype(t)
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
_CONTROL = re.compile(r"[\x00-\x1f]+")


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
    if type(size) is not int or not 1 <= size <= MAX_GROUP:
        size = len(rank_list) if rank_list and len(rank_list) <= MAX_GROUP else 0
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
            d = lookup_dtype(token)
            if d:
                dtype = d[0]
                break
    return Said(op, dtype=dtype)
