"""The actuator service: recommendations and approvals in, signed commands and decisions out.

It reads ``perfloop.recommendations`` (the stream tier's `Recommendation` events and people's
`Approval` events, keyed by job so a job's approval follows its recommendation) and, from
``perfloop.control``, the ``ConfigChange`` events addressed to it (target ``actuator``: a
job's tier, dry run and limits; `perfloop.actuators.policy`), and from
``perfloop.telemetry.job`` each job's `JobInfo` (the knob ranges its hardware allows). For
each recommendation and approval, `Policy` decides; the service signs the command it issues
(HMAC-SHA256 with the job's own key when ``job_signing_keys`` has one, key id ``job:<id>``,
else key ``default``) and publishes it on ``perfloop.control``, and publishes the `Decision`
(issued, pending, refused with the reason, …) on ``perfloop.actuations``, from where the sink
lands it in the ``audit`` table. Offsets are committed after both are delivered (at least
once; the job agent drops a replayed command by its sequence number). Before the policy sees
them, recommendations, approvals and settings pass the checks of `perfloop.actuators.trust`
(the stream tier's signature; a roster principal's, within their role): what fails them
changes nothing, and its refusal is published as a decision like any other.

From ``perfloop.actuations`` it reads the jobs' verdicts: once the last command for a knob
was judged ``kept``, that knob's cooldown is over, so a rule that grows a knob one verified
step at a time (loader workers that wait on storage) is not held for ``cooldown_s``.

From ``perfloop.telemetry.job`` it also takes each job's end (its launcher's lifecycle event,
rank -1): the recommendations and approvals of a job that ended are refused ("job ended") and
its state is freed ``ended_job_retention_s`` later (`Policy.sweep`).

A recommendation for a hook knob (``cluster.drain_node``: a straggler's node) is never sent to
the job: when the job's tier lets it through (``auto``, or ``approve`` once a person approved
it), the service runs the operator's action hook (``straggler_hook``,
`perfloop.actuators.hook`) on a thread of its own, so a slow hook holds up no other job, and
publishes the decision once the hook is done: ``issued`` with its exit code and the first line
of its output, or ``refused`` with why it failed ("action hook failed: exit 3: …", timed
out, cannot run). With no hook configured such recommendations are recorded with the reason.
A hook runs at most once per job and node, ``straggler_hook_max_per_hour`` times an hour.

The settings it was given live are read back from the warehouse (``config_changes``) when it
starts, so a restarted service keeps each job's tier; a change published in the second before
a restart, not yet in the warehouse, is lost (it can be set again). So are the jobs that ended
in the last day (``job_lifecycle``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from perfloop.actuators._stored import stored_settings
from perfloop.actuators.hook import render, run_hook
from perfloop.actuators.policy import HOOK_KNOBS, KNOB_BOUNDS, JobRules, Policy
from perfloop.actuators.signing import check_signature, sign, verify
from perfloop.actuators.trust import Gate, refusal
from perfloop.bad_input import Failed, OnError, decide, skip_policy
from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, KeyringFile, PrivateKey, TrustedKey
from perfloop.kafka import consumer, dlq_headers, producer
from perfloop.roster import RosterFile
from perfloop.schemas import (
    ActuationResult,
    Approval,
    Command,
    ConfigChange,
    Decision,
    JobInfo,
    JobLifecycle,
    Recommendation,
    SchemaError,
    decode_event,
    encode_event,
)
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings

__all__ = ["KNOB_BOUNDS", "ActuatorService", "JobRules", "Policy"]

log = logging.getLogger("perfloop.actuator")

SIGNING_KEY_ID = "default"
PENDING_HOOKS = 1000
"""Hook recommendations waiting for approval remembered (their ranks and reason)."""


def _rules(settings: ActuatorSettings) -> JobRules:
    return JobRules(
        tier=settings.tier,
        dry_run=settings.dry_run,
        min_gain_pct=settings.min_gain_pct,
        cooldown_s=settings.cooldown_s,
        max_commands_per_min=settings.max_commands_per_min,
    )


class ActuatorService:
    """Consumes recommendations and approvals, decides with `Policy`, publishes signed
    commands and every decision."""

    def __init__(self, settings: ActuatorSettings, *, on_error: OnError = skip_policy) -> None:
        self.settings = settings
        self.on_error = on_error
        """What to do with a message that does not decode (`perfloop.bad_input`)."""
        self._key = settings.signing_key.get_secret_value().encode()
        self._private = (
            PrivateKey.load(settings.signing_private_key)
            if settings.signing_private_key is not None
            else None
        )
        self._own_ring: Keyring | None = None  # the keys whose commands count as its own
        if self._private is not None:
            ring = Keyring.load(settings.command_keyring) if settings.command_keyring else Keyring()
            ring.keys[self._private.key_id] = TrustedKey.of(self._private.public_bytes(), "self")
            self._own_ring = ring
        self.policy = Policy(
            _rules(settings),
            ttl_s=settings.command_ttl_s,
            approval_ttl_s=settings.approval_ttl_s,
            keys={SIGNING_KEY_ID: self._key},
            action_hook=bool(settings.straggler_hook.strip()),
            hook_max_per_hour=settings.straggler_hook_max_per_hour,
            ended_retention_s=settings.ended_job_retention_s,
        )
        ring, roster = settings.recommendation_keyring, settings.roster
        self.gate = Gate(
            recommenders=KeyringFile(ring) if ring is not None else None,
            roster=RosterFile(roster) if roster is not None else None,
        )
        """What a recommendation, an approval or a setting must be to be taken (`trust`)."""
        self._stop = threading.Event()
        self._consumer = consumer(
            settings,
            settings.group_id,
            **{
                "session.timeout.ms": settings.session_timeout_ms,
                "fetch.wait.max.ms": settings.fetch_max_wait_ms,
            },
        )
        self._producer = producer(settings)
        self.issued = 0
        self.decisions = 0
        # hook recommendations pending approval, by id: what the hook is told when approved
        self._pending_hooks: collections.OrderedDict[str, Recommendation] = (
            collections.OrderedDict()
        )
        self._actions: queue.Queue[tuple[list[str], Decision] | None] = queue.Queue()
        self._hook_thread: threading.Thread | None = None

    def start(self) -> None:
        self.load_settings()
        self.load_ended_jobs()
        self._consumer.subscribe(
            [Topics.RECOMMENDATIONS, Topics.CONTROL, Topics.JOB, Topics.ACTUATIONS],
            on_assign=self._on_assign,
        )

    def _on_assign(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        """Partitions given to this service (at its start, or moved from another actuator of
        the group): before any of their messages is handled, read back what was acted on in
        them (`recall`)."""
        ours = [p for p in partitions if p.topic in (Topics.CONTROL, Topics.ACTUATIONS)]
        if ours and self.settings.recall_s > 0:
            self.recall(ours)
        log.info("assigned %d partition(s)", len(partitions))

    def recall(self, partitions: list[TopicPartition], *, timeout_s: float = 15.0) -> int:
        """Read the commands and decisions (and the jobs' verdicts) of the last ``recall_s`` in
        ``partitions`` of ``perfloop.control`` and ``perfloop.actuations``, up to their ends as
        they are now, into the policy (`Policy.observe_command`, `observe_decision`,
        `observe_verdict`): the commands first, then the rest, so a verdict meets its command.
        The topics are the record of what was acted on: the service publishes a command and its
        decision before it commits the recommendation's offset, so a recommendation it (or the
        actuator before it) acted on and did not commit is found here when it comes again.
        Returns the events read; a broker that does not answer in ``timeout_s`` leaves what was
        read (one line in the log)."""
        since_ms = (time.time_ns() // 1_000_000) - int(self.settings.recall_s * 1000)
        reader = consumer(self.settings, f"perfloop-actuator-recall-{uuid.uuid4().hex[:12]}",
                          **{"enable.partition.eof": False})  # fmt: skip
        events: dict[str, list[Any]] = {Topics.CONTROL: [], Topics.ACTUATIONS: []}
        deadline = time.monotonic() + timeout_s
        try:
            asked = [TopicPartition(p.topic, p.partition, since_ms) for p in partitions]
            starts = reader.offsets_for_times(asked, timeout=timeout_s)
            todo: dict[tuple[str, int], int] = {}
            begin = []
            for tp in starts:
                low, high = reader.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=timeout_s
                )
                if tp.error is not None:  # no lookup by time: all of it, filtered by time
                    offset = low
                elif tp.offset < 0:  # nothing at or after the time
                    continue
                else:
                    offset = tp.offset
                if offset < high:
                    todo[(tp.topic, tp.partition)] = high
                    begin.append(TopicPartition(tp.topic, tp.partition, offset))
            reader.assign(begin)
            while todo and time.monotonic() < deadline:
                msg = reader.poll(0.2)
                if msg is None or msg.error():
                    continue
                where = (msg.topic(), msg.partition())
                if msg.timestamp()[1] >= since_ms:
                    with contextlib.suppress(SchemaError):
                        events[msg.topic()].append(decode_event(msg.value() or b""))
                if where in todo and msg.offset() + 1 >= todo[where]:
                    del todo[where]
            if todo:
                log.warning(
                    "recall: %d partition(s) not read to their end in %.0f s; what was acted "
                    "on there may be acted on again", len(todo), timeout_s,
                )  # fmt: skip
        except KafkaException as e:
            log.warning("recall: the broker did not answer (%s); what was acted on before may "
                        "be acted on again", e.args[0].str() if e.args else e)  # fmt: skip
        finally:
            reader.close()
        ignored = 0
        for ev in events[Topics.CONTROL]:
            if isinstance(ev, Command):
                if self.signed_here(ev):
                    self.policy.observe_command(ev)
                else:
                    ignored += 1
        if ignored:
            log.warning("recall: %d command(s) on the topic not signed with this actuator's "
                        "keys left out", ignored)  # fmt: skip
        for ev in events[Topics.ACTUATIONS]:
            if isinstance(ev, Decision):
                self.policy.observe_decision(ev)
            elif isinstance(ev, ActuationResult):
                self.policy.observe_verdict(ev)
        n = sum(len(v) for v in events.values())
        log.info(
            "recall: %d command(s), %d decision(s) and verdict(s) of the last %.0f s read back "
            "from %d partition(s)", len(events[Topics.CONTROL]), len(events[Topics.ACTUATIONS]),
            self.settings.recall_s, len(partitions),
        )  # fmt: skip
        return n

    def stop(self) -> None:
        self._stop.set()

    def wait_actions(self, timeout_s: float) -> bool:
        """Wait until every hook run asked for is done and its decision published."""
        deadline = time.monotonic() + timeout_s
        while self._actions.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._actions.unfinished_tasks

    def run(self) -> None:
        self.start()
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(0.2)
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("consumer error: %s", msg.error())
                    continue
                self.handle(msg.value() or b"", msg.topic(), partition=msg.partition(),
                            offset=msg.offset(), key=msg.key())  # fmt: skip
                if msg.topic() in (Topics.JOB, Topics.ACTUATIONS):  # nothing published for it
                    self._consumer.commit(message=msg, asynchronous=True)
                    continue
                self._producer.flush(10)
                self._consumer.commit(message=msg, asynchronous=False)
        finally:
            self._consumer.close()
            if self._hook_thread is not None:  # a hook running now ends (or is killed) first
                self._actions.put(None)
                self._hook_thread.join(self.settings.straggler_hook_timeout_s + 10)
            self._producer.flush(5)

    def load_settings(self) -> int:
        """Apply the actuator settings changed live before this start (``config_changes``, in
        order; those `_stored` says may be); return how many. A warehouse that cannot be read
        is logged, not fatal."""
        try:
            changes = stored_settings(self.settings, self.gate)
        except Exception as e:  # no warehouse (yet), no table yet: start with the defaults
            log.warning("actuator starts without its live settings from the warehouse: %s", e)
            return 0
        applied = 0
        for change in changes:
            try:
                self.policy.configure(change)
                applied += 1
            except ConfigError as e:
                log.warning("skipping stored actuator setting %s: %s", change.event_id, e)
        if applied:
            log.info("applied %d actuator settings changed before this start", applied)
        return applied

    def load_ended_jobs(self) -> int:
        """Take the jobs that ended in the last day from the warehouse (``job_lifecycle``, rank
        -1), so a restarted service refuses them too; return how many ended."""
        from perfloop.warehouse import query

        try:
            rows = query(
                self.settings,
                "SELECT job_id, argMax(state, ts), argMax(exit_code, ts) FROM job_lifecycle "
                "WHERE rank = -1 AND ts >= now() - INTERVAL 1 DAY GROUP BY job_id",
            ).result_rows
        except Exception as e:  # no warehouse (yet): the ends come from the topic
            log.warning("actuator starts without the jobs that ended before it: %s", e)
            return 0
        now = time.time_ns()
        for job_id, state, code in rows:
            try:
                event = JobLifecycle(ts_ns=now, job_id=job_id, node="warehouse", rank=-1,
                                     state=state, exit_code=code)  # fmt: skip
            except ValueError as e:  # a row this version cannot read: skip it
                log.warning("skipping the stored lifecycle of job %r: %s", job_id, e)
                continue
            self.policy.observe_lifecycle(event, now_ns=now)
        return sum(bool(self.policy.ended(job_id)) for job_id, _, _ in rows)

    def handle(
        self,
        data: bytes,
        topic: str = Topics.RECOMMENDATIONS,
        *,
        partition: int = -1,
        offset: int = -1,
        key: bytes | None = None,
    ) -> Command | None:
        """Decide on one message; publish the command if one is issued, and the decision.

        A message that does not decode is left to `on_error` (`perfloop.bad_input`): skipped,
        by default, with one line in the log, since the sink, which reads every topic the
        actuator reads, dead-letters it."""
        try:
            ev = decode_event(data)
        except SchemaError as e:
            action, why = decide(self.on_error, e, Failed(topic, partition, offset, key, data), log)
            if action == "dead_letter":
                headers = dlq_headers(why, topic, partition, offset)
                self._producer.produce(Topics.DLQ, key=key, value=data, headers=headers)
            return None
        now = time.time_ns()
        for job_id in self.policy.sweep(now):  # ended a while ago: forget what it left here
            for rec_id in [r for r, rec in self._pending_hooks.items() if rec.job_id == job_id]:
                del self._pending_hooks[rec_id]
        if isinstance(ev, ConfigChange):
            self._configure(ev, now)
            return None
        if isinstance(ev, JobInfo):
            self.policy.observe_info(ev)
            return None
        if isinstance(ev, JobLifecycle):
            self.policy.observe_lifecycle(ev, now_ns=now)
            return None
        if isinstance(ev, ActuationResult):  # a job's verdict ends its knob's cooldown
            if self.policy.observe_verdict(ev):
                log.info("%s kept %s (command %s): its cooldown is over", ev.job_id, ev.knob,
                         ev.command_id)  # fmt: skip
            if ev.status == "rejected":  # a command the job refused: on record in audit too
                self._publish(Topics.ACTUATIONS, refused_at_job(ev, self.policy.rules(ev.job_id)))
            return None
        if isinstance(ev, Command):  # issued here, or by another actuator of the group
            if self.signed_here(ev):
                self.policy.observe_command(ev)
            else:
                log.warning("a command for %s (seq %d) not signed with this actuator's keys: "
                            "not counted as acted on", ev.job_id, ev.seq)  # fmt: skip
            return None
        if isinstance(ev, Decision):
            self.policy.observe_decision(ev)
            return None
        if isinstance(ev, Recommendation | Approval):
            who, why = self.gate.check(ev, now_ns=now)
            if why:
                self._refuse(ev, who, why, now)
                return None
        rec: Recommendation | None = None
        if isinstance(ev, Recommendation):
            cmd, decision = self.policy.decide(ev, now_ns=now)
            rec = ev
            if ev.knob in HOOK_KNOBS and decision.outcome == "pending":
                self._pending_hooks[ev.event_id] = ev
                while len(self._pending_hooks) > PENDING_HOOKS:
                    self._pending_hooks.popitem(last=False)
        elif isinstance(ev, Approval):
            by = who if self.gate.roster is not None else ""
            cmd, decision = self.policy.approve(ev, now_ns=now, verified_by=by)
            if decision.outcome != "refused":  # acted on (or rejected): no longer pending
                rec = self._pending_hooks.pop(ev.rec_id, None)
        else:  # commands (its own, on the control topic) and anything else
            return None
        log.info(
            "%s %s for %s (%s %s -> %s) by %s: %s: %s",
            ev.KIND,
            decision.rec_id,
            ev.job_id,
            decision.knob,
            decision.from_value,
            decision.to_value,
            decision.actor,
            decision.outcome,
            decision.reason,
        )
        if cmd is not None and cmd.knob in HOOK_KNOBS:  # not for the job: the hook, apart
            self._act(cmd, decision, rec)
            return None
        if cmd is not None:
            key_id, key = self.signing_key_for(cmd.job_id)
            cmd = sign(cmd.model_copy(update={"key_id": key_id}), key)
            if not self._publish(Topics.CONTROL, cmd):
                decision = decision.model_copy(
                    update={"outcome": "refused", "reason": "the command could not be published"}
                )
                cmd = None
            else:
                self.issued += 1
        if self._publish(Topics.ACTUATIONS, decision):
            self.decisions += 1
        return cmd

    # -- the action hook ---------------------------------------------------------------------
    def _act(self, cmd: Command, decision: Decision, rec: Recommendation | None) -> None:
        """Have the hook run for ``cmd`` on the hook thread; its decision is published there."""
        try:
            argv = render(self.settings.straggler_hook, hook_values(cmd, rec))
        except ConfigError as e:
            refused = decision.model_copy(update={"outcome": "refused", "reason": str(e)[:1000]})
            if self._publish(Topics.ACTUATIONS, refused):
                self.decisions += 1
            return
        if self._hook_thread is None:
            self._hook_thread = threading.Thread(
                target=self._run_actions, name="perfloop-action-hook", daemon=True
            )
            self._hook_thread.start()
        self._actions.put((argv, decision))

    def _run_actions(self) -> None:
        while True:
            item = self._actions.get()
            try:
                if item is None:
                    return
                argv, decision = item
                result = run_hook(argv, self.settings.straggler_hook_timeout_s)
                what = f"{decision.knob} = {decision.to_value}"
                if result.ok:
                    update = {"reason": f"action hook ran for {what}: {result.describe()}"}
                else:
                    why = f"action hook failed for {what}: {result.describe()}"
                    update = {"outcome": "refused", "reason": why}
                decision = decision.model_copy(update={**update, "ts_ns": time.time_ns()})
                log.info("action hook for %s of job %s: %s", what, decision.job_id,
                         decision.reason)  # fmt: skip
                if self._publish(Topics.ACTUATIONS, decision):
                    self.decisions += 1
                    self._producer.flush(10)
            except Exception as e:  # the next hook run, and the service, go on
                log.error("action hook run failed: %r", e)
            finally:
                self._actions.task_done()

    def signed_here(self, cmd: Command) -> bool:
        """Whether a command read back from ``perfloop.control`` was signed with this
        actuator's keys (its private key's, or an actuator key before it in
        ``command_keyring``, as trusted when it was signed; else the shared key it signs the
        job's commands with). Only those count as acted on: a command anyone else put on the
        topic — a forgery the job refuses, or one whose sequence number would push the job's
        sequence out of reach — changes nothing here."""
        if self._own_ring is not None:
            return check_signature(cmd, key=None, keyring=self._own_ring, now_ns=cmd.ts_ns) == ""
        _, key = self.signing_key_for(cmd.job_id)
        return isinstance(key, bytes) and verify(cmd, key)

    def signing_key_for(self, job_id: str) -> tuple[str, bytes | PrivateKey]:
        """``(key id, key)`` a job's commands are signed with: the actuator's private key when
        it has one, else the job's own shared key when it has one, else the shared key."""
        if self._private is not None:
            return self._private.key_id, self._private
        own = self.settings.job_signing_keys.get(job_id)
        if own is not None:
            return f"job:{job_id}", own.get_secret_value().encode()
        return SIGNING_KEY_ID, self._key

    def _configure(self, change: ConfigChange, now: int) -> None:
        if change.target != "actuator":
            return
        who, why = self.gate.check(change, now_ns=now)
        if not why:
            try:
                old, new = self.policy.configure(change)
            except ConfigError as e:
                why = str(e)
        if why:  # one line in the log, and the refusal in audit
            self._refuse(change, who, why, now)
            return
        scope = "every job" if change.applies_to == "*" else f"job {change.applies_to}"
        by = f"{who}: {change.author}" if self.gate.roster is not None else change.author
        log.info("%s for %s: %r -> %r (by %s)", change.key, scope, old, new, by)

    def _refuse(self, ev: Recommendation | Approval | ConfigChange, who: str, why: str,
                now: int) -> None:  # fmt: skip
        """Record ``ev`` refused by the checks of `trust` (or a setting the policy refused)."""
        job = ev.applies_to if isinstance(ev, ConfigChange) else ev.job_id
        decision = refusal(ev, tier=self.policy.rules(job).tier, reason=why, actor=who,
                           now_ns=now)  # fmt: skip
        log.warning("%s %s refused (claimed by %s): %s", ev.KIND, ev.event_id, who, why)
        if self._publish(Topics.ACTUATIONS, decision):
            self.decisions += 1

    def _publish(self, topic: str, event: Command | Decision) -> bool:
        try:
            self._producer.produce(topic, key=event.job_id.encode(), value=encode_event(event))
        except (KafkaException, BufferError) as e:
            log.error("cannot publish %s %s: %s", event.KIND, event.event_id, e)
            return False
        return True


def refused_at_job(ack: ActuationResult, rules: Any) -> Decision:
    """The `audit` row of a command a job refused (forged, tampered, replayed, expired, out of
    its bounds, a knob it does not have): the job's reason, which names the key a signature
    claimed; its id is made from the ack's (``refused-<ack id>``), so it lands once however
    often the ack is read.

    >>> from perfloop.actuators.policy import JobRules
    >>> ack = ActuationResult(ts_ns=5, job_id="j", node="n", rank=0, command_id="c1",
    ...                       status="rejected", reason="unsigned: it carries no signature",
    ...                       knob="torch.num_threads")
    >>> d = refused_at_job(ack, JobRules())
    >>> d.outcome, d.actor, d.command_id, d.event_id == f"refused-{ack.event_id}"
    ('refused', 'job j (node n, rank 0)', 'c1', True)
    >>> d.reason
    'the job refused command c1: unsigned: it carries no signature'
    """
    return Decision(
        ts_ns=ack.ts_ns,
        event_id=f"refused-{ack.event_id}"[:64],
        job_id=ack.job_id,
        node=ack.node,
        rank=ack.rank,
        command_id=ack.command_id,
        knob=ack.knob,
        to_value=ack.value,
        tier=rules.tier,
        outcome="refused",
        reason=f"the job refused command {ack.command_id}: {ack.reason}"[:1000],
        actor=f"job {ack.job_id} (node {ack.node}, rank {ack.rank})"[:256],
    )


def hook_values(cmd: Command, rec: Recommendation | None) -> dict[str, str]:
    """What the action hook's placeholders stand for: the node, the job, the ranks named in the
    recommendation's evidence (``rank``), its id and its rationale (one line, at most 200
    characters); without the recommendation (approved after a restart), what the command
    says."""
    node = str(cmd.value)
    ranks: set[int] = set()
    reason = f"straggler on {node}"
    if rec is not None:
        ranks = {int(v) for k, v in rec.evidence.items() if k == "rank" and 0 <= v < 1 << 20}
        if rec.rank >= 0:
            ranks.add(rec.rank)
        reason = " ".join(rec.rationale.split())[:200].lstrip("- ") or reason
    return {
        "node": node,
        "job": cmd.job_id,
        "ranks": ",".join(str(r) for r in sorted(ranks)),
        "rec_id": cmd.rec_id,
        "reason": reason,
    }
