"""``perfloop jobs [--all] [--since 1d] [--json]``: the running and recent jobs, from the warehouse.

Per job: its state (running, finished, failed, killed, or silent: not ended and nothing heard
from it for a minute), its ranks and nodes, its recent step time (median over the last
`RECENT_S` seconds of its steps, all ranks) and steps per second, its open diagnoses (the
bottleneck, its ranks and share of the step), its last change (the knob, from → to) and what
became of it (kept, rolled back, rejected, or pending), when it started and when it was last
seen. By default the jobs seen in the last ``--since`` (1 day); ``--all``: every job the
warehouse holds.

`load_jobs` runs the queries (through `perfloop.warehouse.query`, each failure one line);
`perfloop.cli._jobs_rows` builds and prints the rows. ``perfloop top`` lists jobs with it too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any, TextIO

from perfloop.cli._jobs_rows import (
    ChangeSummary,
    DiagnosisSummary,
    JobRow,
    build_rows,
    parse_duration,
    render_table,
    to_json,
    verdict,
)
from perfloop.settings import BaseServiceSettings, load_settings

__all__ = ["RECENT_S", "duration_arg", "jobs_command", "load_jobs"]

NS = 1_000_000_000
RECENT_S = 30
"""The step time and steps/s of a job are over its last this many seconds of steps."""

# When each job was first and last seen, in telemetry or job events (since a time).
_SEEN = """
SELECT job_id, toUnixTimestamp64Nano(min(first)), toUnixTimestamp64Nano(max(last)) FROM (
    SELECT job_id, min(ts) AS first, max(ts) AS last FROM steps
        WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) GROUP BY job_id
    UNION ALL SELECT job_id, min(ts), max(ts) FROM host_samples
        WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) GROUP BY job_id
    UNION ALL SELECT job_id, min(ts), max(ts) FROM gpu_samples
        WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) GROUP BY job_id
    UNION ALL SELECT job_id, min(ts), max(ts) FROM job_lifecycle
        WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) GROUP BY job_id
    UNION ALL SELECT job_id, min(ts), max(ts) FROM job_info
        WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) GROUP BY job_id
)
GROUP BY job_id ORDER BY max(last) DESC LIMIT {limit:UInt32}
"""
# Each rank's latest lifecycle state (rank -1: the job as a whole; of two at one time, the end)
# and when it began.
_LIFECYCLE = """
SELECT job_id, rank, argMax(state, (ts, state IN ('finished', 'failed', 'killed'))),
       argMax(exit_code, (ts, state IN ('finished', 'failed', 'killed'))),
       toUnixTimestamp64Nano(min(ts))
FROM job_lifecycle WHERE job_id IN {jobs:Array(String)} GROUP BY job_id, rank
"""
_INFO = """
SELECT job_id, max(world_size), max(nodes) FROM job_info
WHERE job_id IN {jobs:Array(String)} GROUP BY job_id
"""
# The median step time, the steps made per second (from the step numbers) and the ranks and
# nodes of each job's last RECENT_S seconds of steps.
_STEPS = """
SELECT s.job_id, median(s.step_time_ms), max(s.step) - min(s.step),
       (toUnixTimestamp64Nano(max(s.ts)) - toUnixTimestamp64Nano(min(s.ts))) / 1e9,
       uniqExact(s.rank), uniqExact(s.node)
FROM steps AS s
INNER JOIN (
    SELECT job_id, max(ts) AS last FROM steps WHERE job_id IN {jobs:Array(String)} GROUP BY job_id
) AS l ON s.job_id = l.job_id
WHERE s.job_id IN {jobs:Array(String)} AND s.ts >= l.last - toIntervalSecond({recent:UInt32})
GROUP BY s.job_id
"""
# Each diagnosis's latest state; those not resolved are open.
_DIAGNOSES = """
SELECT job_id, argMax(bottleneck, ts), argMax(level, ts), argMax(ranks, ts),
       argMax(step_share, ts), argMax(critical_path, ts), argMax(explained_by, ts),
       diagnosis_id, argMax(summary, ts), toUnixTimestamp64Nano(argMax(onset, ts))
FROM diagnoses WHERE job_id IN {jobs:Array(String)}
GROUP BY job_id, diagnosis_id HAVING argMax(state, ts) != 'resolved'
"""
# Each job's last command, and the latest ack about it.
_CHANGES = """
SELECT c.job_id, c.knob, c.from_value, c.value, toUnixTimestamp64Nano(c.ts), a.status
FROM (
    SELECT job_id, command_id, knob, from_value, value, ts FROM commands
    WHERE job_id IN {jobs:Array(String)} ORDER BY ts DESC LIMIT 1 BY job_id
) AS c
LEFT JOIN (
    SELECT command_id, argMax(status, ts) AS status FROM actuations
    WHERE job_id IN {jobs:Array(String)} GROUP BY command_id
) AS a ON a.command_id = c.command_id
"""


def duration_arg(text: str) -> float:
    """``--since``'s type: seconds in ``30m``, ``1d``, … (a bad one is a command-line error)."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rows(settings: BaseServiceSettings, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    from perfloop.warehouse import query

    return [tuple(r) for r in query(settings, sql, params).result_rows]


def load_jobs(
    settings: BaseServiceSettings,
    *,
    since_ns: int = 0,
    limit: int = 500,
    now_ns: int | None = None,
) -> list[JobRow]:
    """The jobs seen since ``since_ns`` (0: every one), the most recently seen ``limit``, with
    what `perfloop jobs` shows about each. Raises `WarehouseError` (one line) when the
    warehouse is unreachable or not migrated."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    seen = {
        str(job): (int(first), int(last))
        for job, first, last in _rows(settings, _SEEN, {"since": since_ns, "limit": limit})
    }
    if not seen:
        return []
    p = {"jobs": list(seen), "recent": RECENT_S}
    lifecycle: dict[str, list[tuple[int, str, int | None, int]]] = {}
    for job, rank, state, code, first in _rows(settings, _LIFECYCLE, p):
        lifecycle.setdefault(job, []).append((int(rank), str(state), code, int(first)))
    info = {job: (int(w), int(n)) for job, w, n in _rows(settings, _INFO, p)}
    steps = {}
    for job, median, n_steps, span_s, ranks, nodes in _rows(settings, _STEPS, p):
        rate = n_steps / span_s if n_steps > 0 and span_s > 0 else None
        steps[job] = (float(median), rate, int(ranks), int(nodes))
    diagnoses: dict[str, list[DiagnosisSummary]] = {}
    for job, *d in _rows(settings, _DIAGNOSES, p):
        bottleneck, level, ranks, share, critical, explained, did, summary, onset = d
        diagnoses.setdefault(job, []).append(
            DiagnosisSummary(
                bottleneck=str(bottleneck),
                level=str(level),
                ranks=tuple(int(r) for r in ranks),
                step_share=float(share),
                critical_path=bool(critical),
                explained_by=str(explained),
                diagnosis_id=str(did),
                summary=str(summary),
                onset_ns=int(onset),
            )
        )
    changes = {
        job: ChangeSummary(str(knob), str(before), str(after), verdict(str(status or "")), int(t))
        for job, knob, before, after, t, status in _rows(settings, _CHANGES, p)
    }
    return build_rows(seen, lifecycle, info, steps, diagnoses, changes, now_ns)


_IDENTITY = """
SELECT job_id, argMax(scheduler, ts), argMax(slurm_job_id, ts), argMax(slurm_job_name, ts),
       argMax(k8s_namespace, ts), argMax(k8s_pod, ts)
FROM job_info WHERE job_id IN {jobs:Array(String)} GROUP BY job_id
"""
IDENTITY_FIELDS = ("scheduler", "slurm_job_id", "slurm_job_name", "k8s_namespace", "k8s_pod")


def load_identities(settings: BaseServiceSettings, jobs: list[str]) -> dict[str, dict[str, str]]:
    """Each job's identity in its scheduler (`JobInfo` v2: Slurm job, Kubernetes pod), as its
    latest job info says; a job without one has empty values."""
    if not jobs:
        return {}
    rows = _rows(settings, _IDENTITY, {"jobs": jobs})
    return {str(r[0]): dict(zip(IDENTITY_FIELDS, map(str, r[1:]), strict=True)) for r in rows}


def jobs_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop jobs``."""
    from perfloop.settings import StackSettings

    out = out or sys.stdout
    settings = load_settings(StackSettings)
    now = time.time_ns()
    since_ns = 0 if args.all else now - int(args.since * NS)
    rows = load_jobs(settings, since_ns=since_ns, now_ns=now)
    slurm_job, namespace = getattr(args, "slurm_job", None), getattr(args, "namespace", None)
    ids = load_identities(settings, [r.job_id for r in rows]) if rows else {}
    if slurm_job or namespace:  # what the cluster's users know the job by
        none = dict.fromkeys(IDENTITY_FIELDS, "")
        rows = [
            r
            for r in rows
            if (not slurm_job or ids.get(r.job_id, none)["slurm_job_id"] == slurm_job)
            and (not namespace or ids.get(r.job_id, none)["k8s_namespace"] == namespace)
        ]
    if args.json:
        docs = to_json(rows)
        for doc in docs:
            doc["identity"] = ids.get(doc["job_id"], {})
        print(json.dumps(docs, indent=2), file=out)
        return 0
    if not rows:
        print("no jobs" + ("" if args.all else " seen since " + _since_text(args.since)), file=out)
        return 0
    width = min(120, shutil.get_terminal_size((120, 24)).columns)
    print(render_table(rows, now, width=width, color=out.isatty()), file=out)
    return 0


def _since_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit} ago (--all: every job)"
    return f"{seconds:g}s ago (--all: every job)"
