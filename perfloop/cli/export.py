"""``perfloop export JOB [--steps A..B] [-o FILE]``: a job's steps, phase spans, collectives
and GPU and process counters from the warehouse, as a Chrome trace that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open (`perfloop.cli._export_trace`)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.settings import load_settings

__all__ = ["export_command", "step_range"]

# rows are at least once in the warehouse (the sink's inserts may repeat): one of each event
_ONCE = "LIMIT 1 BY event_id"


def step_range(text: str) -> tuple[int, int]:
    """``A..B`` (both included), ``A..`` (from A on) or ``N`` (that step alone).

    >>> step_range("10..20"), step_range("5"), step_range("7..")[0]
    ((10, 20), (5, 5), 7)
    >>> step_range("9..3")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: steps 9..3: the first is after the last
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?:(\.\.)\s*(\d*)\s*)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"steps {text!r}: give A..B, A.. or N (step numbers)")
    first = int(m.group(1))
    last = first if not m.group(2) else int(m.group(3)) if m.group(3) else 2**63 - 1
    if last < first:
        raise argparse.ArgumentTypeError(f"steps {text}: the first is after the last")
    return first, last


def _rows(settings: Any, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    from perfloop.warehouse import query

    return [tuple(r) for r in query(settings, sql, params).result_rows]


def export_command(args: argparse.Namespace) -> int:
    from perfloop.cli._export_trace import check_trace, chrome_trace
    from perfloop.settings import StackSettings

    settings = load_settings(StackSettings)
    job = args.job
    first, last = args.steps or (0, 2**63 - 1)
    p = {"j": job, "a": first, "b": last}
    steps = _rows(
        settings,
        "SELECT rank, node, step, toUnixTimestamp64Nano(ts), step_time_ms, data_wait_ms, "
        f"samples, tokens, loss FROM steps WHERE job_id = {{j:String}} AND step BETWEEN "
        f"{{a:UInt64}} AND {{b:UInt64}} ORDER BY rank, step {_ONCE}",
        **p,
    )
    if not steps:
        known = _rows(settings, "SELECT count() FROM steps WHERE job_id = {j:String}", j=job)
        if not known or not known[0][0]:
            raise ConfigError(
                f"no steps of job {job!r} in the warehouse (perfloop jobs lists them)"
            )
        upto = "" if last == 2**63 - 1 else str(last)
        raise ConfigError(f"job {job!r} has no steps in {first}..{upto}")
    # counters over the exported steps' time (and a second around it)
    t_lo = min(int(s[3]) - int(float(s[4]) * 1e6) for s in steps) - 1_000_000_000
    t_hi = max(int(s[3]) for s in steps) + 1_000_000_000
    spans = _rows(
        settings,
        "SELECT rank, step, toUnixTimestamp64Nano(ts), duration_ms, phase, name, depth "
        "FROM spans WHERE job_id = {j:String} AND step BETWEEN {a:UInt64} AND {b:UInt64} "
        f"{_ONCE}",
        **p,
    )
    collectives = _rows(
        settings,
        "SELECT rank, step, toUnixTimestamp64Nano(ts), duration_ms, op, size_bytes, `group`, "
        "group_size, dtype FROM collectives WHERE job_id = {j:String} AND step BETWEEN "
        f"{{a:UInt64}} AND {{b:UInt64}} {_ONCE}",
        **p,
    )
    window = (
        "job_id = {j:String} AND ts BETWEEN fromUnixTimestamp64Nano({lo:Int64}) "
        "AND fromUnixTimestamp64Nano({hi:Int64})"
    )
    gpu = _rows(
        settings,
        "SELECT rank, node, device, toUnixTimestamp64Nano(ts), sm_util_pct, mem_used_bytes, "
        f"power_w FROM gpu_samples WHERE {window} ORDER BY ts {_ONCE}",
        j=job, lo=t_lo, hi=t_hi,
    )  # fmt: skip
    host = _rows(
        settings,
        "SELECT rank, node, toUnixTimestamp64Nano(ts), proc_cpu_pct, proc_rss_bytes "
        f"FROM host_samples WHERE {window} AND rank >= 0 ORDER BY ts {_ONCE}",
        j=job, lo=t_lo, hi=t_hi,
    )  # fmt: skip
    trace = chrome_trace(job, steps=steps, spans=spans, collectives=collectives, gpu=gpu, host=host)
    counts = check_trace(trace)  # what a viewer would refuse is a bug here: say it now
    out = Path(args.output or f"perfloop-trace-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}.json")
    data = json.dumps(trace, separators=(",", ":")).encode()
    try:
        if out.suffix == ".gz":
            out.write_bytes(gzip.compress(data))
        else:
            out.write_bytes(data)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from e
    print(
        f"wrote {out}: {counts['steps']} steps of {counts['ranks']} rank(s), {len(spans)} spans, "
        f"{len(collectives)} collectives, {len(gpu)} GPU and {len(host)} process samples; open it "
        "in https://ui.perfetto.dev or chrome://tracing"
    )
    return 0
