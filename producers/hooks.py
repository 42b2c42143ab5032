"""Zero-code-change training telemetry: global PyTorch hooks installed by `perfloop run`.

`install` patches torch once it is imported (the run bootstrap calls it from an import hook);
nothing is recorded until the process shows training activity, so a launcher process that
merely imports torch (the torchrun agent) publishes nothing. What is hooked:

- module calls: only the outermost call (depth 0) is timed. For the first steps (and one step
  every ``rediscover_every``) global forward hooks find the root modules; after that only
  the roots carry hooks, so submodule calls keep torch's hook-free fast path;
- ``torch.autograd.backward`` (so ``loss.backward()``) and ``torch.autograd.grad``, the
  global optimizer step pre/post hooks (and ``Optimizer.__init__``: whether one exists;
  ``GradScaler.step``: a step skipped for inf gradients), ``DataLoader`` iteration
  (``data_wait``), ``clip_grad_norm_`` (gradient norm) and the ``torch.distributed``
  collectives (`CollectiveOp` rows and ``comm`` spans).

`Tracer` turns those events into steps (pure Python, no torch): the step of the first
optimizer that steps ends a training step (gradient accumulation: several forward/backward
pairs in one step); in a process with no optimizer (a loop that updates its parameters
itself) a training forward that follows a backward begins the next step. The first step
starts at the first recorded activity. A forward under ``torch.no_grad()`` or of a module
in ``eval()`` mode opens an ``eval`` region that covers the data fetches and forwards of an
evaluation loop, so evaluation makes ``eval`` spans, not steps; a short one that comes in
every step (a frozen teacher's forward after the step's fetch) is forward work of the step,
its fetch the step's data. Spans tile each step (`perfloop.producers.training.Recorder`).

Every hook is guarded: an exception inside perfloop's code is counted and logged once and
the user's call goes on. Only the thread that first showed training activity is traced;
forked children (DataLoader workers) and DataLoader worker processes are never traced.

Where each part lives (private modules of this package):

- `_hooks_state`: what the hooks know of the process (`_S`), and how an error is counted;
- `_hooks_session`: `Session` and its start at the first training activity (`_traced`);
- `_hooks_agent`: what the job agent gets: the optional knobs, the live DataLoader, the
  script's own thread count (``torch.set_num_threads``);
- `_hooks_forward`: module calls, root discovery, ``torch.compile``, and the step boundary;
- `_hooks_backward_optimizer`: backward, ``autograd.grad``, the optimizer's step, the
  ``GradScaler``, ``clip_grad_norm_``;
- `_hooks_loader`: DataLoader iteration (``data_wait``, batch size and tokens, epochs);
- `_hooks_distributed`: collectives, functional collectives and their waits, DDP,
  ``init_process_group``;
- `_hooks_checkpoint`: ``torch.save`` (``checkpoint`` spans);
- here: `install` (what is patched), `uninstall`, the job's config patch, and the handover to
  an explicit `Monitor`; `Tracer` (steps from events, pure Python) is in `_tracer`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import os
import sys
from typing import Any

from perfloop.producers import _hooks_backward_optimizer, _hooks_forward
from perfloop.producers._comm import COLLECTIVES, FUNCOL_MODULE, collective_op, funcol_functions
from perfloop.producers._hooks_agent import CAPTURE_MAX_STEPS as CAPTURE_MAX_STEPS  # its old home
from perfloop.producers._hooks_agent import _make_set_threads
from perfloop.producers._hooks_backward_optimizer import (
    _make_backward,
    _make_clip,
    _make_opt_init,
    _make_scaler_step,
    _opt_post,
    _opt_pre,
)
from perfloop.producers._hooks_checkpoint import _make_save
from perfloop.producers._hooks_distributed import (
    _make_collective,
    _make_ddp_init,
    _make_funcol,
    _make_funcol_wait,
    _make_init_pg,
    _make_own_comm_hook,
    _make_work_wait,
)
from perfloop.producers._hooks_forward import _compile_starts as _compile_starts  # tests read it
from perfloop.producers._hooks_forward import _make_compile, _set_discovery
from perfloop.producers._hooks_loader import _make_iter, _make_next
from perfloop.producers._hooks_session import Session, _at_exit
from perfloop.producers._hooks_state import _S, _oops
from perfloop.producers._tracer import Tracer
from perfloop.producers.training import Callback

__all__ = [
    "COLLECTIVES",
    "Session",
    "Tracer",
    "collective_op",
    "explicit_monitor_started",
    "install",
    "installed",
    "session",
    "uninstall",
]


def _patch(obj: Any, name: str, make: Any, *extra: Any) -> None:
    orig = getattr(obj, name, None)
    if orig is None or hasattr(orig, "__perfloop_wrapped__"):
        return
    setattr(obj, name, make(orig, *extra))
    _S.patches.append((obj, name, orig))


def _after_fork_in_child() -> None:
    _S.enabled = False
    _S.tid = None


_FORK_REGISTERED = False


def install(
    settings: Any,
    *,
    command: str = "",
    callbacks: Callback | None = None,
    publisher: Any = None,
    discovery_steps: int = 2,
    rediscover_every: int = 500,
) -> bool:
    """Patch torch (already imported) so this process publishes its training telemetry.

    ``settings`` is a `ProducerSettings` (job id, node, transport); ``publisher`` replaces
    the Kafka `Publisher` (tests, benchmarks). Returns False (and changes nothing) if torch is
    not imported or the hooks are already installed.
    """
    global _FORK_REGISTERED
    torch = sys.modules.get("torch")
    if torch is None or _S.installed:
        return False
    import torch.distributed as dist
    import torch.nn.utils
    import torch.optim.optimizer as optim
    import torch.utils.data
    import torch.utils.data.dataloader as dl

    s = _S
    s.reset()
    s.torch = torch
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is not None:  # while it traces, the module and backward hooks do nothing
        _hooks_forward._compiling = _hooks_backward_optimizer._compiling = is_compiling
    s.settings, s.command, s.callbacks, s.publisher = settings, command, callbacks, publisher
    s.discovery_steps = max(1, discovery_steps)
    s.rediscover_every = max(1, rediscover_every)
    s.pid = os.getpid()
    _load_patch(settings)
    try:
        _set_discovery(True)
        s.opt_handles = [
            optim.register_optimizer_step_pre_hook(_opt_pre),
            optim.register_optimizer_step_post_hook(_opt_post),
        ]
        _patch(torch.autograd, "backward", _make_backward)
        _patch(torch.autograd, "grad", _make_backward, "outputs")
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler is not None:
            _patch(scaler, "step", _make_scaler_step)
        _patch(optim.Optimizer, "__init__", _make_opt_init)
        _patch(torch, "save", _make_save)
        _patch(torch, "compile", _make_compile)
        _patch(torch, "set_num_threads", _make_set_threads)
        _patch(dl._BaseDataLoaderIter, "__next__", _make_next)
        _patch(dl.DataLoader, "__iter__", _make_iter)
        for mod in (torch.nn.utils, sys.modules.get("torch.nn.utils.clip_grad")):
            if mod is not None:
                _patch(mod, "clip_grad_norm_", _make_clip)
        if dist.is_available():
            c10d = dist.distributed_c10d
            names = [n for n in vars(c10d) if not n.startswith("_") and collective_op(n)]
            for fname in dict.fromkeys([*COLLECTIVES, *names]):
                fn = getattr(c10d, fname, None)
                op = collective_op(fname)
                if not inspect.isfunction(fn) or op is None:
                    continue
                wrapped = _make_collective(fn, op)
                for mod in (c10d, dist):
                    if getattr(mod, fname, None) is fn:
                        setattr(mod, fname, wrapped)
                        s.patches.append((mod, fname, fn))
            for mod in (c10d, dist):
                _patch(mod, "init_process_group", _make_init_pg)
            try:
                funcol = importlib.import_module(FUNCOL_MODULE)
            except ImportError:  # a torch without them
                funcol = None
            for fname, op in funcol_functions(funcol) if funcol is not None else ():
                _patch(funcol, fname, _make_funcol, op, funcol)
            if funcol is not None:
                _patch(funcol, "wait_tensor", _make_funcol_wait)
            _patch(dist.distributed_c10d.Work, "wait", _make_work_wait)
            from torch.nn.parallel import DistributedDataParallel as DDP

            _patch(DDP, "__init__", _make_ddp_init)
            for name in ("register_comm_hook", "_register_builtin_comm_hook"):
                _patch(DDP, name, _make_own_comm_hook)
    except Exception as e:
        _oops("installing the torch hooks", e)
        uninstall()
        return False
    if not _FORK_REGISTERED and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _FORK_REGISTERED = True
    s.installed = True
    s.enabled = True
    return True


def _load_patch(settings: Any) -> None:
    """The job's config patch (slow-loop changes) for the script's tunables; never raises."""
    job_id = getattr(settings, "job_id", None)
    if not job_id:
        return
    try:
        from perfloop.actuators.config_patch import patch_path, read_patch
        from perfloop.producers.knobs import use_patch

        use_patch(read_patch(settings.config_patch or patch_path(settings.home_dir, job_id)))
    except Exception as e:
        _oops("reading the config patch", e)


def uninstall() -> None:
    """Undo `install`: close the session (publishing what is pending) and restore torch."""
    s = _S
    if s.session is not None and s.pid == os.getpid():
        with contextlib.suppress(Exception):
            atexit.unregister(_at_exit)
        s.tid = None
        s.enabled = False
        s.session.close()
    for h in [*s.global_handles, *s.opt_handles]:
        with contextlib.suppress(Exception):
            h.remove()
    for pre, post in list(s.roots.values()):
        with contextlib.suppress(Exception):
            pre.remove()
            post.remove()
    for obj, name, orig in reversed(s.patches):
        with contextlib.suppress(Exception):
            setattr(obj, name, orig)
    if s.compile_watch:
        with contextlib.suppress(Exception):
            s.compile_watch[0].remove_start_callback(s.compile_watch[1])
    s.reset()


def installed() -> bool:
    """Whether the hooks are installed in this process."""
    return _S.installed


def session() -> Session | None:
    """This process's session once training activity was seen (else None)."""
    return _S.session


def explicit_monitor_started() -> Session | None:
    """A `Monitor` takes over: the hooks stop recording steps and spans in this process.

    Returns the session (or None) so the monitor can reuse its job id and settings.
    """
    s = _S
    if not s.installed:
        return None
    s.enabled = False
    s.tid = None
    sess = s.session
    if sess is not None:
        with contextlib.suppress(Exception):
            atexit.unregister(_at_exit)
        sess.close()
        return sess
    if s.settings is not None:
        return _SettingsOnly(s.settings)  # type: ignore[return-value]
    return None


class _SettingsOnly:
    def __init__(self, settings: Any) -> None:
        self.settings = settings
