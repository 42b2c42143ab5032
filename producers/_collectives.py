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

Where each part lives (all re-exported here):

- `collective_op` and `span_kind` (which collective a name names, which host spans belong to
  one), and `describe_span`, `said_by_args` and `said_by_kernel_name` (what one event says, a
  `Said`): `perfloop.producers._collective_events`;
- `dtype_name` and `dtype_bytes` (element types): `perfloop.producers._dtypes`;
- `HostComms` (the host spans of one call, nested on one thread, and the call that launched a
  kernel): `perfloop.producers._collective_calls`;
- here, `ProcessGroups` (group sizes from the trace's metadata) and `combine`, which merges
  what the events of one collective say into its row, a `Collective`.

A missing, negative, non-integral, non-numeric or absurd (over 2**48 elements or 2**56
bytes, a group over 2**20 ranks) value is *unknown*, never an error: the row then carries
0 bytes, group size 0, an empty dtype or op ``other``, the schema's "not recorded".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from perfloop.producers._collective_calls import HostComms
from perfloop.producers._collective_events import (
    API,
    BACKEND,
    MAX_GROUP,
    PARAMS,
    Said,
    collective_op,
    describe_span,
    said_by_args,
    said_by_kernel_name,
    span_kind,
)
from perfloop.producers._dtypes import dtype_bytes, dtype_name

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


_MAX_BYTES = 1 << 56
_SAME_SHAPE = frozenset({"all_reduce", "broadcast", "reduce", "send", "recv", "barrier"})
"""Collectives whose output buffer is the size of their input."""


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
            if type(size) is not int or not 1 <= size <= MAX_GROUP:
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
        if small > 0 and big >= small and big % small == 0 and big // small <= MAX_GROUP:
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
