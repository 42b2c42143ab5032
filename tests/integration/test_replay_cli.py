"""`perfloop replay` as a user runs it: two rank files of one job land in the warehouse."""

from __future__ import annotations

import uuid

import pytest

from perfloop.settings import StackSettings
from perfloop.warehouse import client
from tests.helpers import TRACES

from .conftest import perfloop_cli, wait_for

pytestmark = pytest.mark.integration

RANKS = sorted((TRACES / "hta" / "trace_filter").glob("sampled_rank-*.json.gz"))


def _rows(settings: StackSettings, sql: str, **params: object) -> list[tuple[object, ...]]:
    ch = client(settings)
    try:
        return list(ch.query(sql, parameters=params).result_rows)
    finally:
        ch.close()


@pytest.mark.skipif(len(RANKS) != 2, reason="trace_filter rank files missing")
def test_replay_two_ranks_into_the_warehouse(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = f"replay-it-{uuid.uuid4().hex[:8]}"
    run = perfloop_cli("replay", "--job-id", job, *map(str, RANKS), env=stack_env_vars)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert f"as job {job}" in run.stdout and "rank 1" in run.stdout
    assert "times shifted by" in run.stdout  # 2023 traces: moved to now, or the TTL drops them

    def steps() -> list[tuple[object, ...]]:
        rows = _rows(
            stack,
            "SELECT rank, step, step_time_ms FROM steps WHERE job_id = {j:String} "
            "ORDER BY rank, step",
            j=job,
        )
        return rows if len(rows) == 4 else []

    got = wait_for(steps, 60, "4 step rows (2 ranks x 2 steps)")
    assert [(r[0], r[1]) for r in got] == [(0, 551), (0, 552), (1, 551), (1, 552)]
    assert all(600 < float(r[2]) < 640 for r in got)  # ProfilerStep spans of ~607-631 ms

    def gpu_busy() -> list[tuple[object, ...]]:
        rows = _rows(
            stack,
            "SELECT rank, step, count, busy_ms FROM kernel_summaries WHERE job_id = {j:String} "
            "AND stream = -1 AND kernel_class = 'all' ORDER BY rank, step",
            j=job,
        )
        return rows if len(rows) == 4 else []

    busy = wait_for(gpu_busy, 60, "the per-step GPU busy rows of both ranks")
    assert {(r[0], r[1]) for r in busy} == {(0, 551), (0, 552), (1, 551), (1, 552)}
    assert all(int(r[2]) > 0 and float(r[3]) > 0 for r in busy)
    # Every rank's activities add up to what the trace holds (1204 and 1154 launches).
    per_rank = {rank: sum(int(r[2]) for r in busy if r[0] == rank) for rank in (0, 1)}
    assert per_rank == {0: 1204, 1: 1154}
