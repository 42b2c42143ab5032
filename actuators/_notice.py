"""The job agent's lines on the training process's stderr: one per change applied, verdict
(kept or rolled back) and rejected command, so the person watching the job's terminal sees
what perfloop did to it without a query.

>>> from perfloop.schemas import ActuationResult, Command
>>> cmd = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=7, knob="dataloader.num_workers",
...               from_value=0, value=1, expires_ts_ns=2, event_id="7c1f00aa11bb22cc")
>>> applied = ActuationResult(ts_ns=1, job_id="j", node="n", rank=0, command_id=cmd.event_id,
...                           status="applied", knob=cmd.knob, value=1, step=41)
>>> notice(applied, cmd, rank=0, was=0)
'perfloop[rank 0]: applied dataloader.num_workers 0 → 1 at step 41 (command 7c1f00aa11bb)'
"""

from __future__ import annotations

import contextlib
import sys

from perfloop.schemas import ActuationResult, Command, KnobValue

__all__ = ["notice", "say"]

SHORT_ID = 12
"""Characters of a command id shown (enough to find it: ``WHERE startsWith(command_id, …)``)."""


def _show(value: KnobValue | None) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "?" if value is None else str(value)


def notice(
    result: ActuationResult, cmd: Command, *, rank: int, was: KnobValue | None = None
) -> str:
    """The one line for ``result`` (an ack of ``cmd``); ``was`` is the knob's value before an
    applied change, when known."""
    who = f"perfloop[rank {rank}]" if rank >= 0 else "perfloop"
    knob, value, ref = cmd.knob, _show(cmd.value), f"command {cmd.event_id[:SHORT_ID]}"
    if result.status == "applied" and cmd.loop == "slow":
        text = f"recorded {knob} = {value} for the next start ({ref}): {result.reason}"
    elif result.status == "applied":
        change = f"{_show(was)} → {value}" if was is not None else f"= {value}"
        text = f"applied {knob} {change} at step {result.step} ({ref})"
    elif result.status == "kept":
        text = f"kept {knob} = {value}: {result.reason}"
    elif result.status == "rolled_back":
        text = f"rolled back {knob} {value} → {_show(result.value)}: {result.reason}"
    else:
        text = f"rejected {knob} = {value} ({ref}): {result.reason}"
    return f"{who}: {' '.join(text.split())}"


def say(line: str) -> None:
    """Write ``line`` to stderr as it is now; never raises (a closed, broken or missing stderr
    must not matter to the training loop)."""
    # nothing to report a failure to: the place to report it is what failed
    with contextlib.suppress(Exception):
        stream = sys.stderr
        if stream is not None:
            stream.write(line + "\n")
            stream.flush()
