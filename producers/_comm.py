"""Communication the training hooks cannot time from the calling thread alone.

Three things live here, all used by the training hooks (`_hooks_state`, `_hooks_distributed`):

- `InFlight`: asynchronous collectives (``async_op=True``, and every gradient all-reduce of
  DDP) are timed from the call — the rank's arrival at the collective — to the completion of
  their work, reported by a done-callback on the work's future (on the backend's thread).
  Completed ones wait in a queue until the training thread takes them (`InFlight.take`);
  those still in flight tell the progress reporter that the rank is blocked in a collective.
- DDP's gradient all-reduce runs in C++ (the reducer) and never calls ``torch.distributed``
  from Python, so it is invisible to the collective hooks. After the first optimizer step of
  a process, every `DistributedDataParallel` without a communication hook of its own gets
  `timed_allreduce_hook`'s: what PyTorch's stock ``allreduce_hook`` does (the same averaging
  all-reduce, issued from Python), each bucket timed as one ``all_reduce`` in the callback
  that hands it back. A hook the script registers is left alone
  (its own collectives are timed like any other); one registered after ours would fail
  ("can only be registered once"), which is why ours waits for the first step: PyTorch asks
  for hooks to be registered before the first backward.

- `Unwaited`: a functional collective (``torch.distributed._functional_collectives``, what
  DTensor's tensor parallelism calls) returns at once a tensor whose work is waited on where
  it is first used (``wait_tensor``). Its row waits here, by that tensor's memory, for the
  wait to be timed: what the rank spent in the collective is its call plus its wait.

`union` turns overlapping intervals into disjoint ones, for ``comm`` spans nested in the
phase that waited (a bucket's all-reduce overlaps the next bucket's backward).
`collective_op` names the ``torch.distributed`` functions that are collectives, and
`_payload` sizes their tensors.
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "COLLECTIVES",
    "FUNCOL_MODULE",
    "DdpWatch",
    "InFlight",
    "Unwaited",
    "collective_op",
    "funcol_functions",
    "funcol_size",
    "hook_ddp",
    "timed_allreduce_hook",
    "union",
]

_now = time.perf_counter_ns

# torch.distributed function → CollectiveOp.op. Functions of torch.distributed not named here
# are hooked too when their name starts like a collective (`collective_op`): PyTorch adds new
# variants (all_gather_single, reduce_scatter_single, …) that FSDP uses at once.
COLLECTIVES: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "reduce": "reduce",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "scatter_object_list": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "send": "send",
    "isend": "send",
    "send_object_list": "send",
    "recv": "recv",
    "irecv": "recv",
    "recv_object_list": "recv",
}
_OP_PREFIXES = (
    ("all_reduce", "all_reduce"),
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
)


def collective_op(name: str) -> str | None:
    """The `CollectiveOp.op` of a ``torch.distributed`` function, or None (not a collective).

    >>> collective_op("all_gather_single"), collective_op("reduce_scatter_single")
    ('all_gather', 'reduce_scatter')
    >>> collective_op("all_reduce_coalesced"), collective_op("get_rank")
    ('all_reduce', None)
    """
    if name in COLLECTIVES:
        return COLLECTIVES[name]
    return next((op for prefix, op in _OP_PREFIXES if name.startswith(prefix)), None)


FUNCOL_MODULE = "torch.distributed._functional_collectives"
"""PyTorch's functional collectives (DTensor's tensor and sequence parallelism call them; they
issue the c10d ops directly, not through ``torch.distributed``'s functions)."""


def funcol_functions(mod: Any) -> list[tuple[str, str]]:
    """``(name, op)`` of the functional collectives of ``mod`` (`FUNCOL_MODULE`): its own public
    functions named like a collective, not autograd's helpers (``*_backward``,
    ``*_setup_context``) nor ``wait_tensor``.

    >>> import types
    >>> mod = types.ModuleType("m")
    >>> def f(): pass
    >>> for n in ("all_reduce", "all_gather_single", "all_reduce_backward", "wait_tensor"):
    ...     g = types.FunctionType(f.__code__, {}, n); g.__module__ = "m"; setattr(mod, n, g)
    >>> funcol_functions(mod)
    [('all_reduce', 'all_reduce'), ('all_gather_single', 'all_gather')]
    """
    out = []
    for name, fn in vars(mod).items():
        if name.startswith("_") or name.endswith(("_backward", "_setup_context")):
            continue
        if not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
            continue
        op = collective_op(name)
        if op is not None:
            out.append((name, op))
    return out


def funcol_size(op: str, tensor_bytes: int, group_size: int) -> int:
    """A functional collective's size by the convention below (its larger buffer): an
    all-gather's output is its input times the group; the others move their input's bytes.

    >>> funcol_size("all_gather", 1024, 4), funcol_size("reduce_scatter", 1024, 4)
    (4096, 1024)
    """
    return tensor_bytes * max(1, group_size) if op == "all_gather" else tensor_bytes


# A collective's size is its larger buffer, input or output (the convention of nccl-tests and
# HTA, and of trace replay): an all-gather moves its output's bytes, a reduce-scatter its input's.
_PAYLOAD_NAMES = (
    "tensor",
    "tensors",
    "input_tensor",
    "input",
    "input_list",
    "input_tensor_list",
    "output_tensor",
    "output",
    "output_tensor_list",
    "output_tensor_lists",
    "tensor_list",
    "gather_list",
    "scatter_list",
)


class Unwaited:
    """Collectives called but not yet waited on, by the memory of the tensor their call
    returned (``key``: a view of it, which is what a view of an `AsyncCollectiveTensor` waits
    on, shares it; a tensor with no storage counts by itself); at most ``limit``, the oldest
    handed back by `add` once more are called. Nothing is held: a tensor dropped unwaited
    leaves its row here until `add` or `older` hands it back (recorded without a wait), and a
    new one at the same memory pushes it out first.

    >>> class T:  # a tensor, with the address of its memory
    ...     def __init__(self, ptr): self.ptr = ptr
    >>> key = lambda t: t.ptr
    >>> u, t = Unwaited(key, limit=1), T(100)
    >>> u.add(t, ("all_reduce", 1, 2, 4, "world", 2, "float32", 0))
    []
    >>> u.pop(T(200)), len(u)
    (None, 1)
    >>> u.pop(T(100))[0], len(u), u.pop(t)  # a view of t: the same memory
    ('all_reduce', 0, None)
    >>> u.add(t, ("all_reduce", 1, 2, 4, "world", 2, "float32", 0))
    []
    >>> [r[1] for r in u.add(T(300), ("all_reduce", 3, 4, 4, "world", 2, "", 0))]
    [1]
    >>> u.older(0), [r[1] for r in u.older(1)], len(u)
    ([], [3], 0)
    """

    def __init__(self, key: Callable[[Any], Any], limit: int = 256) -> None:
        self.key, self.limit = key, limit
        self._rows: dict[Any, Done] = {}
        self._lock = threading.Lock()

    def add(self, tensor: Any, row: Done) -> list[Done]:
        """Note ``row`` until ``tensor`` (or a view of it) is waited on; the rows this pushes
        out (the oldest beyond ``limit``, or one left at the same memory)."""
        k = self.key(tensor)
        out = []
        with self._lock:
            rows = self._rows
            old = rows.pop(k, None)
            if old is not None:
                out.append(old)
            while len(rows) >= self.limit:
                out.append(rows.pop(next(iter(rows))))
            rows[k] = row
        return out

    def pop(self, tensor: Any) -> Done | None:
        """The row of the collective whose tensor ``tensor`` is (or views), forgotten; None if
        none."""
        k = self.key(tensor)
        with self._lock:
            return self._rows.pop(k, None)

    def older(self, step: int | None = None) -> list[Done]:
        """The rows of steps before ``step`` (all with None), forgotten: their tensors were
        not waited on through the hooks (dropped, or waited on by another path)."""
        with self._lock:
            rows = self._rows
            keys = [k for k, r in rows.items() if step is None or r[7] < step]
            return [rows.pop(k) for k in keys]

    def __len__(self) -> int:
        return len(self._rows)


def _payload(x: Any, tensor_type: Any, depth: int = 0) -> tuple[int, str]:
    """Bytes and dtype of a tensor, or of a list of tensors (or of lists of them)."""
    if isinstance(x, tensor_type):
        return int(x.numel() * x.element_size()), str(x.dtype).removeprefix("torch.")
    size, dtype = 0, ""
    if depth < 2 and isinstance(x, (list, tuple)):
        for y in x:
            n, d = _payload(y, tensor_type, depth + 1)
            size += n
            dtype = dtype or d
    return size, dtype


Done = tuple[str, int, int, int, str, int, str, int]
"""A completed collective: (op, t0, t1, size_bytes, group, group_size, dtype, step), ``step``
the one it was called in (its completion may be noticed in the next)."""


def union(intervals: Iterable[tuple[int, int]], after: int = 0) -> list[tuple[int, int]]:
    """The disjoint cover of ``intervals``, each clipped to start at ``after`` or later.

    >>> union([(5, 9), (1, 3), (2, 4), (8, 12)])
    [(1, 4), (5, 12)]
    >>> union([(1, 3), (5, 9)], after=6)
    [(6, 9)]
    """
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        a = max(a, after)
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class InFlight:
    """Asynchronous collectives of one process: in flight, and completed but not yet taken.

    >>> class Fut:
    ...     def add_done_callback(self, cb): self.cb = cb
    >>> class Work:
    ...     def __init__(self): self.fut = Fut()
    ...     def get_future(self): return self.fut
    >>> f = InFlight(); w = Work()
    >>> f.watch(w, ("all_reduce", 10, 0, 4096, "world", 2, "float32", 7))
    True
    >>> f.oldest()[0], f.take()
    ('all_reduce', [])
    >>> w.fut.cb(w.fut)
    >>> [(op, size, step) for op, _, _, size, *_, step in f.take()], f.oldest()
    ([('all_reduce', 4096, 7)], None)
    >>> class Send:
    ...     asked = 0
    ...     def get_future(self):
    ...         Send.asked += 1
    ...         raise RuntimeError("no future")
    >>> [f.watch(Send(), ("send", 1, 0, 64, "world", 2, "", 8)) for _ in range(3)], Send.asked
    ([False, False, False], 1)
    """

    def __init__(self) -> None:
        self._flying: dict[int, tuple[str, int]] = {}
        self._done: collections.deque[Done] = collections.deque()
        self._seq = 0
        self._lock = threading.Lock()
        self._futureless: set[tuple[str, str]] = set()

    def watch(self, work: Any, row: Done) -> bool:
        """Time ``work`` to its completion; False when its future cannot tell (then the caller
        times it to the call's return). An op whose work had no future in a group is not
        asked again there (gloo's send and receive: the refusal costs ~14 µs a call, and a
        pipeline stage makes several a micro-batch). In a group with a backend per device
        (``cpu:gloo,cuda:nccl``) the first answer stands for both devices' sends."""
        kind = (row[0], row[4])
        if kind in self._futureless:
            return False
        try:
            fut = work.get_future()
        except Exception:  # e.g. gloo's send/recv have no future
            self._futureless.add(kind)
            return False
        completed = self.begin(row)
        try:
            fut.add_done_callback(completed)
        except Exception:
            completed.cancel()  # type: ignore[attr-defined]
            return False
        return True

    def begin(self, row: Done) -> Callable[[Any], None]:
        """Note ``row``'s collective as in flight; the function returned notes it completed
        (call it once, from any thread; it never raises; its ``cancel`` forgets it)."""
        with self._lock:
            self._seq += 1
            key = self._seq
            self._flying[key] = (row[0], row[1])
        done, flying, lock = self._done, self._flying, self._lock

        def completed(_fut: Any = None) -> None:
            # on the backend's thread: note and forget, never raise into it
            t1 = _now()
            with lock:
                flying.pop(key, None)
            done.append((row[0], row[1], t1, *row[3:]))

        def cancel() -> None:
            with lock:
                flying.pop(key, None)

        completed.cancel = cancel  # type: ignore[attr-defined]
        return completed

    def done(self, row: Done) -> None:
        """Note a collective that already completed, timed by its caller (any thread)."""
        self._done.append(row)

    def take(self) -> list[Done]:
        """The collectives completed since the last call (training thread)."""
        out = []
        done = self._done
        while done:
            try:
                out.append(done.popleft())
            except IndexError:
                break
        return out

    def oldest(self) -> tuple[str, int] | None:
        """(op, start) of the collective in flight the longest, or None."""
        with self._lock:
            items = list(self._flying.values())
        return min(items, key=lambda x: x[1]) if items else None

    def __len__(self) -> int:
        return len(self._flying)


# -- DDP ------------------------------------------------------------------------------------
class DdpWatch:
    """The process's `DistributedDataParallel` modules, and which ones have a hook already."""

    def __init__(self) -> None:
        self.pending: weakref.WeakSet[Any] = weakref.WeakSet()

    def created(self, ddp: Any) -> None:
        self.pending.add(ddp)

    def own_hook(self, ddp: Any) -> None:
        """The script registered a hook: ours is not added."""
        self.pending.discard(ddp)

    def hook_pending(self, hook: Any, on_error: Callable[[str, BaseException], None]) -> int:
        """Give each pending module ``hook`` (`timed_allreduce_hook`'s); return how many got
        it."""
        n = 0
        for ddp in list(self.pending):
            self.pending.discard(ddp)
            try:
                if hook_ddp(ddp, hook):
                    n += 1
            except Exception as e:
                on_error("adding the timing hook to DistributedDataParallel", e)
        return n


def hook_ddp(ddp: Any, hook: Any) -> bool:
    """Register ``hook`` (`timed_allreduce_hook`'s) on ``ddp`` if nothing replaced its
    reducer's all-reduce yet (no comm hook, no mixed-precision hook, no compiled python
    reducer)."""
    if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_use_python_reducer", False):
        return False
    if getattr(ddp, "mixed_precision", None) is not None:
        return False
    register = type(ddp).register_comm_hook
    register = getattr(register, "__perfloop_wrapped__", register)
    register(ddp, ddp.process_group, hook)
    ddp._perfloop_hooked = True
    return True


def _no_note() -> None:
    pass


def timed_allreduce_hook(
    inflight: InFlight, describe: Callable[[Any], tuple[str, int, int]]
) -> Callable[[Any, Any], Any]:
    """A DDP comm hook that does what PyTorch's stock ``allreduce_hook`` does (average the
    bucket over the group, all-reduce it asynchronously, hand it back when done), with
    the all-reduce timed from the call (the rank's arrival) to its completion in the one
    callback that hands the bucket back: like the stock hook, one Python call on the
    backend's thread per bucket. ``describe(group)`` gives (group name, group size, step).

    Gradients come out bit for bit as DDP's reducer makes them. Where the group's size is a
    power of two and the bucket single or double precision, the average is taken in that
    callback, off the training thread (the reducer folds it into its copy into the bucket,
    which a hook cannot; a pass of its own on the training thread cost a 2-rank CPU job's
    training thread 1.4-4 % more CPU a step, in the callback 0.3 % less to 0.6 % more than
    no hook: bench/README.md)."""
    import torch
    import torch.distributed as dist

    all_reduce = getattr(dist.all_reduce, "__perfloop_wrapped__", dist.all_reduce)
    exact_scaling = (torch.float32, torch.float64)

    def allreduce(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        t0 = _now()
        n = group.size()
        # the average: by a power of two in single or double precision, of the sum on the
        # backend's thread once it is in (the same bits: such a scaling is exact above the
        # subnormal numbers, ~1e-38), not in the backward on the training thread; else
        # first (no overflow in half types), by the reciprocal, as DDP's reducer does it
        after = n > 1 and n & (n - 1) == 0 and tensor.dtype in exact_scaling
        if n != 1 and not after:
            tensor.mul_(1.0 / n)
        fut = all_reduce(tensor, group=group, async_op=True).get_future()
        scale = 1.0 / n
        try:
            gname, gsize, step = describe(group)
            size = int(tensor.numel() * tensor.element_size())
            dtype = str(tensor.dtype).removeprefix("torch.")
            completed = inflight.begin(("all_reduce", t0, 0, size, gname, gsize, dtype, step))
        except Exception:  # never let the timing fail the all-reduce
            completed = _no_note

        def done(f):  # type: ignore[no-untyped-def]
            completed()
            out = f.value()[0]
            if after:
                out.mul_(scale)
            return out

        return fut.then(done)

    return allreduce
