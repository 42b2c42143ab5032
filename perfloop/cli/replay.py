"""``perfloop replay [--job-id ID] [--node N] [--require-steps] [--keep-time] TRACE…``: stream
PyTorch-profiler traces as perfloop telemetry (`perfloop.producers.replay`), one line per file."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.producers.replay import (
    ReplayResult,
    TraceError,
    default_job_id,
    index_trace,
    replay_trace,
)
from perfloop.schemas.base import JOB_ID_PATTERN
from perfloop.settings import ProducerSettings, load_settings

__all__ = ["replay_command"]


_JOB_ID = re.compile(JOB_ID_PATTERN)


_KEEP_TIME_NS = 7 * 86_400 * 10**9  # traces younger than this keep their own times


def replay_command(args: argparse.Namespace, settings: Any = None) -> int:
    """``perfloop replay``: replay each trace, one line per file; non-zero if any failed.

    A trace that ended more than a week ago is moved so that the first trace ends now
    (every file by the same amount, so ranks stay aligned): raw warehouse tables expire rows
    30 days after their event time, and ClickHouse drops already-expired rows as they are
    inserted. The shift and the original start are kept in each rank's `JobInfo` ``extra``.
    A recent trace keeps its times, so it lines up with the job's live telemetry;
    ``args.keep_time`` keeps them always. ``settings``: `ProducerSettings`, from the
    environment when not given.
    """
    from perfloop.producers.publisher import Publisher

    if settings is None:
        settings = load_settings(ProducerSettings)
    paths = [Path(t) for t in args.traces]
    job_id = args.job_id or getattr(settings, "job_id", None) or default_job_id(paths[0])
    if not _JOB_ID.match(job_id):
        raise ConfigError(f"invalid job id {job_id!r}: use 1-128 of A-Z a-z 0-9 . _ : / @ + -")
    node = args.node or getattr(settings, "node", None)
    # A trace recorded without a profiler schedule has no ProfilerStep: the command still
    # replays it (as one step 0, said in its summary line) unless --require-steps.
    whole_trace = not bool(getattr(args, "require_steps", False))
    keep_time = bool(getattr(args, "keep_time", False))
    publisher = Publisher(settings)
    print(f"replaying {len(paths)} trace(s) as job {job_id}", flush=True)
    failed = 0
    shift: int | None = 0 if keep_time else None
    for p in paths:
        try:
            idx = index_trace(p, whole_trace=whole_trace)
            if shift is None:
                age_ns = time.time_ns() - idx.end_ns
                shift = age_ns if age_ns > _KEEP_TIME_NS else 0
                if shift:
                    when = datetime.fromtimestamp(idx.end_ns / 1e9, tz=UTC)
                    print(
                        f"times shifted by {shift / 86_400e9:+.2f} days so the trace that "
                        f"ended {when.isoformat(' ', 'seconds')} ends now",
                        flush=True,
                    )
            idx.shift_ns = shift
            r = replay_trace(p, publisher, job_id=job_id, node=node, index=idx)
        except TraceError as e:
            print(f"perfloop: replay: {e}", file=sys.stderr, flush=True)
            failed += 1
            continue
        except Exception as e:  # never a traceback for one bad file: say it, go on
            msg = " ".join(str(e).split())[:200]
            print(
                f"perfloop: replay: {p}: cannot replay: {type(e).__name__}: {msg}",
                file=sys.stderr,
                flush=True,
            )
            failed += 1
            continue
        print(_summary(r), flush=True)
    timeout_s = getattr(settings, "message_timeout_ms", 15_000) / 1000.0 + 5.0
    left = publisher.flush(timeout_s)
    close = getattr(publisher, "close", None)
    if callable(close):
        close()
    if left:
        print(
            f"perfloop: replay: {left} message(s) not delivered to "
            f"{getattr(settings, 'kafka_bootstrap', 'the broker')} (is the stack up? "
            "see `perfloop status`)",
            file=sys.stderr,
        )
        return 1
    if failed:
        print(f"perfloop: replay: {failed} of {len(paths)} trace(s) failed", file=sys.stderr)
    return 1 if failed else 0


def _summary(r: ReplayResult) -> str:
    steps = (
        "whole trace as step 0 (no ProfilerStep spans)"
        if r.whole_trace
        else f"{r.steps} step{'s' * (r.steps != 1)} ({_ranges(r.step_numbers)})"
    )
    gpu = f"{r.gpu_events} GPU activities"
    if r.unattributed_gpu_events:
        gpu += f" ({r.unattributed_gpu_events} outside any step, left out)"
    return (
        f"{r.path}: rank {r.rank}, node {r.node}: {steps}, {gpu}, {r.kernel_rows} kernel "
        f"summaries, {r.spans} spans, {r.collectives} collectives (from {r.comm_source})"
    )


def _ranges(numbers: Iterable[int]) -> str:
    ns = sorted(numbers)
    if not ns:
        return "none"
    return f"{ns[0]}-{ns[-1]}" if len(ns) > 1 else str(ns[0])
