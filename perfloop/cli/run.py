"""`perfloop run [--job-id ID] [--node NAME] [--no-gpu] [--tier T] [--pin KNOB]... -- COMMAND…`.

Runs COMMAND as a subprocess with perfloop's run bootstrap first on ``PYTHONPATH`` (any
``sitecustomize`` it shadows still runs) and the run described in ``PERFLOOP_*`` variables:
``PERFLOOP_JOB_ID``, ``PERFLOOP_NODE``, ``PERFLOOP_RUN_HOOKS=1``, ``PERFLOOP_RUN_COMMAND``.
Every Python process of the run that imports torch (each torchrun rank, ``mp.spawn``
children) installs the training hooks and publishes its steps, spans, collectives, job info
and lifecycle; the launcher publishes the job's lifecycle (rank -1: started, then finished,
failed or killed with the exit code) and runs the node sampler (host, and GPU unless
``--no-gpu``) next to the command.

Every traced process runs a job agent that applies the actuator's signed commands between
steps (``PERFLOOP_AGENT=0`` turns it off). ``--tier`` sets the job's automation tier before
the command starts (a live ``actuator.tier`` change for this job on ``perfloop.control``:
observe, recommend, approve or auto); without it the actuator's default applies. ``--pin KNOB``
(repeatable; with those in ``PERFLOOP_PINNED_KNOBS``) keeps a knob out of perfloop's reach: the
job's agents refuse commands for it (``PERFLOOP_PINNED_KNOBS`` in the command's environment)
and the actuator is told not to issue them (``actuator.pinned`` for this job, published like
the tier). The job agents print each change, verdict and rejection as one line on the
command's stderr (``PERFLOOP_QUIET=1`` silences them). The job's config patch (slow-loop
changes its agent recorded, `perfloop.actuators.config_patch`) is passed to the command as
``PERFLOOP_CONFIG_PATCH`` and what it holds is printed.

The command's exit code is ``perfloop run``'s (128 + N when it dies of signal N). SIGTERM,
SIGHUP and SIGINT are forwarded to it; a Ctrl-C typed in the terminal already reaches the
command (same process group), so it is not sent twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.producers.launch import child_env, new_job_id
from perfloop.schemas.base import JOB_ID_PATTERN
from perfloop.settings import ProducerSettings, load_settings

__all__ = ["run_command"]

log = logging.getLogger("perfloop.producers")

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _terminal_sent_it() -> bool:
    """Whether a SIGINT came from our terminal (which also sent it to the command)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _start_sampler(settings: Any, emitter: Any, pid: int, gpu: bool) -> tuple[Any, Any]:
    """The node sampler watching ``pid`` and its live-config listener (None, None if off)."""
    try:
        from perfloop.producers.node_sampler import NodeSampler, config_listener
    except ImportError as e:  # pragma: no cover - shipped with the observation tier
        log.info("no node sampler: %s", e)
        return None, None
    try:
        sampler = NodeSampler(
            settings,
            emitter,
            rank=-1,
            pids=[pid],
            enable_gpu=gpu,
            producer_id=f"run-sampler-{emitter.node}"[:128],
        )
        sampler.start()
        # live sampling changes (`perfloop config set sampling.…`) for this job
        return sampler, config_listener(settings, emitter.job_id, sampler)
    except Exception as e:  # sampling is a bonus: the command runs regardless
        print(f"perfloop: node sampler not started: {e}", file=sys.stderr)
        return None, None


def run_command(args: argparse.Namespace, settings: Any = None) -> int:
    """Run ``args.cmd`` with perfloop's hooks; return its exit code (2: a usage error).

    ``settings``: `ProducerSettings`, from the environment when not given."""
    from perfloop.schemas.knobs import pinned_knobs

    if not [a for a in args.cmd or [] if a != "--"]:
        print(
            "perfloop: error: run needs a command, e.g. `perfloop run -- python train.py`",
            file=sys.stderr,
        )
        return 2
    try:
        pinned_knobs(getattr(args, "pin", None) or [])
    except ConfigError as e:
        print(f"perfloop: error: argument --pin: {e} (see `perfloop run --help`)",
              file=sys.stderr)  # fmt: skip
        return 2
    if settings is None:
        settings = load_settings(ProducerSettings)
    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    job_id = args.job_id or settings.job_id or new_job_id()
    if not re.fullmatch(JOB_ID_PATTERN, job_id):
        raise ConfigError(
            f"invalid --job-id {job_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ : / @ + -"
        )
    node = args.node or settings.node or socket.gethostname()
    if not 0 < len(node) <= 255:
        raise ConfigError(f"invalid --node {node!r}: use 1-255 characters")
    given = getattr(args, "pin", None) or []
    pins = pinned_knobs([*getattr(settings, "pinned_knobs", ()), *given])
    settings = settings.model_copy(update={"job_id": job_id, "node": node, "pinned_knobs": pins})
    env = child_env(os.environ, job_id=job_id, node=node, command=cmd)
    env["PERFLOOP_CONFIG_PATCH"] = str(_show_patch(settings, job_id))
    if pins:
        env["PERFLOOP_PINNED_KNOBS"] = ",".join(pins)
    print(f"perfloop: job {job_id} on {node}: {shlex.join(cmd)}", file=sys.stderr, flush=True)

    from perfloop.producers.emitter import Emitter
    from perfloop.producers.publisher import Publisher
    from perfloop.schemas import JobLifecycle

    publisher = Publisher(settings, producer_id=f"run-{node}"[:128])
    emitter = Emitter(
        publisher,
        job_id=job_id,
        node=node,
        producer_id=f"run-{node}-{os.getpid()}"[:128],
        flush_interval_s=settings.publish_interval_ms / 1000,
    )

    def lifecycle(state: str, code: int | None = None, message: str = "") -> None:
        with contextlib.suppress(Exception):
            emitter.event(
                JobLifecycle(
                    ts_ns=time.time_ns(),
                    job_id=job_id,
                    node=node,
                    rank=-1,
                    state=state,  # type: ignore[arg-type]
                    exit_code=code,
                    message=message[:2000],
                )
            )

    lifecycle("started", message=shlex.join(cmd))
    if getattr(args, "tier", None):
        what = f"automation tier {args.tier}"
        _publish_rule(settings, job_id, "actuator.tier", args.tier, "--tier", what)
    if pins:
        what = f"pinned {', '.join(pins)} (its agents and the actuator leave them alone)"
        _publish_rule(settings, job_id, "actuator.pinned", json.dumps(list(pins)), "--pin", what)
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as e:
        lifecycle("failed", 127, f"cannot run {cmd[0]}: {e.strerror or e}")
        _close(emitter, publisher, settings.kafka_bootstrap)
        raise ConfigError(f"cannot run {cmd[0]!r}: {e.strerror or e}") from e

    def forward(signum: int, _: Any) -> None:
        if signum == signal.SIGINT and _terminal_sent_it():
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    old = {}
    for sig in _FORWARDED:
        with contextlib.suppress(ValueError, OSError):  # not the main thread: no forwarding
            old[sig] = signal.signal(sig, forward)
    sampler, listener = _start_sampler(settings, emitter, proc.pid, gpu=not args.no_gpu)
    try:
        while True:
            try:
                returncode = proc.wait()
                break
            except KeyboardInterrupt:  # a handler was replaced under us: keep waiting
                continue
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.stop()
            if listener is not None:
                with contextlib.suppress(Exception):
                    listener.stop(timeout_s=2.0)
    code = _exit_code(returncode)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        lifecycle("killed", code, f"killed by {name}")
    elif returncode:
        lifecycle("failed", code)
    else:
        lifecycle("finished", 0)
    _close(emitter, publisher, settings.kafka_bootstrap)
    return code


def _show_patch(settings: Any, job_id: str) -> Path:
    """The job's config patch file (slow-loop changes for this start); say what it holds."""
    from perfloop.actuators.config_patch import patch_path, read_patch

    path = Path(settings.config_patch or patch_path(settings.home_dir, job_id))
    try:
        values = read_patch(path)
    except ConfigError as e:
        print(f"perfloop: {e}", file=sys.stderr)
        return path
    if values:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(values.items()))
        print(f"perfloop: config patch {path}: {shown}", file=sys.stderr, flush=True)
    return path


def _publish_rule(
    settings: Any, job_id: str, key: str, value: Any, flag: str, what: str, timeout_s: float = 10.0
) -> None:
    """Set an actuator rule for this job only (``actuator.tier`` for ``--tier``,
    ``actuator.pinned`` for ``--pin``); a broker that does not take it is one line on stderr,
    and the command runs regardless."""
    from perfloop.cli.config import build_change, publish_change

    change = build_change(
        key, value, job=job_id, reason=f"perfloop run {flag}", author="perfloop run"
    )
    why = publish_change(settings, change, timeout_s)
    if why:
        print(f"perfloop: {key} not set for job {job_id}: {why}", file=sys.stderr)
    else:
        print(f"perfloop: job {job_id}: {what}", file=sys.stderr, flush=True)


def _close(emitter: Any, publisher: Any, where: str, timeout_s: float = 5.0) -> None:
    from perfloop.producers.training import close_publisher

    with contextlib.suppress(Exception):
        emitter.close()
    try:
        left = close_publisher(publisher, timeout_s)
    except Exception as e:
        print(f"perfloop: closing the publisher failed: {e}", file=sys.stderr)
        return
    if left:
        print(
            f"perfloop: {left} telemetry messages not delivered yet to {where} "
            "(kept in the spool when it has one)",
            file=sys.stderr,
        )
