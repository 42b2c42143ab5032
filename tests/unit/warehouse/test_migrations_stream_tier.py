"""Migration 3: stream-tier tables, dead letters, windows v2, rollups and their TTLs."""

from __future__ import annotations

import re

import pytest

from perfloop.schemas.topics import Topics
from perfloop.warehouse.migrations import MIGRATIONS
from perfloop.warehouse.rollups import ROLLUP_RESOLUTIONS, ROLLUP_SECONDS, ROLLUP_TTL_DAYS, ROLLUPS
from perfloop.warehouse.tables import DEAD_LETTER_PAYLOAD_BYTES, RAW_TTL_DAYS, TABLES, WINDOW_KEY

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
def test_rollups_are_one_table_one_feed_and_a_view_per_resolution(source: str) -> None:
    table = f"{source}_rollups"
    ddl = _stmt(rf"CREATE TABLE IF NOT EXISTS {table} \(")
    assert "ENGINE = AggregatingMergeTree" in ddl and "res_s UInt32" in ddl
    # One TTL per resolution kept for a while; none for the one kept for good.
    ttl = ddl.split("TTL ", 1)[1].split("\nSETTINGS")[0]
    for res, days in ROLLUP_TTL_DAYS.items():
        clause = f"ts + INTERVAL {days} DAY DELETE WHERE res_s = {ROLLUP_SECONDS[res]}"
        assert (clause in ttl) == (days is not None), (res, ttl)
    assert ttl.count("DELETE WHERE") == sum(d is not None for d in ROLLUP_TTL_DAYS.values())
    feed = _stmt(rf"CREATE MATERIALIZED VIEW IF NOT EXISTS {table}_mv TO {table} AS")
    assert re.search(rf"^FROM {source}$", feed, re.M), feed  # the raw table, once
    assert f"arrayJoin([{', '.join(str(ROLLUP_SECONDS[r]) for r in ROLLUP_RESOLUTIONS)}])" in feed
    # Every column the view writes is a column of its table, and the reverse.
    written = set(re.findall(r" AS (\w+)", feed.split("SELECT", 1)[1]))
    declared = set(re.findall(r"^\s+(\w+) ", ddl.split("ENGINE")[0], re.M))
    keys = {k.strip() for k in feed.split("GROUP BY res_s, ts,")[1].split(",")}
    assert written | keys == declared
    for res in ROLLUP_RESOLUTIONS:
        view = _stmt(rf"CREATE VIEW IF NOT EXISTS {source}_{res} AS")
        assert view.endswith(f"FROM {table}\nWHERE res_s = {ROLLUP_SECONDS[res]}")
        assert set(re.findall(r"\w+", view.split("SELECT", 1)[1].split("FROM")[0])) == (
            declared - {"res_s"}
        )


def test_rollup_keys_are_the_sorting_key() -> None:
    # An AggregatingMergeTree merges rows of equal sorting key: every group column must be in it.
    for source, keys, _ in ROLLUPS:
        ddl = _stmt(rf"CREATE TABLE IF NOT EXISTS {source}_rollups \(")
        assert f"ORDER BY (res_s, {keys}, ts)" in ddl


def test_migration_7_converts_the_old_chain_and_8_tunes_the_new_tables() -> None:
    m7, m8 = MIGRATIONS[6], MIGRATIONS[7]
    assert (m7.version, m8.version, m8.tuning) == (7, 8, True)
    for source, _, _ in ROLLUPS:
        stmts = list(m7.statements)
        at = {s.split("\n")[0]: i for i, s in enumerate(stmts)}
        for res in ROLLUP_RESOLUTIONS:
            # The old feed stops before the rows move, the rows move before the table goes,
            # and the view of that name comes after.
            stop = at[f"DROP VIEW IF EXISTS {source}_{res}_mv"]
            copy = next(
                i
                for i, s in enumerate(stmts)
                if s.startswith(f"INSERT INTO {source}_rollups") and f"FROM {source}_{res}\n" in s
            )
            drop = at[f"DROP TABLE IF EXISTS {source}_{res}"]
            view = at[f"CREATE VIEW IF NOT EXISTS {source}_{res} AS"]
            assert stop < copy < drop < view
            assert "engine = 'AggregatingMergeTree'" in stmts[copy]
        assert f"ALTER TABLE {source}_rollups MODIFY SETTING merge_selector_base" in "\n".join(
            m8.statements
        )
