"""What the prediction models read: a second's window features from the steps that ended in
it, and a job's features from what it says about itself at start (the cross-run models).

Public through `perfloop.streams.predict` (`job_features`).
"""

from __future__ import annotations

import numpy as np

from perfloop.schemas.job import JobInfo
from perfloop.streams.steps import PHASE_NAMES, StepRecord

__all__ = ["SHARES", "job_features", "window_features"]

SHARES = ("data_wait", "forward", "backward", "comm", "optimizer")
"""The step phases whose times and shares are window features."""
_PHASE_TARGETS = tuple(f"{p}_ms" for p in SHARES)
_PHASE_IDX = [PHASE_NAMES.index(p) for p in SHARES]
_BITS = {"fp32": 32.0, "tf32": 19.0, "bf16": 16.0, "fp16": 16.0, "amp_bf16": 16.0, "amp_fp16": 16.0}


def job_features(info: JobInfo) -> dict[str, float]:
    """What the cross-run models compare jobs by, from what a job says about itself at start
    (figures it left at 0 are unknown, so left out).

    >>> from perfloop.schemas.job import JobInfo
    >>> job_features(JobInfo(ts_ns=1, job_id="j", node="n", rank=-1, model_params=7 * 10**9,
    ...                      world_size=8, batch_size=32, precision="bf16"))
    {'params': 7000000000.0, 'world': 8.0, 'batch_size': 32.0, 'precision_bits': 16.0}
    """
    x = {
        "params": float(info.model_params),
        "world": float(info.world_size),
        "batch_size": float(info.batch_size),
        "grad_accum_steps": float(info.grad_accum_steps),
        "gpu_memory_bytes": float(info.gpu_mem_bytes),
        "tp_size": float(info.tp_size),
        "pp_size": float(info.pp_size),
        "precision_bits": _BITS.get(info.precision, 0.0),
    }
    keep = {k: v for k, v in x.items() if v > 0}
    for k in ("grad_accum_steps", "tp_size", "pp_size"):
        if keep.get(k) == 1.0:
            del keep[k]  # the default: says nothing about the job
    return keep


def window_features(records: list[StepRecord]) -> dict[str, float]:
    """The job-level view of the steps that ended in one second: medians over every rank's
    steps (NaN-free), in ms, and each phase's share of the step time."""
    x: dict[str, float] = {}
    step = np.concatenate([r.step_ms for r in records])
    step = step[np.isfinite(step)]
    if not len(step):
        return x
    x["step_time_ms"] = float(np.median(step))
    phases = np.concatenate([r.phase_ms[:, _PHASE_IDX] for r in records])
    known = np.isfinite(phases).all(axis=1)
    if known.any():
        med = np.median(phases[known], axis=0)
        for target, v in zip(_PHASE_TARGETS, med.tolist(), strict=True):
            x[target] = v
            if x["step_time_ms"] > 0:
                x[target.removesuffix("_ms") + "_share"] = v / x["step_time_ms"]
    idle = np.concatenate([r.idle_share for r in records])
    idle = idle[np.isfinite(idle)]
    if len(idle):
        x["idle_share"] = float(np.median(idle))
    return x
