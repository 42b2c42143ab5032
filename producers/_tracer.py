"""`Tracer`: what the training hooks see, turned into steps and tiled phase spans.

Pure Python, no torch: the training hooks (`perfloop.producers.hooks` and its `_hooks_*`
modules) call it from their torch patches with ``perf_counter_ns`` times, and it hands spans,
collectives and finished steps to a `perfloop.producers.training.Recorder`.
"""

from __future__ import annotations

from typing import Any

from perfloop.producers._comm import union
from perfloop.producers.training import StepRecord
from perfloop.schemas import P2P_OPS

__all__ = ["Tracer"]


class Tracer:
    """Turns what the hooks see into steps and tiled phase spans (pure Python).

    Times are ``perf_counter_ns`` values. ``forward_begin`` / ``backward_begin`` /
    ``optimizer_begin`` return whether they opened a depth-0 span (False when nested, e.g. a
    recomputed forward inside backward); only then is the matching ``*_end`` called.

    >>> from perfloop.producers.training import Recorder
    >>> tr = Tracer(Recorder(None, wall_offset_ns=0))
    >>> ms = 1_000_000
    >>> tr.fetch(0, 2 * ms, batch_size=32)
    >>> tr.forward_begin(2 * ms, training=True)
    True
    >>> tr.forward_end(5 * ms)
    >>> tr.backward_begin(5 * ms); tr.backward_end(9 * ms, loss=0.5)
    True
    >>> tr.optimizer_begin(9 * ms, key=1); rec = tr.optimizer_end(10 * ms, key=1, lr=0.1)
    True
    >>> rec.step, rec.step_time_ms, rec.fields["samples"], rec.fields["loss"]
    (0, 10.0, 32, [0.5])
    >>> rec.phase_ms
    {'data_wait': 2.0, 'forward': 3.0, 'backward': 4.0, 'optimizer': 1.0}
    """

    def __init__(self, recorder: Any) -> None:
        self.rec = recorder
        self.open: str | None = None  # the open depth-0 activity
        self.open_t0 = 0
        self.pending: list[tuple[int, int, int, int, Any, int]] = []  # unclassified fetches
        self._source: Any = None  # the loader pass training data last came from
        self.eval_t0: int | None = None
        self.eval_t1 = 0
        # what the open no-grad region holds, to tell an evaluation loop from a forward that
        # is part of each training step (a distillation teacher's, a target network's)
        self.eval_kept: list[tuple[int, int, int, int, Any, int]] = []  # fetches before it
        self.eval_fetches = 0
        self.eval_fwds: list[tuple[int, int]] = []
        self.eval_stopped = False  # a loader pass ended inside it
        self.short_now = False  # this step had a short no-grad region
        self.short_prev = False  # the step before did
        self.primary: int | None = None
        self._other: int | None = None
        self._other_run = 0
        self.comm_covered = 0  # where the last nested comm span of async collectives ended
        self.opt_suspended = False  # optimizer.step(closure): the closure is running
        self._reset()

    @property
    def source(self) -> Any:
        """The loader pass the training data last came from: ``(id(iterator), epoch)``."""
        return self._source

    def _reset(self) -> None:
        self.batch_size = 0
        self.samples = 0
        self.tokens = 0
        self.fetched = False  # a DataLoader fetch fed this step
        self.fwd_batch = self.fwd_samples = self.fwd_tokens = 0  # from the forwards' inputs
        self.backwards = 0
        self.losses: list[Any] = []
        self.grad_norm: Any = None
        self.epoch = getattr(self, "epoch", 0)
        self.workers = getattr(self, "workers", 0)

    # -- classification ------------------------------------------------------------------
    def _train(self) -> None:
        """A training activity begins: close an eval region, pending fetches were training's."""
        if self.eval_t0 is not None:
            self._close_eval()
        if self.pending:
            for fetch in self.pending:
                self._take(*fetch)
            self.pending.clear()

    def _take(self, t0: int, t1: int, bs: int, tok: int, source: Any, workers: int) -> None:
        """A fetch of training data: its ``data_wait`` span, samples, tokens and epoch."""
        self.rec.span("data_wait", "data_wait", t0, t1)
        self.fetched = True
        if bs:
            self.samples += bs
            if not self.batch_size:
                self.batch_size = bs
        self.tokens += tok
        self.workers = workers
        if source is not None and source != self._source:
            if self._source is not None:
                self.epoch += 1  # a new pass over the training data
            self._source = source

    def _eval(self, t: int) -> None:
        if self.eval_t0 is None:
            self.eval_t0 = self.pending[0][0] if self.pending else t
            self.eval_kept = list(self.pending)
            self.eval_fetches = len(self.pending)
            self.eval_fwds = []
            self.eval_stopped = False
        else:
            self.eval_fetches += len(self.pending)
        self.pending.clear()

    def _close_eval(self) -> None:
        """The no-grad region ends where training resumes. A short one (at most one fetch,
        no loader pass ended, a few forwards) that recurs step after step (or comes in the
        first two steps) is part of the training step: a frozen teacher's or a target
        network's forward, its fetch the step's data. Anything else is an evaluation."""
        t0, self.eval_t0 = self.eval_t0, None
        if t0 is None:
            return
        short = not self.eval_stopped and self.eval_fetches <= 1 and len(self.eval_fwds) <= 8
        self.short_now = self.short_now or short
        if short and (self.short_prev or self.rec.step < 2):
            for fetch in self.eval_kept:
                self._take(*fetch)
            for f0, f1 in self.eval_fwds:
                self.rec.span("forward", "forward", f0, f1)
        else:
            self.rec.span("eval", "eval", t0, max(self.eval_t1, t0))
        self.eval_kept, self.eval_fwds = [], []

    # -- events --------------------------------------------------------------------------
    def fetch(
        self,
        t0: int,
        t1: int,
        batch_size: int = 0,
        tokens: int = 0,
        source: Any = None,
        workers: int = 0,
        *,
        stop: bool = False,
    ) -> None:
        """A DataLoader fetch (``stop``: the one that ended a pass over the data).

        ``source`` names the pass (loader iterator and its generation): a new source of
        training data starts a new epoch.
        """
        if self.open is not None:
            return
        if stop and self.eval_t0 is not None and not self.pending:
            self.eval_t1 = t1  # the end of an evaluation loop
            self.eval_stopped = True
            return
        self.pending.append((t0, t1, batch_size, tokens, source, workers))

    def _closure(self, t: int) -> None:
        """A forward or backward inside ``optimizer.step(closure)`` (PyTorch Lightning, LBFGS):
        the optimizer span so far is recorded and the step's own work is timed as usual; the
        optimizer span resumes where the closure's last activity ended."""
        self.rec.span("optimizer", "optimizer", self.open_t0, t)
        self.open = None
        self.opt_suspended = True

    def forward_begin(self, t: int, training: bool) -> bool:
        if self.open == "optimizer" and training:
            self._closure(t)
        if self.open is not None:
            return False
        if training:
            self._train()
            self.open = "forward"
        else:
            self._eval(t)
            self.open = "eval"
        self.open_t0 = t
        return True

    def forward_input(self, batch_size: int, tokens: int) -> None:
        """The input of the training forward just begun (the first dimension of its first
        tensor; tokens: elements of its first integer tensor of two or more dimensions): the
        step's samples and tokens when no DataLoader fetch fed it (a loop that slices its
        own tensors)."""
        if self.open != "forward":
            return
        if not self.fwd_batch:
            self.fwd_batch = batch_size
        self.fwd_samples += batch_size
        self.fwd_tokens += tokens

    def forward_end(self, t: int) -> None:
        if self.open == "forward":
            self.rec.span("forward", "forward", self.open_t0, t)
        elif self.open == "eval":
            self.eval_t1 = t
            self.eval_fwds.append((self.open_t0, t))
        self.open = None

    def backward_begin(self, t: int) -> bool:
        if self.open == "optimizer":
            self._closure(t)
        if self.open is not None:
            return False
        self._train()
        self.open, self.open_t0 = "backward", t
        return True

    def backward_end(self, t: int, loss: Any = None, counted: bool = True) -> None:
        """``loss``: what backward was called on (read later, when rows are published).
        ``counted=False``: a gradient taken for the loss itself (a gradient penalty's,
        ``create_graph=True``): its span, but neither a backward pass of the step nor a loss."""
        self.rec.span("backward", "backward", self.open_t0, t)
        self.open = None
        if not counted:
            return
        self.backwards += 1
        if loss is not None:
            self.losses.append(loss)

    def optimizer_begin(self, t: int, key: int) -> bool:
        if self.open is not None:
            return False
        self._train()
        self.open, self.open_t0 = "optimizer", t
        return True

    def optimizer_end(self, t: int, key: int, lr: Any = None) -> StepRecord | None:
        """The optimizer ``key`` stepped; return the step's record if that ended a step.

        The first optimizer that steps ends steps; another one takes over once it steps
        twice with no step of the first in between (the script switched optimizers).
        """
        if self.opt_suspended:  # a closure ran: the optimizer's own work came after it
            self.opt_suspended = False
            self.rec.span("optimizer", "optimizer", self.rec.cursor, t)
        else:
            self.rec.span("optimizer", "optimizer", self.open_t0, t)
        self.open = None
        if self.primary is None:
            self.primary = key
        if key != self.primary:
            if key == self._other:
                self._other_run += 1
            else:
                self._other, self._other_run = key, 1
            if self._other_run < 2:
                return None
            self.primary = key
        self._other, self._other_run = None, 0
        return self._end_step(t, lr)

    def cycle_end(self, t: int) -> StepRecord | None:
        """A training forward begins at ``t`` in a loop with no optimizer (the script updates
        its parameters itself, after ``torch.autograd.grad`` or ``backward``): if the step so
        far had a backward, it ends here, so each forward-backward cycle is a step. The caller
        knows no optimizer exists; one that steps later takes over (`optimizer_end`).

        The step ends where the next one's first activity began: its first data fetch, or
        the evaluation loop run in between, as an optimizer's step would have ended before
        them."""
        if self.open is not None or self.primary is not None or not self.backwards:
            return None
        end = t
        if self.pending:
            end = min(end, self.pending[0][0])
        if self.eval_t0 is not None:
            end = min(end, self.eval_t0)
        return self._end_step(max(end, self.rec.cursor), None)

    def _end_step(self, t: int, lr: Any) -> StepRecord | None:
        self.short_prev, self.short_now = self.short_now, False
        fed = self.fetched  # else the forwards' inputs count
        fields = {
            "batch_size": self.batch_size if fed else self.fwd_batch,
            "num_workers": self.workers,
            "epoch": self.epoch,
            "samples": self.samples if fed else self.fwd_samples,
            "tokens": self.tokens if fed else self.fwd_tokens,
            "grad_accum_steps": self.backwards or 1,
            "loss": self.losses or None,
            "grad_norm": self.grad_norm,
            "lr": None if lr is None else [lr],
        }
        self._reset()
        return self.rec.end_step(t, fields)

    def collective(
        self,
        op: str,
        t0: int,
        t1: int,
        size_bytes: int = 0,
        group: str = "",
        group_size: int = 0,
        dtype: str = "",
    ) -> None:
        """A collective call: always a `CollectiveOp` row; a ``comm`` span when in a step
        (named ``send`` or ``recv`` for a point-to-point op, ``comm`` otherwise)."""
        self.rec.collective(
            op, t0, t1, size_bytes=size_bytes, group=group, group_size=group_size, dtype=dtype
        )
        self.comm(t0, t1, op if op in P2P_OPS else "comm")

    def waited(
        self,
        row: tuple[str, int, int, int, str, int, str, int],
        w0: int,
        w1: int,
    ) -> None:
        """A collective whose call (``row``: op, call start, call end, size, group, group
        size, dtype, step) returned before its work was done, waited on from ``w0`` to ``w1``
        (a functional collective, waited where its tensor is first used): a `CollectiveOp` row
        at the call, in the call's step, lasting the call plus the wait (what this rank spent
        in it; the work it did in between is not counted), and a ``comm`` span for the wait
        (the call's was recorded by `comm` as it returned; none when it was never waited on:
        ``w0 == w1``)."""
        op, t0, t1, size, group, gsize, dtype, step = row
        self.rec.collective(
            op,
            t0,
            t1 + max(w1 - w0, 0),
            size_bytes=size,
            group=group,
            group_size=gsize,
            dtype=dtype,
            step=step,
        )
        if w1 > w0:
            self.comm(w0, w1, op if op in P2P_OPS else "comm")

    def comm(self, t0: int, t1: int, name: str = "comm") -> None:
        """Time in a collective (its call or its wait): a ``comm`` span nested in the open
        activity or the eval region, one of its own in a step between activities."""
        rec = self.rec
        if self.open is not None:
            rec.span("comm", name, t0, t1, depth=1)
        elif self.eval_t0 is not None:
            self.eval_t1 = t1
            rec.span("comm", name, t0, t1, depth=1)
        elif rec.started or self.pending:
            self._train()
            rec.span("comm", name, t0, t1)

    def async_done(self, done: list[Any]) -> None:
        """Asynchronous collectives that completed (DDP's bucket all-reduces among them): a
        `CollectiveOp` row each, timed from the call to completion, and ``comm`` spans nested
        in the phase they overlapped, over the union of their intervals (buckets overlap the
        backward pass and each other)."""
        rec = self.rec
        for op, t0, t1, size, group, gsize, dtype, step in done:
            rec.collective(
                op, t0, t1, size_bytes=size, group=group, group_size=gsize, dtype=dtype, step=step
            )
        if not rec.started:
            return
        for step in sorted({d[7] for d in done}):  # each collective in the step it was called in
            spans = union(((d[1], d[2]) for d in done if d[7] == step), after=self.comm_covered)
            for t0, t1 in spans:
                rec.span("comm", "comm", t0, t1, depth=1, step=step)
                self.comm_covered = t1

    def checkpoint(self, t0: int, t1: int, name: str) -> None:
        """A checkpoint save (``torch.save``): a ``checkpoint`` span of its own between
        activities, nested in the one it happened in otherwise."""
        depth = 0 if self.open is None and not self.pending and self.eval_t0 is None else 1
        self.rec.span("checkpoint", name, t0, t1, depth=depth)

    def close(self) -> None:
        """The process ends: record the eval region and fetches of the unfinished step."""
        if self.eval_t0 is not None:
            self._close_eval()
        for t0, t1, *_ in self.pending:
            self.rec.span("data_wait", "data_wait", t0, t1)
        self.pending.clear()
        self.rec.close()
