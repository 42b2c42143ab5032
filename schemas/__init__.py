"""perfloop's event schemas: the contract between producers, streams and actuators.

Every event is a frozen pydantic model with ``schema_version``, ``event_id``, integer
nanosecond event time ``ts_ns``, ``job_id``, ``node`` and ``rank``, and units in its field
names. Telemetry travels in columnar batches (`BatchBuilder`, `decode_batch`); control
events travel one per message (`encode_event`, `decode_event`). Bad input raises
`SchemaError` with a one-line message naming the field and the value.
"""

from perfloop.schemas.base import Event, new_event_id, now_ns
from perfloop.schemas.codec import (
    BATCH_KINDS,
    EVENT_KINDS,
    Batch,
    BatchBuilder,
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
)
from perfloop.schemas.control import ActuationResult, Command, KnobValue, Recommendation
from perfloop.schemas.exceptions import SchemaError
from perfloop.schemas.telemetry import GpuSample, StepEvent

__all__ = [
    "BATCH_KINDS",
    "EVENT_KINDS",
    "ActuationResult",
    "Batch",
    "BatchBuilder",
    "Command",
    "Event",
    "GpuSample",
    "KnobValue",
    "Recommendation",
    "SchemaError",
    "StepEvent",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
    "new_event_id",
    "now_ns",
]
