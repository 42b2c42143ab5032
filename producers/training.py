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
`Monitor.close`) and `ProducerStats` every ``stats_interval_s``. With the settings' ``agent``
on, it starts the job agent, a callback that acts between steps (``_training_agent``).

Nothing here raises into the training loop: a failure is counted (`Monitor.errors`) and logged
once. torch is optional: it is only looked at (``sys.modules``) once the script imported it.

This module holds the `Monitor`; the parts it is built from live in private modules next to
it, and every name below is public here:

- `Callback`, `CallbackSet` and the records they get (`StepRecord`, `SpanRecord`,
  `CollectiveRecord`): ``_training_callbacks``. Other parts of perfloop act at step
  boundaries through them: the job agent's callback is in ``_training_agent`` (not public),
  and the hooks' `Session` starts it the same way.
- `Recorder`, the span tiling shared with the zero-code-change hooks
  (`perfloop.producers.hooks`): ``_training_spans``.
- `step_row` and `clean_float`, a step's figures cleaned into a row, and the rows' columns:
  ``_training_rows``.
- `describe_job`, what the job is (`JobInfo`'s fields): ``_training_identity``.
- `Pipeline`, publisher → emitter → recorder with the lifecycle and self-metrics, and
  `close_publisher`: ``_training_pipeline``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from perfloop.producers._training_agent import NOT_STARTED, start_agent_callback
from perfloop.producers._training_callbacks import (
    Callback,
    CallbackSet,
    CollectiveRecord,
    SpanRecord,
    StepRecord,
)
from perfloop.producers._training_identity import describe_job
from perfloop.producers._training_pipeline import Pipeline, close_publisher
from perfloop.producers._training_rows import STEP_DEFAULTS, clean_float, step_row
from perfloop.producers._training_spans import Recorder
from perfloop.producers.world import launcher_world
from perfloop.schemas import STANDARD_PHASES

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

_STANDARD = frozenset(STANDARD_PHASES)
_CONTROL = re.compile(r"[\x00-\x1f]")


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
            from perfloop.producers.knobs import TorchKnobs

            knobs = TorchKnobs(sys.modules.get("torch"), None)
        except Exception as e:  # the job runs on, unchanged
            self._pipe.errors(NOT_STARTED, e)
            return
        started = start_agent_callback(self._pipe, settings, knobs)
        self.agent = started.agent if started is not None else None

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
            if k in STEP_DEFAULTS and not k.startswith(("mem_", "rss")):
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
            if rec is not None:
                self._pipe.step_boundary(rec)  # the job agent acts here
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
        state = "finished" if not exit_code else "failed"
        self._pipe.ending(state)  # the job agent stops
        self.agent = None
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
