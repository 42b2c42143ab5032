"""Profiler captures on command: the knob ``profiler.capture_steps`` (capture the next N steps).

`ProfileCapture` lives in the training process. Its knob handler `ProfileCapture.request` takes
a number of steps; at the next step boundary (`ProfileCapture.step_boundary`, called by the
training loop before each step, on the training thread) it starts a PyTorch profiler (CPU, plus
CUDA when ``torch.cuda.is_available()``), marks each captured step as ``ProfilerStep#<step>``
with the training loop's own step number, and after N steps stops it. A worker thread then
exports the Chrome trace to a file under ``out_dir``, reads it with the trace-replay code
(`perfloop.producers.replay`: the same parsing as ``perfloop replay``) as this job's
``job_id`` / ``node`` / ``rank``, and hands what it finds to ``emit``:

- telemetry as decoded `perfloop.schemas.Batch` objects (columnar, already validated): by
  default only what the live hooks cannot see, `KernelSummary` rows (GPU busy time per stream
  and kernel class) and depth-1 `PhaseSpan` rows (the ``record_function`` annotations: optimizer
  steps, ``## forward ##``…). The step events, the depth-0 phase tiling, the collectives and the
  `JobInfo` a replay also makes restate what the traced process already publishes for the same
  steps (the warehouse would hold two rows per step, the second slowed by the profiler), so they
  are left out unless ``full_replay=True`` (a process with no live telemetry);
- then one summary, a `CapabilityReport` of component ``profiler_capture``: ``available`` says
  whether the capture worked, ``reason`` why not, and ``details`` the captured steps, the
  profiled time, the trace's path and the top operators by self time (``top1`` …).

`emit_to` routes those objects into a `perfloop.producers.emitter.Emitter`. Nothing here raises
into the training loop: a failure (the profiler would not start, the export or the parse failed,
``emit`` raised) is logged as one line and reported in the summary; only `request` raises, a
`ConfigError` naming the bad value, which the job agent acks as a refusal.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.producers._kineto import EVENTS_PREFIX, iter_events
from perfloop.schemas import (
    Batch,
    CapabilityReport,
    Event,
    KnobValue,
    decode_batch,
    decode_event,
    is_batch,
)

__all__ = [
    "COMPONENT",
    "KNOB",
    "CaptureSummary",
    "OpTime",
    "ProfileCapture",
    "emit_to",
    "summarize_trace",
]

log = logging.getLogger("perfloop.producers")

KNOB = "profiler.capture_steps"
COMPONENT = "profiler_capture"
"""The `CapabilityReport.component` of a capture's summary."""
TOP_OPS = 10
_SKEW_NS = 600 * 10**9  # a trace whose clock is further than this from ours is moved to ours
_OP_CATS = frozenset({"cpu_op", "operator"})
_SAFE = re.compile(r"[^A-Za-z0-9._@+-]+")

_IDLE, _REQUESTED, _ACTIVE, _PROCESSING = "idle", "requested", "active", "processing"


@dataclass(frozen=True, slots=True)
class OpTime:
    """One operator's (or GPU kernel's) total time in a capture."""

    name: str
    self_ms: float
    calls: int

    def text(self) -> str:
        return f"{self.name}: {self.self_ms:.3f} ms self, {self.calls} calls"


@dataclass(frozen=True)
class CaptureSummary:
    """What one capture found; ``ok`` is False when it failed (``error`` says why)."""

    ok: bool
    steps: tuple[int, ...] = ()
    profiled_ms: float = 0.0
    top_ops: tuple[OpTime, ...] = ()
    top_kernels: tuple[OpTime, ...] = ()
    trace_path: str = ""
    trace_events: int = 0
    emitted_samples: int = 0
    cuda: bool = False
    error: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def report(self, *, job_id: str, node: str, rank: int) -> CapabilityReport:
        """The summary as the event that carries it."""
        details = {
            "steps": _span(self.steps),
            "step_count": str(len(self.steps)),
            "profiled_ms": f"{self.profiled_ms:.3f}",
            "trace": self.trace_path,
            "trace_events": str(self.trace_events),
            "emitted_samples": str(self.emitted_samples),
            **self.extra,
        }
        for i, op in enumerate(self.top_ops, 1):
            details[f"top{i}"] = op.text()
        for i, k in enumerate(self.top_kernels, 1):
            details[f"kernel{i}"] = k.text()
        return CapabilityReport(
            ts_ns=time.time_ns(),
            job_id=job_id,
            node=node,
            rank=rank,
            component=COMPONENT,
            available=self.ok,
            devices=_cuda_devices() if self.cuda else 0,
            signals=["cpu_ops", *(["gpu_kernels"] if self.cuda else [])],
            missing=[] if self.ok else ["trace"],
            reason=self.error[:2000],
            details={k: v for k, v in details.items() if v},
        )


def _span(steps: tuple[int, ...]) -> str:
    if not steps:
        return ""
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__


def _cuda_devices() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:
        return 0


# -- the trace's summary ------------------------------------------------------------------------


def summarize_trace(
    path: str | Path, prefix: str = "traceEvents.item", top: int = TOP_OPS
) -> tuple[tuple[OpTime, ...], tuple[OpTime, ...]]:
    """The ``top`` CPU operators by self time, and the ``top`` GPU kernels by total time.

    An operator's self time is its duration less that of the operators nested in it on the
    same thread; one nested directly in an operator of its own name is not another call.
    ``prefix`` is the ijson prefix of the events (a first pass finds it:
    ``TraceIndex.meta[EVENTS_PREFIX]``).
    """
    ops: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in iter_events(path, prefix):
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat"), ev.get("name")
        ts, dur = ev.get("ts"), ev.get("dur")
        if type(cat) is not str or type(name) is not str:
            continue
        if not isinstance(ts, int | float) or not isinstance(dur, int | float) or dur < 0:
            continue
        cat = cat.lower()
        if cat in _OP_CATS:
            ops[(ev.get("pid"), ev.get("tid"))].append((float(ts), float(dur), name))
        elif cat == "kernel":
            k = kernels[name]
            k[0] += dur
            k[1] += 1
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for events in ops.values():
        events.sort(key=lambda e: (e[0], -e[1]))
        stack: list[list[Any]] = []  # [end, name, dur, children's dur]
        for ts, dur, name in events:
            while stack and ts >= stack[-1][0]:
                _close(stack.pop(), self_us)
            if stack:
                stack[-1][3] += dur
            # an operator re-entering itself (a redispatch, e.g. aten::div_ in aten::div_) is
            # one call, as the profiler's own key averages count it
            if not stack or stack[-1][1] != name:
                calls[name] += 1
            stack.append([ts + dur, name, dur, 0.0])
        while stack:
            _close(stack.pop(), self_us)
    top_ops = sorted(self_us.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    top_kernels = sorted(kernels.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
    return (
        tuple(OpTime(n[:256], us / 1000.0, calls[n]) for n, us in top_ops),
        tuple(OpTime(n[:256], v[0] / 1000.0, int(v[1])) for n, v in top_kernels),
    )


def _close(frame: list[Any], self_us: dict[str, float]) -> None:
    _, name, dur, children = frame
    self_us[name] += max(0.0, dur - children)


# -- routing what a capture emits -----------------------------------------------------------


def emit_to(emitter: Any) -> Callable[[object], None]:
    """An ``emit`` that hands a capture's output to an `Emitter`: batches are appended to its
    pending samples (published at its next flush), events are published at once."""

    def emit(obj: object) -> None:
        if isinstance(obj, Batch):
            emitter.extend(obj.kind, **obj.columns)
        elif isinstance(obj, Event):
            emitter.event(obj)
        else:
            raise TypeError(f"cannot emit a {type(obj).__name__}: not a Batch or an Event")

    return emit


class _Relay:
    """A publisher for `replay_trace`: decodes each message and passes on what is kept."""

    def __init__(self, emit: Callable[[object], None], *, full: bool) -> None:
        self.emit, self.full = emit, full
        self.samples = 0
        self.errors: list[str] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        if not is_batch(value):
            event = decode_event(value)
            if self.full:
                self._emit(event)
            return True
        batch = decode_batch(value)
        if not self.full:
            if batch.kind == "span":
                batch = _rows(batch, batch.columns["depth"] >= 1)
            elif batch.kind != "kernel":
                return True
        if len(batch):
            self.samples += len(batch)
            self._emit(batch)
        return True

    def _emit(self, obj: object) -> None:
        try:
            self.emit(obj)
        except Exception as e:  # the caller's sink: note it, keep going
            if not self.errors:
                log.warning("profiler capture: emit failed: %s", _one_line(e))
            self.errors.append(_one_line(e))


def _rows(batch: Batch, keep: np.ndarray) -> Batch:
    return dataclasses.replace(batch, columns={k: v[keep] for k, v in batch.columns.items()})


# -- the capture ----------------------------------------------------------------------------


class ProfileCapture:
    """Captures the next N training steps with the PyTorch profiler, on request.

    ``emit`` receives decoded telemetry `Batch` objects and, last, the summary
    (`CapabilityReport`, component ``profiler_capture``), on the worker thread; see the module
    for which rows.
    ``out_dir`` keeps the traces (a new temporary folder when ``None``). ``background=False``
    processes a finished capture on the training thread instead of a worker (for tools).
    `request`, `step_boundary` and `close` belong to the training thread (the job agent runs
    knob handlers there); the worker only ends the processing of a finished capture.

    >>> seen = []
    >>> cap = ProfileCapture(job_id="j1", node="n0", rank=0, emit=seen.append, max_steps=5)
    >>> cap.request(9)
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: profiler.capture_steps=9 is outside [1, 5]
    >>> cap.busy
    False
    """

    def __init__(
        self,
        *,
        job_id: str,
        node: str,
        rank: int,
        emit: Callable[[object], None],
        out_dir: str | None = None,
        max_steps: int = 50,
        full_replay: bool = False,
        background: bool = True,
    ) -> None:
        if type(rank) is not int or not 0 <= rank <= 1 << 20:
            raise ConfigError(f"rank {rank!r} is not a rank: use 0 … {1 << 20}")
        if type(max_steps) is not int or max_steps < 1:
            raise ConfigError(f"max_steps {max_steps!r}: use a whole number ≥ 1")
        self.job_id, self.node, self.rank = job_id, node, rank
        self.emit = emit
        self.max_steps = max_steps
        self.full_replay = full_replay
        self.background = background
        self._out_dir = Path(out_dir) if out_dir is not None else None
        self._state = _IDLE
        self._want = 0
        self._steps: list[int] = []
        self._prof: Any = None
        self._mark: Any = None
        self._cuda = False
        self._worker: threading.Thread | None = None
        self.summaries: list[CaptureSummary] = []
        """Every capture's summary, oldest first."""

    # -- the knob --------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a capture is requested, running, or being processed."""
        return self._state != _IDLE

    def request(self, steps: KnobValue) -> None:
        """Knob handler for ``profiler.capture_steps``: capture the next ``steps`` steps.

        Raises `ConfigError` for a value that is not a whole number in ``[1, max_steps]``,
        while another capture is pending, running or being processed, when torch cannot be
        imported, and while another PyTorch profiler is running in this process.
        """
        if isinstance(steps, bool) or not isinstance(steps, int | float):
            raise ConfigError(f"{KNOB}={steps!r} is not a whole number of steps")
        if isinstance(steps, float) and not steps.is_integer():
            raise ConfigError(f"{KNOB}={steps!r} is not a whole number of steps")
        n = int(steps)
        if not 1 <= n <= self.max_steps:
            raise ConfigError(f"{KNOB}={steps!r} is outside [1, {self.max_steps}]")
        try:
            import torch
            import torch.profiler  # the profiler must be importable now
        except Exception as e:
            raise ConfigError(f"{KNOB}={n}: torch's profiler is not available: {e}") from None
        if self._state != _IDLE:
            raise ConfigError(f"{KNOB}={n}: {self._busy_text()}; try again after it")
        if _profiler_running(torch):
            raise ConfigError(f"{KNOB}={n}: another PyTorch profiler is running in this process")
        self._want, self._state = n, _REQUESTED

    def _busy_text(self) -> str:
        if self._state == _REQUESTED:
            return f"a capture of {self._want} steps is already requested"
        if self._state == _ACTIVE:
            done = len(self._steps)
            return f"a capture of {self._want} steps is running ({done} captured)"
        return "the previous capture is still being processed"

    # -- the training loop's side ----------------------------------------------------------

    def step_boundary(self, step: int) -> None:
        """Call between two steps (``step``: the one about to begin); never raises."""
        state = self._state
        if state == _REQUESTED:
            self._begin(step)
        elif state == _ACTIVE:
            self._advance(step)

    def _begin(self, step: int) -> None:
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile, record_function

            activities = [ProfilerActivity.CPU]
            self._cuda = bool(torch.cuda.is_available())
            if self._cuda:
                activities.append(ProfilerActivity.CUDA)
            prof = profile(activities=activities)
            prof.start()
            self._prof = prof
            self._steps = [step]
            mark = record_function(f"ProfilerStep#{step}")
            mark.__enter__()
            self._mark = mark
            self._state = _ACTIVE
        except Exception as e:
            self._fail(f"the profiler did not start at step {step}", e, stop=True)

    def _advance(self, step: int) -> None:
        try:
            self._end_mark()
            if len(self._steps) >= self._want:
                self._finish()
                return
            from torch.profiler import record_function

            self._steps.append(step)
            mark = record_function(f"ProfilerStep#{step}")
            mark.__enter__()
            self._mark = mark
        except Exception as e:
            self._fail(f"the capture failed at step {step}", e, stop=True)

    def _end_mark(self) -> None:
        mark, self._mark = self._mark, None
        if mark is not None:
            mark.__exit__(None, None, None)

    def _finish(self) -> None:
        """Stop the profiler (training thread), then export and publish (worker)."""
        prof, self._prof = self._prof, None
        steps = tuple(self._steps)
        self._state = _PROCESSING
        if self._cuda:  # the last step's kernels finish inside the capture
            import torch

            torch.cuda.synchronize()
        prof.stop()
        stop_ns = time.time_ns()
        if not self.background:
            self._process(prof, steps, stop_ns)
            return
        self._worker = threading.Thread(
            target=self._process,
            args=(prof, steps, stop_ns),
            name="perfloop-capture",
            daemon=True,
        )
        self._worker.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """End a running capture early (what was captured is published) and wait for the
        worker; never raises. Call when training ends."""
        try:
            if self._state == _REQUESTED:
                self._state = _IDLE
            elif self._state == _ACTIVE:
                self._end_mark()
                self._finish()
        except Exception as e:
            self._fail("the capture failed while closing", e, stop=True)
        self.wait(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for a finished capture to be published; True when none is in progress."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout_s)
        return self._state in (_IDLE, _REQUESTED)

    # -- after the capture -----------------------------------------------------------------

    def _process(self, prof: Any, steps: tuple[int, ...], stop_ns: int) -> None:
        path = ""
        summary: CaptureSummary
        try:
            out = self._folder()
            name = f"{_SAFE.sub('_', self.job_id)}.rank{self.rank}.steps{_span(steps)}"
            path = str(out / f"{name}.{stop_ns}.pt.trace.json")
            prof.export_chrome_trace(path)
            summary = self._publish(path, steps, stop_ns)
        except Exception as e:
            what = f"capture of steps {_span(steps)}"
            log.warning("profiler capture: %s failed: %s", what, _one_line(e))
            summary = CaptureSummary(
                ok=False,
                steps=steps,
                trace_path=path,
                cuda=self._cuda,
                error=f"{what} failed: {_one_line(e)}",
            )
        try:
            self._report(summary)
        finally:
            self._state = _IDLE

    def _folder(self) -> Path:
        if self._out_dir is None:
            self._out_dir = Path(tempfile.mkdtemp(prefix="perfloop-capture-"))
        self._out_dir.mkdir(parents=True, exist_ok=True)
        return self._out_dir

    def _publish(self, path: str, steps: tuple[int, ...], stop_ns: int) -> CaptureSummary:
        from perfloop.producers.replay import index_trace, replay_trace

        idx = index_trace(path, whole_trace=True)
        info = idx.meta.get("distributedInfo")
        idx.meta["distributedInfo"] = {
            **(info if isinstance(info, dict) else {}),
            "rank": self.rank,
        }
        if abs(idx.end_ns - stop_ns) > _SKEW_NS:  # no (or a wrong) baseTimeNanoseconds
            idx.shift_ns = stop_ns - idx.end_ns
        relay = _Relay(self.emit, full=self.full_replay)
        replay_trace(path, relay, job_id=self.job_id, node=self.node, index=idx)
        top_ops, top_kernels = summarize_trace(path, idx.meta[EVENTS_PREFIX])
        profiled_ms = sum(s.end_us - s.start_us for s in idx.steps) / 1000.0
        extra = {"emit_errors": str(len(relay.errors))} if relay.errors else {}
        return CaptureSummary(
            ok=not relay.errors,
            steps=steps,
            profiled_ms=profiled_ms,
            top_ops=top_ops,
            top_kernels=top_kernels,
            trace_path=path,
            trace_events=idx.events,
            emitted_samples=relay.samples,
            cuda=self._cuda,
            error=f"emit failed: {relay.errors[0]}" if relay.errors else "",
            extra=extra,
        )

    def _report(self, summary: CaptureSummary) -> None:
        self.summaries.append(summary)
        try:
            self.emit(summary.report(job_id=self.job_id, node=self.node, rank=self.rank))
        except Exception as e:
            log.warning("profiler capture: the summary was not emitted: %s", _one_line(e))

    def _fail(self, what: str, e: BaseException, *, stop: bool) -> None:
        """A failure on the training thread: say it once, stop the profiler, report, go idle."""
        log.warning("profiler capture: %s: %s", what, _one_line(e))
        self._mark = None
        prof, self._prof = self._prof, None
        if stop and prof is not None:
            try:
                prof.stop()
            except Exception as e2:
                log.debug("profiler capture: stopping after a failure: %s", _one_line(e2))
        steps = tuple(self._steps)
        self._steps = []
        self._report(
            CaptureSummary(ok=False, steps=steps, cuda=self._cuda, error=f"{what}: {_one_line(e)}")
        )
        self._state = _IDLE


def _profiler_running(torch: Any) -> bool:
    try:
        return bool(torch.autograd._profiler_enabled())
    except Exception:
        return False
