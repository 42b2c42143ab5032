"""Module calls and step boundaries: the forward hooks, the discovery of the root modules,
what ``torch.compile`` changes in it, and what runs between two steps (`_after_step`).

Only the outermost module call (depth 0) is timed. For the first steps (and one step every
``rediscover_every``) global forward hooks find the root modules; after that only the roots
carry hooks, so submodule calls keep torch's hook-free fast path. Once ``torch.compile``
traces code in the process, the global hooks go for good (`_compile_starts`).

A step ends where the optimizer steps (`_hooks_backward_optimizer`) or, in a process with no
optimizer, at a training forward that follows a backward (`_cycle_step`); either way
`_after_step` runs next, and may turn discovery on or off.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref
from typing import Any

from perfloop.producers._hooks_distributed import _ddp_hook, _funcol_done
from perfloop.producers._hooks_loader import _inspect_batch
from perfloop.producers._hooks_session import _traced
from perfloop.producers._hooks_state import _S, _get_ident, _now, _oops
from perfloop.producers._tracer import Tracer
from perfloop.producers.training import StepRecord


def _after_step(rec: StepRecord) -> None:
    s = _S
    if len(s.unwaited):  # functional collectives of earlier steps never waited on
        for row in s.unwaited.older(rec.step):
            _funcol_done(row, 0, 0)
    if len(s.posted):  # point-to-point works of earlier steps never waited on
        for row in s.posted.older(rec.step):
            _funcol_done(row, 0, 0)
    if s.session is not None:
        s.session.pipeline.step_boundary(rec)  # where the job agent acts
        s.session.after_step(rec)
    if s.ddp.pending:  # after the first step: no hook of the script's can come after ours
        if getattr(s.settings, "ddp_comm_hook", True):
            s.ddp.hook_pending(_ddp_hook(), _oops)
        else:
            s.ddp.pending.clear()
    n = rec.step + 1
    want = not s.compiled and (n < s.discovery_steps or n % s.rediscover_every == 0)
    if want != s.discovering and s.fdepth == 0:
        _set_discovery(want)


def _set_discovery(on: bool) -> None:
    s = _S
    mm = s.torch.nn.modules.module
    _drop_global_hooks()
    if on:
        s.global_handles = [
            mm.register_module_forward_pre_hook(_global_pre),
            mm.register_module_forward_hook(_global_post, always_call=True),
        ]
        if not s.hushed:  # torch's advice to whoever added global hooks: that is perfloop
            s.hushed = True  # here, and its hooks expect the extra call (`_pre`)
            warnings.filterwarnings("ignore", _COMPILE_WARNING, UserWarning)
    s.discovering = on


_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def _drop_global_hooks() -> None:
    s = _S
    for h in s.global_handles:
        h.remove()
    s.global_handles = []


def _pre(module: Any, args: Any = ()) -> None:
    tr = _traced()
    if tr is None:
        return
    s = _S
    if s.fdepth == 0:
        t = _now()
        try:
            training = module.training and s.torch.is_grad_enabled()
            if training and tr.backwards and not s.optimizer_made:
                _cycle_step(tr, t, module)
            s.fwd_open = tr.forward_begin(t, training)
            was_root = module in s.roots
            if s.discovering and not was_root:
                s.roots[module] = (
                    module.register_forward_pre_hook(_root_pre),
                    module.register_forward_hook(_root_post, always_call=True),
                )
            if s.global_handles and getattr(module, "_orig_mod", None) is not None:
                # a model made by torch.compile: its trace would see the global hooks and
                # guard on them, and compile it again once they are gone. It is a root; the
                # global hooks go now, before it is traced (its own hooks time it).
                _drop_global_hooks()
                s.skip_root_pre = module if was_root else None  # next in this very call
            if training and s.session is not None and s.session.model is None:
                _first_train_forward(module)
            if s.fwd_open and training and args and not tr.fetched:
                _forward_input(tr, module, args)
        except Exception as e:
            _oops("the forward pre-hook", e)
        s.pipe.overhead_ns += _now() - t  # type: ignore[union-attr]
    s.fdepth += 1


def _forward_input(tr: Tracer, module: Any, args: Any) -> None:
    """A step no DataLoader fed: the trained model's input counts its samples and tokens
    (only the model's: a loss module or a second model called at the top level would count
    the batch again)."""
    sess = _S.session
    model = sess.model() if sess is not None and sess.model is not None else None
    if model is module:
        tr.forward_input(*_inspect_batch(args, _S.torch.Tensor))


def _cycle_step(tr: Tracer, t: int, module: Any) -> None:
    """A training forward after a backward, and no optimizer in the process: the script
    updates its parameters itself, and each forward-backward cycle is a step."""
    s = _S
    if not s.optimizer_scanned:  # one made before the hooks were installed (Monitor API)
        s.optimizer_scanned = True
        opt = s.torch.optim.Optimizer  # by type: isinstance would run any __class__ property
        s.optimizer_made = any(issubclass(type(o), opt) for o in gc.get_objects())
        if s.optimizer_made:
            return
    rec = tr.cycle_end(t)
    if rec is None:
        return
    had_global = bool(s.global_handles)
    _after_step(rec)
    if had_global and not s.global_handles and module in s.roots:
        s.skip_root_pre = module  # discovery ended inside this call: its root pre-hook is next


def _post() -> None:
    s = _S
    if s.tid != _get_ident():
        return
    s.fdepth -= 1
    if s.fdepth <= 0:
        s.fdepth = 0
        if s.fwd_open:
            t = _now()
            s.fwd_open = False
            try:
                s.tracer.forward_end(t)  # type: ignore[union-attr]
            except Exception as e:
                _oops("the forward hook", e)
            s.pipe.overhead_ns += _now() - t  # type: ignore[union-attr]


def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing (`install` puts ``torch.compiler.is_compiling``
    here, and in `_hooks_backward_optimizer`, which imports this name). The module hooks then
    do nothing: what they would trace (a thread id, a clock) breaks the graph, and a compiled
    module is timed by the call around it."""
    return False


def _global_pre(module: Any, args: Any) -> None:
    if not _compiling():
        _pre(module, args)


def _global_post(module: Any, args: Any, output: Any) -> None:
    if not _compiling():
        _post()


def _root_pre(module: Any, args: Any) -> None:
    s = _S
    if s.skip_root_pre is module:  # its global pre-hook ran in this call (`_pre`)
        s.skip_root_pre = None
    elif not s.global_handles and not _compiling():
        _pre(module, args)


def _root_post(module: Any, args: Any, output: Any) -> None:
    if not _S.global_handles and not _compiling():
        _post()


def _first_train_forward(module: Any) -> None:
    s = _S
    torch = s.torch
    if not any(True for _ in module.parameters()):
        return
    sess = s.session
    assert sess is not None
    sess.model = weakref.ref(module)
    with contextlib.suppress(Exception):
        for dev in ("cuda", "cpu"):
            if torch.is_autocast_enabled(dev):
                dtype = str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
                sess.precision = _AMP.get(dtype, f"amp_{dtype}")
                break


_AMP = {"bfloat16": "amp_bf16", "float16": "amp_fp16"}


def _make_compile(orig: Any) -> Any:
    """``torch.compile`` (``Module.compile`` calls it too): from the first compilation on,
    discovery's global module hooks are gone (`_compile_starts`)."""

    @functools.wraps(orig)
    def compile(*args: Any, **kwargs: Any) -> Any:
        _watch_compiles()
        return orig(*args, **kwargs)

    compile.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return compile


def _watch_compiles() -> None:
    """Have `_compile_starts` called when torch.compile's tracer starts on a frame; never
    raises."""
    s = _S
    if s.compile_watch is not None or not s.installed:
        return
    try:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(_compile_starts)
        s.compile_watch = (callback_handler, _compile_starts)
    except Exception as e:  # a torch without the callbacks: compiled code may compile twice
        _oops("watching torch.compile", e)
        s.compile_watch = ()


def _compile_starts(_args: Any = None) -> None:
    """torch.compile is about to trace a frame. Code it traces guards on the process's global
    module hooks: were discovery's hooks in place now, their removal two steps later would
    make it compile again (for a large model under Inductor, up to as long as the first
    time). So they go before the trace, and are not added again in this process (a
    rediscovery's hooks would fail the guards of what was compiled without them): the roots
    found so far stay timed."""
    s = _S
    s.compiled = True
    if s.global_handles:
        with contextlib.suppress(Exception):
            _drop_global_hooks()
        if s.fdepth > 0:  # inside modules entered through the global hooks: of them only the
            s.fdepth = 1  # outermost, a root (`_pre`), will see its end, by its own hook
