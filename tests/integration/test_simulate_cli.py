"""`perfloop simulate` on the real embedded stack: every telemetry kind of a simulated
multi-node job lands in its table, and the ground truth file equals the warehouse's."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from perfloop.settings import StackSettings
from perfloop.warehouse import client

from .conftest import perfloop_cli, wait_for

pytestmark = pytest.mark.integration


def _rows(settings: StackSettings, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    ch = client(settings)
    try:
        return list(ch.query(sql, parameters=params).result_rows)
    finally:
        ch.close()


def test_simulated_straggler_lands_in_every_table_with_its_ground_truth(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    job = f"it-sim-{uuid.uuid4().hex[:8]}"
    gt_file = tmp_path / "ground_truth.jsonl"
    out = perfloop_cli(
        "simulate",
        "--scenario",
        "straggler",
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--duration",
        "5",
        "--speed",
        "5",
        "--seed",
        "3",
        "--job-id",
        job,
        "--ground-truth",
        str(gt_file),
        env=stack_env_vars,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("done: finished") and "straggler@" in summary, summary
    m = re.search(r" (\d+) steps, ([\d,]+) samples", summary)
    assert m, summary
    steps, samples = int(m.group(1)), int(m.group(2).replace(",", ""))
    assert steps > 20

    expected = {
        "steps": 4 * steps,
        "spans": 4 * 5 * steps,
        "collectives": 4 * steps,
        "gpu_samples": 4 * 50,  # every rank every 100 ms for 5 s
        "host_samples": 4 * 5,
        "job_info": 4,
        "ground_truth": 1,
        "job_lifecycle": 2 * 5,  # started and finished, per rank and for the job
    }
    assert sum(v for k, v in expected.items() if k not in ("job_info", "job_lifecycle")) == (
        samples + 1  # the summary counts telemetry samples, not job events
    )

    def counts() -> dict[str, int]:
        return {
            t: int(
                _rows(stack, f"SELECT count() FROM {t} WHERE job_id = {{j:String}}", j=job)[0][0]
            )
            for t in expected
        }

    wait_for(lambda: counts() == expected, 30, f"rows {expected} (last: {counts()})")
    nodes = _rows(
        stack,
        "SELECT DISTINCT node FROM gpu_samples WHERE job_id = {j:String} ORDER BY node",
        j=job,
    )
    assert [n for (n,) in nodes] == [f"{job}-node-0", f"{job}-node-1"]

    (line,) = gt_file.read_text().splitlines()
    doc = json.loads(line)
    (row,) = _rows(
        stack,
        "SELECT event_id, scenario, fault, toUnixTimestamp64Nano(onset), "
        "toUnixTimestamp64Nano(end), ranks, nodes, detail, node, rank "
        "FROM ground_truth WHERE job_id = {j:String}",
        j=job,
    )
    assert row == (
        doc["event_id"],
        doc["scenario"],
        doc["fault"],
        doc["onset_ns"],
        doc["end_ns"],
        doc["ranks"],
        doc["nodes"],
        doc["detail"],
        doc["node"],
        -1,
    )
    assert doc["scenario"] == doc["fault"] == "straggler" and len(doc["ranks"]) == 1
    # the straggler's forward passes are slower by the stated factor once the fault is on
    (straggler,) = doc["ranks"]
    (ratio,) = _rows(
        stack,
        "SELECT avgIf(duration_ms, rank = {r:Int32}) / avgIf(duration_ms, rank != {r:Int32}) "
        "FROM spans WHERE job_id = {j:String} AND phase = 'forward' "
        "AND ts > fromUnixTimestamp64Nano({on:Int64}) + INTERVAL 200 MILLISECOND "
        "AND ts < fromUnixTimestamp64Nano({end:Int64})",
        j=job,
        r=straggler,
        on=doc["onset_ns"],
        end=doc["end_ns"],
    )[0]
    factor = float(re.search(r"compute ([\d.]+)x", doc["detail"]).group(1))  # type: ignore[union-attr]
    assert ratio == pytest.approx(factor, rel=0.03)


def test_a_bad_scenario_is_a_one_line_error(stack_env_vars: dict[str, str]) -> None:
    out = perfloop_cli("simulate", "--scenario", "nope", "--duration", "1", env=stack_env_vars)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "valid: healthy, dataloader_starvation" in out.stderr
