"""Training integration, explicit API: mark steps and phases, report figures, publish them.

A script instruments its loop with a `Monitor`::

    mon = Monitor(job_id="llm-7", settings=ProducerSettings())
    for batch in loader:
        with mon.step(batch_size=len(batch)):
            with mon.phase("forward"):
                loss = model(batch)
            with mon.phase("backward"):
                loss.backward()
            with mon.phase("optimizer"):
                opt.step()
            mon.report(loss=loss.item(), lr=opt.param_groups[0]["lr"])
    mon.close()

Each step becomes one `StepEvent` (step time, data wait, batch size, samples, tokens, loss,
gradient norm, learning rate, memory: CUDA allocator figures when CUDA is in use, RSS
always) and its phases become `PhaseSpan` rows: standard phases (`STANDARD_PHASES`) keep their
name, any other name is a ``"user"`` span. Depth-0 spans of a step tile it: a gap of at most
``glue_ns`` is folded into the span before it and a longer one becomes a ``"user"`` span named
``"other"``, so the spans of a step add up to its step time. The monitor also publishes
`JobInfo` (`Monitor.job_info`), `JobLifecycle` (started at creation, finished or failed at
`Monitor.close`) and `ProducerStats` every ``stats_interval_s``.

Nothing here raises into the training loop: a failure is counted (`Monitor.errors`) and logged
once. torch is optional: it is only looked at (``sys.modules``) once the script imported it.
`Callback` / `CallbackSet` let other parts of perfloop (the job agent) act at step boundaries;
`Recorder` is the tiling core shared with the zero-code-change hooks (`perfloop.producers.hooks`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from perfloop.producers.world import launcher_world
from perfloop.schemas import STANDARD_PHASES, JobInfo, JobLifecycle, ProducerStats

__all__ = [
    "Callback",
    "CallbackSet",
    "CollectiveRecord",
    "Monitor",
    "Pipeline",
    "Recorder",
    "SpanRecord",
    "StepRecord",
    "clean_float",
    "close_publisher",
    "describe_job",
    "launcher_world",
    "step_row",
]

log = logging.getLogger("perfloop.producers")

_STANDARD = frozenset(STANDARD_PHASES)
_CONTROL = re.compile(r"[\x00-\x1f]")


@dataclass(slots=True)
class StepRecord:
    """One finished step as callbacks see it (times in Unix ns and ms).

    ``phase_ms`` is the depth-0 time per phase (user spans by their name); ``fields`` are
    the step's figures as reported (cleaned when the step is published).
    """

    step: int
    start_ns: int
    end_ns: int
    step_time_ms: float
    phase_ms: dict[str, float] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SpanRecord:
    """One recorded phase span (``start_ns`` in Unix ns)."""

    step: int
    phase: str
    name: str
    start_ns: int
    duration_ms: float
    depth: int


@dataclass(slots=True)
class CollectiveRecord:
    """One collective call (``start_ns`` in Unix ns)."""

    step: int
    op: str
    start_ns: int
    duration_ms: float
    size_bytes: int
    group: str
    group_size: int
    dtype: str


class Callback:
    """Do-nothing hooks called at step and phase boundaries; override what you need.

    >>> class Count(Callback):
    ...     def __init__(self): self.steps = 0
    ...     def on_step_end(self, record): self.steps += 1
    >>> c = Count(); c.on_step_end(None); c.on_phase_begin("forward", "forward"); c.steps
    1
    """

    def on_train_begin(self, info: dict[str, Any]) -> None:
        """The process started publishing (``info``: job id, node, rank)."""

    def on_train_end(self, state: str) -> None:
        """The process stops publishing; ``state`` is ``finished`` or ``failed``."""

    def on_step_begin(self, step: int) -> None:
        """Step ``step`` started."""

    def on_step_end(self, record: StepRecord) -> None:
        """A step finished; the place to act at a step boundary."""

    def on_phase_begin(self, phase: str, name: str) -> None:
        """A phase started (explicit API, and the forward/backward/optimizer hooks)."""

    def on_phase_end(self, span: SpanRecord) -> None:
        """A phase span was recorded."""

    def on_collective(self, op: CollectiveRecord) -> None:
        """A collective call finished."""


class CallbackSet(Callback):
    """Fans every hook out to its callbacks, in order.

    >>> class Say(Callback):
    ...     def __init__(self, tag, out): self.tag, self.out = tag, out
    ...     def on_step_begin(self, step): self.out.append((self.tag, step))
    >>> out = []
    >>> CallbackSet([Say("a", out), Say("b", out)]).on_step_begin(3); out
    [('a', 3), ('b', 3)]
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks: list[Callback] = []
        self.wanted: frozenset[str] = frozenset()
        """The hooks some callback overrides (the others are not called at all)."""
        for c in callbacks:
            self.append(c)

    def __len__(self) -> int:
        return len(self.callbacks)

    def append(self, callback: Callback) -> None:
        self.insert(len(self.callbacks), callback)

    def insert(self, index: int, callback: Callback) -> None:
        self.callbacks.insert(index, callback)
        self.wanted = frozenset(h for h in _HOOKS if any(_overrides(c, h) for c in self.callbacks))

    def on_train_begin(self, info: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_train_begin(info)

    def on_train_end(self, state: str) -> None:
        for c in self.callbacks:
            c.on_train_end(state)

    def on_step_begin(self, step: int) -> None:
        for c in self.callbacks:
            c.on_step_begin(step)

    def on_step_end(self, record: StepRecord) -> None:
        for c in self.callbacks:
            c.on_step_end(record)

    def on_phase_begin(self, phase: str, name: str) -> None:
        for c in self.callbacks:
            c.on_phase_begin(phase, name)

    def on_phase_end(self, span: SpanRecord) -> None:
        for c in self.callbacks:
            c.on_phase_end(span)

    def on_collective(self, op: CollectiveRecord) -> None:
        for c in self.callbacks:
            c.on_collective(op)


_HOOKS = tuple(n for n in vars(Callback) if n.startswith("on_"))


def _overrides(callback: Callback, hook: str) -> bool:
    if isinstance(callback, CallbackSet):
        return hook in callback.wanted
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


class _Errors:
    """Counts failures and logs each kind once (never raises)."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()

    def __call__(self, where: str, exc: BaseException) -> None:
        self.count += 1
        if where not in self._seen:
            self._seen.add(where)
            log.warning("perfloop: %s failed (counted, reported once): %s", where, exc)


def _float_or_none(v: Any, *, nonneg: bool = False) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(f) or (nonneg and f < 0):
        return None
    return f


def _count(v: Any, hi: int = 1 << 62) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        return 0
    return min(max(n, 0), hi)


class _Memory:
    """Reads memory cheaply: RSS from /proc/self/statm, CUDA allocator figures if CUDA is up."""

    def __init__(self) -> None:
        self._pid = 0
        self._fd = -1
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rss(self) -> int:
        pid = os.getpid()
        if pid != self._pid:  # a forked child must not read its parent's statm
            self._pid = pid
            try:
                self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            except OSError:
                self._fd = -1
        if self._fd >= 0:
            try:
                return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                return 0
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:
            return 0

    def read(self) -> dict[str, int]:
        out = {"rss_bytes": self.rss()}
        torch = sys.modules.get("torch")
        if torch is not None:
            cuda = torch.cuda
            if cuda.is_initialized():
                dev = cuda.current_device()
                out["mem_allocated_bytes"] = int(cuda.memory_allocated(dev))
                out["mem_reserved_bytes"] = int(cuda.memory_reserved(dev))
                out["mem_peak_bytes"] = int(cuda.max_memory_allocated(dev))
        return out


class Recorder:
    """Tiles steps with phase spans and hands the rows to an emitter (one training thread).

    Times are ``time.perf_counter_ns`` values; rows carry Unix ns. With ``contiguous`` (the
    hooks) a step ends where the next one starts and the first starts at the first span;
    otherwise (the explicit API) `open_step` starts each step. Depth-0 spans of a step never
    overlap; the gaps between them are glued onto the span before (up to ``glue_ns``) or
    recorded as ``("user", "other")`` spans, and two spans of the same phase closer than
    ``coalesce_ns`` become one, so the spans of a step sum to its step time.

    The training thread only appends tuples: memory is read at most every
    ``memory_every_ns``, and rows are cleaned (losses read with ``resolve``) and handed to
    the emitter every ``handover_ns``, by `drain` on another thread when ``background``.

    >>> r = Recorder(None, wall_offset_ns=0)
    >>> r.span("data_wait", "data_wait", 0, 2_000_000)
    >>> r.span("forward", "forward", 2_010_000, 5_000_000)   # 10 µs glue → data_wait
    >>> r.span("backward", "backward", 6_000_000, 9_000_000)  # 1 ms gap → "other"
    >>> rec = r.end_step(9_020_000)                             # 20 µs glue → backward
    >>> rec.step, rec.step_time_ms, rec.phase_ms
    (0, 9.02, {'data_wait': 2.01, 'forward': 2.99, 'other': 1.0, 'backward': 3.02})
    """

    def __init__(
        self,
        emitter: Any,
        *,
        rank: int = 0,
        contiguous: bool = True,
        callbacks: Callback | None = None,
        glue_ns: int = 50_000,
        coalesce_ns: int = 200_000,
        wall_offset_ns: int | None = None,
        memory: Callable[[], dict[str, int]] | None = None,
        errors: _Errors | None = None,
        handover_ns: int = 100_000_000,
        memory_every_ns: int = 250_000_000,
        resolve: Callable[[Any], float | None] | None = None,
    ) -> None:
        self.emitter = emitter
        self.rank = rank
        self.contiguous = contiguous
        if not isinstance(callbacks, CallbackSet):
            callbacks = CallbackSet([callbacks] if callbacks is not None else [])
        self.callbacks = callbacks
        self.glue_ns = glue_ns
        self.coalesce_ns = coalesce_ns
        self.offset = (
            time.time_ns() - time.perf_counter_ns() if wall_offset_ns is None else wall_offset_ns
        )
        self.memory = memory
        self.errors = errors or _Errors()
        self.step = 0
        self.steps = 0  # finished
        self.step_ms_total = 0.0
        self._start: int | None = None
        self._cursor = 0
        self._last: list[Any] | None = None  # the pending depth-0 span [phase, name, t0, t1]
        self._phase_ms: dict[str, float] = {}
        self._spans: list[tuple[Any, ...]] = []  # rows in _SPAN_COLUMNS order
        self._steps: list[dict[str, Any]] = []
        self._colls: list[tuple[Any, ...]] = []  # rows in _COLLECTIVE_COLUMNS order
        self.handover_ns = handover_ns
        self._handed = 0
        self.background = False
        self._draining = threading.Lock()
        self._outbox: collections.deque[tuple[list[Any], list[Any], list[Any]]] = (
            collections.deque()
        )
        self.memory_every_ns = memory_every_ns
        self._mem_t = -(1 << 62)
        self._mem: dict[str, int] | None = None
        self.resolve = resolve

    @property
    def started(self) -> bool:
        """Whether a step is open."""
        return self._start is not None

    @property
    def cursor(self) -> int:
        """Where the depth-0 spans recorded so far end."""
        return self._cursor

    # -- spans -------------------------------------------------------------------------
    def _emit(
        self,
        phase: str,
        name: str,
        t0: int,
        t1: int,
        depth: int,
        tiles: bool = True,
        step: int | None = None,
    ) -> None:
        ms = (t1 - t0) / 1e6
        step = self.step if step is None else step
        self._spans.append((t0 + self.offset, self.rank, step, phase, name, ms, depth))
        if depth == 0 and tiles:
            key = name if phase == "user" else phase
            self._phase_ms[key] = self._phase_ms.get(key, 0.0) + ms
        if "on_phase_end" in self.callbacks.wanted:
            try:
                self.callbacks.on_phase_end(
                    SpanRecord(step, phase, name, t0 + self.offset, ms, depth)
                )
            except Exception as e:
                self.errors("a callback (on_phase_end)", e)

    def _flush_last(self) -> None:
        last = self._last
        if last is not None:
            self._last = None
            self._emit(last[0], last[1], last[2], last[3], 0)

    def _begin(self, t: int) -> None:
        self._start = self._cursor = t
        if "on_step_begin" in self.callbacks.wanted:
            try:
                self.callbacks.on_step_begin(self.step)
            except Exception as e:
                self.errors("a callback (on_step_begin)", e)

    def open_step(self, t: int) -> None:
        """Start a step at ``t`` (explicit API); a step already open is left as it is."""
        if self._start is None:
            self._begin(t)

    def span(
        self, phase: str, name: str, t0: int, t1: int, depth: int = 0, step: int | None = None
    ) -> None:
        """Record a span from ``t0`` to ``t1``; depth-0 spans arrive in time order. A nested
        span (``depth`` ≥ 1) may name the ``step`` it belongs to (default: the open one)."""
        if t1 < t0:
            t1 = t0
        if depth:
            self._emit(phase, name, t0, t1, depth, step=step)
            return
        if self._start is None:
            if not self.contiguous:  # outside a step block: kept, but it tiles nothing
                self._emit(phase, name, t0, t1, 0, tiles=False)
                return
            self._begin(t0)
        cur = self._cursor
        if t0 < cur:
            if t1 <= cur:  # inside what is already recorded: a nested span
                self._emit(phase, name, t0, t1, 1)
                return
            t0 = cur
        last = self._last
        gap = t0 - cur
        if last is not None and last[0] == phase and last[1] == name and gap <= self.coalesce_ns:
            last[3] = t1
            self._cursor = t1
            return
        if gap > 0:
            if gap <= self.glue_ns:
                if last is not None:
                    last[3] = t0
                else:
                    t0 = cur
            else:
                self._flush_last()
                self._emit("user", "other", cur, t0, 0)
        self._flush_last()
        self._last = [phase, name, t0, t1]
        self._cursor = t1

    def collective(
        self,
        op: str,
        t0: int,
        t1: int,
        *,
        size_bytes: int = 0,
        group: str = "",
        group_size: int = 0,
        dtype: str = "",
        step: int | None = None,
    ) -> None:
        """Record one collective call as a `CollectiveOp` row (its span is the caller's), in
        ``step`` (default: the open one)."""
        ms = max(t1 - t0, 0) / 1e6
        step = self.step if step is None else step
        self._colls.append(
            (
                t0 + self.offset,
                self.rank,
                step,
                op,
                size_bytes,
                group[:128],
                group_size,
                ms,
                dtype[:32],
            )
        )
        if "on_collective" in self.callbacks.wanted:
            try:
                self.callbacks.on_collective(
                    CollectiveRecord(
                        step, op, t0 + self.offset, ms, size_bytes, group, group_size, dtype
                    )
                )
            except Exception as e:
                self.errors("a callback (on_collective)", e)

    # -- steps -------------------------------------------------------------------------
    def end_step(
        self, t: int, fields: dict[str, Any] | None = None, **figures: Any
    ) -> StepRecord | None:
        """Close the open step at ``t`` with its figures (`StepEvent` names), given as the
        ``fields`` dict or as keywords. They are cleaned when rows are handed over (a
        ``loss`` may be a list of values to average, read with ``resolve``).

        Returns the step's record, or None when no step was open (nothing to time).
        """
        start = self._start
        if start is None:
            if self.contiguous:
                self._begin(t)
            return None
        cur = self._cursor
        gap = t - cur
        if gap > 0:
            if gap <= self.glue_ns and self._last is not None:
                self._last[3] = t
            else:
                self._flush_last()
                self._emit("user", "other", cur, t, 0)
        self._flush_last()
        step_ms = max((t - start) / 1e6, 1e-6)
        if fields is None:
            fields = figures
        if self.memory is not None and t - self._mem_t >= self.memory_every_ns:
            self._mem_t = t
            try:
                self._mem = self.memory()
            except Exception as e:
                self.errors("reading memory", e)
        phase_ms = self._phase_ms
        self._steps.append(
            (
                t + self.offset,
                self.rank,
                self.step,
                step_ms,
                phase_ms.get("data_wait", 0.0),
                fields,
                self._mem,
            )
        )
        rec = StepRecord(self.step, start + self.offset, t + self.offset, step_ms, phase_ms)
        rec.fields = fields
        self._phase_ms = {}
        self.step += 1
        self.steps += 1
        self.step_ms_total += step_ms
        self._start = None
        if t - self._handed >= self.handover_ns:
            self._handed = t
            self.handover()
        if "on_step_end" in self.callbacks.wanted:
            try:
                self.callbacks.on_step_end(rec)
            except Exception as e:
                self.errors("a callback (on_step_end)", e)
        if self.contiguous:
            self._begin(t)
        return rec

    def _step_rows(self, steps: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
        rows = []
        for ts, rank, step, step_ms, data_wait, fields, mem in steps:
            row = step_row(fields, self.resolve)
            if mem:
                row.update(mem)
            row["ts_ns"], row["rank"], row["step"] = ts, rank, step
            row["step_time_ms"], row["data_wait_ms"] = step_ms, data_wait
            rows.append(row)
        return {k: [r[k] for r in rows] for k in rows[0]}

    def handover(self) -> None:
        """Hand the pending rows over: to the emitter at once, or with ``background`` set,
        to `drain` (another thread cleans them, reads losses and calls the emitter)."""
        batch = (self._steps, self._spans, self._colls)
        self._steps, self._spans, self._colls = [], [], []
        if self.background:
            self._outbox.append(batch)
        else:
            self._publish(batch)

    def drain(self) -> None:
        """Publish what `handover` queued (thread-safe against the training thread, and one
        drain at a time, so batches reach the emitter in the order they were queued)."""
        out = self._outbox
        with self._draining:
            while out:
                try:
                    batch = out.popleft()
                except IndexError:
                    return
                self._publish(batch)

    def _publish(self, batch: tuple[list[Any], list[Any], list[Any]]) -> None:
        steps, spans, colls = batch
        em = self.emitter
        if em is None:
            return
        try:
            if steps:
                em.extend("step", **self._step_rows(steps))
            if spans:
                em.extend("span", **_columns(_SPAN_COLUMNS, spans))
            if colls:
                em.extend("collective", **_columns(_COLLECTIVE_COLUMNS, colls))
        except Exception as e:
            self.errors("handing rows to the emitter", e)

    def close(self) -> None:
        """Record the last open span of an unfinished step and publish everything."""
        self._flush_last()
        self.handover()
        self.drain()


def _columns(names: tuple[str, ...], rows: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    return {n: list(c) for n, c in zip(names, zip(*rows, strict=True), strict=True)}


_SPAN_COLUMNS = ("ts_ns", "rank", "step", "phase", "name", "duration_ms", "depth")
_COLLECTIVE_COLUMNS = (
    "ts_ns",
    "rank",
    "step",
    "op",
    "size_bytes",
    "group",
    "group_size",
    "duration_ms",
    "dtype",
)
_STEP_DEFAULTS: dict[str, Any] = {
    "batch_size": 0,
    "num_workers": 0,
    "epoch": 0,
    "samples": 0,
    "tokens": 0,
    "grad_accum_steps": 1,
    "loss": None,
    "grad_norm": None,
    "lr": None,
    "mem_allocated_bytes": 0,
    "mem_reserved_bytes": 0,
    "mem_peak_bytes": 0,
    "rss_bytes": 0,
}


_FLOAT_FIELDS = {"loss": False, "grad_norm": True, "lr": True}  # name → must be >= 0
_INT_LIMITS = {"grad_accum_steps": 1 << 16, "num_workers": 1024}


def clean_float(v: Any, nonneg: bool = False) -> float | None:
    """``v`` as a finite float (>= 0 with ``nonneg``), else None.

    >>> clean_float(float("nan")), clean_float(-1.0, nonneg=True), clean_float(2)
    (None, None, 2.0)
    """
    if v is None:
        return None
    f = v if type(v) is float else _float_or_none(v)
    if f is None or f != f or f in (math.inf, -math.inf) or (nonneg and f < 0):
        return None
    return f


def step_row(
    fields: dict[str, Any], resolve: Callable[[Any], float | None] | None = None
) -> dict[str, Any]:
    """A step row with every optional column, values clamped to what `StepEvent` accepts.

    >>> r = step_row({"batch_size": 8, "loss": float("inf"), "grad_accum_steps": 0})
    >>> r["batch_size"], r["samples"], r["loss"], r["grad_accum_steps"]
    (8, 8, None, 1)
    """
    row = dict(_STEP_DEFAULTS)
    for k, v in fields.items():
        if k not in row:
            continue
        nonneg = _FLOAT_FIELDS.get(k)
        if nonneg is not None:
            if isinstance(v, (list, tuple)):  # values to average (micro-batch losses)
                vals = [clean_float(resolve(x) if resolve else x) for x in v]
                vals = [x for x in vals if x is not None]
                v = sum(vals) / len(vals) if vals else None
            row[k] = clean_float(v, nonneg)
        elif type(v) is int and 0 <= v < _INT_LIMITS.get(k, 1 << 62):
            row[k] = v
        else:
            row[k] = _count(v, _INT_LIMITS.get(k, 1 << 62))
    if row["grad_accum_steps"] < 1:
        row["grad_accum_steps"] = 1
    if not row["samples"] and row["batch_size"]:
        row["samples"] = row["batch_size"] * row["grad_accum_steps"]
    return row


# -- what the job is -----------------------------------------------------------------------
_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
_WRAPPERS = {
    "DistributedDataParallel": "ddp",
    "FullyShardedDataParallel": "fsdp",
    "DataParallel": "dp",
}


def describe_job(
    *,
    model: Any = None,
    optimizer: Any = None,
    precision: str | None = None,
    command: str = "",
    **fields: Any,
) -> dict[str, Any]:
    """`JobInfo` fields found by looking at the model, the optimizer, torch and the host.

    ``fields`` (any `JobInfo` field) override what is found. torch is never imported here.

    >>> d = describe_job(command="python train.py", batch_size=32)
    >>> d["world_size"] >= 1, d["command"], d["batch_size"], d["cpu_count"] > 0
    (True, 'python train.py', 32, True)
    """
    info: dict[str, Any] = dict(launcher_world())
    info.pop("rank")
    info.pop("local_rank")
    info["cpu_count"] = os.cpu_count() or 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        info["host_mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    torch = sys.modules.get("torch")
    if torch is not None:
        info["framework"] = "torch"
        info["framework_version"] = str(getattr(torch, "__version__", ""))
        info["cuda_version"] = str(getattr(torch.version, "cuda", None) or "")
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                info["gpu_name"] = str(props.name)[:256]
                info["gpu_mem_bytes"] = int(props.total_memory)
                info["gpu_count"] = int(torch.cuda.device_count())
        dist = sys.modules.get("torch.distributed")
        with contextlib.suppress(Exception):
            if dist is not None and dist.is_available() and dist.is_initialized():
                info["backend"] = str(dist.get_backend())
    if model is not None:
        with contextlib.suppress(Exception):
            wrapper = type(model).__name__
            inner = getattr(model, "module", model) if wrapper in _WRAPPERS else model
            info["model_name"] = type(inner).__name__[:256]
            info["parallelism"] = _WRAPPERS.get(
                wrapper, "none" if info["world_size"] == 1 else "dp"
            )
            params = list(model.parameters())
            info["model_params"] = int(sum(p.numel() for p in params))
            if precision is None and params:
                dtype = str(params[0].dtype).removeprefix("torch.")
                precision = _PRECISION.get(dtype, dtype)
                if precision == "fp32" and params[0].is_cuda:
                    with contextlib.suppress(Exception):
                        if torch is not None and torch.backends.cuda.matmul.allow_tf32:
                            precision = "tf32"
            if info["parallelism"] in ("ddp", "fsdp", "dp"):
                info["dp_size"] = info["world_size"]
    if optimizer is not None:
        info["optimizer"] = type(optimizer).__name__[:256]
    if precision:
        info["precision"] = precision[:256]
    info["command"] = command[:4096]
    info.update({k: v for k, v in fields.items() if v is not None})
    return info


# -- the plumbing shared by the monitor and the hooks --------------------------------------
class Pipeline:
    """One process's telemetry: publisher → emitter → `Recorder`, lifecycle and self-metrics.

    Either pass a ``publisher`` (anything with ``publish(topic, key, value) -> bool``; its
    owner flushes and closes it) or ``settings`` (a `ProducerSettings`; a `Publisher` is made
    from it, flushed and closed by `close`).
    """

    def __init__(
        self,
        *,
        job_id: str,
        node: str,
        rank: int,
        settings: Any = None,
        publisher: Any = None,
        producer_id: str | None = None,
        contiguous: bool = True,
        callbacks: Callback | None = None,
        flush_interval_s: float | None = None,
        stats_interval_s: float | None = None,
    ) -> None:
        from perfloop.producers.emitter import Emitter

        self.errors = _Errors()
        self_id = (producer_id or f"torch-{node}-{os.getpid()}")[:128]
        self.owns_publisher = publisher is None
        if publisher is None:
            if settings is None:
                from perfloop.settings import ProducerSettings

                settings = ProducerSettings()  # the explicit API's script is the entry point
            from perfloop.producers.publisher import Publisher

            publisher = Publisher(settings, producer_id=self_id)
        self.settings = settings
        self.publisher = publisher
        self.job_id, self.node = job_id, node
        self.producer_id = self_id
        if flush_interval_s is None:
            flush_interval_s = settings.publish_interval_ms / 1000 if settings is not None else None
        if stats_interval_s is None and settings is not None:
            stats_interval_s = settings.stats_interval_s
        # no flusher thread of the emitter's own: the worker below flushes it right after it
        # drained the recorder (one wake-up, one GIL hand-over per interval, and rows leave
        # as soon as they are handed over)
        self.flush_interval_s = flush_interval_s
        self.emitter = Emitter(publisher, job_id=job_id, node=node, producer_id=self.producer_id)
        if not isinstance(callbacks, CallbackSet):
            callbacks = CallbackSet([callbacks] if callbacks is not None else [])
        self.callbacks = callbacks
        self.overhead_ns = 0  # time spent in perfloop's own code on the training thread
        self.meter = _overhead_meter()
        # overhead ns (the hooks', and the publisher's CPU, which may predate us) and step
        # ms already given to the meter
        self._charged = (self._publisher_cpu_s(self._publisher_stats()) * 1e9, 0.0)
        self.recorder = Recorder(
            self.emitter,
            rank=rank,
            contiguous=contiguous,
            callbacks=self.callbacks,
            memory=_Memory().read,
            errors=self.errors,
        )
        self.t0_ns = time.perf_counter_ns()
        self._last_stats = (self.t0_ns, 0)
        self._closed = False
        self._stop = threading.Event()
        self.tick: Callable[[], None] | None = None
        """Called on the worker thread every drain interval (the hooks' progress reports)."""
        # one worker: publishes the recorder's rows off the training thread, and stats
        self.recorder.background = True
        self._thread = threading.Thread(
            target=self._work,
            args=(stats_interval_s or 0.0,),
            name="perfloop-pipeline",
            daemon=True,
        )
        self._thread.start()

    @property
    def rank(self) -> int:
        return self.recorder.rank

    def event(self, kind: type[Any], **fields: Any) -> bool:
        """Publish one job-level event now; count a failure instead of raising."""
        try:
            ev = kind(
                ts_ns=time.time_ns(),
                job_id=self.job_id,
                node=self.node,
                rank=fields.pop("rank", self.recorder.rank),
                **fields,
            )
            return bool(self.emitter.event(ev))
        except Exception as e:
            self.errors(f"publishing {getattr(kind, 'KIND', kind)}", e)
            return False

    def lifecycle(self, state: str, exit_code: int | None = None, message: str = "") -> None:
        self.event(JobLifecycle, state=state, exit_code=exit_code, message=message[:2000])

    def job_info(self, fields: dict[str, Any]) -> None:
        known = JobInfo.model_fields
        self.event(JobInfo, **{k: v for k, v in fields.items() if k in known})

    def _feed_meter(self) -> None:
        """Give the `OverheadMeter` the hooks' time and the steps' time since last time."""
        meter = self.meter
        if meter is None:
            return
        # the training thread's time in hooks, plus the publisher thread's CPU time
        o = self.overhead_ns + self._publisher_cpu_s(self._publisher_stats()) * 1e9
        ms = self.recorder.step_ms_total
        o0, ms0 = self._charged
        self._charged = (o, ms)
        meter.charge((o - o0) / 1e9)
        meter.record_step((ms - ms0) / 1e3)

    def stats(self) -> None:
        """Publish `ProducerStats`: counts so far and the overhead over the last interval."""
        now = time.perf_counter_ns()
        last_t, last_o = self._last_stats
        self._last_stats = (now, self.overhead_ns)
        wall = max(now - last_t, 1)
        ps = self._publisher_stats()
        em = self.emitter

        def n(name: str) -> int:
            return max(int(getattr(ps, name, 0) or 0), 0)

        self.event(
            ProducerStats,
            producer_id=self.producer_id,
            samples=em.samples,
            messages=em.messages,
            published=n("published"),
            spooled=n("spooled"),
            replayed=n("replayed"),
            dropped=n("dropped"),
            dropped_samples=n("dropped_samples"),
            failed=n("failed") + self.errors.count,
            in_flight=n("in_flight"),
            spool_bytes=n("spool_bytes"),
            cpu_time_ms=self.overhead_ns / 1e6 + self._publisher_cpu_s(ps) * 1e3,
            overhead_pct=self.overhead_pct(last_o, wall),
        )

    def _publisher_stats(self) -> Any:
        try:
            return getattr(self.publisher, "stats", None)
        except Exception:
            return None

    @staticmethod
    def _publisher_cpu_s(ps: Any) -> float:
        v = getattr(ps, "cpu_time_s", 0.0) if ps is not None else 0.0
        return float(v) if isinstance(v, (int, float)) and v >= 0 else 0.0

    def overhead_pct(self, since_ns: int = 0, wall_ns: int = 0) -> float:
        """The training thread's time in perfloop code as a share of step time (the
        `OverheadMeter`'s window) or, without a meter, of wall time since ``since_ns``."""
        if self.meter is not None:
            with contextlib.suppress(Exception):
                self._feed_meter()
                return max(float(self.meter.overhead_pct()), 0.0)
        wall = wall_ns or max(time.perf_counter_ns() - self.t0_ns, 1)
        return 100.0 * max(self.overhead_ns - since_ns, 0) / wall

    def _work(self, stats_interval_s: float, drain_interval_s: float = 0.25) -> None:
        flush_s = self.flush_interval_s
        wait_s = min(drain_interval_s, flush_s) if flush_s else drain_interval_s
        next_stats = time.monotonic() + stats_interval_s
        next_flush = time.monotonic() + (flush_s or 0.0)
        while not self._stop.wait(wait_s):
            self.recorder.drain()
            tick = self.tick
            if tick is not None:
                try:
                    tick()
                except Exception as e:
                    self.errors("the pipeline's periodic check", e)
            if flush_s and time.monotonic() >= next_flush - wait_s / 2:
                next_flush = max(next_flush + flush_s, time.monotonic())
                try:
                    self.emitter.flush()
                except Exception as e:  # the batch taken is lost (counted); the next goes on
                    self.errors("publishing a telemetry batch", e)
            if stats_interval_s and time.monotonic() >= next_stats:
                next_stats = time.monotonic() + stats_interval_s
                self.stats()

    def close(
        self,
        state: str = "finished",
        exit_code: int | None = None,
        message: str = "",
        timeout_s: float = 3.0,
    ) -> None:
        """Record what is pending, publish the final lifecycle and stats, flush (bounded)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.recorder.close()
            self.emitter.flush()
            self.lifecycle(state, exit_code, message)
            self.stats()
            self.emitter.close()
            if self.owns_publisher:  # else whoever made it flushes and closes it
                close_publisher(self.publisher, timeout_s)
        except Exception as e:
            self.errors("closing the publisher", e)
        with contextlib.suppress(Exception):
            self.callbacks.on_train_end(state)


def close_publisher(publisher: Any, timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for delivery, then close (a spooling publisher keeps the
    rest on disk); return the messages not delivered yet."""
    left = 0
    flush = getattr(publisher, "flush", None)
    if callable(flush):
        left = int(flush(timeout_s) or 0)
    close = getattr(publisher, "close", None)
    if callable(close):
        try:
            close(timeout_s=0)
        except TypeError:
            close()
    return left


def _overhead_meter() -> Any:
    try:
        from perfloop.producers.adaptive import OverheadMeter
    except ImportError:  # pragma: no cover - shipped with the observation tier
        return None
    return OverheadMeter()


def _phase_of(name: str) -> tuple[str, str]:
    if name in _STANDARD:
        return name, name
    clean = _CONTROL.sub(" ", str(name)).strip()[:128] or "unnamed"
    return "user", clean


class _StepBlock:
    __slots__ = ("fields", "mon")

    def __init__(self, mon: Monitor, fields: dict[str, Any]) -> None:
        self.mon, self.fields = mon, fields

    def __enter__(self) -> _StepBlock:
        self.mon._step_enter(self.fields)
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.mon._step_exit(et)


class _PhaseBlock:
    __slots__ = ("mon", "name", "phase", "t0")

    def __init__(self, mon: Monitor, name: str) -> None:
        self.mon = mon
        self.phase, self.name = _phase_of(name)
        self.t0 = 0

    def __enter__(self) -> _PhaseBlock:
        self.t0 = self.mon._phase_enter(self.phase, self.name)
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.mon._phase_exit(self.phase, self.name, self.t0)


class Monitor:
    """Explicit instrumentation of a training loop: steps, phases and per-step figures.

    Give ``settings`` (a `ProducerSettings`) or a ``publisher``; with neither, settings are
    read from the environment (the script is the entry point). With settings whose ``agent``
    is on (the default), a job agent applies the actuator's signed commands between steps:
    ``torch.num_threads`` when torch is imported, the script's `perfloop.producers.tunable`
    values and slow-loop changes (its config patch); loader knobs need `perfloop run`'s hooks.
    ``job_id`` and ``node`` default to those settings (or to those of `perfloop run` when the
    script runs under it), then to a generated id and the host name; ``rank`` defaults to the
    launcher's.

    >>> class Collect:
    ...     def __init__(self): self.sent = []
    ...     def publish(self, topic, key, value): self.sent.append(topic); return True
    >>> pub = Collect()
    >>> mon = Monitor(job_id="doc", node="n0", publisher=pub)
    >>> for i in range(3):
    ...     with mon.step(batch_size=8):
    ...         with mon.phase("forward"):
    ...             pass
    ...         mon.report(loss=1.0 / (i + 1), lr=0.1)
    >>> mon.close(); mon.steps, mon.errors
    (3, 0)
    >>> sorted(set(pub.sent))
    ['perfloop.telemetry.job', 'perfloop.telemetry.span', 'perfloop.telemetry.step']
    """

    def __init__(
        self,
        job_id: str | None = None,
        *,
        node: str | None = None,
        rank: int | None = None,
        settings: Any = None,
        publisher: Any = None,
        callbacks: Iterable[Callback] = (),
        producer_id: str | None = None,
        flush_interval_s: float | None = None,
        stats_interval_s: float | None = None,
    ) -> None:
        hooks = sys.modules.get("perfloop.producers.hooks")
        session = hooks.explicit_monitor_started() if hooks is not None else None
        if settings is None and session is not None:  # under `perfloop run`: its job
            settings = session.settings
        if settings is None and publisher is None:
            from perfloop.settings import ProducerSettings

            settings = ProducerSettings()  # the script is the entry point
        job_id = (
            job_id or getattr(settings, "job_id", None) or f"job-{os.getpid()}-{time.time_ns()}"
        )
        node = node or getattr(settings, "node", None) or socket.gethostname()
        world = launcher_world()
        self._pipe = Pipeline(
            job_id=job_id,
            node=node,
            rank=world["rank"] if rank is None else rank,
            settings=settings,
            publisher=publisher,
            producer_id=producer_id,
            contiguous=False,
            callbacks=CallbackSet(callbacks),
            flush_interval_s=flush_interval_s,
            stats_interval_s=stats_interval_s,
        )
        self._rec = self._pipe.recorder
        self._report: dict[str, Any] = {}
        self._step_fields: dict[str, Any] = {}
        self._depth = 0
        self._tid = threading.get_ident()
        self.job_id, self.node = job_id, node
        self._pipe.lifecycle("started")
        with contextlib.suppress(Exception):
            self._pipe.callbacks.on_train_begin(
                {"job_id": job_id, "node": node, "rank": self._rec.rank}
            )
        self.agent: Any = None
        if settings is not None and getattr(settings, "agent", False):
            self._start_agent(settings)
        atexit.register(self._at_exit)  # a script that never calls close() still publishes

    def _start_agent(self, settings: Any) -> None:
        try:
            from perfloop.producers.knobs import TorchKnobs, start_agent

            knobs = TorchKnobs(sys.modules.get("torch"), None)
            self.agent = start_agent(
                settings, knobs, job_id=self.job_id, node=self.node, rank=self._rec.rank
            )
        except Exception as e:  # the job runs on, unchanged
            self._pipe.errors("starting the job agent (no changes will be applied)", e)

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return self._rec.steps

    @property
    def errors(self) -> int:
        """Failures counted so far (publishing, callbacks, bad values)."""
        return self._pipe.errors.count

    @property
    def callbacks(self) -> CallbackSet:
        return self._pipe.callbacks

    def step(self, batch_size: int = 0, *, samples: int = 0, tokens: int = 0) -> _StepBlock:
        """A context manager around one training step."""
        return _StepBlock(self, {"batch_size": batch_size, "samples": samples, "tokens": tokens})

    def phase(self, name: str) -> _PhaseBlock:
        """A context manager around one phase; a non-standard name is a ``"user"`` span."""
        return _PhaseBlock(self, name)

    def report(self, **figures: Any) -> None:
        """Figures of the current step: ``loss``, ``grad_norm``, ``lr``, ``tokens``,
        ``samples``, ``batch_size``, ``epoch``, ``grad_accum_steps``, ``num_workers``.

        Values may be numbers or one-element tensors (converted with ``float()``, which waits
        for the GPU). Unknown names are counted as errors and ignored.
        """
        t = time.perf_counter_ns()
        for k, v in figures.items():
            if k in _STEP_DEFAULTS and not k.startswith(("mem_", "rss")):
                self._report[k] = v
            else:
                self._pipe.errors("report() with an unknown figure", KeyError(k))
        self._pipe.overhead_ns += time.perf_counter_ns() - t

    def job_info(self, *, model: Any = None, optimizer: Any = None, **fields: Any) -> None:
        """Publish `JobInfo` (model size, optimizer, precision, world, hardware, command)."""
        t = time.perf_counter_ns()
        try:
            fields.setdefault("command", " ".join(sys.argv))
            self._pipe.job_info(describe_job(model=model, optimizer=optimizer, **fields))
        except Exception as e:
            self._pipe.errors("describing the job", e)
        self._pipe.overhead_ns += time.perf_counter_ns() - t

    def _step_enter(self, fields: dict[str, Any]) -> None:
        t = time.perf_counter_ns()
        if self._rec.started:
            self._pipe.errors("step() inside a step", RuntimeError("nested step ignored"))
        self._step_fields = fields
        self._rec.open_step(t)
        self._pipe.overhead_ns += time.perf_counter_ns() - t

    def _step_exit(self, exc_type: Any) -> None:
        t = time.perf_counter_ns()
        try:
            fields = {k: v for k, v in self._step_fields.items() if v}
            fields.update(self._report)
            self._report = {}
            rec = self._rec.end_step(t, **fields)
            if rec is not None and self.agent is not None:
                loss = fields.get("loss")
                loss = float(loss) if isinstance(loss, int | float) else None
                self.agent.observe_step(rec.step, rec.step_time_ms, loss)
                self.agent.step_boundary(rec.step + 1)
        except Exception as e:
            self._pipe.errors("recording a step", e)
        self._pipe.overhead_ns += time.perf_counter_ns() - t

    def _phase_enter(self, phase: str, name: str) -> int:
        t = time.perf_counter_ns()
        self._depth += 1
        if "on_phase_begin" in self._pipe.callbacks.wanted:
            try:
                self._pipe.callbacks.on_phase_begin(phase, name)
            except Exception as e:
                self._pipe.errors("a callback (on_phase_begin)", e)
        self._pipe.overhead_ns += time.perf_counter_ns() - t
        return t

    def _phase_exit(self, phase: str, name: str, t0: int) -> None:
        t = time.perf_counter_ns()
        self._depth -= 1
        try:
            self._rec.span(phase, name, t0, t, self._depth)
        except Exception as e:
            self._pipe.errors("recording a span", e)
        self._pipe.overhead_ns += time.perf_counter_ns() - t

    def close(self, exit_code: int | None = 0, message: str = "") -> None:
        """Publish what is pending and the lifecycle end: ``finished`` for exit code 0."""
        with contextlib.suppress(Exception):
            atexit.unregister(self._at_exit)
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.stop()
            self.agent = None
        state = "finished" if not exit_code else "failed"
        self._pipe.close(state, exit_code, message)

    def _at_exit(self) -> None:
        self.close(None)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is None:
            self.close(0)
        else:
            self.close(1, f"{et.__name__}: {ev}"[:2000])
