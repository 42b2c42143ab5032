"""The warehouse's first three migrations: the tables as perfloop first made them (the thin
slice, the observation tier's telemetry catalog, the stream tier's tables with their rollups and
TTLs). `perfloop.warehouse.migrations` adds the later ones and is the module to import.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfloop.warehouse.rollups import (
    ROLLUPS,
    rollup_statements,
)
from perfloop.warehouse.tables import (
    RAW_TTL_DAYS,
    WINDOW_KEY,
    add_columns,
    create_table,
    modify_ttl,
)

__all__ = ["MIGRATIONS", "Migration"]


@dataclass(frozen=True, slots=True)
class Migration:
    """One versioned, idempotent warehouse change (every statement is `IF NOT EXISTS`)."""

    version: int
    name: str
    statements: tuple[str, ...]
    tuning: bool = False
    """Only tunes the server (settings): a server that does not know a setting skips it."""


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "thin slice: steps, gpu_samples, windows, recommendations, commands, actuations",
        (
            create_table(
                "steps",
                """    step UInt64,
    step_time_ms Float64,
    data_wait_ms Float64,
    batch_size UInt32,
    num_workers UInt16""",
                raw=True,
            ),
            create_table(
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
            create_table(
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
            create_table(
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
            create_table(
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
            create_table(
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


MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        2,
        "observation tier: full telemetry catalog, job events, ground truth",
        (
            add_columns(
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
            add_columns(
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
            create_table(
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
            create_table(
                "spans",
                """    step UInt64,
    phase LowCardinality(String),
    name LowCardinality(String),
    duration_ms Float64,
    depth UInt8""",
                raw=True,
            ),
            create_table(
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
            create_table(
                "kernel_summaries",
                """    step UInt64,
    stream Int32,
    kernel_class LowCardinality(String),
    count UInt64,
    busy_ms Float64""",
                raw=True,
            ),
            create_table(
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
            create_table(
                "job_lifecycle",
                """    state LowCardinality(String),
    exit_code Nullable(Int32),
    message String""",
            ),
            create_table(
                "capabilities",
                """    component LowCardinality(String),
    available Bool,
    devices UInt16,
    signals Array(String),
    missing Array(String),
    reason String,
    details Map(String, String)""",
            ),
            create_table(
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
            create_table(
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

# -- migration 3: stream tier tables, dead letters, windows v2, rollups, TTLs ----------------
#
# Retention (docs/tables.md): high-rate raw telemetry (gpu_samples, host_samples,
# spans, collectives, kernel_summaries) 7 days; steps, windows and dead_letters 30 days;
# rollups 1 s 30 days, 1 min 365 days, 1 h kept. Events (jobs, phases, diagnoses, changes,
# recommendations, commands, actuations) are small and kept.


_WINDOWS_LATEST = f"""CREATE VIEW IF NOT EXISTS windows_latest AS
SELECT
    {", ".join(WINDOW_KEY)},
    argMax(event_id, inserted) AS event_id,
    argMax(window_end, inserted) AS window_end,
    argMax(count, inserted) AS count,
    argMax(mean, inserted) AS mean,
    argMax(min, inserted) AS min,
    argMax(max, inserted) AS max,
    argMax(p50, inserted) AS p50,
    argMax(p95, inserted) AS p95,
    argMax(p99, inserted) AS p99,
    argMax(rate_per_s, inserted) AS rate_per_s,
    argMax(slope_per_s, inserted) AS slope_per_s,
    argMax(closed, inserted) AS closed,
    max(inserted) AS last_inserted
FROM windows
GROUP BY {", ".join(WINDOW_KEY)}"""

MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        3,
        "stream tier: phases, diagnoses, config changes, dead letters, windows v2, rollups, TTLs",
        (
            create_table(
                "phases",
                """    level LowCardinality(String),
    phase LowCardinality(String),
    previous LowCardinality(String),
    since DateTime64(9, 'UTC'),
    step UInt64,
    source LowCardinality(String),
    confidence Float32,
    duration_ms Float64,
    next_phase LowCardinality(String),
    next_ts Nullable(DateTime64(9, 'UTC'))""",
            ),
            create_table(
                "diagnoses",
                """    diagnosis_id String,
    bottleneck LowCardinality(String),
    level LowCardinality(String),
    loop LowCardinality(String),
    state LowCardinality(String),
    onset DateTime64(9, 'UTC'),
    step_share Float32,
    confidence Float32,
    critical_path Bool,
    explained_by LowCardinality(String),
    ranks Array(Int32),
    nodes Array(String),
    step UInt64,
    evidence Map(String, Float64),
    summary String""",
            ),
            create_table(
                "config_changes",
                """    target LowCardinality(String),
    applies_to String,
    key LowCardinality(String),
    value String,
    author String,
    reason String""",
            ),
            create_table(
                "dead_letters",
                """    topic LowCardinality(String),
    partition Int32,
    offset Int64,
    reason String,
    reason_class LowCardinality(String),
    key String,
    payload String,
    payload_bytes UInt64,
    headers Map(String, String)""",
            ).replace("SETTINGS", "TTL toDateTime(ts) + INTERVAL 30 DAY\nSETTINGS"),
            add_columns(
                "windows",
                """device Int32 DEFAULT -1,
    hop_s Float32,
    closed DateTime64(9, 'UTC'),
    inserted DateTime64(9, 'UTC') DEFAULT now64(9)""",
            ),
            _WINDOWS_LATEST,
            modify_ttl("windows", 30),
            *(
                modify_ttl(t, RAW_TTL_DAYS)
                for t in ("gpu_samples", "host_samples", "spans", "collectives", "kernel_summaries")
            ),
            *(s for source, keys, spec in ROLLUPS for s in rollup_statements(source, keys, spec)),
        ),
    ),
)
