"""The session of one traced process (`Session`: its `Pipeline`, `Tracer`, job description
and job agent) and the moment it begins: the first training activity on a thread
(`_traced`, which the torch patches ask first, and `_activate`), and its end at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
from typing import Any

from perfloop.producers._cpu import cpu_budget
from perfloop.producers._hooks_agent import _live_loader, _optional_knobs
from perfloop.producers._hooks_state import _S, _get_ident, _now, _oops
from perfloop.producers._priority import in_background
from perfloop.producers._progress import ProgressWatch, Where
from perfloop.producers._tracer import Tracer
from perfloop.producers._training_agent import NOT_STARTED, start_agent_callback
from perfloop.producers.training import (
    Callback,
    CallbackSet,
    Pipeline,
    StepRecord,
    describe_job,
)
from perfloop.producers.world import launcher_world


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
            self._start_agent(world["rank"])
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

    def _start_agent(self, rank: int) -> None:
        """The job agent: this process's knobs, changed by signed commands between steps (a
        callback of the pipeline's). The knobs stay, for the job info, if it cannot start."""
        try:
            from perfloop.producers.knobs import TorchKnobs

            self.knobs = TorchKnobs(
                _S.torch, _live_loader, **_optional_knobs(self.pipeline, rank, self.settings)
            )
        except Exception as e:  # the job runs on, unchanged
            self.pipeline.errors(NOT_STARTED, e)
            return
        started = start_agent_callback(
            self.pipeline, self.settings, self.knobs, on_result=self._changed, nice=self.nice,
            loss=_last_loss,
        )  # fmt: skip
        self.agent = started.agent if started is not None else None

    def _changed(self, result: Any) -> None:
        """An ack: a knob that moved is published in the next job info."""
        if result.status in ("applied", "rolled_back"):
            self.info_dirty = True

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
        self.pipeline.ending(state)  # the job agent stops, before the tracer's last rows
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


def _capability() -> type[Any]:
    from perfloop.schemas import CapabilityReport

    return CapabilityReport


def _last_loss(losses: Any) -> float | None:
    """The job agent's loss of a step: the last of the step's losses, read as `_scalar`."""
    return _scalar(losses[-1]) if losses else None


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
