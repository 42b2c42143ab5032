"""Migration 3: stream-tier tables, dead letters, windows v2, rollups and their TTLs."""

from __future__ import annotations

import re

import pytest

from perfloop.catalog import (
    DEAD_LETTER_PAYLOAD_BYTES,
    MIGRATIONS,
    RAW_TTL_DAYS,
    ROLLUP_RESOLUTIONS,
    ROLLUP_TTL_DAYS,
    ROLLUPS,
    TABLES,
    WINDOW_KEY,
    Topics,
)

M3 = MIGRATIONS[2]


def _stmt(pattern: str) -> str:
    found = [s for s in M3.statements if re.match(pattern, s)]
    assert len(found) == 1, (pattern, len(found))
    return found[0]


def test_migration_3_is_the_stream_tier() -> None:
    assert M3.version == 3
    for table in ("phases", "diagnoses", "config_changes", "dead_letters"):
        _stmt(rf"CREATE TABLE IF NOT EXISTS {table} \(")


def test_dead_letters_keep_reason_source_and_a_bounded_payload() -> None:
    assert TABLES[Topics.DLQ] == ("dead_letters",)  # the sink lands the dead-letter topic
    ddl = _stmt(r"CREATE TABLE IF NOT EXISTS dead_letters \(")
    for col in ("topic", "partition", "offset", "reason", "reason_class", "key", "payload"):
        assert re.search(rf"^\s+{col} \S", ddl, re.M), col
    assert "payload_bytes UInt64" in ddl and "headers Map(String, String)" in ddl
    assert "TTL toDateTime(ts) + INTERVAL 30 DAY" in ddl
    assert DEAD_LETTER_PAYLOAD_BYTES == 64 << 10


def test_windows_v2_columns_and_a_view_that_collapses_re_emitted_windows() -> None:
    alter = _stmt(r"ALTER TABLE windows\n\s+ADD")
    for col in ("device Int32 DEFAULT -1", "hop_s Float32", "closed DateTime64(9, 'UTC')"):
        assert f"ADD COLUMN IF NOT EXISTS {col}" in alter
    assert "inserted DateTime64(9, 'UTC') DEFAULT now64(9)" in alter
    view = _stmt(r"CREATE VIEW IF NOT EXISTS windows_latest AS")
    assert view.rstrip().endswith("GROUP BY " + ", ".join(WINDOW_KEY))


@pytest.mark.parametrize(
    ("table", "days"),
    [
        ("gpu_samples", RAW_TTL_DAYS),
        ("host_samples", RAW_TTL_DAYS),
        ("spans", RAW_TTL_DAYS),
        ("collectives", RAW_TTL_DAYS),
        ("kernel_summaries", RAW_TTL_DAYS),
        ("windows", 30),
    ],
)
def test_raw_ttls_are_modified_in_place(table: str, days: int) -> None:
    stmt = _stmt(rf"ALTER TABLE {table}\n\s+MODIFY TTL")
    assert stmt.endswith(f"MODIFY TTL toDateTime(ts) + INTERVAL {days} DAY")


@pytest.mark.parametrize("source", [r[0] for r in ROLLUPS])
def test_rollups_chain_1s_1m_1h(source: str) -> None:
    feeds = {"1s": source, "1m": f"{source}_1s", "1h": f"{source}_1m"}
    for res in ROLLUP_RESOLUTIONS:
        table = f"{source}_{res}"
        ddl = _stmt(rf"CREATE TABLE IF NOT EXISTS {table} \(")
        assert "ENGINE = AggregatingMergeTree" in ddl
        days = ROLLUP_TTL_DAYS[res]
        assert (f"TTL ts + INTERVAL {days} DAY" in ddl) == (days is not None)
        assert ("TTL" in ddl) == (days is not None)
        view = _stmt(rf"CREATE MATERIALIZED VIEW IF NOT EXISTS {table}_mv TO {table} AS")
        assert re.search(rf"^FROM {feeds[res]}$", view, re.M), view
        # Every column the view writes is a column of its table, and the reverse.
        written = set(re.findall(r" AS (\w+)", view.split("SELECT", 1)[1]))
        declared = set(re.findall(r"^\s+(\w+) ", ddl.split("ENGINE")[0], re.M))
        keys = {k.strip() for k in view.split("GROUP BY ts,")[1].split(",")}
        assert written | keys == declared


def test_rollup_keys_are_the_sorting_key() -> None:
    # An AggregatingMergeTree merges rows of equal sorting key: every group column must be in it.
    for source, keys, _ in ROLLUPS:
        ddl = _stmt(rf"CREATE TABLE IF NOT EXISTS {source}_1s \(")
        assert f"ORDER BY ({keys}, ts)" in ddl
