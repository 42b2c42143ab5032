"""Rollups of raw telemetry at 1 s, 1 min and 1 h: one AggregatingMergeTree table per source,
``{source}_rollups``, fed by one materialized view, and a view per resolution, ``{source}_1s``,
``{source}_1m``, ``{source}_1h`` (their migrations create them; see docs/tables.md).

The view reads each insert into the raw table once and writes its rows at every resolution
(``res_s`` 1, 60 and 3600, the bucket's seconds) into one part: one view and one part per raw
insert, where a chain of three views (raw → 1 s → 1 min → 1 h) made three. The inserts and
their parts, not the aggregation, are what rollups cost the warehouse: on `bench/warehouse.py`'s
flushes, 2.15–2.98 µs per row in all (mean 2.42) against 2.70–3.14 (mean 2.89) for the chain,
alternating (docs/tables.md).

Each rollup holds, per ``ts`` bucket and group key, ``n`` (rows) and ``{column}_{agg}``
columns: ``avg`` and ``q`` (p50/p95/p99, t-digest) as -State columns read with ``avgMerge`` /
``quantilesTDigestMerge(0.5, 0.95, 0.99)``, ``min``/``max``/``sum``/``or`` as simple aggregate
columns read with ``min``/``max``/``sum``/``groupBitOr``. Every resolution aggregates the raw
rows themselves. 1 s buckets are kept 30 days, 1 min buckets 365 days, 1 h buckets for good
(a TTL per resolution on the one table).

A retried insert (same ``insert_deduplication_token``) counts once in the rollups when it is
sent with ``deduplicate_blocks_in_dependent_materialized_views = 1`` (the sink does): the
rollup table keeps a deduplication window, and the view's block inherits the insert's token.

`legacy_rollup_statements` converts a warehouse migrated with the earlier chain (three tables
of those names, each fed by its own view): its rows move into ``{source}_rollups``, and the
tables give way to the views.
"""

from __future__ import annotations

__all__ = [
    "ROLLUPS",
    "ROLLUP_RESOLUTIONS",
    "ROLLUP_SECONDS",
    "ROLLUP_TTL_DAYS",
    "legacy_rollup_statements",
    "rollup_statements",
]

ROLLUP_RESOLUTIONS = ("1s", "1m", "1h")
ROLLUP_SECONDS = {"1s": 1, "1m": 60, "1h": 3600}
"""Each resolution's bucket in seconds (the ``res_s`` of its rows)."""
ROLLUP_TTL_DAYS: dict[str, int | None] = {"1s": 30, "1m": 365, "1h": None}
"""Days each resolution is kept (None: kept)."""

# Rollup sources: (table, group columns besides ts, [(column, type, aggregates)]). Aggregates:
# avg and q (p50/p95/p99, t-digest) are -State columns; min, max, sum, or are simple ones.
_LEVELS = "(0.5, 0.95, 0.99)"
_QUANTILES = f"quantilesTDigest{_LEVELS}"
ROLLUPS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    (
        "steps",
        "job_id, rank",
        (
            ("step_time_ms", "Float64", "avg min max q"),
            ("data_wait_ms", "Float64", "avg max q"),
            ("samples", "UInt64", "sum"),
            ("tokens", "UInt64", "sum"),
        ),
    ),
    (
        "gpu_samples",
        "job_id, node, rank, device",
        (
            ("sm_util_pct", "Float32", "avg min max"),
            ("mem_util_pct", "Float32", "avg max"),
            ("mem_used_bytes", "UInt64", "avg max"),
            ("power_w", "Float32", "avg max"),
            ("temp_c", "Float32", "avg max"),
            ("sm_clock_mhz", "Float32", "avg min"),
            ("energy_mj", "UInt64", "min max"),
            ("throttle_reasons", "UInt64", "or"),
        ),
    ),
    (
        "host_samples",
        "job_id, node, rank",
        (
            ("proc_cpu_pct", "Float32", "avg max"),
            ("proc_rss_bytes", "UInt64", "max"),
            ("sys_cpu_pct", "Float32", "avg max"),
            ("sys_iowait_pct", "Float32", "avg max"),
            ("load_avg_1m", "Float32", "avg max"),
            ("sys_mem_used_bytes", "UInt64", "max"),
            ("loader_cpu_pct", "Float32", "avg max"),
            ("loader_rss_bytes", "UInt64", "max"),
            ("disk_read_bytes_per_s", "Float64", "avg"),
            ("disk_write_bytes_per_s", "Float64", "avg"),
            ("net_rx_bytes_per_s", "Float64", "avg"),
            ("net_tx_bytes_per_s", "Float64", "avg"),
        ),
    ),
)
_SIMPLE = {"min": "min", "max": "max", "sum": "sum", "or": "groupBitOr"}
_KEY_TYPES = {"job_id": "LowCardinality(String)", "node": "LowCardinality(String)"}
_KEY_TYPES |= {"rank": "Int32", "device": "UInt16"}


def _columns(spec: tuple[tuple[str, str, str], ...]) -> list[tuple[str, str]]:
    cols = [("n SimpleAggregateFunction(sum, UInt64)", "count()")]
    return cols + [_rollup_column(c, t, a) for c, t, aggs in spec for a in aggs.split()]


def _rollup_column(column: str, typ: str, agg: str) -> tuple[str, str]:
    """(name and type, expression over raw rows)."""
    name = f"{column}_{agg}"
    if agg == "avg":
        return f"{name} AggregateFunction(avg, {typ})", f"avgState({column})"
    if agg == "q":
        return (
            f"{name} AggregateFunction({_QUANTILES}, {typ})",
            f"quantilesTDigestState{_LEVELS}({column})",
        )
    fn = _SIMPLE[agg]
    return f"{name} SimpleAggregateFunction({fn}, {typ})", f"{fn}({column})"


def rollup_statements(source: str, keys: str, spec: tuple[tuple[str, str, str], ...]) -> list[str]:
    """The table ``{source}_rollups``, a view per resolution over it, and the materialized
    view that feeds it from ``source``."""
    table = f"{source}_rollups"
    cols = _columns(spec)
    key_cols = [k.strip() for k in keys.split(",")]
    decl = ",\n".join(
        ["    res_s UInt32", "    ts DateTime('UTC')"]
        + [f"    {k} {_KEY_TYPES[k]}" for k in key_cols]
        + [f"    {d}" for d, _ in cols]
    )
    ttl = ",\n    ".join(
        f"ts + INTERVAL {days} DAY DELETE WHERE res_s = {ROLLUP_SECONDS[res]}"
        for res, days in ROLLUP_TTL_DAYS.items()
        if days is not None
    )
    create = (
        f"CREATE TABLE IF NOT EXISTS {table} (\n{decl}\n)\nENGINE = AggregatingMergeTree\n"
        f"PARTITION BY toYYYYMM(ts)\nORDER BY (res_s, {', '.join([*key_cols, 'ts'])})\n"
        f"TTL {ttl}\nSETTINGS non_replicated_deduplication_window = 10000"
    )
    names = ", ".join(["ts", *key_cols, *(d.split()[0] for d, _ in cols)])
    views = [
        f"CREATE VIEW IF NOT EXISTS {source}_{res} AS\nSELECT {names}\nFROM {table}\n"
        f"WHERE res_s = {sec}"
        for res, sec in ROLLUP_SECONDS.items()
    ]
    seconds = ", ".join(str(sec) for sec in ROLLUP_SECONDS.values())
    exprs = ",\n    ".join(f"{raw} AS {d.split()[0]}" for d, raw in cols)
    feed = (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {table}_mv TO {table} AS\n"
        f"SELECT\n    arrayJoin([{seconds}]) AS res_s,\n"
        f"    toDateTime(intDiv(toUnixTimestamp({source}.ts), res_s) * res_s, 'UTC') AS ts,\n"
        f"    {keys},\n    {exprs}\nFROM {source}\nGROUP BY res_s, ts, {keys}"
    )
    return [create, *views, feed]


def legacy_rollup_statements(
    source: str, keys: str, spec: tuple[tuple[str, str, str], ...]
) -> list[str]:
    """Convert ``source``'s rollups from the chain of three tables (migration 3 before the
    single table) to `rollup_statements`' layout, rows kept; on a warehouse already in that
    layout, they change nothing (the views are dropped and made again)."""
    new = rollup_statements(source, keys, spec)
    names = ", ".join(["ts", keys, *(d.split()[0] for d, _ in _columns(spec))])
    out = [new[0]]
    out += [f"DROP VIEW IF EXISTS {source}_{res}_mv" for res in ROLLUP_SECONDS]
    for res, sec in ROLLUP_SECONDS.items():
        # Only from a table of the chain: once it is a view over the new table, nothing. The
        # token makes a second copy (a migration cut short between the copy and the drop, then
        # run again) a duplicate block the table drops.
        out.append(
            f"INSERT INTO {source}_rollups (res_s, {names})\n"
            f"SETTINGS insert_deduplication_token = 'migrate-{source}-{res}'\n"
            f"SELECT {sec}, {names}\nFROM {source}_{res}\n"
            "WHERE (SELECT count() FROM system.tables WHERE database = currentDatabase() "
            f"AND name = '{source}_{res}' AND engine = 'AggregatingMergeTree') = 1"
        )
        out.append(f"DROP TABLE IF EXISTS {source}_{res}")
    return out + new[1:]
