"""A two-rank job as the warehouse would give it to the report (`JobData`), with every kind of
row the page shows: steps, phases, a checkpoint, collectives with a late rank, GPU samples,
a change and its verdict, a diagnosis and predictions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from perfloop.report.accounting import Spans, Steps
from perfloop.report.collectives import Collectives
from perfloop.report.data import GpuSeries, JobData

NS = 10**9
T0 = 1_800_000_000 * NS  # the job starts
STEP_MS = 100.0


def two_rank_job(**overrides: Any) -> JobData:
    """Two ranks, 100 steps of 100 ms each from 1 s after the start; rank 1 arrives 30 ms late
    at each step's all-reduce from step 50 on; GPU samples on one device each."""
    n = 100
    ranks = np.repeat([0, 1], n)
    steps = np.tile(np.arange(n), 2)
    end = T0 + NS + (steps + 1) * int(STEP_MS * 1e6)
    late1 = np.where(np.arange(n) >= 50, 30.0, 0.0)  # rank 1's lateness
    coll_start = end - 40_000_000 + (np.concatenate([np.zeros(n), late1]) * 1e6).astype(np.int64)
    coll_ms = np.concatenate([5.0 + late1, np.full(n, 5.0)])  # rank 0 waits for rank 1
    data = {
        "job_id": "unit-job",
        "info": {
            "model_name": "Net",
            "model_params": 1_000_000,
            "world_size": 2,
            "parallelism": "ddp",
            "precision": "bf16",
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "gpu_count": 1,
            "cpu_count": 16,
            "tp_size": 1,
            "pp_size": 1,
            "command": "python train.py",
            "extra": {"flops_per_step": "2e12"},
        },
        "nodes": {"n0": {"cpu_count": 16, "gpu_count": 1}, "n1": {"cpu_count": 16, "gpu_count": 1}},
        "lifecycle": [
            {"rank": -1, "ts_ns": T0, "state": "started", "exit_code": None, "message": ""},
            {"rank": -1, "ts_ns": T0 + 12 * NS, "state": "finished", "exit_code": 0, "message": ""},
        ],
        "steps": Steps.of(
            rank=ranks,
            step=steps,
            end_ns=end,
            step_ms=[STEP_MS] * 2 * n,
            data_wait_ms=[10.0] * 2 * n,
            samples=[32] * 2 * n,
            tokens=[4096] * 2 * n,
        ),
        "phase_ms": [
            {"rank": r, "phase": p, "total_ms": ms * n, "steps": n}
            for r in (0, 1)
            for p, ms in (("data_wait", 10.0), ("forward", 30.0), ("backward", 40.0))
        ],
        "stalls": Spans.of(
            rank=[0], start_ns=[T0 + 11 * NS], duration_ms=[500.0], phase=["checkpoint"]
        ),
        "collectives": Collectives.of(
            rank=ranks, step=steps, start_ns=coll_start, duration_ms=coll_ms, group=["0"] * 2 * n
        ),
        "gpus": [
            GpuSeries(
                node,
                0,
                [T0 // 10**6 + i * 100 for i in range(100)],
                [90.0] * 100,
                [400.0] * 100,
                [40e9] * 100,
                80 * 2**30,
            )
            for node in ("n0", "n1")
        ],
        "gpu_energy": [
            {
                "node": node,
                "device": 0,
                "first_mj": 1_000_000,
                "last_mj": 6_000_000,
                "mean_power_w": 400.0,
                "span_s": 10.0,
            }
            for node in ("n0", "n1")
        ],
        "changes": [
            {
                "command_id": "c1",
                "ts_ns": T0 + 4 * NS,
                "rank": 0,
                "status": "applied",
                "knob": "dataloader.num_workers",
                "value": "2",
                "step": 30,
                "reason": "",
                "evidence": {},
                "from_value": "0",
            },
            {
                "command_id": "c1",
                "ts_ns": T0 + 7 * NS,
                "rank": 0,
                "status": "kept",
                "knob": "dataloader.num_workers",
                "value": "2",
                "step": 60,
                "reason": "it helped",
                "evidence": {"before_ms": 120.0, "after_ms": 100.0, "ratio": 0.83, "p_value": 0.01},
                "from_value": "0",
            },
        ],
        "diagnoses": [
            {
                "diagnosis_id": "d1",
                "bottleneck": "straggler",
                "level": "network",
                "state": state,
                "ts_ns": T0 + t * NS,
                "onset_ns": T0 + 6 * NS,
                "step_share": 0.3,
                "confidence": 0.9,
                "ranks": [1],
                "explained_by": "",
                "critical_path": True,
                "summary": "rank 1 arrives late",
            }
            for state, t in (("open", 7), ("update", 9))
        ],
        "predictions": [
            {
                "target": "step_time_ms",
                "model": "steptime",
                "ts_ns": T0 + (3 + i) * NS,
                "predicted": 100.0 + i,
                "realised": 100.0,
                "baseline": 110.0,
                "ape": i / 100.0,
                "baseline_ape": 0.1,
            }
            for i in range(5)
        ],
    }
    data.update(overrides)
    return JobData(**data)


@pytest.fixture()
def make_job() -> Callable[..., JobData]:
    return two_rank_job
