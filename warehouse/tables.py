"""The warehouse's tables: which table each event kind lands in, the tables each topic fills,
and the pieces every table's DDL is built from.

Tables are MergeTree, partitioned by day, ordered by ``(job_id, rank, ts)``, with a
deduplication window so that a retried insert carrying the same ``insert_deduplication_token``
lands once. Their definitions and changes are `perfloop.warehouse.migrations`.

>>> TABLES[Topics.JOB][:2], KIND_TABLES["step"]
(('job_info', 'job_lifecycle'), 'steps')
"""

from __future__ import annotations

from perfloop.schemas.topics import KIND_TOPICS, Topics

__all__ = [
    "DEAD_LETTER_PAYLOAD_BYTES",
    "KIND_TABLES",
    "MERGE_SELECTOR_BASE",
    "RAW_TTL_DAYS",
    "TABLES",
    "WINDOW_KEY",
    "add_columns",
    "create_table",
    "modify_ttl",
]

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


TABLES: dict[str, tuple[str, ...]] = {}

# Tables the sink fills, by the topic they come from (a topic may carry several kinds).
TABLES: dict[str, tuple[str, ...]] = {}
for _kind, _topic in KIND_TOPICS.items():
    TABLES[_topic] = (*TABLES.get(_topic, ()), KIND_TABLES[_kind])
TABLES[Topics.WINDOWS] = ("windows",)
TABLES[Topics.DLQ] = ("dead_letters",)  # the sink lands perfloop.dlq too

# Retention (docs/tables.md): high-rate raw telemetry (gpu_samples, host_samples,
# spans, collectives, kernel_summaries) 7 days; steps, windows and dead_letters 30 days;
# rollups 1 s 30 days, 1 min 365 days, 1 h kept. Events (jobs, phases, diagnoses, changes,
# recommendations, commands, actuations) are small and kept.

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


def create_table(name: str, columns: str, *, raw: bool = False) -> str:
    """``CREATE TABLE IF NOT EXISTS`` with the common columns; ``raw``: rows expire 30 days
    after their event time."""
    engine = _MERGE_TREE.format(ttl=_RAW_TTL if raw else "")
    return f"CREATE TABLE IF NOT EXISTS {name} (\n{_COMMON}\n{columns}\n)\n{engine}"


def add_columns(table: str, columns: str) -> str:
    """``ALTER TABLE … ADD COLUMN IF NOT EXISTS`` for each line of ``columns``."""
    adds = ",\n".join(
        f"    ADD COLUMN IF NOT EXISTS {line.strip().rstrip(',')}"
        for line in columns.strip().splitlines()
    )
    return f"ALTER TABLE {table}\n{adds}"


RAW_TTL_DAYS = 7
"""Days high-rate raw telemetry is kept (its 1 s / 1 min / 1 h rollups outlive it)."""


DEAD_LETTER_PAYLOAD_BYTES = 64 << 10
"""A dead letter's payload is stored up to this many bytes (``payload_bytes`` is the size)."""


WINDOW_KEY = ("job_id", "node", "rank", "device", "metric", "window_s", "hop_s", "ts")
"""The columns that identify one window row (a re-emitted window repeats them)."""


def modify_ttl(table: str, days: int) -> str:
    """``ALTER TABLE … MODIFY TTL``: rows expire ``days`` after their event time."""
    return f"ALTER TABLE {table}\n    MODIFY TTL toDateTime(ts) + INTERVAL {days} DAY"


MERGE_SELECTOR_BASE = 20
"""How many parts of a size the merge selector gathers before merging them (ClickHouse's
default is 5). Every insert makes a part in each table it feeds; at the default, background
merges cost nearly as much CPU as the inserts themselves. At 20, merges cost 0.81 instead of
1.89 µs per row and the warehouse 1.38× less CPU in all, for more parts between merges (148
instead of 54 active parts over 28 tables after 40 one-second flushes; ClickHouse slows
inserts at 1,000 in a partition): `python bench/warehouse.py --sim-s 600`."""
