"""``perfloop config``: change the stream tier or producers live, and read back every change.

``perfloop config set KEY VALUE [--target streams|producers|actuator] [--job JOB|*]
[--reason TEXT]`` publishes one `ConfigChange` on ``perfloop.control``, keyed by the job id (or
"*"), with ``author`` = user@host. VALUE is read by `parse_value`. The target defaults to
"producers" for ``sampling.*`` keys, "actuator" for ``actuator.*`` keys (a job's automation
tier, dry run, limits and pinned knobs, e.g. ``actuator.pinned '["torch.num_threads"]'``,
`perfloop.actuators.policy`) and "streams" otherwise; a producers or
actuator change is checked here before it is sent, a streams change by the stream workers
(which refuse a bad one to ``perfloop.dlq``). Every change is signed with this person's key
(``PERFLOOP_PRINCIPAL_KEY``, by default the embedded stack's owner key) and expires in five
minutes: an actuator, a stream worker or a job with a roster applies it only if the
principal's role allows it.

``perfloop config history [--job JOB] [--limit N] [--json]`` reads the warehouse table
``config_changes`` (filled by the sink from ``perfloop.control``), oldest first; with
``--job``, the changes addressed to that job or to every job. Parameters are bound server-side.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
import re
import socket
import sys
import time
from typing import Any, TextIO

from perfloop.exceptions import ConfigError
from perfloop.settings import load_settings

__all__ = [
    "ISSUER_JOB_ID",
    "build_change",
    "config_command",
    "default_target",
    "parse_value",
]

ISSUER_JOB_ID = "ops"
"""``job_id`` of a change addressed to every job ("*"): it names who issued it."""

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?")
_HISTORY_COLUMNS = (
    "ts",
    "event_id",
    "job_id",
    "node",
    "target",
    "applies_to",
    "key",
    "value",
    "author",
    "reason",
)


def parse_value(text: str) -> int | float | bool | str:
    """A command-line VALUE as the setting's type: int, float, bool, else the string itself.

    Window specs ("1,10,60,60/10") and any other list stay strings, read by the component.

    >>> [parse_value(v) for v in ("250", "-3", "0.7", "1e-3", "true", "False")]
    [250, -3, 0.7, 0.001, True, False]
    >>> parse_value("1,10,60,60/10"), parse_value("inf")
    ('1,10,60,60/10', 'inf')
    """
    s = text.strip()
    if not s:
        raise ConfigError("VALUE is empty; give a number, true/false, or text")
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    if _INT.fullmatch(s):
        return int(s)
    if _FLOAT.fullmatch(s):
        v = float(s)
        if not math.isfinite(v):
            raise ConfigError(f"VALUE {text!r} is not a finite number")
        return v
    return s


def default_target(key: str) -> str:
    """Where a change of ``key`` goes when ``--target`` is not given.

    >>> default_target("sampling.gpu_interval_ms"), default_target("detect.hang.after_s")
    ('producers', 'streams')
    >>> default_target("actuator.tier")
    'actuator'
    """
    if key.startswith("sampling."):
        return "producers"
    return "actuator" if key.startswith("actuator.") else "streams"


def _author() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no user name in this environment
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:256]


def principal_key(settings: Any) -> Any:
    """This person's private key (`BaseServiceSettings.principal_key_path`), or None."""
    from perfloop.identity import PrivateKey

    path = settings.principal_key_path
    return PrivateKey.load(path) if path is not None else None


def build_change(
    key: str,
    value: Any,
    *,
    target: str | None = None,
    job: str = "*",
    reason: str = "",
    author: str | None = None,
    ts_ns: int | None = None,
) -> Any:
    """The `ConfigChange` ``perfloop config set`` publishes; `ConfigError` if it is invalid.

    >>> c = build_change("sampling.host_interval_ms", 250, author="ana@n1", ts_ns=1)
    >>> c.target, c.applies_to, c.job_id, c.value
    ('producers', '*', 'ops', 250)
    """
    from pydantic import ValidationError

    from perfloop.schemas import ConfigChange

    target = target or default_target(key)
    if target == "streams" and job != "*" and not key.startswith("detect."):
        raise ConfigError(
            f"{key} applies to every job: only detect.* settings can be set for one job "
            "(leave out --job)"
        )
    if target == "producers":
        from perfloop.producers.adaptive import sampling_value

        sampling_value(key, value)  # refuse here what every sampler would refuse
    if target == "actuator":
        from perfloop.actuators.policy import JobRules

        JobRules().with_setting(key, value)  # refuse here what the actuator would refuse
    try:
        return ConfigChange(
            ts_ns=time.time_ns() if ts_ns is None else ts_ns,
            job_id=ISSUER_JOB_ID if job == "*" else job,
            node=socket.gethostname()[:255] or "cli",
            rank=-1,
            target=target,
            applies_to=job,
            key=key,
            value=value,
            author=_author() if author is None else author,
            reason=reason,
        )
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "change"
        names = {"key": "KEY", "job_id": "--job", "applies_to": "--job", "reason": "--reason"}
        label = names.get(field, field)
        shown = str(err.get("input", ""))[:80]
        raise ConfigError(f"invalid {label} {shown!r}: {err['msg']}") from None


def config_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop config set|history``."""
    from perfloop.settings import StackSettings

    settings = load_settings(StackSettings)
    if args.config_command == "set":
        return _set(args, settings, out or sys.stdout)
    return _history(args, settings, out or sys.stdout)


def publish_change(settings: Any, change: Any, timeout_s: float = 10.0) -> str:
    """Publish a `ConfigChange` on ``perfloop.control`` (keyed by whom it applies to) and wait
    for the broker to take it; return why it was not delivered ("" when it was).

    A change of the stream tier for every job goes to every partition of the topic: each
    partition's state lives in an engine of its own, maybe on another worker
    (`perfloop.streams.shards`), and takes the change with the partition's input, in order
    and into its snapshots. Readers of the other targets see it once; `perfloop config
    history` shows each change once."""
    from perfloop.actuators.trust import signed_by
    from perfloop.kafka import producer
    from perfloop.schemas import encode_event
    from perfloop.schemas.topics import Topics

    errors: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err.str())

    change = signed_by(change, principal_key(settings))  # by this person, for a roster
    try:
        p = producer(settings, **{"linger.ms": 0, "message.timeout.ms": int(timeout_s * 1000)})
        partitions: list[int | None] = [None]
        if change.target == "streams" and change.applies_to == "*":
            md = p.list_topics(Topics.CONTROL, timeout=timeout_s).topics.get(Topics.CONTROL)
            if md is None or md.error is not None or not md.partitions:
                return f"no topic {Topics.CONTROL} on the broker"
            partitions = sorted(md.partitions)
        value = encode_event(change)
        for part in partitions:
            extra = {} if part is None else {"partition": part}
            p.produce(
                Topics.CONTROL,
                key=change.applies_to.encode(),
                value=value,
                on_delivery=delivered,
                **extra,
            )
        left = p.flush(timeout_s + 5)
    except Exception as e:  # the caller says what it means to them
        return " ".join(str(e).split())[:300]
    return errors[0] if errors else "no answer" if left else ""


def _set(args: argparse.Namespace, settings: Any, out: TextIO) -> int:
    from perfloop.exceptions import BrokerError
    from perfloop.kafka import ping
    from perfloop.schemas.topics import Topics

    change = build_change(
        args.key, parse_value(args.value), target=args.target, job=args.job, reason=args.reason
    )
    ping(settings)  # a broker that is not there is one line now
    why = publish_change(settings, change)
    if why:
        raise BrokerError(
            f"config change not delivered to {settings.kafka_bootstrap}: {why} "
            "(is the broker up? see `perfloop status`)"
        )
    scope = "every job" if args.job == "*" else f"job {args.job}"
    print(
        f"config change {change.event_id}: {change.key} = {json.dumps(change.value)} "
        f"→ {change.target} of {scope} (by {change.author}) on {Topics.CONTROL}",
        file=out,
    )
    return 0


def _history(args: argparse.Namespace, settings: Any, out: TextIO) -> int:
    from perfloop.demo import format_table
    from perfloop.warehouse import query

    if not 1 <= args.limit <= 100_000:
        raise ConfigError(f"--limit {args.limit} is outside [1, 100000]")
    where, params = "", {"limit": args.limit}
    if args.job is not None:
        # Changes addressed to the job, to every job, or issued under its id.
        where = "WHERE applies_to IN ({job:String}, '*') OR job_id = {job2:String} "
        params |= {"job": args.job, "job2": args.job}
    sql = (
        f"SELECT {', '.join(_HISTORY_COLUMNS)} FROM config_changes {where}"
        "ORDER BY ts DESC, event_id LIMIT 1 BY event_id LIMIT {limit:UInt32}"
    )
    r = query(settings, sql, params)
    rows = [tuple(row) for row in reversed(r.result_rows)]  # oldest first
    if args.json:
        docs = [dict(zip(_HISTORY_COLUMNS, row, strict=True)) for row in rows]
        print(json.dumps(docs, indent=2, default=str), file=out)
        return 0
    print(format_table(list(_HISTORY_COLUMNS), rows), file=out)
    return 0
