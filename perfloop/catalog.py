"""The catalog: every topic and every warehouse table, with versioned migrations.

Topics are keyed by ``job_id`` so all ranks of a job meet in one partition. Tables are
MergeTree, partitioned by day, ordered by ``(job_id, rank, ts)``, with a deduplication window
so that a retried insert carrying the same ``insert_deduplication_token`` lands once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KIND_TABLES", "KIND_TOPICS", "MIGRATIONS", "TABLES", "TOPICS", "Migration", "Topics"]


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
    "recommendation": Topics.RECOMMENDATIONS,
    "command": Topics.CONTROL,
    "actuation": Topics.ACTUATIONS,
    "phase": Topics.PHASES,
    "diagnosis": Topics.DIAGNOSES,
    "config": Topics.CONTROL,
}

# The table each event kind lands in (the sink picks it by the message's kind).
KIND_TABLES: dict[str, str] = {
    "gpu": "gpu_samples",
    "host": "host_samples",
    "step": "steps",
    "span": "spans",
    "collective": "collectives",
    "kernel": "kernel_summaries",
    "job_info": "job_info",
    "lifecycle": "job_lifecycle",
    "capability": "capabilities",
    "producer": "producer_stats",
    "ground_truth": "ground_truth",
    "recommendation": "recommendations",
    "command": "commands",
    "actuation": "actuations",
    "phase": "phases",
    "diagnosis": "diagnoses",
    "config": "config_changes",
}

# Tables the sink fills, by the topic they come from (a topic may carry several kinds).
TABLES: dict[str, tuple[str, ...]] = {}
for _kind, _topic in KIND_TOPICS.items():
    TABLES[_topic] = (*TABLES.get(_topic, ()), KIND_TABLES[_kind])
TABLES[Topics.WINDOWS] = ("windows",)

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


def _add_columns(table: str, columns: str) -> str:
    adds = ",\n".join(
        f"    ADD COLUMN IF NOT EXISTS {line.strip().rstrip(',')}"
        for line in columns.strip().splitlines()
    )
    return f"ALTER TABLE {table}\n{adds}"


MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        2,
        "observation tier: full telemetry catalog, job events, ground truth",
        (
            _add_columns(
                "gpu_samples",
                """power_limit_w Float32,
    energy_mj UInt64,
    mem_clock_mhz Float32,
    throttle_reasons UInt64,
    pcie_rx_bytes_per_s Float64,
    pcie_tx_bytes_per_s Float64,
    nvlink_rx_bytes_per_s Float64,
    nvlink_tx_bytes_per_s Float64,
    ecc_sbe_total UInt64,
    ecc_dbe_total UInt64,
    xid_events UInt32,
    last_xid UInt32,
    process_mem_bytes UInt64""",
            ),
            _add_columns(
                "steps",
                """epoch UInt32,
    samples UInt64,
    tokens UInt64,
    grad_accum_steps UInt32 DEFAULT 1,
    loss Nullable(Float64),
    grad_norm Nullable(Float64),
    lr Nullable(Float64),
    mem_allocated_bytes UInt64,
    mem_reserved_bytes UInt64,
    mem_peak_bytes UInt64,
    rss_bytes UInt64""",
            ),
            _table(
                "host_samples",
                """    pid UInt32,
    proc_cpu_pct Float32,
    proc_rss_bytes UInt64,
    proc_threads UInt32,
    sys_cpu_pct Float32,
    sys_iowait_pct Float32,
    load_avg_1m Float32,
    sys_mem_used_bytes UInt64,
    sys_mem_total_bytes UInt64,
    disk_read_bytes_per_s Float64,
    disk_write_bytes_per_s Float64,
    net_rx_bytes_per_s Float64,
    net_tx_bytes_per_s Float64,
    loader_workers UInt16,
    loader_cpu_pct Float32,
    loader_rss_bytes UInt64""",
                raw=True,
            ),
            _table(
                "spans",
                """    step UInt64,
    phase LowCardinality(String),
    name LowCardinality(String),
    duration_ms Float64,
    depth UInt8""",
                raw=True,
            ),
            _table(
                "collectives",
                """    step UInt64,
    op LowCardinality(String),
    size_bytes UInt64,
    group String,
    group_size UInt32,
    duration_ms Float64,
    dtype LowCardinality(String)""",
                raw=True,
            ),
            _table(
                "kernel_summaries",
                """    step UInt64,
    stream Int32,
    kernel_class LowCardinality(String),
    count UInt64,
    busy_ms Float64""",
                raw=True,
            ),
            _table(
                "job_info",
                """    model_name String,
    model_params UInt64,
    optimizer LowCardinality(String),
    parallelism LowCardinality(String),
    dp_size UInt32,
    tp_size UInt32,
    pp_size UInt32,
    precision LowCardinality(String),
    world_size UInt32,
    local_world_size UInt32,
    nodes UInt32,
    batch_size UInt32,
    grad_accum_steps UInt32,
    gpu_name LowCardinality(String),
    gpu_count UInt16,
    gpu_mem_bytes UInt64,
    cpu_count UInt32,
    host_mem_bytes UInt64,
    framework LowCardinality(String),
    framework_version String,
    cuda_version String,
    backend LowCardinality(String),
    command String,
    extra Map(String, String)""",
            ),
            _table(
                "job_lifecycle",
                """    state LowCardinality(String),
    exit_code Nullable(Int32),
    message String""",
            ),
            _table(
                "capabilities",
                """    component LowCardinality(String),
    available Bool,
    devices UInt16,
    signals Array(String),
    missing Array(String),
    reason String,
    details Map(String, String)""",
            ),
            _table(
                "producer_stats",
                """    producer_id String,
    samples UInt64,
    messages UInt64,
    published UInt64,
    spooled UInt64,
    replayed UInt64,
    dropped UInt64,
    dropped_samples UInt64,
    failed UInt64,
    resent UInt64,
    refused UInt64,
    in_flight UInt64,
    spool_bytes UInt64,
    cpu_time_ms Float64,
    overhead_pct Float64,
    rates_hz Map(String, Float64)""",
            ),
            _table(
                "ground_truth",
                """    scenario LowCardinality(String),
    fault LowCardinality(String),
    onset DateTime64(9, 'UTC'),
    end Nullable(DateTime64(9, 'UTC')),
    ranks Array(Int32),
    nodes Array(String),
    detail String""",
            ),
        ),
    ),
)
