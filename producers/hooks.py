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
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import inspect
import logging
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from perfloop.producers._comm import (
    _PAYLOAD_NAMES,
    COLLECTIVES,
    FUNCOL_MODULE,
    DdpWatch,
    InFlight,
    Unwaited,
    _payload,
    collective_op,
    funcol_functions,
    funcol_size,
    timed_allreduce_hook,
)
from perfloop.producers._cpu import cpu_budget
from perfloop.producers._priority import in_background
from perfloop.producers._progress import ProgressWatch, Where
from perfloop.producers._tracer import Tracer
from perfloop.producers.training import (
    Callback,
    CallbackSet,
    Pipeline,
    StepRecord,
    describe_job,
)
from perfloop.producers.world import launcher_world
from perfloop.schemas import P2P_OPS

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

log = logging.getLogger("perfloop.producers")
_now = time.perf_counter_ns
_get_ident = threading.get_ident

CAPTURE_MAX_STEPS = 50
"""The longest profiler capture a command may ask for (``profiler.capture_steps``)."""


# -- the session: one traced process ------------------------------------------------------
class Session:
    """The telemetry of one traced process: its `Pipeline`, `Tracer` and job description."""

    def __init__(
        self,
        settings: Any,
        *,
        command: str = "",
        callbacks: Callback | None = None,
        publisher: Any = None,
    ) -> None:
        world = launcher_world()
        node = settings.node or socket.gethostname()
        job_id = settings.job_id or f"job-{node}-{os.getpid()}"
        self.settings = settings
        self.command = command
        # built on a niced thread: its threads (publisher, Kafka client, worker) inherit it
        self.nice = int(getattr(settings, "background_nice", 0) or 0)
        self.pipeline = in_background(
            Pipeline,
            nice=self.nice,
            job_id=job_id,
            node=node,
            rank=world["rank"],
            settings=settings,
            publisher=publisher,
            producer_id=f"torch-{node}-r{world['rank']}"[:128],
            contiguous=True,
            callbacks=CallbackSet([callbacks] if callbacks is not None else []),
        )
        self.pipeline.recorder.resolve = _scalar  # losses, norms: CPU tensors only
        self.tracer = Tracer(self.pipeline.recorder)
        self.model: Any = None  # weakref of the first trained root module with parameters
        self.optimizer: Any = None  # weakref of the optimizer that ends steps
        self.precision: str | None = None
        self.info_published = False
        self.info_dirty = False
        self.failure = ""
        self.pipeline.lifecycle("started", message=command[:2000])
        self.pipeline.event(
            _capability(),
            rank=world["rank"],
            component="torch_hooks",
            available=True,
            signals=[
                "steps",
                "phase_spans",
                "data_wait",
                "collectives",
                "loss_cpu",
                "grad_norm_clip",
                "lr",
                "memory",
            ],
            missing=["loss_cuda"],
            reason="loss is read only from CPU tensors (reading a CUDA one would sync)",
        )
        with contextlib.suppress(Exception):
            self.pipeline.callbacks.on_train_begin(
                {"job_id": job_id, "node": node, "rank": world["rank"]}
            )
        self.knobs: Any = None
        self.agent: Any = None
        if getattr(settings, "agent", False):
            self._start_agent(job_id, node, world["rank"])
        self.progress = ProgressWatch(
            self._publish_progress, wall_offset_ns=self.pipeline.recorder.offset
        )
        self._next_check = 0
        self.pipeline.tick = self._tick

    def _publish_progress(self, **fields: Any) -> bool:
        from perfloop.schemas import RankProgress

        return self.pipeline.event(RankProgress, **fields)

    def _tick(self) -> None:
        """On the pipeline's worker thread: report a step that goes on too long."""
        now = _now()
        if now >= self._next_check:
            self._next_check = now + 500_000_000
            self.progress.check(now, self._where)

    def _where(self) -> Where | None:
        """Where this rank is in its open step (read from another thread: a snapshot)."""
        rec = self.pipeline.recorder
        start = rec._start
        if start is None:
            return None
        tr = self.tracer
        waiting = _S.waiting
        flying = _S.inflight.oldest()
        if waiting is not None:
            phase, op, since = waiting
        elif flying is not None and _now() - flying[1] > 1_000_000_000:
            phase, op, since = "comm", flying[0], flying[1]
        elif tr.open is not None:
            phase, op, since = tr.open, "", tr.open_t0
        elif tr.eval_t0 is not None:
            phase, op, since = "eval", "", tr.eval_t0
        else:
            phase, op, since = "other", "", rec._cursor
        return rec.step, start, phase, op, since

    def _start_agent(self, job_id: str, node: str, rank: int) -> None:
        """The job agent: this process's knobs, changed by signed commands between steps."""
        try:
            from perfloop.producers.knobs import TorchKnobs, start_agent

            self.knobs = TorchKnobs(_S.torch, _live_loader, **_optional_knobs(self, rank))
            self.agent = in_background(
                start_agent, self.settings, self.knobs, job_id=job_id, node=node, rank=rank,
                on_result=self._changed, nice=self.nice,
            )  # fmt: skip
        except Exception as e:  # the job runs on, unchanged
            self.agent = None
            self.pipeline.errors("starting the job agent (no changes will be applied)", e)

    def _changed(self, result: Any) -> None:
        """An ack: a knob that moved is published in the next job info."""
        if result.status in ("applied", "rolled_back"):
            self.info_dirty = True

    def boundary(self, rec: StepRecord) -> None:
        """Between two steps: the agent judges the step, then applies what is due."""
        agent = self.agent
        if agent is None:
            return
        losses = rec.fields.get("loss") or ()
        loss = _scalar(losses[-1]) if losses else None
        agent.observe_step(rec.step, rec.step_time_ms, loss)
        agent.step_boundary(rec.step + 1)
        self.knobs.step_boundary(rec.step + 1)

    @property
    def job_id(self) -> str:
        return self.pipeline.job_id

    def describe(self, first: StepRecord | None = None) -> dict[str, Any]:
        model = self.model() if self.model is not None else None
        opt = self.optimizer() if self.optimizer is not None else None
        extra: dict[str, Any] = {}
        if first is not None:
            extra["batch_size"] = first.fields.get("batch_size") or None
            extra["grad_accum_steps"] = first.fields.get("grad_accum_steps") or None
        facts: dict[str, str] = {}
        with contextlib.suppress(Exception):
            budget = cpu_budget(launcher_world()["local_world_size"])
            facts = {"cpu_budget": str(budget.cpus), "cpu_budget_why": budget.why}
            if _S.threads_by_script is not None:
                facts["torch.num_threads.by_script"] = str(_S.threads_by_script)
            if _S.torch is not None:
                facts["torch.num_threads"] = str(_S.torch.get_num_threads())
        if self.knobs is not None:
            with contextlib.suppress(Exception):
                knobs = {k: str(v) for k, v in self.knobs.current().items()}
                ranges = {
                    f"bounds.{k}": f"{lo:g},{hi:g}" for k, (lo, hi) in self.knobs.bounds.items()
                }
                facts = {**knobs, **ranges, "cpu_affinity": str(self.knobs.cpus), **facts}
        extra["extra"] = facts
        return describe_job(
            model=model,
            optimizer=opt,
            precision=self.precision,
            command=self.command,
            **extra,
        )

    def after_step(self, rec: StepRecord) -> None:
        self.progress.step_done(rec.step_time_ms)
        if not self.info_published or self.info_dirty:
            self.info_published, self.info_dirty = True, False
            self.pipeline.job_info(self.describe(rec))

    def close(self, state: str = "finished", exit_code: int | None = None) -> None:
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.stop()
            with contextlib.suppress(Exception):
                self.knobs.close()
        try:
            for row in (*_S.unwaited.older(), *_S.posted.older()):  # never waited on
                self.tracer.waited(row, 0, 0)
            done = _S.inflight.take()  # collectives completed since the last drain
            if done:
                self.tracer.async_done(done)
            self.tracer.close()
            if not self.info_published:
                self.info_published = True
                self.pipeline.job_info(self.describe())
        except Exception as e:
            self.pipeline.errors("closing the tracer", e)
        self.pipeline.close(state, exit_code, self.failure)


def _live_loader() -> tuple[Any, Any] | None:
    """The iterator the training data last came from, and its DataLoader (None if gone)."""
    tr = _S.tracer
    source = tr.source if tr is not None else None
    ref = _S.iters.get(source[0]) if source else None
    it = ref() if ref is not None else None
    loader = getattr(it, "_perfloop_loader", None)
    return None if it is None or loader is None else (it, loader)


def _optional_knobs(session: Session, rank: int) -> dict[str, Any]:
    """The profiler capture and, with CUDA, the GPU power limit (each where available)."""
    out: dict[str, Any] = {}
    try:
        from perfloop.producers._capture import ProfileCapture, emit_to

        out["capture"] = ProfileCapture(
            job_id=session.job_id,
            node=session.pipeline.node,
            rank=rank,
            emit=emit_to(session.pipeline.emitter),
            max_steps=CAPTURE_MAX_STEPS,
        )
    except Exception as e:
        session.pipeline.errors("the profiler capture knob", e)
    torch = _S.torch
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            from perfloop.producers._power import power_limit_handler, power_limit_range
            from perfloop.producers.gpu import NvmlBackend

            backend = NvmlBackend()
            backend.init()
            devices = [_nvml_index(torch)]
            out["power"] = power_limit_handler(backend, devices)
            out["power_range"] = power_limit_range(backend, devices)
    except Exception as e:  # no NVML, or no power control here: the knob is not offered
        log.info("perfloop: no GPU power-limit knob: %s", e)
    return out


def _nvml_index(torch: Any) -> int:
    """The NVML index of this process's CUDA device (CUDA_VISIBLE_DEVICES renumbers CUDA's;
    NVML's follow the PCI bus), found by its PCI bus id."""
    import pynvml

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
    return int(pynvml.nvmlDeviceGetIndex(handle))


def _capability() -> type[Any]:
    from perfloop.schemas import CapabilityReport

    return CapabilityReport


# -- process state and the torch layer -----------------------------------------------------
class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.installed = False
        self.enabled = False
        self.tid: int | None = None
        self.pid = 0
        self.session: Session | None = None
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


def _activate() -> Tracer | None:
    """First training activity on this thread: start publishing (or decide never to)."""
    s = _S
    try:
        if s.pid != os.getpid():
            s.enabled = False
            return None
        torch = s.torch
        if torch.utils.data.get_worker_info() is not None:  # a DataLoader worker process
            s.enabled = False
            return None
        s.session = Session(
            s.settings, command=s.command, callbacks=s.callbacks, publisher=s.publisher
        )
        s.pipe = s.session.pipeline
        s.tracer = s.session.tracer
        s.tid = _get_ident()
        atexit.register(_at_exit)
        prev = sys.excepthook

        def excepthook(et: Any, ev: Any, tb: Any) -> None:
            if s.session is not None:
                s.session.failure = f"{getattr(et, '__name__', et)}: {ev}"[:2000]
            prev(et, ev, tb)

        sys.excepthook = excepthook
        return s.tracer
    except Exception as e:
        s.enabled = False
        _oops("starting the torch hooks (telemetry off for this process)", e)
        return None


def _traced() -> Tracer | None:
    s = _S
    if s.tid == _get_ident():
        return s.tracer
    if s.tid is None and s.enabled:
        return _activate()
    return None


def _at_exit() -> None:
    s = _S
    sess = s.session
    if sess is None or s.pid != os.getpid():
        return
    s.tid = None
    s.enabled = False
    sess.close("failed" if sess.failure else "finished", 1 if sess.failure else None)


def _after_step(rec: StepRecord) -> None:
    s = _S
    if len(s.unwaited):  # functional collectives of earlier steps never waited on
        for row in s.unwaited.older(rec.step):
            _funcol_done(row, 0, 0)
    if len(s.posted):  # point-to-point works of earlier steps never waited on
        for row in s.posted.older(rec.step):
            _funcol_done(row, 0, 0)
    if s.session is not None:
        s.session.boundary(rec)
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


# forward ---------------------------------------------------------------------------------
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
    here). The module hooks then do nothing: what they would trace (a thread id, a clock)
    breaks the graph, and a compiled module is timed by the call around it."""
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


# backward, optimizer, grad norm ------------------------------------------------------------
def _scalar(v: Any) -> float | None:
    """A float from a one-element CPU tensor or a number; None for CUDA (no sync)."""
    try:
        if isinstance(v, (int, float)):
            return float(v)
        if v is not None and v.numel() == 1 and v.device.type == "cpu":
            return float(v.item())
    except Exception:
        return None
    return None


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


# data loading ------------------------------------------------------------------------------
def _inspect_batch(batch: Any, tensor_type: Any) -> tuple[int, int]:
    """(batch size, tokens): the first dimension of the first tensor; tokens = elements of
    the first integer tensor with two or more dimensions (token ids)."""
    items: Any
    if isinstance(batch, tensor_type):
        items = (batch,)
    elif isinstance(batch, dict):
        items = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return 0, 0
    bs = tok = 0
    for i, x in enumerate(items):
        if i >= 4:
            break
        if isinstance(x, tensor_type):
            if not bs and x.dim() >= 1:
                bs = int(x.shape[0])
            if not tok and x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
                tok = int(x.numel())
    return bs, tok


def _make_next(orig: Any) -> Any:
    @functools.wraps(orig)
    def __next__(self: Any) -> Any:
        tr = _traced()
        if tr is None:
            return orig(self)
        t0 = _now()
        _S.waiting = ("data_wait", "", t0)
        try:
            batch = orig(self)
        except StopIteration:
            _S.waiting = None
            t1 = _now()
            try:
                tr.fetch(t0, t1, stop=True)
            except Exception as e:
                _oops("the data-loader hook", e)
            raise
        except BaseException:
            _S.waiting = None
            raise
        t1 = _now()
        _S.waiting = None
        try:
            bs, tok = _inspect_batch(batch, _S.torch.Tensor)
            iters = _S.iters
            ref = iters.get(id(self))
            if ref is None or ref() is not self:
                if len(iters) >= 16:
                    iters.clear()
                iters[id(self)] = weakref.ref(self)
            tr.fetch(
                t0,
                t1,
                bs,
                tok,
                (id(self), getattr(self, "_perfloop_epoch", 0)),
                getattr(self, "_num_workers", 0),  # kept current by a mid-epoch change
            )
        except Exception as e:
            _oops("the data-loader hook", e)
        _S.pipe.overhead_ns += _now() - t1  # type: ignore[union-attr]
        return batch

    __next__.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return __next__


def _make_iter(orig: Any) -> Any:
    @functools.wraps(orig)
    def __iter__(self: Any) -> Any:
        it = orig(self)
        try:
            n = _S.epochs.get(self, -1) + 1
            _S.epochs[self] = n
            it._perfloop_epoch = n
            it._perfloop_loader = self  # what the job agent changes
        except Exception as e:
            _oops("the data-loader epoch counter", e)
        return it

    __iter__.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return __iter__


# torch.distributed -------------------------------------------------------------------------
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


def _make_set_threads(orig: Any) -> Any:
    """The script sets its own thread count: never raised past it (the stream tier reads it
    in the job info); the job agent's changes call the original."""

    @functools.wraps(orig)
    def set_num_threads(n: Any) -> Any:
        out = orig(n)
        with contextlib.suppress(Exception):
            s = _S
            if s.pid == os.getpid() and not isinstance(n, bool):
                s.threads_by_script = int(n)
                if s.session is not None:
                    s.session.info_dirty = True
        return out

    set_num_threads.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return set_num_threads


def _make_save(orig: Any) -> Any:
    """``torch.save`` on the training thread: a ``checkpoint`` span."""

    @functools.wraps(orig)
    def save(*args: Any, **kwargs: Any) -> Any:
        s = _S
        if s.tid != _get_ident() or s.tracer is None or s.waiting is not None:
            return orig(*args, **kwargs)
        t0 = _now()
        s.waiting = ("checkpoint", "torch.save", t0)
        try:
            return orig(*args, **kwargs)
        finally:
            s.waiting = None
            t1 = _now()
            try:
                s.tracer.checkpoint(t0, t1, "torch.save")
            except Exception as e:
                _oops("the torch.save hook", e)
            s.pipe.overhead_ns += _now() - t1  # type: ignore[union-attr]

    save.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return save


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


# install ---------------------------------------------------------------------------------
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

    global _compiling
    s = _S
    s.reset()
    s.torch = torch
    _compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _compiling)
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
        from perfloop.actuators.patch import patch_path, read_patch
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
