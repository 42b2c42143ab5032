"""The catalog: every table has a topic, migrations are ordered, tables share their key columns."""

from __future__ import annotations

import itertools
import re

import pytest

from perfloop.schemas import BATCH_KINDS, EVENT_KINDS
from perfloop.schemas.topics import KIND_TOPICS, TOPICS, Topics
from perfloop.warehouse.migrations import MIGRATIONS
from perfloop.warehouse.tables import KIND_TABLES, TABLES

STATEMENTS = [s for m in MIGRATIONS for s in m.statements]


def _table_ddl(name: str) -> str:
    for stmt in STATEMENTS:
        if re.match(rf"CREATE TABLE IF NOT EXISTS {name} \(", stmt):
            return stmt
    raise AssertionError(f"no CREATE TABLE for {name}")


def test_every_table_topic_is_a_known_topic() -> None:
    assert set(TABLES) <= set(TOPICS)


def test_topics_are_unique_and_namespaced() -> None:
    assert len(TOPICS) == len(set(TOPICS))
    assert all(t.startswith("perfloop.") for t in TOPICS)
    assert Topics.CONTROL in TOPICS and Topics.DLQ in TOPICS


def test_migration_versions_increase_from_one() -> None:
    versions = [m.version for m in MIGRATIONS]
    assert versions[0] == 1
    assert all(b > a for a, b in itertools.pairwise(versions))


def test_every_statement_is_idempotent() -> None:
    for stmt in STATEMENTS:
        if stmt.startswith("ALTER TABLE"):
            # the changes follow the table's name, on the same line or on their own lines
            changes = [" ".join(stmt.split()[3:])] if "\n" not in stmt else stmt.splitlines()[1:]
            assert changes and all(
                "ADD COLUMN IF NOT EXISTS" in ln
                or ln.strip().startswith(("MODIFY TTL ", "MODIFY SETTING "))
                for ln in changes
            ), stmt
        elif stmt.startswith("DROP "):
            assert stmt.split()[2:4] == ["IF", "EXISTS"], stmt
        elif stmt.startswith("INSERT INTO"):
            # migration 7's copy: a fixed deduplication token, and nothing once it is done
            assert "SETTINGS insert_deduplication_token = 'migrate-" in stmt, stmt
            assert "engine = 'AggregatingMergeTree') = 1" in stmt, stmt
        else:
            assert "IF NOT EXISTS" in stmt.split("(")[0], stmt.splitlines()[0]


def test_each_table_is_created_one_way() -> None:
    creates = [(re.match(r"CREATE TABLE IF NOT EXISTS (\w+)", s), s) for s in STATEMENTS]
    ddl: dict[str, set[str]] = {}
    for m, stmt in creates:
        if m:
            ddl.setdefault(m.group(1), set()).add(stmt)
    # A table made again by a later migration (migration 7's rollup tables) is made the same
    assert all(len(v) == 1 for v in ddl.values()), [k for k, v in ddl.items() if len(v) > 1]
    assert {t for tables in TABLES.values() for t in tables} <= set(ddl)


def test_every_kind_has_a_topic_and_a_table() -> None:
    kinds = set(BATCH_KINDS) | set(EVENT_KINDS)
    assert set(KIND_TOPICS) == kinds == set(KIND_TABLES)
    for kind, topic in KIND_TOPICS.items():
        assert KIND_TABLES[kind] in TABLES[topic]


def test_telemetry_kinds_travel_on_telemetry_topics() -> None:
    for kind in BATCH_KINDS:
        assert KIND_TOPICS[kind].startswith("perfloop.telemetry."), kind


@pytest.mark.parametrize("table", sorted({t for ts in TABLES.values() for t in ts}))
def test_every_table_has_time_job_and_rank(table: str) -> None:
    ddl = _table_ddl(table)
    assert re.search(r"^\s*ts DateTime64\(9, 'UTC'\),$", ddl, re.M)
    assert re.search(r"^\s*job_id \S", ddl, re.M)
    assert re.search(r"^\s*rank Int\d+", ddl, re.M)
    assert "ORDER BY (job_id, rank, ts)" in ddl


@pytest.mark.parametrize(
    "table", ["steps", "gpu_samples", "host_samples", "spans", "collectives", "kernel_summaries"]
)
def test_raw_telemetry_expires(table: str) -> None:
    assert "TTL" in _table_ddl(table)
