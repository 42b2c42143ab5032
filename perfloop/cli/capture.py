"""``perfloop capture JOB --steps N``: ask a running job for a PyTorch-profiler capture of its
next N steps, through the signed-command path.

The request is a person's signed `Approval` of the action knob ``profiler.capture_steps``
(signed like ``perfloop approve``'s, with the person's own key): the actuator checks the
signature, the job's tier (every tier but observe), the knob's bounds, the cooldown and the
rate limit, records its decision in ``audit``, and issues the job a signed command. The job's
agent runs the profiler at its next step boundary, and its summary (the trace's path, the
captured steps, the top operators) lands in ``capabilities`` as component
``profiler_capture``; the kernel summaries and annotated spans land with the job's telemetry.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import uuid
from typing import Any, TextIO

from perfloop.exceptions import PerfloopError
from perfloop.settings import load_settings

__all__ = ["capture_command", "capture_steps"]

KNOB = "profiler.capture_steps"


def capture_steps(text: str) -> int:
    """``--steps``: a whole number of steps within the knob's bounds.

    >>> capture_steps("3")
    3
    >>> capture_steps("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: --steps 0: profiler.capture_steps takes 1 to 50 steps
    """
    from perfloop.schemas.knobs import KNOB_BOUNDS

    lo, hi = KNOB_BOUNDS[KNOB]
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps {text!r}: a whole number of steps") from None
    if not lo <= n <= hi:
        raise argparse.ArgumentTypeError(f"--steps {n}: {KNOB} takes {lo:g} to {hi:g} steps")
    return n


def _running(settings: Any, job: str) -> None:
    """Refuse, in one line, a job the warehouse does not know or that has ended."""
    from perfloop.cli.recs import _query

    seen = _query(
        settings,
        "SELECT count(), countIf(rank = -1 AND state IN ('finished', 'failed', 'killed')) "
        "FROM job_lifecycle WHERE job_id = {j:String}",
        {"j": job},
    )
    steps = _query(settings, "SELECT count() FROM steps WHERE job_id = {j:String}", {"j": job})
    if not (seen and seen[0][0]) and not (steps and steps[0][0]):
        raise PerfloopError(f"no job {job!r} in the warehouse (`perfloop jobs` lists them)")
    if seen and seen[0][1]:
        raise PerfloopError(f"job {job} has ended: there is no step left to capture")


def _summary(settings: Any, job: str, since_ns: int) -> tuple[bool, str, dict[str, str]] | None:
    from perfloop.cli.recs import _query

    rows = _query(
        settings,
        "SELECT available, reason, details FROM capabilities WHERE job_id = {j:String} "
        "AND component = 'profiler_capture' AND ts >= fromUnixTimestamp64Nano({t:Int64}) "
        "ORDER BY ts DESC LIMIT 1",
        {"j": job, "t": since_ns},
    )
    if not rows:
        return None
    ok, reason, details = rows[0]
    return bool(ok), str(reason), {str(k): str(v) for k, v in dict(details).items()}


def capture_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop capture``."""
    from perfloop.actuators.service import SIGNING_KEY_ID
    from perfloop.cli.config import _author
    from perfloop.cli.recs import _await_decision, send_signed
    from perfloop.schemas import Approval
    from perfloop.settings import ActuatorSettings

    out = out or sys.stdout
    settings = load_settings(ActuatorSettings)
    job, steps = args.job, args.steps
    _running(settings, job)
    author = _author()
    sent_ns = time.time_ns()
    ask = Approval(
        ts_ns=sent_ns,
        job_id=job,
        node=socket.gethostname()[:255] or "cli",
        rank=-1,
        rec_id=f"capture-{uuid.uuid4().hex[:16]}",
        verdict="approve",
        author=author,
        reason=f"a profiler capture of {steps} step(s), asked for with perfloop capture",
        knob=KNOB,
        from_value=0,
        to_value=steps,
        loop="fast",
        rec_ts_ns=sent_ns,
        key_id=SIGNING_KEY_ID,
    )
    ask = send_signed(settings, ask, "the capture request")
    print(f"asked job {job} for a profiler capture of {steps} step(s) ({ask.rec_id}, by {author})",
          file=out)  # fmt: skip
    if args.wait_s <= 0:
        return 0
    deadline = time.monotonic() + args.wait_s
    decision = _await_decision(settings, ask.rec_id, author, sent_ns, args.wait_s)
    if decision is None:
        raise PerfloopError(
            f"no decision from the actuator within {args.wait_s:g} s (is it running? "
            "`perfloop status`)"
        )
    outcome, reason, command_id = decision
    print(f"actuator: {outcome}: {reason}" + (f" (command {command_id})" if command_id else ""),
          file=out)  # fmt: skip
    if outcome != "issued":
        raise PerfloopError(f"the actuator did not ask the job: {reason}")
    while time.monotonic() < deadline:
        got = _summary(settings, job, sent_ns - 60 * 1_000_000_000)
        if got is not None:
            ok, why, details = got
            if not ok:
                raise PerfloopError(f"the job could not capture: {why}")
            top = [details[f"top{i}"] for i in range(1, 6) if f"top{i}" in details]
            print(f"captured steps {details.get('steps', '?')} ({details.get('profiled_ms', '?')}"
                  f" ms profiled); trace {details.get('trace', '?')}", file=out)  # fmt: skip
            for line in top:
                print(f"  {line}", file=out)
            return 0
        time.sleep(0.5)
    raise PerfloopError(
        f"the job has not reported the capture within {args.wait_s:g} s; `perfloop sql "
        f"\"SELECT * FROM capabilities WHERE component = 'profiler_capture'\"` shows it later"
    )
