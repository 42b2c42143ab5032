"""Training callbacks: do-nothing hooks at step and phase boundaries, and the records they get.

`Callback` has one method per boundary (train begin and end, step begin and end, the boundary
between two steps, phase begin and end, a collective call, the close) that does nothing; a
callback overrides the ones it needs. `CallbackSet` fans each hook out to its callbacks in order
and knows which hooks some callback overrides (`CallbackSet.wanted`), so the `Recorder` and the
owners of a `Pipeline` skip the others without a call. `StepRecord`, `SpanRecord` and
`CollectiveRecord` are what ``on_step_end`` and ``on_step_boundary``, ``on_phase_end`` and
``on_collective`` receive. Public through `perfloop.producers.training`.

The job agent is one of them (`perfloop.producers._training_agent`): it acts in
``on_step_boundary`` and stops in ``on_close``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Callback", "CallbackSet", "CollectiveRecord", "SpanRecord", "StepRecord"]


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
        """A step finished; its record is out."""

    def on_step_boundary(self, record: StepRecord) -> None:
        """Between step ``record.step`` and the next, after every ``on_step_end``, on the
        training thread: the place to change the job before the next step runs (the job
        agent applies its commands here). The explicit API calls it as the step block closes;
        `perfloop run`'s hooks after the optimizer step that ended the step, when the next
        step's clock already runs (its ``on_step_begin`` came first)."""

    def on_phase_begin(self, phase: str, name: str) -> None:
        """A phase started (explicit API, and the forward/backward/optimizer hooks)."""

    def on_phase_end(self, span: SpanRecord) -> None:
        """A phase span was recorded."""

    def on_collective(self, op: CollectiveRecord) -> None:
        """A collective call finished."""

    def on_close(self, state: str) -> None:
        """Training ends (``state`` as for ``on_train_end``), called once, before what is
        pending is published: the last moment to publish something or to stop a thread of
        one's own. ``on_train_end`` follows once publishing stopped."""


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

    def on_step_boundary(self, record: StepRecord) -> None:
        for c in self.callbacks:
            c.on_step_boundary(record)

    def on_phase_begin(self, phase: str, name: str) -> None:
        for c in self.callbacks:
            c.on_phase_begin(phase, name)

    def on_phase_end(self, span: SpanRecord) -> None:
        for c in self.callbacks:
            c.on_phase_end(span)

    def on_collective(self, op: CollectiveRecord) -> None:
        for c in self.callbacks:
            c.on_collective(op)

    def on_close(self, state: str) -> None:
        for c in self.callbacks:
            c.on_close(state)


_HOOKS = tuple(n for n in vars(Callback) if n.startswith("on_"))


def _overrides(callback: Callback, hook: str) -> bool:
    if isinstance(callback, CallbackSet):
        return hook in callback.wanted
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)
