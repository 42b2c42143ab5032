"""Warehouse cost: CPU per row of the sink's inserts into the embedded warehouse, merges included,
with the catalog's merge setting against ClickHouse's default, in the same run.

    python bench/warehouse.py                  # 4 jobs × 300 simulated s, 60k rows per flush
    python bench/warehouse.py --per-flush 120000 --every-s 2

Simulated jobs (scenario ``--scenario``) make every telemetry message and, through the stream
core in-process, the window messages; the sink's own row builders turn them into the Arrow
batches it inserts. For each variant a fresh warehouse server
(``perfloop.stack.warehouse_server``, its own data directory, all migrations applied) takes
those batches as the sink sends them: one insert
per table per flush of ``--per-flush`` rows, a flush every ``--every-s`` seconds, then
``--tail-s`` seconds of quiet for the merges still running. Reported per variant: the server's
CPU seconds by thread (ClickHouse names them: ``ThreadPool`` runs inserts and their
materialized views, ``MergeTreeBackgroundExecutor`` threads are ``MergeMutate``), µs per row
in all and for merges, the insert time per table, and the active parts left. Variants: the
catalog as migrated (``merge_selector_base`` = `perfloop.warehouse.tables.MERGE_SELECTOR_BASE`) and
the baseline with ClickHouse's default (5) set back on every table.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/warehouse.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import free_port, save_result, say, wait_for

NS = 1_000_000_000
CLICKHOUSE_DEFAULT_BASE = 5
PACE = 220_000.0
"""Samples per second of wall clock the stream core is fed at (as ``e2e.py --rate``)."""


def _batches(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The sink's batches, one dict (table → `Pending`) per flush."""
    from bench.e2e import _simulated_messages
    from perfloop.schemas.topics import Topics
    from perfloop.settings import StreamsSettings
    from perfloop.streams.app import windows_messages
    from perfloop.streams.engine import StreamEngine
    from perfloop.warehouse._sink_batch import Pending, Source
    from perfloop.warehouse._sink_rows import part_rows, rows_from_message

    ns = argparse.Namespace(
        jobs=args.jobs, sim_s=args.sim_s, scenario=args.scenario, nodes=2, ranks=8
    )
    msgs, _ = _simulated_messages(ns, uuid.uuid4().hex[:6], time.time_ns())
    engine = StreamEngine(StreamsSettings())
    last = {m[1]: i for i, m in enumerate(msgs)}
    offsets: dict[str, int] = {}
    wall0 = wall = time.time_ns()
    flushes: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    rows = 0

    def take(topic: str, value: bytes) -> None:
        nonlocal current, rows
        table, part, dedup = rows_from_message(topic, value)
        if part_rows(part):
            current.setdefault(table, Pending()).extend(
                part, Source(dedup, topic, 0, 0, None, value)
            )
            rows += part_rows(part)
        if rows >= args.per_flush:
            flushes.append(current)
            current, rows = {}, 0

    published = 0
    for i, (_, topic, _, value, n) in enumerate(msgs):
        # The wall clock as the e2e bench paces them (220k samples/s): a job's windows close
        # once its new-job grace has passed, as they would on the stack.
        published += n
        wall = wall0 + int(published / PACE * NS)
        offset = offsets[topic] = offsets.get(topic, -1) + 1
        engine.ingest(topic, value, wall_ns=wall, offset=offset, caught_up=last[topic] == i)
        if topic in (Topics.JOB, Topics.CONTROL):
            continue
        take(topic, value)
        if i % 20 == 19:
            o = engine.tick(wall)
            if o.windows is not None:
                for _, v in windows_messages(o.windows):
                    take(Topics.WINDOWS, v)
    o = engine.tick(wall + 3600 * NS)  # the windows still open at the end
    if o.windows is not None:
        for _, v in windows_messages(o.windows):
            take(Topics.WINDOWS, v)
    if current:
        flushes.append(current)
    return flushes


def _thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """CPU seconds of each thread of ``pid``: {task path: (thread name, seconds)}."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            stat = Path(task, "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[task] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _by_name(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> Any:
    agg: collections.Counter[str] = collections.Counter()
    for task, (name, cpu) in after.items():
        agg[name] += cpu - before.get(task, (name, 0.0))[1]
    return agg


def run_variant(args: argparse.Namespace, flushes: list[dict[str, Any]], base: int | None) -> Any:
    import pyarrow as pa

    from perfloop.settings import SinkSettings
    from perfloop.warehouse import client, migrate

    home = Path(tempfile.mkdtemp(prefix="perfloop-bench-wh-"))
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "perfloop.stack.warehouse_server",
            "--port",
            str(port),
            "--data-dir",
            str(home),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    settings = SinkSettings(home=home, clickhouse_port=port, clickhouse_url_override=None)

    def migrated() -> bool:
        try:
            migrate(settings)
        except Exception:
            return False
        return True

    try:
        if not wait_for(migrated, 60, 0.2):
            raise SystemExit("the warehouse did not start")
        ch = client(settings)
        tables = [
            r[0]
            for r in ch.query(
                "SELECT name FROM system.tables WHERE database = currentDatabase() "
                "AND engine LIKE '%MergeTree' AND name != 'schema_migrations'"
            ).result_rows
        ]
        if base is not None:
            for t in tables:
                ch.command(f"ALTER TABLE {t} MODIFY SETTING merge_selector_base = {base}")
        per_table: dict[str, list[float]] = {}
        before = _thread_cpu(server.pid)
        t0 = time.monotonic()
        for i, flush in enumerate(flushes):
            for table in sorted(flush):
                pending = flush[table]
                opts = {
                    "insert_deduplication_token": uuid.uuid4().hex,
                    "deduplicate_blocks_in_dependent_materialized_views": 1,
                }
                t = time.perf_counter()
                if isinstance(pending.parts[0], pa.RecordBatch):
                    ch.insert_arrow(table, pending.arrow(), settings=opts)
                else:
                    cols = pending.lists()
                    ch.insert(
                        table,
                        list(cols.values()),
                        column_names=list(cols),
                        column_oriented=True,
                        settings=opts,
                    )
                spent = per_table.setdefault(table, [0.0, 0])
                spent[0] += time.perf_counter() - t
                spent[1] += pending.rows
            time.sleep(max(0.0, t0 + (i + 1) * args.every_s - time.monotonic()))
        time.sleep(args.tail_s)
        cpu = _by_name(before, _thread_cpu(server.pid))
        parts = ch.query(
            "SELECT count() FROM system.parts WHERE active AND database = currentDatabase()"
        ).result_rows[0][0]
        ch.close()
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(home, ignore_errors=True)
    rows = sum(p.rows for f in flushes for p in f.values())
    total = sum(cpu.values())
    return {
        "merge_selector_base": base,
        "rows": rows,
        "cpu_s_by_thread": dict(cpu.most_common(6)),
        "cpu_s": total,
        "us_per_row": 1e6 * total / rows,
        "merge_us_per_row": 1e6 * cpu["MergeMutate"] / rows,
        "insert_us_per_row_by_table": {
            t: 1e6 * s / n for t, (s, n) in sorted(per_table.items(), key=lambda kv: -kv[1][0])
        },
        "active_parts": parts,
    }


def main(argv: list[str] | None = None) -> int:
    from perfloop.warehouse.tables import MERGE_SELECTOR_BASE

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--sim-s", type=float, default=300.0, help="simulated seconds per job")
    p.add_argument("--scenario", default="mixed")
    p.add_argument("--per-flush", type=int, default=60_000, help="rows per flush, all tables")
    p.add_argument("--every-s", type=float, default=1.0, help="seconds between flushes")
    p.add_argument("--tail-s", type=float, default=15.0, help="quiet seconds after the last")
    args = p.parse_args(argv)
    t = time.perf_counter()
    flushes = _batches(args)
    rows = sum(pe.rows for f in flushes for pe in f.values())
    say(
        f"{len(flushes)} flushes of ~{args.per_flush:,} rows ({rows:,} rows in all, windows "
        f"included) every {args.every_s:g} s; made in {time.perf_counter() - t:.1f} s"
    )
    variants = []
    for base in (None, CLICKHOUSE_DEFAULT_BASE):
        v = run_variant(args, flushes, base)
        v["merge_selector_base"] = MERGE_SELECTOR_BASE if base is None else base
        variants.append(v)
        say(
            f"  merge_selector_base {v['merge_selector_base']:>2}: {v['us_per_row']:.2f} µs/row "
            f"in all, merges {v['merge_us_per_row']:.2f}; {v['active_parts']} active parts; "
            "CPU s by thread: " + ", ".join(f"{k} {s:.1f}" for k, s in v["cpu_s_by_thread"].items())
        )
        say(
            "    insert µs/row by table: "
            + ", ".join(f"{k} {s:.2f}" for k, s in v["insert_us_per_row_by_table"].items())
        )
    ours, default = variants
    ratio = default["us_per_row"] / ours["us_per_row"]
    say(f"  → default / catalog CPU per row: {ratio:.2f}×")
    save_result(
        "warehouse",
        {"bench": "warehouse", "args": vars(args), "variants": variants, "ratio": ratio},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
