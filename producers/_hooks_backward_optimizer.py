"""The backward and the optimizer's step: ``torch.autograd.backward`` (so ``loss.backward()``)
and ``torch.autograd.grad``, the global optimizer step pre/post hooks (the first optimizer to
step ends the training step: `_after_step`), ``Optimizer.__init__`` (whether one exists),
``GradScaler.step`` (a step skipped for inf gradients) and ``clip_grad_norm_`` (the step's
gradient norm).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from perfloop.producers._hooks_distributed import _drain
from perfloop.producers._hooks_forward import (
    _after_step,
    _compiling,  # rebound with it by `install` (torch.compiler.is_compiling)
)
from perfloop.producers._hooks_session import _traced
from perfloop.producers._hooks_state import _S, _get_ident, _now, _oops


def _make_backward(orig: Any, loss_name: str = "tensors") -> Any:
    """``torch.autograd.backward`` (``loss.backward()``) or ``torch.autograd.grad`` (a loop
    that updates its parameters itself): a ``backward`` span; ``loss_name`` is the argument
    holding what is differentiated (the loss). A ``grad`` with ``create_graph`` (a
    gradient penalty, differentiated again by the step's backward) is a span only."""
    grad = loss_name == "outputs"

    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return orig(*args, **kwargs)
        tr = _traced()
        if tr is None:
            return orig(*args, **kwargs)
        tensors = args[0] if args else kwargs.get(loss_name)
        counted = not (grad and (args[4] if len(args) > 4 else kwargs.get("create_graph")))
        t0 = _now()
        try:
            opened = tr.backward_begin(t0)
        except Exception as e:
            opened = False
            _oops("the backward hook", e)
        pipe = _S.pipe
        pipe.overhead_ns += _now() - t0  # type: ignore[union-attr]
        try:
            return orig(*args, **kwargs)
        finally:
            if opened:
                t1 = _now()
                try:
                    _drain(tr)  # DDP's bucket all-reduces: nested in this backward
                    tr.backward_end(t1, tensors, counted)
                except Exception as e:
                    _oops("the backward hook", e)
                pipe.overhead_ns += _now() - t1  # type: ignore[union-attr]

    backward.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return backward


def _make_opt_init(orig: Any) -> Any:
    """An optimizer is made: steps end where it steps (never at a forward, `_cycle_step`)."""

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _S.optimizer_made = True
        orig(self, *args, **kwargs)

    __init__.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return __init__


def _opt_pre(opt: Any, args: Any, kwargs: Any) -> None:
    tr = _traced()
    if tr is None:
        return
    t = _now()
    s = _S
    try:
        _drain(tr)
        s.opt_stack.append(tr.optimizer_begin(t, id(opt)))
    except Exception as e:
        s.opt_stack.append(False)
        _oops("the optimizer pre-hook", e)
    s.pipe.overhead_ns += _now() - t  # type: ignore[union-attr]


def _opt_post(opt: Any, args: Any, kwargs: Any) -> None:
    s = _S
    if s.tid != _get_ident() or not s.opt_stack:
        return
    t = _now()
    if s.opt_stack.pop():
        try:
            groups = opt.param_groups
            lr = groups[0].get("lr") if groups else None
            rec = s.tracer.optimizer_end(t, id(opt), lr)  # type: ignore[union-attr]
            if rec is not None:
                if s.session is not None and s.session.optimizer is None:
                    s.session.optimizer = weakref.ref(opt)
                _after_step(rec)
        except Exception as e:
            _oops("the optimizer hook", e)
    s.pipe.overhead_ns += _now() - t  # type: ignore[union-attr]


def _make_scaler_step(orig: Any) -> Any:
    """``GradScaler.step(optimizer)`` (mixed precision) is the optimizer's step, run or
    skipped: a step skipped for inf or nan gradients still ends the training step, where it
    would merge with the next one (twice its time, twice its samples)."""

    @functools.wraps(orig)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if _compiling() or _traced() is None:
            return orig(self, optimizer, *args, **kwargs)
        _opt_pre(optimizer, args, kwargs)  # the optimizer's own step, if it runs, is nested
        try:
            return orig(self, optimizer, *args, **kwargs)
        finally:
            _opt_post(optimizer, args, kwargs)

    step.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return step


def _make_clip(orig: Any) -> Any:
    @functools.wraps(orig)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        if _S.tid == _get_ident() and _S.tracer is not None:
            _S.tracer.grad_norm = [out]  # read when the step is published
        return out

    clip_grad_norm_.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return clip_grad_norm_
