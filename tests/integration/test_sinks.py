"""Acceptance: two sinks share the telemetry in one consumer group; one is SIGKILLed (the
process itself) mid-run. Every step sample published lands in the warehouse, and a row lands
twice only for what the killed sink had inserted after its last commit: at most about two
flush intervals of its partitions' rows (docs/guarantees.md).

The stack is this module's own; the second sink is a ``perfloop service sink`` process, as
on another node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher
from perfloop.settings import SinkSettings, StackSettings
from perfloop.warehouse import client

from .conftest import private_stack, wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000
RANKS = 8
STEP_NS = 50_000_000  # each rank: a step every 50 ms
JOBS = 4  # spread over the partitions, so both sinks have some


@pytest.fixture(scope="module")
def sinks_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(tmp_path_factory.mktemp("perfloop-sinks")) as settings:
        yield settings


def _sink(stack: StackSettings, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")} | {
        "PERFLOOP_HOME": str(stack.home),
        "PERFLOOP_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "PERFLOOP_CLICKHOUSE_URL": stack.clickhouse_url,
        "PYTHONUNBUFFERED": "1",
    }
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "perfloop.cli", "service", "sink"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _rows(stack: StackSettings, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    ch = client(stack)
    try:
        return [tuple(r) for r in ch.query(sql, parameters=params).result_rows]
    finally:
        ch.close()


def test_a_killed_sink_loses_nothing_and_repeats_at_most_two_flushes(
    sinks_stack: StackSettings, tmp_path: Path
) -> None:
    stack = sinks_stack
    run = uuid.uuid4().hex[:6]
    jobs = [f"it-sinks-{run}-{i}" for i in range(JOBS)]
    pubs = [Publisher(stack, producer_id=j, spool_dir=stack.home_dir / "spool" / j) for j in jobs]
    ems = [Emitter(p, job_id=j, node="n0", producer_id=j) for p, j in zip(pubs, jobs, strict=True)]
    second = _sink(stack, tmp_path / "sink-2.log")
    sent = 0
    killed_at = 0.0
    step = 0
    t_next = time.time_ns() // STEP_NS * STEP_NS
    start = time.monotonic()
    try:
        while time.monotonic() - start < 40:
            now = time.time_ns()
            ts = np.arange(t_next, now, STEP_NS, dtype=np.int64)
            if len(ts):
                t_next = int(ts[-1]) + STEP_NS
                cols = {
                    "ts_ns": np.repeat(ts, RANKS),
                    "rank": np.tile(np.arange(RANKS), len(ts)),
                    "step": np.repeat(np.arange(step, step + len(ts)), RANKS),
                    "step_time_ms": np.full(len(ts) * RANKS, 50.0),
                    "data_wait_ms": np.full(len(ts) * RANKS, 1.0),
                    "num_workers": np.full(len(ts) * RANKS, 2),
                }
                step += len(ts)
                for em in ems:
                    em.extend("step", **cols)
                    em.flush()
                sent += len(ts) * RANKS * JOBS
            # kill the second sink 20 s in: it has joined the group (a join takes seconds)
            if not killed_at and time.monotonic() - start > 20:
                os.kill(second.pid, signal.SIGKILL)
                killed_at = time.monotonic()
            time.sleep(0.1)
        for p in pubs:
            assert p.flush(15) == 0
    finally:
        for p in pubs:
            p.close()
        if second.poll() is None:
            second.kill()
        second.wait(10)
    inserted = [
        int(line.split(" inserts, ")[1].split(" rows")[0])
        for line in (tmp_path / "sink-2.log").read_text().splitlines()
        if "sink stats:" in line
    ]
    assert inserted and max(inserted) > 0, "the second sink took a share and inserted it"

    def landed() -> bool:
        (n,) = _rows(
            stack,
            "SELECT uniqExact(job_id, rank, step) FROM steps WHERE job_id IN {j:Array(String)}",
            j=jobs,
        )[0]
        return n == sent

    wait_for(landed, 60, f"all {sent} step samples in the warehouse")
    rows, distinct = _rows(
        stack,
        "SELECT count(), uniqExact(job_id, rank, step) FROM steps WHERE job_id IN "
        "{j:Array(String)}",
        j=jobs,
    )[0]
    # what the killed sink may have inserted after its last commit: two flush intervals of
    # the whole rate (its partitions' share of it is less)
    bound = 2 * SinkSettings().flush_interval_s * RANKS * JOBS * NS / STEP_NS
    print(f"{sent} sent, {distinct} landed, {rows - distinct} twice (bound {bound:.0f})")
    assert distinct == sent
    assert rows - distinct <= bound, f"{rows - distinct} rows twice, more than {bound:.0f}"
