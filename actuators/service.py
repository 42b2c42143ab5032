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
once; the job agent drops a replayed command by its sequence number).

From ``perfloop.telemetry.job`` it also takes each job's end (its launcher's lifecycle event,
rank -1): the recommendations and approvals of a job that ended are refused ("job ended") and
its state is freed ``ended_job_retention_s`` later (`Policy.sweep`).

The settings it was given live are read back from the warehouse (``config_changes``) when it
starts, so a restarted service keeps each job's tier; a change published in the second before
a restart, not yet in the warehouse, is lost (it can be set again). So are the jobs that ended
in the last day (``job_lifecycle``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from perfloop.actuators.policy import KNOB_BOUNDS, JobRules, Policy
from perfloop.actuators.signing import sign
from perfloop.catalog import Topics
from perfloop.exceptions import ConfigError
from perfloop.kafka import consumer, producer
from perfloop.schemas import (
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
from perfloop.settings import ActuatorSettings

__all__ = ["KNOB_BOUNDS", "ActuatorService", "JobRules", "Policy"]

log = logging.getLogger("perfloop.actuator")

SIGNING_KEY_ID = "default"


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

    def __init__(self, settings: ActuatorSettings) -> None:
        self.settings = settings
        self._key = settings.signing_key.get_secret_value().encode()
        self.policy = Policy(
            _rules(settings),
            ttl_s=settings.command_ttl_s,
            approval_ttl_s=settings.approval_ttl_s,
            keys={SIGNING_KEY_ID: self._key},
            ended_retention_s=settings.ended_job_retention_s,
        )
        self._stop = threading.Event()
        self._consumer = consumer(
            settings, settings.group_id, **{"session.timeout.ms": settings.session_timeout_ms}
        )
        self._producer = producer(settings)
        self.issued = 0
        self.decisions = 0

    def start(self) -> None:
        self.load_settings()
        self.load_ended_jobs()
        self._consumer.subscribe([Topics.RECOMMENDATIONS, Topics.CONTROL, Topics.JOB])

    def stop(self) -> None:
        self._stop.set()

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
                self.handle(msg.value() or b"", msg.topic())
                if msg.topic() == Topics.JOB:  # nothing published for it: no need to wait
                    self._consumer.commit(message=msg, asynchronous=True)
                    continue
                self._producer.flush(10)
                self._consumer.commit(message=msg, asynchronous=False)
        finally:
            self._consumer.close()
            self._producer.flush(5)

    def load_settings(self) -> int:
        """Apply the actuator settings changed live before this start (``config_changes``, in
        order); return how many. A warehouse that cannot be read is logged, not fatal."""
        from perfloop.warehouse import client, unix_ns

        try:
            ch = client(self.settings)
            try:
                rows = ch.query(
                    "SELECT ts, event_id, job_id, node, applies_to, key, value FROM "
                    "config_changes WHERE target = 'actuator' "
                    "ORDER BY ts, event_id LIMIT 1 BY event_id"
                ).result_rows
            finally:
                ch.close()
        except Exception as e:  # no warehouse (yet), no table yet: start with the defaults
            log.warning("actuator starts without its live settings from the warehouse: %s", e)
            return 0
        applied = 0
        for ts, event_id, job_id, node, applies_to, key, value in rows:
            change = ConfigChange(
                ts_ns=unix_ns(ts),
                event_id=event_id,
                job_id=job_id,
                node=node,
                rank=-1,
                target="actuator",
                applies_to=applies_to,
                key=key,
                value=_stored(value),
            )
            try:
                self.policy.configure(change)
                applied += 1
            except ConfigError as e:
                log.warning("skipping stored actuator setting %s: %s", event_id, e)
        if applied:
            log.info("applied %d actuator settings changed before this start", applied)
        return applied

    def load_ended_jobs(self) -> int:
        """Take the jobs that ended in the last day from the warehouse (``job_lifecycle``, rank
        -1), so a restarted service refuses them too; return how many ended."""
        from perfloop.warehouse import client

        try:
            ch = client(self.settings)
            try:
                rows = ch.query(
                    "SELECT job_id, argMax(state, ts), argMax(exit_code, ts) FROM job_lifecycle "
                    "WHERE rank = -1 AND ts >= now() - INTERVAL 1 DAY GROUP BY job_id"
                ).result_rows
            finally:
                ch.close()
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

    def handle(self, data: bytes, topic: str = Topics.RECOMMENDATIONS) -> Command | None:
        """Decide on one message; publish the command if one is issued, and the decision."""
        try:
            ev = decode_event(data)
        except SchemaError as e:
            log.warning("ignoring a bad message on %s: %s", topic, e)
            return None
        now = time.time_ns()
        self.policy.sweep(now)  # jobs that ended a while ago: forget what they left here
        if isinstance(ev, ConfigChange):
            self._configure(ev)
            return None
        if isinstance(ev, JobInfo):
            self.policy.observe_info(ev)
            return None
        if isinstance(ev, JobLifecycle):
            self.policy.observe_lifecycle(ev, now_ns=now)
            return None
        if isinstance(ev, Recommendation):
            cmd, decision = self.policy.decide(ev, now_ns=now)
        elif isinstance(ev, Approval):
            cmd, decision = self.policy.approve(ev, now_ns=now)
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

    def signing_key_for(self, job_id: str) -> tuple[str, bytes]:
        """``(key id, key)`` a job's commands are signed with: its own when it has one."""
        own = self.settings.job_signing_keys.get(job_id)
        if own is not None:
            return f"job:{job_id}", own.get_secret_value().encode()
        return SIGNING_KEY_ID, self._key

    def _configure(self, change: ConfigChange) -> None:
        if change.target != "actuator":
            return
        try:
            old, new = self.policy.configure(change)
        except ConfigError as e:
            log.warning("refused actuator setting %s: %s", change.event_id, e)
            return
        scope = "every job" if change.applies_to == "*" else f"job {change.applies_to}"
        log.info("%s for %s: %r -> %r (by %s)", change.key, scope, old, new, change.author)

    def _publish(self, topic: str, event: Command | Decision) -> bool:
        try:
            self._producer.produce(topic, key=event.job_id.encode(), value=encode_event(event))
        except (KafkaException, BufferError) as e:
            log.error("cannot publish %s %s: %s", event.KIND, event.event_id, e)
            return False
        return True


def _stored(value: str) -> Any:
    """A value as ``config_changes`` keeps it (strings as they are, the rest as JSON)."""
    import orjson

    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
