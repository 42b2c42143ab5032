"""Rollups of raw telemetry: 1 s → 1 min → 1 h AggregatingMergeTree tables fed by a chain of
materialized views (the catalog's migration 3 creates them; see README "The SQL tables").

Each rollup table ``{source}_{res}`` holds, per ``ts`` bucket and group key, ``n`` (rows) and
``{column}_{agg}`` columns: ``avg`` and ``q`` (p50/p95/p99, t-digest) as -State columns read
with ``avgMerge`` / ``quantilesTDigestMerge(0.5, 0.95, 0.99)``, ``min``/``max``/``sum``/``or``
as simple aggregate columns read with ``min``/``max``/``sum``/``groupBitOr``. The 1 s view
reads the raw table, the 1 min view the 1 s table, the 1 h view the 1 min table.

A retried insert (same ``insert_deduplication_token``) counts once in every rollup when it is
sent with ``deduplicate_blocks_in_dependent_materialized_views = 1`` (the sink does): each
rollup table keeps a deduplication window, and the views' blocks inherit the insert's token.
"""

from __future__ import annotations

__all__ = ["ROLLUPS", "ROLLUP_RESOLUTIONS", "ROLLUP_TTL_DAYS", "rollup_statements"]

ROLLUP_RESOLUTIONS = ("1s", "1m", "1h")
ROLLUP_TTL_DAYS: dict[str, int | None] = {"1s": 30, "1m": 365, "1h": None}
"""Days each rollup resolution is kept (None: kept)."""

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
_BUCKET = {"1s": "toDateTime(ts)", "1m": "toStartOfMinute(ts)", "1h": "toStartOfHour(ts)"}
_SOURCE = {"1s": "", "1m": "1s", "1h": "1m"}


def _rollup_column(column: str, typ: str, agg: str) -> tuple[str, str, str]:
    """(name and type, expression over raw rows, expression over a finer rollup)."""
    name = f"{column}_{agg}"
    if agg == "avg":
        return (
            f"{name} AggregateFunction(avg, {typ})",
            f"avgState({column})",
            f"avgMergeState({name})",
        )
    if agg == "q":
        return (
            f"{name} AggregateFunction({_QUANTILES}, {typ})",
            f"quantilesTDigestState{_LEVELS}({column})",
            f"quantilesTDigestMergeState{_LEVELS}({name})",
        )
    fn = _SIMPLE[agg]
    return f"{name} SimpleAggregateFunction({fn}, {typ})", f"{fn}({column})", f"{fn}({name})"


def rollup_statements(
    source: str, keys: str, spec: tuple[tuple[str, str, str], ...], res: str
) -> list[str]:
    """The AggregatingMergeTree table ``{source}_{res}`` and the view that feeds it."""
    table = f"{source}_{res}"
    cols = [("n SimpleAggregateFunction(sum, UInt64)", "count()", "sum(n)")]
    cols += [_rollup_column(c, t, a) for c, t, aggs in spec for a in aggs.split()]
    key_cols = [k.strip() for k in keys.split(",")]
    decl = ",\n".join(
        ["    ts DateTime('UTC')"]
        + [f"    {k} {_KEY_TYPES[k]}" for k in key_cols]
        + [f"    {d}" for d, _, _ in cols]
    )
    days = ROLLUP_TTL_DAYS[res]
    ttl = f"TTL ts + INTERVAL {days} DAY\n" if days else ""
    partition = "toDate(ts)" if res == "1s" else "toYYYYMM(ts)"
    create = (
        f"CREATE TABLE IF NOT EXISTS {table} (\n{decl}\n)\nENGINE = AggregatingMergeTree\n"
        f"PARTITION BY {partition}\nORDER BY ({', '.join([*key_cols, 'ts'])})\n{ttl}"
        "SETTINGS non_replicated_deduplication_window = 10000"
    )
    finer = _SOURCE[res]
    exprs = ",\n    ".join(
        f"{raw if not finer else merged} AS {d.split()[0]}" for d, raw, merged in cols
    )
    view = (
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {table}_mv TO {table} AS\n"
        f"SELECT\n    {_BUCKET[res]} AS ts,\n    {keys},\n    {exprs}\n"
        f"FROM {f'{source}_{finer}' if finer else source}\nGROUP BY ts, {keys}"
    )
    return [create, view]
