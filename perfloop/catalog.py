"""The catalog: every topic and every warehouse table, with versioned migrations.

Topics are keyed by ``job_id`` so all ranks of a job meet in one partition. Tables are
MergeTree, partitioned by day, ordered by ``(job_id, rank, ts)``, with a deduplication window
so that a retried insert carrying the same ``insert_deduplication_token`` lands once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIGRATIONS", "TABLES", "TOPICS", "Migration", "Topics"]


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


TOPICS: tuple[str, ...] = tuple(
    v for k, v in vars(Topics).items() if k.isupper() and isinstance(v, str)
)

# Tables the sink fills, by the topic they come from.
TABLES: dict[str, str] = {
    Topics.STEP: "steps",
    Topics.GPU: "gpu_samples",
    Topics.WINDOWS: "windows",
    Topics.RECOMMENDATIONS: "recommendations",
    Topics.CONTROL: "commands",
    Topics.ACTUATIONS: "actuations",
}

_MERGE_TREE = """ENGINE = MergeTree
PARTITION BY toDate(ts)
ORDER BY (job_id, rank, ts)
{ttl}SETTINGS non_replicated_deduplication_window = 10000"""

_RAW_TTL = "TTL toDateTime(ts) + INTERVAL 30 DAY\n"
_COMMON = """    ts DateTime64(9, 'UTC'),
    event_id String,
    job_id LowCardinality(String),
    node LowCardinality(String),
    rank Int32,"""


@dataclass(frozen=True, slots=True)
class Migration:
    """One versioned, idempotent warehouse change (every statement is `IF NOT EXISTS`)."""

    version: int
    name: str
    statements: tuple[str, ...]


def _table(name: str, columns: str, *, raw: bool = False) -> str:
    engine = _MERGE_TREE.format(ttl=_RAW_TTL if raw else "")
    return f"CREATE TABLE IF NOT EXISTS {name} (\n{_COMMON}\n{columns}\n)\n{engine}"


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "thin slice: steps, gpu_samples, windows, recommendations, commands, actuations",
        (
            _table(
                "steps",
                """    step UInt64,
    step_time_ms Float64,
    data_wait_ms Float64,
    batch_size UInt32,
    num_workers UInt16""",
                raw=True,
            ),
            _table(
                "gpu_samples",
                """    device UInt16,
    sm_util_pct Float32,
    mem_util_pct Float32,
    mem_used_bytes UInt64,
    mem_total_bytes UInt64,
    power_w Float32,
    temp_c Float32,
    sm_clock_mhz Float32""",
                raw=True,
            ),
            _table(
                "windows",
                """    window_end DateTime64(9, 'UTC'),
    window_s Float32,
    metric LowCardinality(String),
    count UInt64,
    mean Float64,
    min Float64,
    max Float64,
    p50 Float64,
    p95 Float64,
    p99 Float64,
    rate_per_s Float64,
    slope_per_s Float64""",
            ),
            _table(
                "recommendations",
                """    rec_id String,
    knob LowCardinality(String),
    from_value String,
    to_value String,
    loop LowCardinality(String),
    expected_gain_pct Float64,
    confidence Float64,
    rationale String,
    evidence Map(String, Float64)""",
            ),
            _table(
                "commands",
                """    command_id String,
    rec_id String,
    seq UInt64,
    knob LowCardinality(String),
    from_value String,
    value String,
    loop LowCardinality(String),
    expires_ts DateTime64(9, 'UTC'),
    key_id String,
    signature String""",
            ),
            _table(
                "actuations",
                """    command_id String,
    status LowCardinality(String),
    reason String,
    knob LowCardinality(String),
    value String,
    step UInt64""",
            ),
        ),
    ),
)
