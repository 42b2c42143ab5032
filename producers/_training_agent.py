"""The job agent as a training callback: what a `JobAgent` (`perfloop.actuators.JobAgent`) is
given of the training loop, through the `Callback` hooks.

The explicit API (`perfloop.producers.training.Monitor`) and `perfloop run`'s hooks (their
`Session`) each start one agent over the knobs they can offer
(`perfloop.producers.knobs.TorchKnobs`) with `start_agent_callback`, which puts its
`AgentCallback` first among their pipeline's callbacks (a failing callback of the script's
cannot keep the agent from a step boundary). From then on, on the training thread:

- ``on_step_boundary``, after the step's record went out and every ``on_step_end``: the agent
  judges the step (`JobAgent.observe_step`: its time, and its loss when the owner reads one
  without waiting on a GPU), applies what is due before the next step
  (`JobAgent.step_boundary`), and the knobs start or end a profiler capture
  (`TorchKnobs.step_boundary`);
- ``on_close``, before what is pending is published: the agent stops (delivering its last acks)
  and the knobs close (a capture still running is published).

The agent's own thread consumes the control topic; knob handlers run only at the boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from perfloop.producers._priority import in_background
from perfloop.producers._training_callbacks import Callback, StepRecord

if TYPE_CHECKING:
    from perfloop.producers._training_pipeline import Pipeline

__all__ = ["NOT_STARTED", "AgentCallback", "number", "start_agent_callback"]

NOT_STARTED = "starting the job agent (no changes will be applied)"
"""How a job agent that could not start is counted (the job runs on, unchanged)."""


def number(value: Any) -> float | None:
    """A loss reported as a plain number, as a float; anything else (a tensor) is None."""
    return float(value) if isinstance(value, int | float) else None


class AgentCallback(Callback):
    """A started job agent (and its ``knobs``, if any) as a callback; ``loss`` turns a step's
    ``loss`` figure, as its owner records it, into a float (None: not known without waiting).

    >>> class Agent:
    ...     def __init__(self): self.seen = []
    ...     def observe_step(self, step, ms, loss=None): self.seen.append((step, ms, loss))
    ...     def step_boundary(self, step): self.seen.append(step)
    ...     def stop(self): self.seen.append("stop")
    >>> agent = Agent()
    >>> cb = AgentCallback(agent)
    >>> cb.on_step_boundary(StepRecord(4, 0, 1, 12.5, fields={"loss": 0.5}))
    >>> cb.on_close("finished"); cb.on_close("finished")
    >>> agent.seen, cb.agent
    ([(4, 12.5, 0.5), 5, 'stop'], None)
    """

    def __init__(
        self,
        agent: Any,
        knobs: Any = None,
        *,
        loss: Callable[[Any], float | None] = number,
    ) -> None:
        self.agent = agent
        """The `JobAgent`; None once it is stopped."""
        self.knobs = knobs
        self.loss = loss

    def on_step_boundary(self, record: StepRecord) -> None:
        agent = self.agent
        if agent is None:
            return
        agent.observe_step(record.step, record.step_time_ms, self.loss(record.fields.get("loss")))
        agent.step_boundary(record.step + 1)
        if self.knobs is not None:
            self.knobs.step_boundary(record.step + 1)

    def on_close(self, state: str) -> None:
        agent, self.agent = self.agent, None
        if agent is None:
            return
        with contextlib.suppress(Exception):
            agent.stop()
        if self.knobs is not None:
            with contextlib.suppress(Exception):
                self.knobs.close()


def start_agent_callback(
    pipeline: Pipeline,
    settings: Any,
    knobs: Any,
    *,
    on_result: Callable[[Any], None] | None = None,
    nice: int = 0,
    loss: Callable[[Any], float | None] = number,
) -> AgentCallback | None:
    """Start the job agent of ``pipeline``'s job over ``knobs``
    (`perfloop.producers.knobs.start_agent`; built on a thread niced by ``nice``, whose
    threads inherit it) and put its callback first among the pipeline's callbacks. Returns
    it, or None when the agent cannot start (counted in ``pipeline.errors``)."""
    try:
        from perfloop.producers.knobs import start_agent

        agent = in_background(
            start_agent, settings, knobs, job_id=pipeline.job_id, node=pipeline.node,
            rank=pipeline.rank, on_result=on_result, nice=nice,
        )  # fmt: skip
    except Exception as e:  # the job runs on, unchanged
        pipeline.errors(NOT_STARTED, e)
        return None
    callback = AgentCallback(agent, knobs, loss=loss)
    pipeline.callbacks.insert(0, callback)
    return callback
