"""``perfloop top [--job J]``: a live terminal view of running jobs (Textual).

It lists the jobs seen (from the warehouse's last day, then as the topics bring them) and
shows the picked one live: per rank its step time, phase shares (data wait, forward,
backward, comm, optimizer, other), GPU and CPU use where reported, and the job's open
diagnoses, recommendations and changes (commands with their acks and verdicts). The picked
job's recent state is read from the warehouse first, so a running job shows its numbers at
once; then the view follows the topics (`perfloop.cli._top_feed`) and redraws every second.
``--job`` picks a job at start (it may not have started yet); without it, the most recently
seen running job. ``q`` quits.

The broker unreachable, or no terminal: one line and exit 1. The warehouse unreachable: the
view runs on the live events alone and says so.
"""

from __future__ import annotations

import argparse
import sys
import time

from perfloop.exceptions import ConfigError, PerfloopError
from perfloop.settings import load_settings

__all__ = ["top_command"]

NS = 1_000_000_000
_LISTED_S = 86400  # jobs listed at start: those seen in the last day


def top_command(args: argparse.Namespace) -> int:
    """``perfloop top``."""
    from perfloop.cli._top_feed import TopicFeed
    from perfloop.cli._top_seed import load_seed
    from perfloop.cli._top_state import TopState
    from perfloop.cli.jobs import load_jobs
    from perfloop.kafka import ping
    from perfloop.settings import StackSettings

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ConfigError("perfloop top needs a terminal; for a snapshot use `perfloop jobs`")
    settings = load_settings(StackSettings)
    ping(settings)
    state, note = TopState(), ""
    try:
        rows = load_jobs(settings, since_ns=time.time_ns() - _LISTED_S * NS)
    except PerfloopError as e:
        rows, note = [], f"warehouse: {e} (live events only)"
    state.seed_jobs(rows)
    job = args.job
    feed = TopicFeed(settings, job=job)
    if not feed.start():
        feed.stop()
        raise ConfigError(
            f"could not follow the topics at {settings.kafka_bootstrap} within 15 s "
            "(see `perfloop status`)"
        )
    from perfloop.cli._top_app import TopApp

    app = TopApp(
        state,
        feed,
        job=job,
        seed=lambda j: load_seed(settings, j),
        jobs=lambda: load_jobs(settings, since_ns=time.time_ns() - _LISTED_S * NS),
        note=note,
    )
    try:
        app.run()
    finally:
        feed.stop()
    return 0
