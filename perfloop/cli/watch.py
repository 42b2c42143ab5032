"""``perfloop watch``: follow perfloop's events as they are published, one line each.

``perfloop watch [--job J]… [--kind K]… [--since 10m] [--json]`` reads the topics with the
typed client (`perfloop.client.Follower`: no consumer group, so it starts at once) and prints
every event of the jobs and kinds asked for (default: every job, `perfloop.client.DEFAULT_KINDS`)
from ``--since`` (a duration ago, ``30s`` ``10m`` ``2h`` ``1d``, or an ISO time; default:
from now) until Ctrl-C, which exits 0. A line for people (`describe`):

    10:42:07.311  my-job  job  diagnosis       open dataloader_starvation (host) 38% of each step …
    10:42:07.402  my-job  job  recommendation  dataloader.num_workers 0 → 4, expected +31% …

the event's own time (with its date when not today), the job, the rank (``job`` for the job
as a whole), the kind and what matters in it; ``--json``: one JSON object per line, the
event's fields and its ``kind``, as `perfloop.schemas.encode_event` writes them. A message
that cannot be decoded is skipped with one line on stderr. Bad arguments: one line on stderr,
exit 2; the broker unreachable or the topics missing: one line, exit 1.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from perfloop.exceptions import ConfigError
from perfloop.settings import load_settings

__all__ = ["describe", "parse_kinds", "stamp", "watch_command"]

_WIDTH = 14  # the kind column


def parse_kinds(values: Iterable[str] | None) -> list[str] | None:
    """``--kind`` values (each may be a comma-separated list) as kinds; None for the default.

    >>> parse_kinds(["diagnosis,recommendation", "actuation"])
    ['diagnosis', 'recommendation', 'actuation']
    """
    if not values:
        return None
    return [k.strip() for v in values for k in v.split(",") if k.strip()]


def stamp(ts_ns: int, now_ns: int | None = None) -> str:
    """An event time for a person: local ``HH:MM:SS.mmm``, with ``MM-DD`` before it when the
    event is not from today.

    >>> stamp(0, now_ns=0)[-4:]
    '.000'
    """
    now = time.time_ns() if now_ns is None else now_ns
    t = time.localtime(ts_ns // 1_000_000_000)
    ms = (ts_ns // 1_000_000) % 1000
    day = "" if time.localtime(now // 1_000_000_000)[:3] == t[:3] else time.strftime("%m-%d ", t)
    return f"{day}{time.strftime('%H:%M:%S', t)}.{ms:03d}"


def _v(value: Any) -> str:
    """A value, short: floats with 4 significant digits, None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _list(values: list[Any], most: int = 8) -> str:
    shown = ",".join(str(v) for v in values[:most])
    return shown + (f",…(+{len(values) - most})" if len(values) > most else "")


def _evidence(evidence: dict[str, float], most: int = 3) -> str:
    items = list(evidence.items())[:most]
    more = " …" if len(evidence) > most else ""
    return " ".join(f"{k}={_v(v)}" for k, v in items) + more


def _why(text: str, most: int = 100) -> str:
    text = " ".join(text.split())
    if not text:
        return ""
    return ": " + (text if len(text) <= most else text[: most - 1] + "…")


def _diagnosis(ev: Any) -> str:
    s = f"{ev.state} {ev.bottleneck} ({ev.level}) {100 * ev.step_share:.0f}% of each step"
    s += f", confidence {ev.confidence:.2f}"
    s += ", critical path" if ev.critical_path else ""
    s += f", explained by {ev.explained_by}" if ev.explained_by else ""
    s += f"; ranks {_list(ev.ranks)}" if ev.ranks else ""
    s += f"; nodes {_list(ev.nodes, 4)}" if ev.nodes else ""
    s += f"; {_evidence(ev.evidence)}" if ev.evidence else ""
    return s


def _recommendation(ev: Any) -> str:
    return (
        f"{ev.knob} {_v(ev.from_value)} → {_v(ev.to_value)}, expected "
        f"{ev.expected_gain_pct:+.0f}%, confidence {ev.confidence:.2f} ({ev.loop} loop), "
        f"rec {ev.event_id}{_why(ev.rationale)}"
    )


def _approval(ev: Any) -> str:
    by = f" by {ev.author}" if ev.author else ""
    return (
        f"{ev.verdict} rec {ev.rec_id}: {ev.knob} {_v(ev.from_value)} → {_v(ev.to_value)}"
        f"{by}{_why(ev.reason)}"
    )


def _decision(ev: Any) -> str:
    change = f" {ev.knob} {_v(ev.from_value)} → {_v(ev.to_value)}" if ev.knob else ""
    cmd = f", command {ev.command_id}" if ev.command_id else ""
    return (
        f"{ev.outcome}{change} (tier {ev.tier}, by {ev.actor}), rec {ev.rec_id or '-'}{cmd}"
        f"{_why(ev.reason)}"
    )


def _command(ev: Any) -> str:
    rec = f", rec {ev.rec_id}" if ev.rec_id else ""
    return f"seq {ev.seq}: {ev.knob} {_v(ev.from_value)} → {_v(ev.value)} ({ev.loop} loop){rec}"


def _actuation(ev: Any) -> str:
    at = f" at step {ev.step}" if ev.step else ""
    ev_s = f"; {_evidence(ev.evidence)}" if ev.evidence else ""
    return f"{ev.status} {ev.knob or '?'} = {_v(ev.value)}{at}{_why(ev.reason)}{ev_s}"


def _config(ev: Any) -> str:
    by = f" by {ev.author}" if ev.author else ""
    return f"{ev.target} {ev.key} = {_v(ev.value)} for {ev.applies_to}{by}{_why(ev.reason)}"


def _prediction(ev: Any) -> str:
    s = f"{ev.state} {ev.target} = {_v(ev.value)}"
    s += f" (realised {_v(ev.realised)})" if ev.realised is not None else ""
    s += f", baseline {_v(ev.baseline)}" if ev.baseline is not None else ""
    s += f", step {ev.step}" if ev.step else ""
    return s + f" by {ev.model}"


def _phase(ev: Any) -> str:
    prev = f"{ev.previous} → " if ev.previous else ""
    nxt = f", next {ev.next_phase}" if ev.next_phase else ""
    return f"{ev.level} {prev}{ev.phase} at step {ev.step} (from {ev.source}){nxt}"


def _lifecycle(ev: Any) -> str:
    code = f" (exit {ev.exit_code})" if ev.exit_code is not None else ""
    return f"{ev.state}{code}{_why(ev.message)}"


def _job_info(ev: Any) -> str:
    parts = [
        ev.model_name or "model ?",
        f"{ev.model_params:,} params" if ev.model_params else "",
        f"world {ev.world_size} on {ev.nodes} node(s)",
        ev.parallelism,
        ev.precision,
        f"{ev.gpu_count}× {ev.gpu_name}" if ev.gpu_count else "",
        f"{ev.framework} {ev.framework_version}".strip(),
    ]
    return ", ".join(p for p in parts if p)


def _capability(ev: Any) -> str:
    s = f"{ev.component} {'available' if ev.available else 'unavailable'}"
    s += f", {ev.devices} device(s)" if ev.devices else ""
    s += f", missing {_list(ev.missing, 4)}" if ev.missing else ""
    return s + _why(ev.reason)


def _progress(ev: Any) -> str:
    op = f" {ev.op}" if ev.op else ""
    return (
        f"step {ev.step} in {ev.phase}{op} for {(ev.ts_ns - ev.since_ns) / 1e9:.1f} s "
        f"(step began {(ev.ts_ns - ev.step_start_ns) / 1e9:.1f} s ago)"
    )


def _ground_truth(ev: Any) -> str:
    ranks = f" on ranks {_list(ev.ranks)}" if ev.ranks else ""
    end = ", ended" if ev.end_ns else ""
    return f"{ev.fault} ({ev.scenario}){ranks}{end}{_why(ev.detail)}"


def _producer(ev: Any) -> str:
    return (
        f"{ev.producer_id}: {ev.published} published, {ev.spooled} spooled, {ev.dropped} "
        f"dropped, {ev.failed} failed, overhead {ev.overhead_pct:.2f}%"
    )


def _step(ev: Any) -> str:
    loss = f", loss {_v(ev.loss)}" if ev.loss is not None else ""
    return f"step {ev.step} {ev.step_time_ms:.1f} ms, data wait {ev.data_wait_ms:.1f} ms{loss}"


def _span(ev: Any) -> str:
    return f"step {ev.step} {ev.phase}/{ev.name} {ev.duration_ms:.2f} ms"


def _gpu(ev: Any) -> str:
    return (
        f"device {ev.device}: sm {ev.sm_util_pct:.0f}%, mem {ev.mem_util_pct:.0f}%, "
        f"{ev.mem_used_bytes / 2**30:.1f} GiB, {ev.power_w:.0f} W, {ev.temp_c:.0f} °C"
    )


def _host(ev: Any) -> str:
    return (
        f"cpu {ev.proc_cpu_pct:.0f}% (system {ev.sys_cpu_pct:.0f}%), rss "
        f"{ev.proc_rss_bytes / 2**30:.2f} GiB, loader workers {ev.loader_workers}"
    )


def _collective(ev: Any) -> str:
    return f"step {ev.step} {ev.op} {ev.size_bytes:,} B in {ev.duration_ms:.2f} ms"


def _kernel(ev: Any) -> str:
    return f"step {ev.step} stream {ev.stream} {ev.kernel_class}: {ev.count}× {ev.busy_ms:.2f} ms"


_DESCRIBE: dict[str, Callable[[Any], str]] = {
    "diagnosis": _diagnosis,
    "recommendation": _recommendation,
    "approval": _approval,
    "decision": _decision,
    "command": _command,
    "actuation": _actuation,
    "config": _config,
    "prediction": _prediction,
    "phase": _phase,
    "lifecycle": _lifecycle,
    "job_info": _job_info,
    "capability": _capability,
    "progress": _progress,
    "ground_truth": _ground_truth,
    "producer": _producer,
    "step": _step,
    "span": _span,
    "gpu": _gpu,
    "host": _host,
    "collective": _collective,
    "kernel": _kernel,
}


def describe(ev: Any, *, now_ns: int | None = None) -> str:
    """One line for a person: time, job, rank, kind and the event's essentials.

    >>> from perfloop.schemas import JobLifecycle
    >>> ev = JobLifecycle(ts_ns=0, job_id="j1", node="n0", rank=-1, state="finished", exit_code=0)
    >>> describe(ev, now_ns=0)[14:]
    'j1  job  lifecycle       finished (exit 0)'
    """
    rank = "job" if ev.rank < 0 else f"r{ev.rank}"
    what = _DESCRIBE.get(ev.KIND)
    detail = what(ev) if what is not None else ""
    return f"{stamp(ev.ts_ns, now_ns)}  {ev.job_id}  {rank}  {ev.KIND:<{_WIDTH}}  {detail}".rstrip()


def _from(since: str | None) -> str:
    """Where ``--since`` starts, in words.

    >>> _from(None), _from("10m"), _from("2026-11-05T10:00:00Z")
    ('from now', 'from 10m ago', 'from 2026-11-05T10:00:00Z')
    """
    if not since or since.strip().lower() == "now":
        return "from now"
    ago = re.fullmatch(r"[\d.]+\s*[smhd]", since.strip().lower())
    return f"from {since.strip()} ago" if ago else f"from {since.strip()}"


def _json_line(ev: Any) -> str:
    from perfloop.schemas import encode_event

    return encode_event(ev).decode()


def watch_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop watch``: 0 when stopped with Ctrl-C or SIGTERM, 2 for bad arguments, 1
    (through the CLI's handler) when the broker cannot be reached."""
    from perfloop.client import Follower, parse_since
    from perfloop.settings import StackSettings

    out = out or sys.stdout
    try:
        since = parse_since(args.since) if args.since else None
        kinds = parse_kinds(args.kind)
        settings = load_settings(StackSettings)
        _quiet_skips()
        follower = Follower(settings, jobs=args.job, kinds=kinds, since=since)
    except ConfigError as e:
        print(f"perfloop: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    line = _json_line if args.json else describe
    jobs = "job " + ", ".join(args.job) if args.job else "every job"
    print(
        f"perfloop watch: following {', '.join(follower.kinds)} of {jobs} "
        f"{_from(args.since)}; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    previous = _stop_on_signals(follower)
    try:
        with follower:
            for ev in follower:
                print(line(ev), file=out, flush=True)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `perfloop watch | head`: the reader is gone
        _silence_stdout()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _stop_on_signals(follower: Any) -> dict[int, Any]:
    """Ctrl-C and SIGTERM stop the follower (its loop ends, the command exits 0) instead of
    raising `KeyboardInterrupt` inside the Kafka client's poll, which its log callbacks (a
    broker away: a line every reconnect) can turn into a `SystemError`. Returns the handlers
    it replaced (none outside the main thread)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda _sig, _frame: follower.stop())
    return previous


def _quiet_skips() -> None:
    """The client's warnings (a message skipped, a broker error) as one plain line each."""
    log = logging.getLogger("perfloop.client")
    if not any(getattr(h, "_perfloop_watch", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("perfloop watch: %(message)s"))
        h._perfloop_watch = True  # type: ignore[attr-defined]
        log.addHandler(h)
        log.propagate = False


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
