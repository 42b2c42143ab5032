"""The actuator service: recommendations in, signed commands out on ``perfloop.control``.

Per job it applies the automation tier (``observe`` and ``recommend`` issue nothing; ``auto``
issues a command), the knob allow-list and its bounds, and a per-knob cooldown. Commands carry
a per-job monotonic sequence number, an expiry and an HMAC-SHA256 signature. Offsets are
committed after the command is delivered (at least once; the job agent drops replays by
sequence number).
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import KafkaError, KafkaException

from perfloop.actuators.signing import sign
from perfloop.catalog import Topics
from perfloop.kafka import consumer, producer
from perfloop.schemas import Command, Recommendation, SchemaError, decode_event, encode_event
from perfloop.settings import ActuatorSettings

__all__ = ["KNOB_BOUNDS", "ActuatorService", "Policy"]

log = logging.getLogger("perfloop.actuator")

# Knobs the fast loop may change, with their inclusive bounds.
KNOB_BOUNDS: dict[str, tuple[float, float]] = {
    "dataloader.num_workers": (0, 64),
    "dataloader.prefetch_factor": (1, 64),
    "gpu.power_limit_w": (100, 700),  # per-device NVML limits narrow it (optimization tier)
}


class Policy:
    """Pure decision: turn a recommendation into a command, or say why not.

    >>> p = Policy(tier="auto", cooldown_s=30, ttl_s=60)
    >>> rec = Recommendation(ts_ns=0, job_id="j", node="n", rank=-1, knob="dataloader.num_workers",
    ...     from_value=2, to_value=5, loop="fast", expected_gain_pct=40, confidence=0.9,
    ...     rationale="r")
    >>> cmd, why = p.decide(rec, now_ns=10**18)
    >>> cmd.value, cmd.rec_id == rec.event_id, why
    (5, True, 'issued')
    >>> p.decide(rec, now_ns=10**18 + 1)[1]
    'cooldown: dataloader.num_workers changed 0 s ago (minimum 30 s)'
    """

    TIERS = ("observe", "recommend", "approve", "auto")

    def __init__(self, *, tier: str, cooldown_s: float, ttl_s: float) -> None:
        if tier not in self.TIERS:
            raise ValueError(f"unknown automation tier {tier!r}; valid: {list(self.TIERS)}")
        self.tier = tier
        self.cooldown_ns = int(cooldown_s * 1e9)
        self.ttl_ns = int(ttl_s * 1e9)
        self._seq: dict[str, int] = {}
        self._last_change: dict[tuple[str, str], int] = {}

    def next_seq(self, job_id: str, now_ns: int) -> int:
        # Monotonic across restarts without stored state: microseconds since the epoch.
        seq = max(self._seq.get(job_id, 0) + 1, now_ns // 1000)
        self._seq[job_id] = seq
        return seq

    def decide(self, rec: Recommendation, *, now_ns: int) -> tuple[Command | None, str]:
        if self.tier in ("observe", "recommend"):
            return None, f"tier {self.tier}: no command issued"
        if self.tier == "approve":
            return None, "tier approve: waiting for approval"
        bounds = KNOB_BOUNDS.get(rec.knob)
        if bounds is None:
            return None, f"knob {rec.knob!r} is not allowed; allowed: {sorted(KNOB_BOUNDS)}"
        value = rec.to_value
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None, f"{rec.knob} target {value!r} is not a number"
        if not bounds[0] <= value <= bounds[1]:
            return None, f"{rec.knob} target {value} is outside [{bounds[0]:g}, {bounds[1]:g}]"
        key = (rec.job_id, rec.knob)
        last = self._last_change.get(key)
        if last is not None and self.cooldown_ns and now_ns - last < self.cooldown_ns:
            return None, (
                f"cooldown: {rec.knob} changed {(now_ns - last) / 1e9:.0f} s ago "
                f"(minimum {self.cooldown_ns / 1e9:.0f} s)"
            )
        self._last_change[key] = now_ns
        cmd = Command(
            ts_ns=now_ns,
            job_id=rec.job_id,
            node=rec.node,
            rank=-1,
            rec_id=rec.event_id,
            seq=self.next_seq(rec.job_id, now_ns),
            knob=rec.knob,
            from_value=rec.from_value,
            value=value,
            loop=rec.loop,
            expires_ts_ns=now_ns + self.ttl_ns,
        )
        return cmd, "issued"


class ActuatorService:
    """Consumes recommendations, decides with `Policy`, publishes signed commands."""

    def __init__(self, settings: ActuatorSettings) -> None:
        self.settings = settings
        self.policy = Policy(
            tier=settings.tier, cooldown_s=settings.cooldown_s, ttl_s=settings.command_ttl_s
        )
        self._key = settings.signing_key.get_secret_value().encode()
        self._stop = threading.Event()
        self._consumer = consumer(
            settings, settings.group_id, **{"session.timeout.ms": settings.session_timeout_ms}
        )
        self._producer = producer(settings)
        self.issued = 0

    def start(self) -> None:
        self._consumer.subscribe([Topics.RECOMMENDATIONS])

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
                self.handle(msg.value() or b"")
                self._producer.flush(10)
                self._consumer.commit(message=msg, asynchronous=False)
        finally:
            self._consumer.close()
            self._producer.flush(5)

    def handle(self, data: bytes) -> Command | None:
        """Decide on one recommendation message; publish the command if one is issued."""
        try:
            rec = decode_event(data)
        except SchemaError as e:
            log.warning("ignoring bad recommendation: %s", e)
            return None
        if not isinstance(rec, Recommendation):
            log.warning("ignoring %s event on %s", rec.KIND, Topics.RECOMMENDATIONS)
            return None
        cmd, why = self.policy.decide(rec, now_ns=time.time_ns())
        log.info(
            "recommendation %s for %s (%s -> %s): %s",
            rec.event_id,
            rec.job_id,
            rec.from_value,
            rec.to_value,
            why,
        )
        if cmd is None:
            return None
        cmd = sign(cmd, self._key)
        try:
            self._producer.produce(Topics.CONTROL, key=cmd.job_id.encode(), value=encode_event(cmd))
        except KafkaException as e:
            log.error("cannot publish command %s: %s", cmd.event_id, e)
            return None
        self.issued += 1
        return cmd
