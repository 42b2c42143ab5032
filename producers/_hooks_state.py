"""What the training hooks know of the process they run in (`_S`), and how a hook's error is
counted (`_oops`).

One `_State` per process, reset by `install` and `uninstall`: whether the hooks are installed
and enabled, which thread is traced, the session once training activity was seen, the torch
layer's handles and patches, the module roots found so far, the collectives in flight and what
the training thread is blocked in. Every other `_hooks_*` module reads and writes it; it
imports none of them.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from perfloop.producers._comm import DdpWatch, InFlight, Unwaited
from perfloop.producers._tracer import Tracer
from perfloop.producers.training import Callback, Pipeline

log = logging.getLogger("perfloop.producers")
_now = time.perf_counter_ns
_get_ident = threading.get_ident


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.installed = False
        self.enabled = False
        self.tid: int | None = None
        self.pid = 0
        self.session: Any = None  # its `Session` (`_hooks_session`), once training began
        self.tracer: Tracer | None = None
        self.pipe: Pipeline | None = None
        self.settings: Any = None
        self.command = ""
        self.callbacks: Callback | None = None
        self.publisher: Any = None
        self.discovery_steps = 2
        self.rediscover_every = 500
        self.discovering = True
        self.skip_root_pre: Any = None  # a root whose global pre-hook just ran (`_pre`)
        self.compiled = False  # torch.compile traced code here: no global hooks from then on
        self.hushed = False  # torch's warning about global hooks and compiled modules
        self.compile_watch: Any = None  # (callback handler, our start callback)
        self.fdepth = 0
        self.fwd_open = False
        self.opt_stack: list[bool] = []
        self.optimizer_made = False  # a torch Optimizer exists in this process
        self.optimizer_scanned = False  # the one look for one made before `install`
        self.global_handles: list[Any] = []
        self.opt_handles: list[Any] = []
        self.roots: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
        self.epochs: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.iters: dict[int, weakref.ref[Any]] = {}  # recent loader iterators, by id
        self.patches: list[tuple[Any, str, Any]] = []
        self.groups: dict[int, tuple[str, int]] = {}
        self.warned: set[str] = set()
        self.errors = 0
        self.torch: Any = None
        self.inflight = InFlight()  # async collectives, timed to their completion
        self.ddp = DdpWatch()
        self.ddp_hook: Any = None  # the comm hook DDP modules get (`_ddp_hook`)
        # what the training thread is blocked in: (phase, op, since) for a fetch, a
        # synchronous collective or a checkpoint save (read by the progress reports)
        self.waiting: tuple[str, str, int] | None = None
        self.threads_by_script: int | None = None
        self.funcol_groups: dict[Any, tuple[str, int]] = {}
        # functional collectives called, their wait not yet timed
        self.unwaited = Unwaited(_memory_of)
        # point-to-point works with no future (gloo's), held until their `wait`
        self.posted = Unwaited(_itself)


def _itself(work: Any) -> Any:
    """A work is its own key in `Unwaited` (held: a new work never takes a waited one's)."""
    return work


def _memory_of(tensor: Any) -> Any:
    """Where a tensor's memory is (its views share it): the key of `Unwaited`."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # no storage (a subclass, a fake tensor): the tensor itself
        return ("id", id(tensor))


_S = _State()


def _oops(where: str, exc: BaseException) -> None:
    """Count an exception raised inside a hook; log each place once."""
    _S.errors += 1
    if _S.pipe is not None:
        _S.pipe.errors(where, exc)
    elif where not in _S.warned:
        _S.warned.add(where)
        log.warning("perfloop: %s failed (counted, reported once): %s", where, exc)
