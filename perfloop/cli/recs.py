"""``perfloop recs``, ``perfloop approve`` and ``perfloop reject``: the recommendations waiting
for a person, and a person's verdict on one.

``perfloop recs [--job JOB] [--all] [--limit N] [--json]`` lists recommendations from the
warehouse with what became of each (the actuator's latest decision about it, table ``audit``):
by default only those pending approval, newest first.

``perfloop approve REC_ID [--reason TEXT]`` and ``perfloop reject REC_ID [--reason TEXT]`` read
the recommendation from the warehouse, check that it is pending, and publish a signed
`Approval` (Ed25519 with the person's own key, ``PERFLOOP_PRINCIPAL_KEY``, by default the
embedded stack's owner key; without one HMAC-SHA256 under the shared ``PERFLOOP_SIGNING_KEY``) on
``perfloop.recommendations``, keyed by its job; then wait up to ``--wait-s`` (15 s) for the
actuator's decision about it to reach the warehouse, and print it. They exit 0 when the
actuator did as asked (the command issued, or in dry run decided; the recommendation
rejected), 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any, TextIO

from perfloop.exceptions import PerfloopError
from perfloop.settings import load_settings

__all__ = ["approve_command", "recs_command", "send_signed"]

_RECS_COLUMNS = (
    "ts",
    "rec_id",
    "job_id",
    "knob",
    "from_value",
    "to_value",
    "loop",
    "expected_gain_pct",
    "confidence",
    "state",
    "reason",
    "command_id",
    "rationale",
)
_SHOWN = ("ts", "rec_id", "job_id", "knob", "from_value", "to_value", "expected_gain_pct",
          "confidence", "state", "reason")  # fmt: skip
# The latest decision about each recommendation.
_LATEST = (
    "SELECT rec_id, argMax(outcome, ts) AS outcome, argMax(reason, ts) AS reason, "
    "argMax(command_id, ts) AS command_id FROM audit GROUP BY rec_id"
)
_DONE = {"approve": ("issued", "dry_run"), "reject": ("rejected",)}


def _query(settings: Any, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    from perfloop.warehouse import query

    return [tuple(r) for r in query(settings, sql, params).result_rows]


def recs_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop recs``."""
    from perfloop.demo import format_table
    from perfloop.settings import ActuatorSettings

    out = out or sys.stdout
    if not 1 <= args.limit <= 100_000:
        raise PerfloopError(f"--limit {args.limit} is outside [1, 100000]")
    settings = load_settings(ActuatorSettings)
    # a pending recommendation past the approval horizon can no longer be approved: expired
    cutoff = time.time_ns() - int(settings.approval_ttl_s * 1e9)
    where, params = [], {"limit": args.limit, "cutoff": cutoff}
    if args.job is not None:
        where.append("r.job_id = {job:String}")
        params["job"] = args.job
    if not args.all:
        where.append("a.outcome = 'pending' AND toUnixTimestamp64Nano(r.ts) >= {cutoff:Int64}")
    sql = (
        "SELECT r.ts, r.rec_id, r.job_id, r.knob, r.from_value, r.to_value, r.loop, "
        "round(r.expected_gain_pct, 1), round(r.confidence, 2), "
        "multiIf(a.outcome = '', 'undecided', a.outcome = 'pending' AND "
        "toUnixTimestamp64Nano(r.ts) < {cutoff:Int64}, 'expired', a.outcome), "
        "a.reason, a.command_id, r.rationale "
        "FROM (SELECT * FROM recommendations ORDER BY ts DESC LIMIT 1 BY rec_id) AS r "
        f"LEFT JOIN ({_LATEST}) AS a ON a.rec_id = r.rec_id "
        + (f"WHERE {' AND '.join(where)} " if where else "")
        + "ORDER BY r.ts DESC LIMIT {limit:UInt32}"
    )
    rows = _query(settings, sql, params)
    if args.json:
        docs = [dict(zip(_RECS_COLUMNS, row, strict=True)) for row in rows]
        print(json.dumps(docs, indent=2, default=str), file=out)
        return 0
    if not rows:
        scope = f" for job {args.job}" if args.job else ""
        what = "recommendations" if args.all else "recommendations pending approval"
        print(f"no {what}{scope}", file=out)
        return 0
    idx = [_RECS_COLUMNS.index(c) for c in _SHOWN]
    print(format_table(list(_SHOWN), [tuple(r[i] for i in idx) for r in rows]), file=out)
    return 0


def _stored_value(text: str, knob: str = "") -> Any:
    """A knob value as the tables keep it (text) back as the value it was (None for ''); the
    value of a hook knob (a node's name, e.g. "1e5" or "007") stays the text it is."""
    from perfloop.cli.config import parse_value
    from perfloop.schemas.knobs import HOOK_KNOBS

    if text == "":
        return None
    return text if knob in HOOK_KNOBS else parse_value(text)


def approve_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop approve`` and ``perfloop reject``."""
    from perfloop.actuators.service import SIGNING_KEY_ID
    from perfloop.cli.config import _author
    from perfloop.schemas import Approval
    from perfloop.settings import ActuatorSettings
    from perfloop.warehouse import unix_ns

    out = out or sys.stdout
    verdict = args.command
    settings = load_settings(ActuatorSettings)
    rec_id = args.rec_id
    found = _query(
        settings,
        "SELECT ts, job_id, knob, from_value, to_value, loop FROM recommendations "
        "WHERE rec_id = {id:String} LIMIT 1",
        {"id": rec_id},
    )
    if not found:
        decided = _query(
            settings, "SELECT count() FROM audit WHERE rec_id = {id:String}", {"id": rec_id}
        )
        if decided and decided[0][0]:
            # the decision and the recommendation reach the warehouse through different topics
            raise PerfloopError(
                f"recommendation {rec_id} has a decision but is not in the warehouse yet; "
                "try again shortly"
            )
        raise PerfloopError(f"no recommendation {rec_id!r} in the warehouse; see `perfloop recs`")
    ts, job_id, knob, from_text, to_text, loop = found[0]
    latest = _query(
        settings,
        "SELECT argMax(outcome, ts), argMax(reason, ts), count() FROM audit "
        "WHERE rec_id = {id:String}",
        {"id": rec_id},
    )
    outcome, reason, n = latest[0] if latest else ("", "", 0)
    if not n:
        raise PerfloopError(
            f"recommendation {rec_id} has no decision from the actuator yet; try again shortly"
        )
    if outcome != "pending":
        raise PerfloopError(
            f"recommendation {rec_id} is {outcome} ({reason}), not pending approval; "
            "only a job in tier approve waits for one"
        )
    age_s = (time.time_ns() - unix_ns(ts)) / 1e9
    if verdict == "approve" and age_s > settings.approval_ttl_s:
        raise PerfloopError(
            f"recommendation {rec_id} is {age_s:.0f} s old, past the {settings.approval_ttl_s:.0f}"
            " s an approval may act on (approval_ttl_s); it expired"
        )
    author = _author()
    sent_ns = time.time_ns()
    approval = Approval(
        ts_ns=sent_ns,
        job_id=job_id,
        node=socket.gethostname()[:255] or "cli",
        rank=-1,
        rec_id=rec_id,
        verdict=verdict,
        author=author,
        reason=args.reason,
        knob=knob,
        from_value=_stored_value(from_text, knob),
        to_value=_stored_value(to_text, knob),
        loop=loop,
        rec_ts_ns=unix_ns(ts),
        key_id=SIGNING_KEY_ID,
    )
    send_signed(settings, approval, f"{verdict} of {rec_id}")
    change = f"job {job_id}: {knob} {from_text} → {to_text}"
    print(f"{verdict} of recommendation {rec_id} sent ({change}) by {author}", file=out)
    if args.wait_s <= 0:
        return 0
    decision = _await_decision(settings, rec_id, author, sent_ns, args.wait_s)
    if decision is None:
        raise PerfloopError(
            f"no decision from the actuator within {args.wait_s:g} s (is it running? "
            "`perfloop status`); `perfloop recs --all` shows it once it comes"
        )
    outcome, reason, command_id = decision
    print(f"actuator: {outcome}: {reason}" + (f" (command {command_id})" if command_id else ""),
          file=out)  # fmt: skip
    if outcome not in _DONE[verdict]:
        raise PerfloopError(f"the actuator did not {verdict} it: {reason}")
    return 0


def send_signed(settings: Any, approval: Any, what: str) -> Any:
    """Sign ``approval`` with this person's key (``PERFLOOP_PRINCIPAL_KEY``, else the stack's
    owner key, else the shared key: `perfloop.actuators.trust.signed_by`) and publish it where
    the actuator reads recommendations (keyed by job); wait for the broker's acknowledgement.
    Return the signed approval; `BrokerError` (one line naming ``what``) if it was not delivered."""
    from perfloop.actuators.trust import signed_by
    from perfloop.cli.config import principal_key
    from perfloop.exceptions import BrokerError
    from perfloop.kafka import ping, producer
    from perfloop.schemas import encode_event
    from perfloop.schemas.topics import Topics

    approval = signed_by(approval, principal_key(settings),
                         shared_key=settings.signing_key.get_secret_value().encode())  # fmt: skip
    ping(settings)
    errors: list[str] = []
    p = producer(settings, **{"linger.ms": 0, "message.timeout.ms": 10_000})
    p.produce(
        Topics.RECOMMENDATIONS,
        key=approval.job_id.encode(),
        value=encode_event(approval),
        on_delivery=lambda err, _m: errors.append(err.str()) if err is not None else None,
    )
    if p.flush(15.0) or errors:
        why = errors[0] if errors else "no answer"
        raise BrokerError(f"{what} not delivered: {why} (see `perfloop status`)")
    return approval


def _await_decision(
    settings: Any, rec_id: str, author: str, sent_ns: int, wait_s: float
) -> tuple[str, str, str] | None:
    """The actuator's decision about this person's verdict, once it is in the warehouse."""
    deadline = time.monotonic() + wait_s
    # the actor is the author, or "principal: author" where a roster checked the signature
    sql = (
        "SELECT outcome, reason, command_id FROM audit WHERE rec_id = {id:String} "
        "AND (actor = {author:String} OR endsWith(actor, concat(': ', {author:String}))) "
        "AND ts >= fromUnixTimestamp64Nano({since:Int64}) "
        "ORDER BY ts DESC LIMIT 1"
    )
    # A decision is stamped with the actuator's clock: allow it a minute behind this one.
    params = {"id": rec_id, "author": author, "since": sent_ns - 60 * 1_000_000_000}
    while True:
        rows = _query(settings, sql, params)
        if rows:
            outcome, reason, command_id = rows[0]
            return str(outcome), str(reason), str(command_id)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.25)
