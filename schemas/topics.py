"""The topics: their names, and the topic each event kind travels on.

Topics are keyed by ``job_id`` so all ranks of a job meet in one partition (DESIGN.md). A
producer publishes an event of kind ``k`` on ``KIND_TOPICS[k]``; the warehouse's tables for
each topic are `perfloop.warehouse.tables`'s.

>>> KIND_TOPICS["step"] == Topics.STEP, Topics.DLQ in TOPICS
(True, True)
"""

from __future__ import annotations

__all__ = ["KIND_TOPICS", "TOPICS", "Topics"]


class Topics:
    """Topic names (DESIGN.md)."""

    GPU = "perfloop.telemetry.gpu"
    HOST = "perfloop.telemetry.host"
    STEP = "perfloop.telemetry.step"
    SPAN = "perfloop.telemetry.span"
    JOB = "perfloop.telemetry.job"
    WINDOWS = "perfloop.windows"
    PHASES = "perfloop.phases"
    DIAGNOSES = "perfloop.diagnoses"
    PREDICTIONS = "perfloop.predictions"
    RECOMMENDATIONS = "perfloop.recommendations"
    CONTROL = "perfloop.control"
    ACTUATIONS = "perfloop.actuations"
    DLQ = "perfloop.dlq"
    STREAM_STATE = "perfloop.streams.state"  # the stream engines' snapshots, per partition


TOPICS: tuple[str, ...] = tuple(
    v for k, v in vars(Topics).items() if k.isupper() and isinstance(v, str)
)

# Where each event kind travels (producers publish with `KIND_TOPICS[kind]`).
KIND_TOPICS: dict[str, str] = {
    "gpu": Topics.GPU,
    "host": Topics.HOST,
    "step": Topics.STEP,
    "span": Topics.SPAN,
    "collective": Topics.SPAN,
    "kernel": Topics.SPAN,
    "job_info": Topics.JOB,
    "lifecycle": Topics.JOB,
    "capability": Topics.JOB,
    "producer": Topics.JOB,
    "ground_truth": Topics.JOB,
    "progress": Topics.JOB,
    "recommendation": Topics.RECOMMENDATIONS,
    "command": Topics.CONTROL,
    "actuation": Topics.ACTUATIONS,
    "approval": Topics.RECOMMENDATIONS,
    "decision": Topics.ACTUATIONS,
    "phase": Topics.PHASES,
    "diagnosis": Topics.DIAGNOSES,
    "prediction": Topics.PREDICTIONS,
    "config": Topics.CONTROL,
}
