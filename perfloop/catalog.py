"""The catalog: every topic and every warehouse table, with versioned migrations.

Topics are keyed by ``job_id`` so all ranks of a job meet in one partition. Tables are
MergeTree, partitioned by day, ordered by ``(job_id, rank, ts)``, with a deduplication window
so that a retried insert carrying the same ``insert_deduplication_token`` lands once.
Raw telemetry is rolled up 1 s → 1 min → 1 h by materialized views (`perfloop._rollups`).
Migrations never change once released: a change is a new migration whose statements are
idempotent (``IF NOT EXISTS``, ``ADD COLUMN IF NOT EXISTS``, ``MODIFY TTL``).
"""

from __future__ import annotations

from dataclasses import dataclass

from perfloop._rollups import (
    ROLLUP_RESOLUTIONS,
    ROLLUP_SECONDS,
    ROLLUP_TTL_DAYS,
    ROLLUPS,
    legacy_rollup_statements,
    rollup_statements,
)
from perfloop.deprecation import moved
from perfloop.schemas.topics import KIND_TOPICS as _KIND_TOPICS
from perfloop.schemas.topics import Topics as _Topics

__all__ = [
    "DEAD_LETTER_PAYLOAD_BYTES",
    "KIND_TABLES",
    "MIGRATIONS",
    "RAW_TTL_DAYS",
    "ROLLUPS",
    "ROLLUP_RESOLUTIONS",
    "ROLLUP_SECONDS",
    "ROLLUP_TTL_DAYS",
    "TABLES",
    "WINDOW_KEY",
    "Migration",
]


__getattr__ = moved(
    __name__, {n: "perfloop.schemas.topics" for n in ("KIND_TOPICS", "TOPICS", "Topics")}
)

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
    "progress": "progress",
    "recommendation": "recommendations",
    "command": "commands",
    "actuation": "actuations",
    "approval": "approvals",
    "decision": "audit",
    "phase": "phases",
    "diagnosis": "diagnoses",
    "prediction": "predictions",
    "config": "config_changes",
}

# Tables the sink fills, by the topic they come from (a topic may carry several kinds).
TABLES: dict[str, tuple[str, ...]] = {}
for _kind, _topic in _KIND_TOPICS.items():
    TABLES[_topic] = (*TABLES.get(_topic, ()), KIND_TABLES[_kind])
TABLES[_Topics.WINDOWS] = ("windows",)

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
    tuning: bool = False
    """Only tunes the server (settings): a server that does not know a setting skips it."""


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

# -- migration 3: stream tier tables, dead letters, windows v2, rollups, TTLs ----------------
#
# Retention (README "The SQL tables"): high-rate raw telemetry (gpu_samples, host_samples,
# spans, collectives, kernel_summaries) 7 days; steps, windows and dead_letters 30 days;
# rollups 1 s 30 days, 1 min 365 days, 1 h kept. Events (jobs, phases, diagnoses, changes,
# recommendations, commands, actuations) are small and kept.

RAW_TTL_DAYS = 7
"""Days high-rate raw telemetry is kept (its 1 s / 1 min / 1 h rollups outlive it)."""
DEAD_LETTER_PAYLOAD_BYTES = 64 << 10
"""A dead letter's payload is stored up to this many bytes (``payload_bytes`` is the size)."""
WINDOW_KEY = ("job_id", "node", "rank", "device", "metric", "window_s", "hop_s", "ts")
"""The columns that identify one window row (a re-emitted window repeats them)."""


def _ttl(table: str, days: int) -> str:
    return f"ALTER TABLE {table}\n    MODIFY TTL toDateTime(ts) + INTERVAL {days} DAY"


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
            _table(
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
            _table(
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
            _table(
                "config_changes",
                """    target LowCardinality(String),
    applies_to String,
    key LowCardinality(String),
    value String,
    author String,
    reason String""",
            ),
            _table(
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
            _add_columns(
                "windows",
                """device Int32 DEFAULT -1,
    hop_s Float32,
    closed DateTime64(9, 'UTC'),
    inserted DateTime64(9, 'UTC') DEFAULT now64(9)""",
            ),
            _WINDOWS_LATEST,
            _ttl("windows", 30),
            *(
                _ttl(t, RAW_TTL_DAYS)
                for t in ("gpu_samples", "host_samples", "spans", "collectives", "kernel_summaries")
            ),
            *(s for source, keys, spec in ROLLUPS for s in rollup_statements(source, keys, spec)),
        ),
    ),
)

TABLES[_Topics.DLQ] = ("dead_letters",)  # the sink lands perfloop.dlq too


# -- migration 4: merge less often --------------------------------------------------------------
MERGE_SELECTOR_BASE = 20
"""How many parts of a size the merge selector gathers before merging them (ClickHouse's
default is 5). Every insert makes a part in each table it feeds; at the default, background
merges cost nearly as much CPU as the inserts themselves. At 20, merges cost 0.81 instead of
1.89 µs per row and the warehouse 1.38× less CPU in all, for more parts between merges (148
instead of 54 active parts over 28 tables after 40 one-second flushes; ClickHouse slows
inserts at 1,000 in a partition): `python bench/warehouse.py --sim-s 600`."""

_MERGE_TREE_TABLES = tuple(
    stmt.split("(", 1)[0].split()[-1]
    for m in MIGRATIONS
    for stmt in m.statements
    if stmt.startswith("CREATE TABLE IF NOT EXISTS") and "MergeTree" in stmt
)

MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        4,
        f"merge less often: merge_selector_base = {MERGE_SELECTOR_BASE} on every MergeTree table",
        tuple(
            f"ALTER TABLE {t} MODIFY SETTING merge_selector_base = {MERGE_SELECTOR_BASE}"
            for t in _MERGE_TREE_TABLES
        ),
        tuning=True,
    ),
)


# -- migration 5: predictions ------------------------------------------------------------------
_PREDICTION_ACCURACY = """CREATE VIEW IF NOT EXISTS prediction_accuracy AS
SELECT
    p.job_id AS job_id,
    p.rank AS rank,
    p.model AS model,
    p.target AS target,
    p.prediction_id AS prediction_id,
    p.ts AS predicted_at,
    p.step AS step,
    p.value AS predicted,
    p.baseline AS baseline,
    r.came AS realised,
    r.came_at AS realised_at,
    abs(p.value - r.came) AS abs_error,
    abs(p.value - r.came) / nullIf(abs(r.came), 0) AS ape,
    abs(p.baseline - r.came) / nullIf(abs(r.came), 0) AS baseline_ape
FROM
(
    SELECT job_id, rank, model, target, prediction_id, ts, step, value, baseline
    FROM predictions
    WHERE state = 'predicted'
    LIMIT 1 BY prediction_id
) AS p
INNER JOIN
(
    SELECT prediction_id, any(realised) AS came, min(ts) AS came_at
    FROM predictions
    WHERE state = 'realised' AND realised IS NOT NULL
    GROUP BY prediction_id
) AS r USING (prediction_id)"""

MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        5,
        "predictions: the online models' forecasts and realised values, and their accuracy",
        (
            _table(
                "predictions",
                """    prediction_id String,
    model LowCardinality(String),
    target LowCardinality(String),
    state LowCardinality(String),
    value Float64,
    realised Nullable(Float64),
    baseline Nullable(Float64),
    step UInt64,
    for_ts Nullable(DateTime64(9, 'UTC')),
    evidence Map(String, Float64),
    summary String""",
            ).replace("SETTINGS", "TTL toDateTime(ts) + INTERVAL 30 DAY\nSETTINGS"),
            _PREDICTION_ACCURACY,
        ),
    ),
    Migration(
        6,
        f"merge less often on predictions: merge_selector_base = {MERGE_SELECTOR_BASE}",
        (f"ALTER TABLE predictions MODIFY SETTING merge_selector_base = {MERGE_SELECTOR_BASE}",),
        tuning=True,
    ),
)


# -- migration 7: one rollup table per source -------------------------------------------------
# Migration 3 used to chain three tables per source (raw → 1 s → 1 min → 1 h), each fed by its
# own materialized view: three views and three parts per raw insert. It now makes one table
# (``{source}_rollups``, all three resolutions) and one view per source, with ``{source}_1s``,
# ``_1m`` and ``_1h`` as views over it; migration 7 converts a warehouse made the old way,
# keeping its rows, and changes nothing on one made the new way.
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        7,
        "rollups: one table and one materialized view per source instead of a chain of three",
        tuple(
            stmt
            for source, keys, spec in ROLLUPS
            for stmt in legacy_rollup_statements(source, keys, spec)
        ),
    ),
    Migration(
        8,
        f"merge less often on the rollup tables: merge_selector_base = {MERGE_SELECTOR_BASE}",
        tuple(
            f"ALTER TABLE {source}_rollups MODIFY SETTING merge_selector_base = "
            f"{MERGE_SELECTOR_BASE}"
            for source, _, _ in ROLLUPS
        ),
        tuning=True,
    ),
)


# -- migration 9: approvals and the actuator's audit trail ------------------------------------
# Every approval or rejection a person gives (``perfloop approve|reject``) and every decision the
# actuator takes about a recommendation or an approval, with its reason; kept like the other
# control tables.
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        9,
        "approvals and the actuator's audit trail",
        (
            _table(
                "approvals",
                """    rec_id String,
    verdict LowCardinality(String),
    author String,
    reason String,
    knob LowCardinality(String),
    from_value String,
    to_value String,
    loop LowCardinality(String),
    rec_ts DateTime64(9, 'UTC'),
    key_id String,
    signature String""",
            ),
            _table(
                "audit",
                """    rec_id String,
    command_id String,
    knob LowCardinality(String),
    from_value String,
    to_value String,
    loop LowCardinality(String),
    tier LowCardinality(String),
    outcome LowCardinality(String),
    reason String,
    actor String""",
            ),
        ),
    ),
    Migration(
        10,
        f"merge less often on approvals and audit: merge_selector_base = {MERGE_SELECTOR_BASE}",
        tuple(
            f"ALTER TABLE {t} MODIFY SETTING merge_selector_base = {MERGE_SELECTOR_BASE}"
            for t in ("approvals", "audit")
        ),
        tuning=True,
    ),
)


# -- migration 11: the verification of each change ----------------------------------------------
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        11,
        "actuations: the evidence a change was kept or rolled back on",
        (_add_columns("actuations", "evidence Map(String, Float64)"),),
    ),
)


# -- migration 12: where each rank is inside an unusually long step ------------------------------
# `RankProgress`: published by the training hooks while a step lasts much longer than the rank's
# recent ones (a hang, a long checkpoint save or evaluation, a rank waiting in a collective).
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        12,
        "progress: where each rank is inside an unusually long step",
        (
            _table(
                "progress",
                """    step UInt64,
    phase LowCardinality(String),
    op LowCardinality(String),
    since DateTime64(9, 'UTC'),
    step_start DateTime64(9, 'UTC')""",
            ),
        ),
    ),
    Migration(
        13,
        f"merge less often on progress: merge_selector_base = {MERGE_SELECTOR_BASE}",
        (f"ALTER TABLE progress MODIFY SETTING merge_selector_base = {MERGE_SELECTOR_BASE}",),
        tuning=True,
    ),
)


# -- migration 14: the room a process has under a memory limit of its own ------------------------
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        14,
        "host_samples: the room each process has under its address-space or cgroup memory limit",
        (
            _add_columns(
                "host_samples",
                """    mem_room_bytes UInt64,
    mem_room_limit LowCardinality(String)""",
            ),
        ),
    ),
)


# -- migration 15: how long a process's threads waited for a CPU --------------------------------
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        15,
        "host_samples: how long each process's threads waited for a CPU (run-queue delay)",
        (_add_columns("host_samples", "    proc_run_delay_pct Float32"),),
    ),
)
