"""The warehouse's versioned migrations: every table, view and rollup, as the changes that made
them (`perfloop.warehouse.access.migrate` applies the pending ones in order).

Migrations never change once released: a change is a new migration whose statements are
idempotent (``IF NOT EXISTS``, ``ADD COLUMN IF NOT EXISTS``, ``MODIFY TTL``). Raw telemetry
is rolled up 1 s → 1 min → 1 h by materialized views (`perfloop.warehouse.rollups`).
"""

from __future__ import annotations

from perfloop.warehouse._first_migrations import MIGRATIONS, Migration
from perfloop.warehouse.rollups import ROLLUPS, legacy_rollup_statements
from perfloop.warehouse.tables import (
    MERGE_SELECTOR_BASE,
    add_columns,
    create_table,
)

__all__ = ["MIGRATIONS", "Migration"]


# -- migration 4: merge less often --------------------------------------------------------------

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
            create_table(
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
            create_table(
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
            create_table(
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
        (add_columns("actuations", "evidence Map(String, Float64)"),),
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
            create_table(
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
            add_columns(
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
        (add_columns("host_samples", "    proc_run_delay_pct Float32"),),
    ),
)


# -- migration 16: the job's identity in its scheduler --------------------------------------------
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        16,
        "job_info: the job's identity in its scheduler (Slurm job, Kubernetes pod)",
        (
            add_columns(
                "job_info",
                """    scheduler LowCardinality(String),
    slurm_job_id String,
    slurm_job_name String,
    slurm_nodelist String,
    slurm_step_id String,
    k8s_pod String,
    k8s_namespace LowCardinality(String),
    k8s_node LowCardinality(String)""",
            ),
        ),
    ),
)


# -- migration 17: each ended job's accounting ------------------------------------------------
# One row per job and accounting (the accountant service, `perfloop.report.accountant`, writes
# one when a job ends, and again when it ends again after a restart); ReplacingMergeTree keeps
# the latest ``computed`` per job once merged (read it with FINAL, or argMax by ``computed``).
_JOB_ACCOUNTING = """CREATE TABLE IF NOT EXISTS job_accounting (
    job_id LowCardinality(String),
    computed DateTime64(9, 'UTC'),
    lifecycle_end DateTime64(9, 'UTC'),
    state LowCardinality(String),
    started DateTime64(9, 'UTC'),
    ended DateTime64(9, 'UTC'),
    wall_s Float64,
    ranks UInt32,
    gpus UInt32,
    cpus UInt32,
    steps_per_rank Float64,
    goodput Float64,
    productive_s Float64,
    data_wait_s Float64,
    straggler_wait_s Float64,
    hang_s Float64,
    restart_s Float64,
    checkpoint_s Float64,
    eval_s Float64,
    warmup_s Float64,
    startup_s Float64,
    idle_s Float64,
    mean_step_ms Nullable(Float64),
    samples_per_s Nullable(Float64),
    tokens_per_s Nullable(Float64),
    mfu Nullable(Float64),
    mfu_wall Nullable(Float64),
    energy_wh Nullable(Float64),
    energy_per_step_j Nullable(Float64),
    price_per_hour Nullable(Float64),
    cost Nullable(Float64),
    cost_per_step Nullable(Float64),
    cost_per_million_tokens Nullable(Float64),
    cost_of_badput Nullable(Float64),
    currency LowCardinality(String),
    diagnosis_ids Array(String),
    diagnosis_bottlenecks Array(LowCardinality(String)),
    diagnosis_hours Array(Float64),
    diagnosis_costs Array(Float64),
    notes Map(String, String)
)
ENGINE = ReplacingMergeTree(computed)
ORDER BY job_id"""

MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        17,
        "job_accounting: each ended job's goodput and badput by cause, throughput, MFU, energy "
        "and money",
        (_JOB_ACCOUNTING,),
    ),
    Migration(
        18,
        f"merge less often on job_accounting: merge_selector_base = {MERGE_SELECTOR_BASE}",
        (f"ALTER TABLE job_accounting MODIFY SETTING merge_selector_base = {MERGE_SELECTOR_BASE}",),
        tuning=True,
    ),
)


# -- migration 19: signed recommendations and actuator settings ---------------------------------
# Recommendations and actuator settings carry a signature, the key that made it and an expiry
# (`perfloop.actuators.trust`); approvals an expiry. Kept with them, so the actuator can check
# a stored setting again when it starts; ``inserted`` says whether it reached the warehouse
# before its expiry.
MIGRATIONS = (
    *MIGRATIONS,
    Migration(
        19,
        "recommendations, approvals and config_changes: signatures, key ids and expiries",
        (
            add_columns(
                "recommendations",
                """    expires_ts_ns Int64,
    key_id String,
    signature String""",
            ),
            add_columns("approvals", "    expires_ts_ns Int64"),
            add_columns(
                "config_changes",
                """    expires_ts_ns Int64,
    key_id String,
    signature String,
    inserted DateTime64(9, 'UTC') DEFAULT now64(9)""",
            ),
        ),
    ),
)
