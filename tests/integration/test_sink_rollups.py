"""Migration 3 on the embedded warehouse: rollups agree with the raw rows at 1 s, 1 min and
1 h; migrations re-run cleanly; migration 7 converts the earlier chain of rollup tables;
re-emitted windows collapse in ``windows_latest``; the rows the sink builds for the stream-tier
tables insert as they are.

The warehouse is a server process of this module's own (free port, temporary data dir)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
from clickhouse_connect.driver.client import Client

from perfloop.exceptions import WarehouseError
from perfloop.kafka import dlq_headers
from perfloop.schemas import ConfigChange, Diagnosis, PhaseChange, encode_batch, encode_event
from perfloop.schemas.topics import Topics
from perfloop.schemas.windows import encode_windows
from perfloop.settings import SinkSettings
from perfloop.warehouse import client, migrate
from perfloop.warehouse.migrations import MIGRATIONS, Migration
from perfloop.warehouse.rollups import ROLLUP_RESOLUTIONS, ROLLUPS
from perfloop.warehouse.sink import rows_from_dead_letter, rows_from_message
from perfloop.warehouse.tables import MERGE_SELECTOR_BASE

from .conftest import free_port, wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000
BUCKET = {"1s": "toDateTime(ts)", "1m": "toStartOfMinute(ts)", "1h": "toStartOfHour(ts)"}
RAW = {"avg": "avg({c})", "min": "min({c})", "max": "max({c})", "sum": "sum({c})"}
RAW |= {"or": "groupBitOr({c})", "q": "quantilesExact(0.5, 0.95, 0.99)({c})"}
MERGED = {"avg": "avgMerge({n})", "min": "min({n})", "max": "max({n})", "sum": "sum({n})"}
MERGED |= {"or": "groupBitOr({n})", "q": "quantilesTDigestMerge(0.5, 0.95, 0.99)({n})"}


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SinkSettings]:
    home: Path = tmp_path_factory.mktemp("sink-rollups")
    port = free_port()
    log = open(home / "warehouse.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "perfloop.stack.warehouse_server",
            "--port",
            str(port),
            "--data-dir",
            str(home),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    s = SinkSettings(home=home, clickhouse_port=port, clickhouse_url_override=None)
    try:
        wait_for(lambda: _pingable(s) or proc.poll() is not None, 60, "the warehouse")
        assert proc.poll() is None, (home / "warehouse.log").read_text()
        assert migrate(s) == [m.version for m in MIGRATIONS]
        yield s
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def _pingable(s: SinkSettings) -> bool:
    try:
        ch = client(s, database="", timeout_s=2)
    except Exception:
        return False
    try:
        return bool(ch.ping())
    finally:
        ch.close()


@pytest.fixture()
def ch(settings: SinkSettings) -> Iterator[Client]:
    c = client(settings)
    yield c
    c.close()


def _insert(ch: Client, table: str, cols: Any, token: str | None = None) -> None:
    """Insert as the sink does: Arrow parts as FORMAT Arrow, lists column by column."""
    settings = {
        "insert_deduplication_token": token or uuid.uuid4().hex,
        "deduplicate_blocks_in_dependent_materialized_views": 1,
    }
    if isinstance(cols, pa.RecordBatch):
        ch.insert_arrow(table, pa.Table.from_batches([cols]), settings=settings)
        return
    ch.insert(
        table,
        [list(v) for v in cols.values()],
        column_names=list(cols),
        column_oriented=True,
        settings=settings,
    )


def _raw_rows(source: str, keys: list[str], n: int, job: str, t0: int) -> dict[str, Any]:
    """``n`` rows of ``source`` for ``job`` over 3 hours from ``t0``, every rollup column set."""
    rng = np.random.default_rng(7)
    cols: dict[str, Any] = {
        "ts": (t0 + np.sort(rng.integers(0, 3 * 3600 * NS, n))).tolist(),
        "event_id": [f"{job}-{i}" for i in range(n)],
        "job_id": [job] * n,
        "node": [f"n{i % 2}" for i in range(n)],
        "rank": (np.arange(n) % 4).tolist(),
    }
    if "device" in keys:
        cols["device"] = (np.arange(n) % 2).tolist()
    spec = next(s for src, _, s in ROLLUPS if src == source)
    for column, typ, _ in spec:
        if typ.startswith("UInt"):
            cols[column] = rng.integers(0, 1 << 40, n).tolist()
        else:
            cols[column] = np.round(rng.gamma(2.0, 50.0, n), 3).tolist()
    return cols


@pytest.mark.parametrize("source", [r[0] for r in ROLLUPS])
def test_rollups_agree_with_the_raw_rows(ch: Client, source: str) -> None:
    keys_text, spec = next((k, s) for src, k, s in ROLLUPS if src == source)
    keys = [k.strip() for k in keys_text.split(",")]
    job = f"roll-{source}-{uuid.uuid4().hex[:6]}"
    t0 = (time.time_ns() // (3600 * NS) - 3) * 3600 * NS  # three whole hours ago
    rows = _raw_rows(source, keys, 6000, job, t0)
    for part in range(6):  # six inserts, as the sink makes them: states merge across them
        sl = slice(part * 1000, (part + 1) * 1000)
        _insert(ch, source, {k: v[sl] for k, v in rows.items()})
    aggs = [(c, a) for c, _, names in spec for a in names.split()]
    group = ", ".join(keys)
    for res in ROLLUP_RESOLUTIONS:
        merged = ", ".join(["sum(n)", *(MERGED[a].format(n=f"{c}_{a}") for c, a in aggs)])
        qs = [c for c, a in aggs if a == "q"]
        ranges = [f"tuple(min({c}), max({c}))" for c in qs]  # each quantile column's range
        direct = ", ".join(["count()", *(RAW[a].format(c=c) for c, a in aggs), *ranges])
        got = ch.query(
            f"SELECT ts, {group}, {merged} FROM {source}_{res} WHERE job_id = {{j:String}} "
            f"GROUP BY ts, {group} ORDER BY ts, {group}",
            parameters={"j": job},
        ).result_rows
        want = ch.query(
            f"SELECT {BUCKET[res]} AS b, {group}, {direct} FROM {source} "
            f"WHERE job_id = {{j:String}} GROUP BY b, {group} ORDER BY b, {group}",
            parameters={"j": job},
        ).result_rows
        assert len(got) == len(want) > 0, res
        assert sum(r[len(keys) + 1] for r in got) == 6000
        width = len(keys) + 1
        for g, w in zip(got, want, strict=True):
            assert g[:width] == w[:width] and g[width] == w[width], (res, g[:width])
            span = dict(zip(qs, w[width + 1 + len(aggs) :], strict=True))
            for (c, a), gv, wv in zip(aggs, g[width + 1 :], w[width + 1 :], strict=False):
                if a == "q" and g[width] >= 50:  # t-digest against exact, by the range
                    lo, hi = span[c]
                    err = max(abs(x - y) for x, y in zip(gv, wv, strict=True))
                    assert err <= 0.05 * (hi - lo), (res, c, g[width], gv, wv)
                elif a == "q":  # a handful of values: within their range, in order
                    lo, hi = span[c]
                    assert lo - 1e-3 <= gv[0] <= gv[1] <= gv[2] <= hi + 1e-3, (res, c, gv, lo, hi)
                elif a == "avg":
                    assert math.isclose(gv, wv, rel_tol=1e-5), (res, c, gv, wv)
                else:
                    assert gv == pytest.approx(wv, rel=1e-6), (res, c, a, gv, wv)


def test_a_retried_insert_counts_once_in_the_rollups(ch: Client) -> None:
    job = f"retry-{uuid.uuid4().hex[:6]}"
    t = time.time_ns()
    cols = {
        "ts": [t + i for i in range(100)],
        "event_id": [str(i) for i in range(100)],
        "job_id": [job] * 100,
        "node": ["n"] * 100,
        "rank": [0] * 100,
        "step_time_ms": [50.0] * 100,
    }
    _insert(ch, "steps", cols, token="same")
    _insert(ch, "steps", cols, token="same")  # the sink's retry after a lost reply
    for table in ("steps", "steps_1s", "steps_1m", "steps_1h"):
        count = "count()" if table == "steps" else "sum(n)"
        n = ch.query(f"SELECT {count} FROM {table} WHERE job_id = {{j:String}}", {"j": job})
        assert n.result_rows[0][0] == 100, table


def test_migrations_re_run_cleanly_over_existing_data(settings: SinkSettings, ch: Client) -> None:
    before = ch.query("SELECT count() FROM steps").result_rows[0][0]
    ch.command("TRUNCATE TABLE schema_migrations")  # as if every migration were pending
    assert migrate(settings) == [m.version for m in MIGRATIONS]
    assert ch.query("SELECT count() FROM steps").result_rows[0][0] == before
    ttl = ch.query(
        "SELECT name, engine_full FROM system.tables WHERE database = currentDatabase() "
        "AND name IN ('gpu_samples', 'steps', 'windows', 'steps_rollups')"
    ).result_rows
    ttls = {name: full.split(" TTL ")[1].split(" SETTINGS")[0] if " TTL " in full else None
            for name, full in ttl}  # fmt: skip
    assert ttls["gpu_samples"] == "toDateTime(ts) + toIntervalDay(7)"
    assert ttls["steps"] == "toDateTime(ts) + toIntervalDay(30)"
    assert ttls["windows"] == "toDateTime(ts) + toIntervalDay(30)"
    assert ttls["steps_rollups"] == (
        "ts + toIntervalDay(30) WHERE res_s = 1, ts + toIntervalDay(365) WHERE res_s = 60"
    )
    # migration 4: every MergeTree table merges less often
    bases = ch.query(
        "SELECT name, extract(engine_full, 'merge_selector_base = (\\d+)') FROM system.tables "
        "WHERE database = currentDatabase() AND engine LIKE '%MergeTree' "
        "AND name != 'schema_migrations'"
    ).result_rows
    made = {
        stmt.split("(", 1)[0].split()[-1]
        for m in MIGRATIONS
        for stmt in m.statements
        if stmt.startswith("CREATE TABLE IF NOT EXISTS") and "MergeTree" in stmt
    }
    assert {n for n, _ in bases} == made and {b for _, b in bases} == {str(MERGE_SELECTOR_BASE)}


_OLD_STATE = {"avg": "avgState({c})", "q": "quantilesTDigestState(0.5, 0.95, 0.99)({c})"}
_OLD_STATE |= {"min": "min({c})", "max": "max({c})", "sum": "sum({c})", "or": "groupBitOr({c})"}


def _old_chain(ch: Client) -> None:
    """Turn a new warehouse's ``steps`` rollups back into the layout migration 3 made before
    migration 7: three AggregatingMergeTree tables, each fed by its own materialized view."""
    keys, spec = next((k, sp) for src, k, sp in ROLLUPS if src == "steps")
    ch.command("DROP VIEW steps_rollups_mv")
    aggs = ", ".join(
        _OLD_STATE[a].format(c=c) + f" AS {c}_{a}" for c, _, names in spec for a in names.split()
    )
    for res in ROLLUP_RESOLUTIONS:
        ch.command(f"DROP VIEW steps_{res}")
        ch.command(
            f"CREATE TABLE steps_{res} ENGINE = AggregatingMergeTree ORDER BY ({keys}, ts) "
            "EMPTY AS SELECT * EXCEPT res_s FROM steps_rollups"
        )
        ch.command(
            f"CREATE MATERIALIZED VIEW steps_{res}_mv TO steps_{res} AS SELECT "
            f"{BUCKET[res]} AS ts, {keys}, count() AS n, {aggs} FROM steps GROUP BY ts, {keys}"
        )
    ch.command("DROP TABLE steps_rollups")


def test_migration_7_moves_the_old_chains_rows_into_the_one_table(settings: SinkSettings) -> None:
    db = f"legacy_{uuid.uuid4().hex[:8]}"
    legacy = settings.model_copy(update={"clickhouse_database": db})
    migrate(legacy)
    ch = client(legacy)
    try:
        _old_chain(ch)
        job = "legacy"
        t0 = (time.time_ns() // (3600 * NS) - 2) * 3600 * NS
        rows = _raw_rows("steps", ["job_id", "rank"], 3000, job, t0)
        _insert(ch, "steps", rows)
        summary = "SELECT count(), sum(n), avgMerge(step_time_ms_avg), max(step_time_ms_max) FROM "
        before = {r: ch.query(summary + f"steps_{r}").result_rows[0] for r in ROLLUP_RESOLUTIONS}
        assert before["1h"][1] == 3000 and before["1s"][0] > before["1m"][0] > 0

        for _ in range(2):  # converts, then finds nothing left to convert
            ch.command(
                "ALTER TABLE schema_migrations DELETE WHERE version IN (7, 8) "
                "SETTINGS mutations_sync = 1"
            )
            assert migrate(legacy) == [7, 8]
            kinds = dict(
                ch.query(
                    "SELECT name, engine FROM system.tables WHERE database = currentDatabase() "
                    "AND name LIKE 'steps\\_%'"
                ).result_rows
            )
            assert kinds == {
                "steps_rollups": "AggregatingMergeTree",
                "steps_rollups_mv": "MaterializedView",
                "steps_1s": "View",
                "steps_1m": "View",
                "steps_1h": "View",
            }
            for res in ROLLUP_RESOLUTIONS:
                got = ch.query(summary + f"steps_{res}").result_rows[0]
                assert got[0] == before[res][0] and got[1] == before[res][1], res
                assert math.isclose(got[2], before[res][2], rel_tol=1e-9), res
        # New rows go through the one view now, into every resolution, once.
        _insert(ch, "steps", rows | {"job_id": ["legacy-2"] * 3000})
        for res in ROLLUP_RESOLUTIONS:
            n = ch.query(f"SELECT sum(n) FROM steps_{res} WHERE job_id = 'legacy-2'")
            assert n.result_rows[0][0] == 3000, res
    finally:
        ch.command(f"DROP DATABASE IF EXISTS {db}")
        ch.close()


def test_a_tuning_migration_skips_settings_the_server_does_not_know(
    settings: SinkSettings, ch: Client, caplog: Any
) -> None:
    unknown = "ALTER TABLE steps MODIFY SETTING no_such_merge_tree_setting = 1"
    tuning = Migration(98, "tuning with an unknown setting", (unknown,), tuning=True)
    assert migrate(settings, (*MIGRATIONS, tuning)) == [98]  # skipped, the migration recorded
    assert "this server skips ALTER TABLE steps" in caplog.text
    schema = Migration(99, "a schema change with an unknown setting", (unknown,))
    with pytest.raises(WarehouseError, match=r"migration failed: .*no_such_merge_tree_setting"):
        migrate(settings, (*MIGRATIONS, tuning, schema))
    done = ch.query("SELECT version FROM schema_migrations WHERE version >= 98").result_rows
    ch.command("DELETE FROM schema_migrations WHERE version >= 98")
    assert sorted(v for (v,) in done) == [98]


def _windows_message(job: str, t: int, mean: float, hop_s: float = 10.0) -> bytes:
    cols: dict[str, Any] = {
        "ts_ns": [t],
        "window_end_ns": [t + 10 * NS],
        "window_s": [10.0],
        "hop_s": [hop_s],
        "job_id": [job],
        "node": ["n0"],
        "rank": [1],
        "device": [-1],
        "metric": ["step_time_ms"],
        "count": [7],
        "mean": [mean],
        "min": [1.0],
        "max": [9.0],
        "p50": [5.0],
        "p95": [8.0],
        "p99": [9.0],
        "rate_per_s": [0.7],
        "slope_per_s": [None],
        "closed_ns": [time.time_ns()],
    }
    return orjson.dumps({"kind": "windows", "v": 2, "columns": cols})


def test_a_telemetry_batch_lands_with_exact_times_nulls_and_ids(ch: Client) -> None:
    job = f"tb-{uuid.uuid4().hex[:6]}"
    t = time.time_ns()
    data = encode_batch(
        "step",
        {
            "ts_ns": [t, t + 1],  # one nanosecond apart
            "rank": [0, 1],
            "step": [3, 3],
            "step_time_ms": [100.25, 99.5],
            "loss": [1.5, None],
        },
        job_id=job,
        node="n7",
        batch_id="tb1",
    )
    table, part, dedup = rows_from_message(Topics.STEP, data)
    _insert(ch, table, part, token=dedup)
    rows = ch.query(
        "SELECT toUnixTimestamp64Nano(ts), event_id, node, rank, step_time_ms, loss, "
        "grad_accum_steps FROM steps WHERE job_id = {j:String} ORDER BY ts",
        {"j": job},
    ).result_rows
    assert rows == [
        (t, "tb1-0", "n7", 0, 100.25, 1.5, 1),
        (t + 1, "tb1-1", "n7", 1, 99.5, None, 1),
    ]


def test_windows_v3_arrow_messages_land_as_they_were_closed(ch: Client) -> None:
    job = f"w3-{uuid.uuid4().hex[:6]}"
    t = (time.time_ns() // NS) * NS
    cols = {
        "ts_ns": np.array([t, t + NS]),
        "window_end_ns": np.array([t + NS, t + 2 * NS]),
        "window_s": np.array([1.0, 1.0]),
        "hop_s": np.array([1.0, 1.0]),
        "job_id": np.array([job, job], dtype=object),
        "node": np.array(["n0", "n1"], dtype=object),
        "rank": np.array([0, 9]),
        "device": np.array([-1, 3]),
        "metric": np.array(["step_time_ms", "sm_util"], dtype=object),
        "count": np.array([10, 20]),
        **{k: np.array([1.5, 2.5]) for k in ("mean", "min", "max", "p50", "p95", "p99")},
        "rate_per_s": np.array([10.0, 20.0]),
        "slope_per_s": np.array([np.nan, 0.25]),
        "closed_ns": np.array([t + 2 * NS, t + 3 * NS]),
    }
    ((_, value),) = encode_windows(cols, job.encode())
    table, part, msg = rows_from_message(Topics.WINDOWS, value)
    _insert(ch, table, part, token=msg)
    rows = ch.query(
        "SELECT toUnixTimestamp64Nano(ts), toUnixTimestamp64Nano(window_end), node, rank, "
        "device, metric, count, mean, slope_per_s, toUnixTimestamp64Nano(closed), event_id "
        "FROM windows WHERE job_id = {j:String} ORDER BY ts",
        {"j": job},
    ).result_rows
    assert [r[:8] for r in rows] == [
        (t, t + NS, "n0", 0, -1, "step_time_ms", 10, 1.5),
        (t + NS, t + 2 * NS, "n1", 9, 3, "sm_util", 20, 2.5),
    ]
    assert math.isnan(rows[0][8]) and rows[1][8] == 0.25
    assert [r[9] for r in rows] == [t + 2 * NS, t + 3 * NS] and {r[10] for r in rows} == {msg}


def test_windows_re_emitted_after_a_restart_collapse_in_windows_latest(ch: Client) -> None:
    job = f"win-{uuid.uuid4().hex[:6]}"
    t = (time.time_ns() // (10 * NS)) * 10 * NS
    for mean, hop in ((4.0, 10.0), (5.0, 10.0), (6.0, 5.0)):  # the second re-emits the first
        table, rows, msg = rows_from_message(Topics.WINDOWS, _windows_message(job, t, mean, hop))
        _insert(ch, table, rows, token=msg)
    q = "SELECT hop_s, mean, count FROM {t} WHERE job_id = {{j:String}} ORDER BY hop_s, mean"
    raw = ch.query(q.format(t="windows"), {"j": job}).result_rows
    assert raw == [(5.0, 6.0, 7), (10.0, 4.0, 7), (10.0, 5.0, 7)]
    latest = ch.query(q.format(t="windows_latest"), {"j": job}).result_rows
    assert latest == [(5.0, 6.0, 7), (10.0, 5.0, 7)]  # the later emission of the same window
    ((closed, inserted, slope),) = ch.query(
        "SELECT toUnixTimestamp64Nano(closed), toUnixTimestamp64Nano(inserted), slope_per_s "
        "FROM windows WHERE job_id = {j:String} AND hop_s = 5",
        {"j": job},
    ).result_rows
    assert 0 < closed <= inserted and math.isnan(slope)


def test_the_sinks_rows_for_the_stream_tier_tables_insert_as_they_are(ch: Client) -> None:
    job = f"ev-{uuid.uuid4().hex[:6]}"
    t = time.time_ns()
    common = {"ts_ns": t, "job_id": job, "node": "n0"}
    events = {
        Topics.PHASES: PhaseChange(**common, rank=-1, level="run", phase="steady",
                                   since_ns=t - NS, source="spans", next_phase="eval",
                                   next_ts_ns=t + NS),
        Topics.DIAGNOSES: Diagnosis(**common, rank=2, diagnosis_id="d1", bottleneck="straggler",
                                    level="network", loop="training", state="open",
                                    onset_ns=t - NS, step_share=0.25, confidence=0.8,
                                    critical_path=True, ranks=[2], nodes=["n0"],
                                    evidence={"score": 0.9}),
        Topics.CONTROL: ConfigChange(**common, rank=-1, target="streams",
                                     key="detect.straggler.score_threshold", value=0.7),
    }  # fmt: skip
    for topic, ev in events.items():
        table, rows, dedup = rows_from_message(topic, encode_event(ev))
        _insert(ch, table, rows, token=dedup)
    bad = b"\xff" * 70_000
    table, rows, dedup = rows_from_dead_letter(
        bad,
        job.encode(),
        dlq_headers("not valid JSON", Topics.STEP, 3, 99),
        timestamp_ms=t // 1_000_000,
        partition=0,
        offset=0,
    )
    _insert(ch, table, rows, token=dedup)
    p = {"j": job}
    assert ch.query(
        "SELECT phase, toUnixTimestamp64Nano(next_ts) FROM phases WHERE job_id = {j:String}", p
    ).result_rows == [("steady", t + NS)]
    assert ch.query(
        "SELECT bottleneck, ranks, evidence['score'], critical_path FROM diagnoses "
        "WHERE job_id = {j:String}",
        p,
    ).result_rows == [("straggler", [2], 0.9, True)]
    assert ch.query(
        "SELECT key, value FROM config_changes WHERE job_id = {j:String}", p
    ).result_rows == [("detect.straggler.score_threshold", "0.7")]
    assert ch.query(
        "SELECT topic, partition, offset, length(payload), payload_bytes, "
        "headers['perfloop.reason'] FROM dead_letters WHERE job_id = {j:String}",
        p,
    ).result_rows == [(Topics.STEP, 3, 99, 64 << 10, 70_000, "not valid JSON")]
