"""perfloop's event schemas: the contract between producers, streams and actuators.

Every event is a frozen pydantic model with ``schema_version``, ``event_id``, integer
nanosecond event time ``ts_ns``, ``job_id``, ``node`` and ``rank``, and units in its field
names. The catalog:

- telemetry, batched per node in columnar messages (`BatchBuilder`, `decode_batch`):
  `GpuSample`, `HostSample`, `StepEvent`, `PhaseSpan`, `CollectiveOp`, `KernelSummary`;
- job-level events, one per message (`encode_event`, `decode_event`): `JobInfo`,
  `JobLifecycle`, `CapabilityReport`, `ProducerStats`, `GroundTruth`, and `RankProgress`
  (where a rank is inside an unusually long step);
- control events: `Recommendation`, `Approval`, `Command`, `ActuationResult`, and the
  actuator's `Decision` about each;
- stream-tier conclusions and live changes: `PhaseChange`, `Diagnosis`, `Prediction`,
  `ConfigChange`.

Bad input raises `SchemaError` with a one-line message naming the field and the value.
`export_json_schemas` writes JSON Schema for consumers in other languages.
"""

from perfloop.schemas.analysis import (
    BOTTLENECKS,
    FUNNEL_LEVELS,
    RUN_PHASES,
    ConfigChange,
    Diagnosis,
    PhaseChange,
    Prediction,
)
from perfloop.schemas.base import Event, new_event_id, now_ns
from perfloop.schemas.codec import (
    BATCH_KINDS,
    EVENT_KINDS,
    MAX_MESSAGE_BYTES,
    WIRE_FORMATS,
    Batch,
    BatchBuilder,
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    is_batch,
)
from perfloop.schemas.control import (
    AUTOMATION_TIERS,
    DECISION_OUTCOMES,
    ActuationResult,
    Approval,
    Command,
    Decision,
    KnobValue,
    Recommendation,
)
from perfloop.schemas.exceptions import SchemaError
from perfloop.schemas.export import export_json_schemas
from perfloop.schemas.job import (
    FAULT_KINDS,
    CapabilityReport,
    FaultKind,
    GroundTruth,
    JobInfo,
    JobLifecycle,
    ProducerStats,
    RankProgress,
)
from perfloop.schemas.telemetry import (
    COLLECTIVE_OPS,
    KERNEL_CLASSES,
    P2P_OPS,
    STANDARD_PHASES,
    CollectiveOp,
    GpuSample,
    HostSample,
    KernelSummary,
    PhaseSpan,
    StepEvent,
)

__all__ = [
    "AUTOMATION_TIERS",
    "BATCH_KINDS",
    "BOTTLENECKS",
    "COLLECTIVE_OPS",
    "DECISION_OUTCOMES",
    "EVENT_KINDS",
    "FAULT_KINDS",
    "FUNNEL_LEVELS",
    "KERNEL_CLASSES",
    "MAX_MESSAGE_BYTES",
    "P2P_OPS",
    "RUN_PHASES",
    "STANDARD_PHASES",
    "WIRE_FORMATS",
    "ActuationResult",
    "Approval",
    "Batch",
    "BatchBuilder",
    "CapabilityReport",
    "CollectiveOp",
    "Command",
    "ConfigChange",
    "Decision",
    "Diagnosis",
    "Event",
    "FaultKind",
    "GpuSample",
    "GroundTruth",
    "HostSample",
    "JobInfo",
    "JobLifecycle",
    "KernelSummary",
    "KnobValue",
    "PhaseChange",
    "PhaseSpan",
    "Prediction",
    "ProducerStats",
    "RankProgress",
    "Recommendation",
    "SchemaError",
    "StepEvent",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_event",
    "export_json_schemas",
    "is_batch",
    "new_event_id",
    "now_ns",
]
