"""``torch.distributed``: the collectives (a `CollectiveOp` row and a ``comm`` span each;
asynchronous ones timed to their completion), the functional collectives and their waits,
point-to-point works waited on later, DDP's gradient all-reduce (a timing comm hook, never
added where the script has its own) and ``init_process_group`` (the rank, the groups).

The collectives that complete off the training thread are taken by it at its next drain
(`_drain`): inside a backward, at the optimizer's step and after each collective.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import warnings
from typing import Any

from perfloop.producers._comm import (
    _PAYLOAD_NAMES,
    _payload,
    funcol_size,
    timed_allreduce_hook,
)
from perfloop.producers._hooks_session import _traced
from perfloop.producers._hooks_state import _S, _get_ident, _now, _oops
from perfloop.producers._tracer import Tracer
from perfloop.producers.world import launcher_world
from perfloop.schemas import P2P_OPS


def _group_of(group: Any) -> tuple[str, int]:
    s = _S
    key = id(group)
    hit = s.groups.get(key)
    if hit is not None:
        return hit
    dist = s.torch.distributed
    world = dist.group.WORLD if hasattr(dist, "group") else None
    if group is None or group is world:
        out = ("world", int(dist.get_world_size()))
    else:
        ranks = list(dist.get_process_group_ranks(group))
        name = ",".join(map(str, ranks)) if len(ranks) <= 16 else f"{ranks[0]}..{ranks[-1]}"
        out = (name[:128], len(ranks))
    s.groups[key] = out
    return out


def _make_collective(orig: Any, op: str) -> Any:
    try:
        params = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        params = []
    g_idx = params.index("group") if "group" in params else -1
    payload = [(params.index(n), n) for n in _PAYLOAD_NAMES if n in params]
    a_idx = params.index("async_op") if "async_op" in params else -1
    posts = getattr(orig, "__name__", "") in ("isend", "irecv")  # always hands a work back

    def describe(args: Any, kwargs: Any) -> tuple[int, str, str, int]:
        tt = _S.torch.Tensor
        size, dtype = 0, ""
        for i, name in payload:
            n, d = _payload(args[i] if i < len(args) else kwargs.get(name), tt)
            if n > size:
                size = n
            dtype = dtype or d
        g = args[g_idx] if 0 <= g_idx < len(args) else kwargs.get("group")
        gname, gsize = _group_of(g)
        return size, dtype, gname, gsize

    @functools.wraps(orig)
    def collective(*args: Any, **kwargs: Any) -> Any:
        s = _S
        tr = _traced()
        is_async = posts or bool(args[a_idx] if 0 <= a_idx < len(args) else kwargs.get("async_op"))
        if tr is None:
            if is_async and s.session is not None and s.enabled and s.pid == os.getpid():
                # another thread of the traced process (CUDA's autograd threads run DDP's
                # hooks): timed to completion, taken by the training thread later
                t0 = _now()
                work = orig(*args, **kwargs)
                with contextlib.suppress(Exception):
                    size, dtype, gname, gsize = describe(args, kwargs)
                    step = s.pipe.recorder.step  # type: ignore[union-attr]
                    s.inflight.watch(work, (op, t0, 0, size, gname, gsize, dtype, step))
                return work
            return orig(*args, **kwargs)
        t0 = _now()
        if not is_async:
            s.waiting = ("comm", op, t0)
        work = None
        try:
            work = orig(*args, **kwargs)
            return work
        finally:
            t1 = _now()
            s.waiting = None
            try:
                size, dtype, gname, gsize = describe(args, kwargs)
                row = (op, t0, 0, size, gname, gsize, dtype, tr.rec.step)
                if not (is_async and work is not None and s.inflight.watch(work, row)):
                    if is_async and work is not None and op in P2P_OPS:
                        # no future (gloo's send and receive): the posting now, the row
                        # and the wait when the work is waited on (`_make_work_wait`)
                        tr.comm(t0, t1, op)
                        for old in s.posted.add(work, (op, t0, t1, *row[3:])):
                            _funcol_done(old, 0, 0)
                    else:
                        tr.collective(op, t0, t1, size, gname, gsize, dtype)
                _drain(tr)
            except Exception as e:
                _oops(f"the {op} hook", e)
            s.pipe.overhead_ns += _now() - t1  # type: ignore[union-attr]

    collective.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return collective


_FUNCOL_CALLS = threading.local()
"""Per thread, whether it is inside a functional collective (``depth``)."""


def _funcol_group(funcol: Any, group: Any, tag: str) -> tuple[str, int]:
    """(name, size) of a functional collective's group: a process group, a device mesh (or
    one of its dimensions), a list of ranks or a registered group's name; resolved once per
    group (quietly: the call itself already warned of a deprecated form)."""
    key = (tuple(map(repr, group)) if isinstance(group, (list, tuple)) else id(group), tag)
    hit = _S.funcol_groups.get(key)
    if hit is not None:
        return hit
    c10d = _S.torch.distributed.distributed_c10d
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = funcol._resolve_group(group, tag)
        if isinstance(g, str):
            g = c10d._resolve_process_group(g)
    out = _S.funcol_groups[key] = _group_of(g)
    return out


def _make_funcol(orig: Any, op: str, funcol: Any) -> Any:
    """A functional collective, recorded at the rank's arrival (its call). Its call returns
    before the work is done, with a tensor waited on where it is first used
    (`_make_funcol_wait`): the row waits for that wait and lasts the call plus the wait (what
    the rank spent in it: a rank that arrives first waits longest, whatever it computed in
    between). Under ``torch.compile``'s tracing it is the original, untouched (no graph
    break)."""
    try:
        params = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        params = []
    g_idx = params.index("group") if "group" in params else -1
    t_idx = params.index("tag") if "tag" in params else -1
    is_compiling = getattr(getattr(_S.torch, "compiler", None), "is_compiling", lambda: False)

    @functools.wraps(orig)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return orig(*args, **kwargs)
        s = _S
        inside = _FUNCOL_CALLS
        if getattr(inside, "depth", 0) or not s.enabled or s.pid != os.getpid():
            return orig(*args, **kwargs)  # one functional collective may call another
        if s.tid is None and threading.current_thread() is not threading.main_thread():
            return orig(*args, **kwargs)  # never make a helper thread the traced one
        tr = _traced()
        if tr is None and s.session is None:
            return orig(*args, **kwargs)
        t0 = _now()
        inside.depth = 1
        out = None
        try:
            out = orig(*args, **kwargs)
            return out
        finally:
            inside.depth = 0
            t1 = _now()
            try:
                size, dtype = _payload(args[0] if args else None, s.torch.Tensor)
                group = args[g_idx] if 0 <= g_idx < len(args) else kwargs.get("group")
                tag = args[t_idx] if 0 <= t_idx < len(args) else kwargs.get("tag", "")
                gname, gsize = _funcol_group(funcol, group, tag or "")
                size = funcol_size(op, size, gsize)
                if tr is not None:
                    step = tr.rec.step
                    tr.comm(t0, t1)
                else:  # another thread of the process (a GPU's backward runs on autograd's
                    # device threads): the training thread takes it at its next drain
                    main = s.tracer  # the training thread's, if it began
                    step = main.rec.step if main is not None else s.pipe.recorder.step  # type: ignore[union-attr]
                row = (op, t0, t1, size, gname, gsize, dtype, step)
                elem = getattr(out, "elem", None)  # an AsyncCollectiveTensor's: waited later
                if isinstance(elem, s.torch.Tensor):
                    for old in s.unwaited.add(elem, row):
                        _funcol_done(old, 0, 0)
                else:
                    _funcol_done(row, 0, 0)
            except Exception as e:
                _oops(f"the functional {op} hook", e)

    collective.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return collective


def _funcol_done(row: Any, w0: int, w1: int) -> None:
    """Record a functional collective (``row`` as `Tracer.waited` takes it) waited on from
    ``w0`` to ``w1`` (0, 0: never waited on): by the training thread's tracer on that
    thread, else taken by it at its next drain."""
    s = _S
    tr = s.tracer if s.tid == _get_ident() else None  # never makes a thread the traced one
    if tr is not None:
        tr.waited(row, w0, w1)
    else:
        op, t0, t1, *rest = row
        _S.inflight.done((op, t0, t1 + max(w1 - w0, 0), *rest))


def _timed_wait(row: Any, what: str, wait: Any, *args: Any, **kwargs: Any) -> Any:
    """``wait(*args, **kwargs)`` for the collective of ``row``, timed (`_funcol_done`); the
    training thread blocked in it reads as in that op to the progress reports."""
    s = _S
    w0 = _now()
    mine = s.waiting is None and s.tid == _get_ident() and s.tracer is not None
    if mine:
        s.waiting = ("comm", row[0], w0)
    try:
        return wait(*args, **kwargs)
    finally:
        w1 = _now()
        if mine:
            s.waiting = None
        try:
            _funcol_done(row, w0, w1)
        except Exception as e:
            _oops(what, e)


def _make_work_wait(orig: Any) -> Any:
    """``Work.wait``: the wait of a point-to-point op whose work has no future (gloo's send
    and receive; a pipeline's schedule posts them, then waits) is timed: its row lasts the
    call plus the wait, the wait is a ``comm`` span named after the op, and the rank blocked
    in it reads as in that op to the progress reports. Any other work waits untouched."""

    @functools.wraps(orig)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        s = _S
        if not len(s.posted) or s.pid != os.getpid():
            return orig(self, *args, **kwargs)
        row = s.posted.pop(self)
        if row is None:
            return orig(self, *args, **kwargs)
        return _timed_wait(row, "the point-to-point wait hook", orig, self, *args, **kwargs)

    wait.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return wait


def _make_funcol_wait(orig: Any) -> Any:
    """Functional collectives' ``wait_tensor`` (an `AsyncCollectiveTensor`'s first use calls
    it): the wait of a collective the hooks saw called is timed, and the rank blocked in it
    reads as in that collective (``comm``) to the progress reports."""
    is_compiling = getattr(getattr(_S.torch, "compiler", None), "is_compiling", lambda: False)

    @functools.wraps(orig)
    def wait_tensor(*args: Any, **kwargs: Any) -> Any:
        s = _S
        if not len(s.unwaited) or is_compiling() or s.pid != os.getpid():
            return orig(*args, **kwargs)
        try:
            row = s.unwaited.pop(args[0] if args else kwargs.get("tensor"))
        except Exception as e:
            _oops("the functional collectives' wait hook", e)
            row = None
        if row is None:
            return orig(*args, **kwargs)
        return _timed_wait(row, "the functional collectives' wait hook", orig, *args, **kwargs)

    wait_tensor.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return wait_tensor


def _ddp_hook() -> Any:
    """The process's timing DDP comm hook (made once)."""
    s = _S
    if s.ddp_hook is None:

        def describe(group: Any) -> tuple[str, int, int]:
            tr = _traced()
            step = tr.rec.step if tr is not None else s.pipe.recorder.step  # type: ignore[union-attr]
            return (*_group_of(group), step)

        s.ddp_hook = timed_allreduce_hook(s.inflight, describe)
    return s.ddp_hook


def _drain(tr: Tracer) -> None:
    """Record the asynchronous collectives that completed since the last call."""
    done = _S.inflight.take()
    if done:
        tr.async_done(done)


def _make_ddp_init(orig: Any) -> Any:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        try:
            if _S.enabled and _S.pid == os.getpid():
                _S.ddp.created(self)
        except Exception as e:
            _oops("the DistributedDataParallel hook", e)

    __init__.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return __init__


def _make_own_comm_hook(orig: Any) -> Any:
    """The script registers its own DDP comm hook: ours is never added to that module."""

    @functools.wraps(orig)
    def register(self: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            _S.ddp.own_hook(self)
        return orig(self, *args, **kwargs)

    register.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return register


def _make_init_pg(orig: Any) -> Any:
    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        try:
            s = _S
            s.groups.clear()
            if s.session is not None and s.pid == os.getpid():
                s.pipe.recorder.rank = launcher_world()["rank"]  # type: ignore[union-attr]
                s.session.info_dirty = True
        except Exception as e:
            _oops("the init_process_group hook", e)
        return out

    init_process_group.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return init_process_group
