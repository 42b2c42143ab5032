"""An example service on the typed client (`perfloop.client`): it approves the
recommendations worth taking, so a person only sees the doubtful ones.

A job in tier ``approve`` (``perfloop config set actuator.tier approve --job JOB``) has each
of its recommendations held by the actuator until someone approves it (``perfloop approve``,
docs/actuation.md). This service is that someone for the clear cases: it follows the
recommendations and the actuator's decisions, and when the actuator puts a recommendation
pending, it approves it if its expected gain and confidence reach ``--min-gain`` and
``--min-confidence`` (a signed `Approval`, like ``perfloop approve``), and otherwise leaves it
for a person (``perfloop recs``). It prints one line per recommendation and per verdict.

    python -m perfloop.examples.approver --min-gain 10 --min-confidence 0.7 [--job JOB]

At least once: it reads in a consumer group (``--group``), and commits only when everything
it has read is handled (no recommendation waiting for the actuator's decision), so after a
restart it reads again what it had not finished; approving a recommendation twice is
harmless (the actuator refuses the second: "already issued"). A recommendation whose
decision never comes is given up after the actuator's approval horizon (``approval_ttl_s``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from collections import OrderedDict
from typing import Any

from perfloop.client import Follower
from perfloop.exceptions import BrokerError, PerfloopError
from perfloop.identity import PrivateKey
from perfloop.schemas import Approval, Decision, Event, Recommendation, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings, load_settings

__all__ = ["Approver", "approval_for", "main", "worth"]

NS = 1_000_000_000


def worth(rec: Recommendation, *, min_gain_pct: float, min_confidence: float) -> str:
    """Why ``rec`` is not worth approving unasked ("" when it is).

    >>> r = Recommendation(ts_ns=1, job_id="j", node="n", rank=-1, knob="k", from_value=1,
    ...                    to_value=2, loop="fast", expected_gain_pct=12.0, confidence=0.8,
    ...                    rationale="")
    >>> worth(r, min_gain_pct=10, min_confidence=0.7), worth(r, min_gain_pct=20, min_confidence=0)
    ('', 'expected gain 12% < 20%')
    """
    if rec.expected_gain_pct < min_gain_pct:
        return f"expected gain {rec.expected_gain_pct:.0f}% < {min_gain_pct:g}%"
    if rec.confidence < min_confidence:
        return f"confidence {rec.confidence:.2f} < {min_confidence:g}"
    return ""


def approval_for(
    rec: Recommendation, *, key: bytes | PrivateKey, key_id: str, author: str, reason: str
) -> Approval:
    """The signed approval of ``rec``, as ``perfloop approve`` would send it: with a person's
    private key (expiring, for an actuator with a roster), or under the shared key."""
    from perfloop.actuators.trust import signed_by

    appr = Approval(
        ts_ns=time.time_ns(),
        job_id=rec.job_id,
        node=socket.gethostname()[:255] or "approver",
        rank=-1,
        rec_id=rec.event_id,
        verdict="approve",
        author=author,
        reason=reason,
        knob=rec.knob,
        from_value=rec.from_value,
        to_value=rec.to_value,
        loop=rec.loop,
        rec_ts_ns=rec.ts_ns,
        key_id=key_id,
    )
    if isinstance(key, PrivateKey):
        return signed_by(appr, key)
    return signed_by(appr, None, shared_key=key)


class Approver:
    """Follows recommendations and decisions; approves the pending ones worth it."""

    def __init__(
        self,
        settings: ActuatorSettings,
        *,
        min_gain_pct: float,
        min_confidence: float,
        jobs: list[str] | None = None,
        group: str = "perfloop-example-approver",
        dry_run: bool = False,
        say: Any = print,
    ) -> None:
        from perfloop.actuators.service import SIGNING_KEY_ID
        from perfloop.kafka import producer

        self.settings, self.say, self.dry_run = settings, say, dry_run
        self.min_gain_pct, self.min_confidence = min_gain_pct, min_confidence
        self.author = f"approver@{socket.gethostname()}"
        path = settings.principal_key_path  # its own key, else the shared one
        own = PrivateKey.load(path) if path is not None else None
        self.key: bytes | PrivateKey = own or settings.signing_key.get_secret_value().encode()
        self.key_id = SIGNING_KEY_ID
        self.approved = 0
        self.left = 0
        # recommendations read whose decision has not come yet, and decisions read whose
        # recommendation has not (the two travel on different topics)
        self._recs: OrderedDict[str, Recommendation] = OrderedDict()
        self._pending: dict[str, Decision] = {}
        self._producer = producer(settings, **{"linger.ms": 0, "message.timeout.ms": 10_000})
        self.events = Follower(settings, jobs=jobs, kinds=[Recommendation, Decision], group=group)

    def handle(self, ev: Event) -> None:
        """Take one event; approve (or leave) a recommendation once both it and the
        actuator's "pending" decision about it are in."""
        if isinstance(ev, Recommendation):
            self.say(
                f"recommendation {ev.event_id} for {ev.job_id}: {ev.knob} {ev.from_value} → "
                f"{ev.to_value}, expected {ev.expected_gain_pct:+.0f}%, "
                f"confidence {ev.confidence:.2f}"
            )
            decision = self._pending.pop(ev.event_id, None)
            if decision is not None:
                self._decide(ev)
            else:
                self._recs[ev.event_id] = ev
        elif isinstance(ev, Decision) and ev.rec_id and ev.actor == "actuator":
            rec = self._recs.pop(ev.rec_id, None)
            if ev.outcome != "pending":
                return  # the actuator decided itself (another tier), or refused it
            if rec is not None:
                self._decide(rec)
            else:
                self._pending[ev.rec_id] = ev
        self._forget_old()

    def _decide(self, rec: Recommendation) -> None:
        why = worth(rec, min_gain_pct=self.min_gain_pct, min_confidence=self.min_confidence)
        if why:
            self.left += 1
            self.say(f"  left for a person ({why}): perfloop approve {rec.event_id}")
            return
        if self.dry_run:
            self.say(f"  would approve {rec.event_id} (dry run)")
            return
        reason = f"expected {rec.expected_gain_pct:+.0f}%, confidence {rec.confidence:.2f}"
        appr = approval_for(rec, key=self.key, key_id=self.key_id, author=self.author,
                            reason=reason)  # fmt: skip
        errors: list[str] = []
        self._producer.produce(
            Topics.RECOMMENDATIONS,
            key=rec.job_id.encode(),
            value=encode_event(appr),
            on_delivery=lambda err, _m: errors.append(err.str()) if err is not None else None,
        )
        if self._producer.flush(15.0) or errors:
            self.say(f"  approval of {rec.event_id} not delivered: {errors[:1] or 'no answer'}")
            return
        self.approved += 1
        self.say(f"  approved {rec.event_id} ({reason})")

    def _forget_old(self) -> None:
        """Give up what can no longer be approved (past the approval horizon)."""
        horizon = time.time_ns() - int(self.settings.approval_ttl_s * NS)
        while self._recs and next(iter(self._recs.values())).ts_ns < horizon:
            self._recs.popitem(last=False)
        for rec_id in [r for r, d in self._pending.items() if d.ts_ns < horizon]:
            del self._pending[rec_id]

    @property
    def busy(self) -> bool:
        """Something read is not handled yet (a recommendation or decision awaits the other)."""
        return bool(self._recs or self._pending)

    def run(self, seconds: float | None = None) -> None:
        """Handle events until ``seconds`` have passed (None: until `stop`);
        commit whenever nothing read is left unhandled."""
        end = None if seconds is None else time.monotonic() + seconds
        while not self.events.closed and (end is None or time.monotonic() < end):
            left = 1.0 if end is None else max(0.0, min(1.0, end - time.monotonic()))
            ev = self.events.poll(left)
            if ev is not None:
                self.handle(ev)
            if not self.busy:
                try:
                    self.events.commit()
                except BrokerError as e:  # read again after a restart: at least once still
                    self.say(f"approver: {e}")

    def stop(self) -> None:
        """End `run` within a fraction of a second (safe from a signal handler)."""
        self.events.stop()

    def close(self) -> None:
        self.events.close()
        self._producer.flush(5.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perfloop.examples.approver", description=__doc__)
    p.add_argument("--min-gain", type=float, default=10.0, metavar="PCT", help="(10)")
    p.add_argument("--min-confidence", type=float, default=0.7, metavar="C", help="(0.7)")
    p.add_argument("--job", action="append", metavar="JOB", help="these jobs only (repeatable)")
    p.add_argument("--group", default="perfloop-example-approver", help="consumer group")
    p.add_argument("--seconds", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--dry-run", action="store_true", help="say what it would approve, only")
    args = p.parse_args(argv)
    try:
        settings = load_settings(ActuatorSettings)
        approver = Approver(
            settings,
            min_gain_pct=args.min_gain,
            min_confidence=args.min_confidence,
            jobs=args.job,
            group=args.group,
            dry_run=args.dry_run,
            say=lambda line: print(line, flush=True),
        )
    except PerfloopError as e:
        print(f"approver: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting
        return 0
    print(
        f"approver: following recommendations of {', '.join(args.job or ['every job'])} in "
        f"group {args.group}; approving gain >= {args.min_gain:g}% and confidence >= "
        f"{args.min_confidence:g}",
        flush=True,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop cleanly: `Follower.stop`
        signal.signal(sig, lambda _sig, _frame: approver.stop())
    try:
        approver.run(args.seconds)
    except PerfloopError as e:
        print(f"approver: {e}", file=sys.stderr)
        return 1
    finally:
        approver.close()
    print(f"approver: {approver.approved} approved, {approver.left} left for a person", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
