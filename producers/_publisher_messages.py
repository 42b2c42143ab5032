"""The messages `perfloop.producers.publisher.Publisher` carries (private to it): one accepted
message (`Rec`), one handed to the producer and why (`Sent`), one acknowledged and kept to
resend (`Kept`); why a message is sent and the publisher's two modes; which Kafka errors end a
message for good; and how many samples a message holds (`count_samples`)."""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError

from perfloop.producers.spool import Position
from perfloop.schemas.arrow_batch import arrow_rows, is_arrow

__all__ = [
    "NEW",
    "NORMAL",
    "NO_TOPIC",
    "PROBE",
    "PURGED",
    "REFUSED",
    "REPLAY",
    "RESEND",
    "SPOOLING",
    "TOPIC_ATTEMPTS",
    "Kept",
    "Rec",
    "Sent",
    "count_samples",
]

# Why a message goes to the producer: new, out of the spool, again after the broker lost it,
# or again to find out whether it did (a probe).
NEW, REPLAY, RESEND, PROBE = 0, 1, 2, 3
NORMAL, SPOOLING = "normal", "spooling"

# Refused by the client or the broker for good: retrying cannot help.
REFUSED = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_TIMESTAMP,
        KafkaError.INVALID_REQUIRED_ACKS,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError._INVALID_ARG,
        KafkaError._INVALID_TYPE,
    }
)
# The topic does not exist (yet: a restarted broker gets its topics back in a moment).
NO_TOPIC = frozenset({KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART})
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
TOPIC_ATTEMPTS = 5  # replays of one message to a missing topic before it counts as failed


class Rec:
    """One accepted message (or one read back from the spool)."""

    __slots__ = ("key", "pos", "samples", "seq", "topic", "value")

    def __init__(self, seq: int, topic: str, key: bytes, value: bytes) -> None:
        self.seq, self.topic, self.key, self.value = seq, topic, key, value
        self.samples = -1  # counted only when needed (spooling, dropping)
        self.pos: Position | None = None  # replayed: the spool position just after it

    def sample_count(self) -> int:
        if self.samples < 0:
            self.samples = count_samples(self.value)
        return self.samples


@dataclass(slots=True)
class Kept:  # an acknowledged message kept to resend if the broker loses it
    rec: Rec
    partition: int
    offset: int
    incarnation: int
    at: float


@dataclass(slots=True)
class Sent:  # one message handed to the producer, and why
    rec: Rec
    kind: int
    kept: Kept | None = None  # a resent one: its entry in the kept tail


def count_samples(value: bytes) -> int:
    """Samples in a message: the rows of a batch (Arrow, or the length of a JSON batch's
    ``ts_ns`` column), else 1."""
    if is_arrow(value):
        return arrow_rows(value)
    i = value.find(b'"ts_ns":[')
    if i < 0:
        return 1
    start = i + 9
    end = value.find(b"]", start)
    if end <= start:
        return 0 if end == start else 1
    return value.count(b",", start, end) + 1
