"""The job agent: runs inside the training process and applies commands at step boundaries.

A background thread consumes ``perfloop.control``, keeps the commands addressed to its job,
and checks each one — signature, expiry, sequence (no replays), knob known and value within
bounds — failing closed: a command that does not pass changes nothing and is acked as
rejected with its reason. Commands that pass wait in a queue until the training loop calls
`JobAgent.step_boundary`, which applies them through the registered knob handlers and acks
each on ``perfloop.actuations``. Nothing here ever raises into the training loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka import KafkaError

from perfloop.actuators.service import KNOB_BOUNDS
from perfloop.actuators.signing import verify
from perfloop.catalog import Topics
from perfloop.kafka import consumer, producer
from perfloop.schemas import (
    ActuationResult,
    Command,
    KnobValue,
    SchemaError,
    decode_event,
    encode_event,
)
from perfloop.settings import BaseServiceSettings

__all__ = ["JobAgent", "KnobHandler"]

log = logging.getLogger("perfloop.agent")

KnobHandler = Callable[[KnobValue], None]


class JobAgent:
    """Applies verified commands for ``job_id`` through ``handlers`` (knob name → setter)."""

    def __init__(
        self,
        settings: BaseServiceSettings,
        *,
        job_id: str,
        node: str,
        signing_key: bytes,
        handlers: dict[str, KnobHandler],
        on_result: Callable[[ActuationResult], None] | None = None,
    ) -> None:
        self.job_id, self.node = job_id, node
        self._key = signing_key
        self._handlers = dict(handlers)
        self._on_result = on_result
        # Each agent reads the control topic from its start; a group per agent instance.
        self._consumer = consumer(
            settings,
            f"perfloop-agent-{job_id}-{uuid.uuid4().hex[:8]}",
            **{"auto.offset.reset": "latest"},
        )
        self._producer = producer(settings, **{"linger.ms": 0})
        self._ready: queue.Queue[Command] = queue.Queue()
        self._last_seq = 0
        self._stop = threading.Event()
        self._assigned = threading.Event()
        self._thread = threading.Thread(target=self.run, name="perfloop-agent", daemon=True)
        self.results: list[ActuationResult] = []

    # -- service -----------------------------------------------------------------------------
    def start(self, wait_assigned_s: float = 15.0) -> bool:
        """Start consuming; return True once the control topic is assigned."""
        self._consumer.subscribe(
            [Topics.CONTROL], on_assign=lambda c, parts: self._on_assign(c, parts)
        )
        self._thread.start()
        return self._assigned.wait(wait_assigned_s)

    def _on_assign(self, c: object, parts: list[object]) -> None:
        self._assigned.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._producer.flush(5)

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(0.1)
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("control consumer error: %s", msg.error())
                    continue
                if msg.key() not in (None, self.job_id.encode()):
                    continue
                self.receive(msg.value() or b"")
        finally:
            self._consumer.close()

    # -- checks and application --------------------------------------------------------------
    def receive(self, data: bytes, *, now_ns: int | None = None) -> str | None:
        """Check one control message; queue it, or ack it as rejected. Returns the reason."""
        try:
            cmd = decode_event(data)
        except SchemaError as e:
            log.warning("rejected unreadable control message: %s", e)
            return str(e)
        if not isinstance(cmd, Command) or cmd.job_id != self.job_id:
            return None
        reason = self.check(cmd, now_ns=time.time_ns() if now_ns is None else now_ns)
        if reason:
            self._ack(cmd, "rejected", reason, step=0)
            return reason
        self._last_seq = cmd.seq
        self._ready.put(cmd)
        return None

    def check(self, cmd: Command, *, now_ns: int) -> str:
        """Why the command must not be applied, or "" if it may."""
        if not verify(cmd, self._key):
            return "signature does not verify"
        if cmd.expires_ts_ns <= now_ns:
            return f"expired {(now_ns - cmd.expires_ts_ns) / 1e9:.1f} s ago"
        if cmd.seq <= self._last_seq:
            return f"sequence {cmd.seq} already seen (last {self._last_seq})"
        if cmd.knob not in self._handlers:
            return (
                f"knob {cmd.knob!r} is not handled by this job; handled: {sorted(self._handlers)}"
            )
        bounds = KNOB_BOUNDS.get(cmd.knob)
        if bounds is not None and (
            isinstance(cmd.value, bool | str) or not bounds[0] <= cmd.value <= bounds[1]
        ):
            return f"{cmd.knob}={cmd.value!r} is outside [{bounds[0]:g}, {bounds[1]:g}]"
        return ""

    def step_boundary(self, step: int) -> list[ActuationResult]:
        """Apply every queued command now (call between two steps); never raises."""
        applied = []
        while True:
            try:
                cmd = self._ready.get_nowait()
            except queue.Empty:
                break
            try:
                self._handlers[cmd.knob](cmd.value)
            except Exception as e:  # a failing handler must not break training
                applied.append(self._ack(cmd, "rejected", f"handler failed: {e!r}", step=step))
            else:
                applied.append(self._ack(cmd, "applied", "", step=step))
        return applied

    def _ack(self, cmd: Command, status: str, reason: str, *, step: int) -> ActuationResult:
        result = ActuationResult(
            ts_ns=time.time_ns(),
            job_id=self.job_id,
            node=self.node,
            rank=-1,
            command_id=cmd.event_id,
            status=status,  # type: ignore[arg-type]
            reason=reason,
            knob=cmd.knob,
            value=cmd.value,
            step=step,
        )
        self.results.append(result)
        try:
            self._producer.produce(
                Topics.ACTUATIONS, key=self.job_id.encode(), value=encode_event(result)
            )
            self._producer.poll(0)
        except Exception as e:  # BufferError/KafkaException: report, never raise into training
            log.warning("cannot publish actuation result: %s", e)
        if self._on_result is not None:
            self._on_result(result)
        return result
