"""Data-pipeline requirement: how many loader workers keep the device fed.

A step takes ``compute + wait`` where ``wait`` is the time the training loop spends waiting
for its next batch. With ``W`` workers loading in parallel, a batch is ready every
``load / W``; the loop stops waiting once ``load / W <= compute``. From one observed step
(share ``s = wait / step``, ``W`` workers) the load time is ``W * step`` and the compute time
is ``(1 - s) * step``, so the workers needed are ``ceil(W / (1 - s))``, plus headroom for
jitter. A loop with no workers loads in the main process, between computes: its wait is the
whole load time (``s * step``), so ``ceil(s / (1 - s))`` workers hide it.

`pipeline_requirement` says the same in rates, for a job whose rates are known (measured or
planned): the device consumes ``batch / compute`` samples a second, one loader worker supplies
``batch / load``; the workers needed are the ratio (plus headroom), and the prefetch depth is
what keeps a slow batch — ``load · (1 + z · cv)`` for a load time with coefficient of variation
``cv`` — from starving the device: the batches in flight (``workers · prefetch_factor``) must
cover the device's consumption during it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "PipelineRequirement",
    "expected_step_gain",
    "loader_workers_needed",
    "pipeline_requirement",
]


def loader_workers_needed(
    data_wait_share: float, current_workers: int, *, max_workers: int, headroom: float = 0.25
) -> int:
    """Workers needed so data loading hides behind compute, capped at ``max_workers``.

    >>> loader_workers_needed(0.5, 2, max_workers=16)
    5
    >>> loader_workers_needed(0.0, 2, max_workers=16)
    2
    >>> loader_workers_needed(0.9, 4, max_workers=8)
    8
    >>> loader_workers_needed(0.4, 0, max_workers=16)  # loading in the loop: 0.4 / 0.6 +25 %
    1
    """
    if not 0.0 <= data_wait_share < 1.0:
        raise ValueError(f"data_wait_share must be in [0, 1), got {data_wait_share!r}")
    if current_workers < 0 or max_workers < 1:
        raise ValueError(f"workers must be >= 0 and max >= 1, got {current_workers}, {max_workers}")
    if data_wait_share == 0.0:
        return current_workers
    # the load time of one batch by one worker, in units of the current step time
    load = float(current_workers) if current_workers else data_wait_share
    needed = max(1, math.ceil(load / (1.0 - data_wait_share) * (1.0 + headroom)))
    return max(current_workers, min(needed, max_workers))


def expected_step_gain(data_wait_share: float, current_workers: int, new_workers: int) -> float:
    """Expected fraction of step time saved by going from ``current`` to ``new`` workers.

    >>> round(expected_step_gain(0.5, 2, 4), 3)
    0.5
    >>> round(expected_step_gain(0.5, 2, 3), 3)
    0.333
    >>> round(expected_step_gain(0.4, 0, 1), 3)  # loading moves off the training loop
    0.4
    """
    if not 0.0 <= data_wait_share <= 1.0:
        raise ValueError(f"data_wait_share must be in [0, 1], got {data_wait_share!r}")
    if current_workers < 0 or new_workers < 0:
        raise ValueError(f"workers must be >= 0, got {current_workers}, {new_workers}")
    if new_workers <= current_workers or data_wait_share == 0.0:
        return 0.0
    compute = 1.0 - data_wait_share  # in units of the current step time
    # load time of one batch by one worker, same units (no workers: the wait is the load)
    load = float(current_workers) if current_workers else data_wait_share
    new_step = max(compute, load / new_workers)
    return max(0.0, 1.0 - new_step)


@dataclass(frozen=True)
class PipelineRequirement:
    """What a data pipeline must supply, and the loader settings that supply it."""

    device_samples_per_s: float  # what the device consumes when never kept waiting
    loader_samples_per_s: float  # what the current workers supply
    bound: str  # "loader" when the loader supplies less than the device consumes, else "device"
    workers_needed: int
    prefetch_factor: int
    expected_speedup: float  # steps/s with ``workers_needed`` over steps/s now


def pipeline_requirement(
    batch_size: int,
    compute_s: float,
    load_s: float,
    workers: int,
    *,
    load_cv: float = 0.0,
    z: float = 2.33,
    headroom: float = 0.1,
    max_workers: int = 64,
) -> PipelineRequirement:
    """Samples/s the device consumes against what the loader supplies → workers and prefetch.

    ``compute_s``: device time per batch; ``load_s``: one worker's time to make a batch (mean),
    ``load_cv`` its coefficient of variation; ``workers``: loader workers now (0 = loading in
    the training process, which then also stops the device while it loads). ``z`` = 2.33 covers
    a 99th-percentile slow batch for normally spread load times.

    >>> r = pipeline_requirement(64, compute_s=0.05, load_s=0.2, workers=2, load_cv=0.3)
    >>> r.device_samples_per_s, r.loader_samples_per_s, r.bound
    (1280.0, 640.0, 'loader')
    >>> r.workers_needed, r.prefetch_factor, round(r.expected_speedup, 2)
    (5, 2, 2.0)
    """
    for name, v in (("compute_s", compute_s), ("load_s", load_s)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be finite and > 0, got {v!r}")
    if batch_size < 1 or workers < 0 or max_workers < 1:
        raise ValueError(
            f"need batch_size >= 1, workers >= 0, max_workers >= 1; got {batch_size}, "
            f"{workers}, {max_workers}"
        )
    if not (load_cv >= 0 and z >= 0 and headroom >= 0):
        raise ValueError(f"need load_cv, z, headroom >= 0; got {load_cv}, {z}, {headroom}")
    device = batch_size / compute_s
    per_worker = batch_size / load_s
    if workers == 0:
        # loading in the training loop: one batch every load + compute
        supplied = batch_size / (load_s + compute_s)
        now_step = load_s + compute_s
    else:
        supplied = per_worker * workers
        now_step = max(compute_s, load_s / workers)
    needed = min(max_workers, max(1, math.ceil(device / per_worker * (1.0 + headroom))))
    new_step = max(compute_s, load_s / needed)
    slow = load_s * (1.0 + z * load_cv)
    prefetch = max(2, math.ceil(slow / (needed * compute_s)))
    return PipelineRequirement(
        device_samples_per_s=device,
        loader_samples_per_s=supplied,
        bound="loader" if supplied < device else "device",
        workers_needed=max(needed, workers) if supplied >= device else needed,
        prefetch_factor=prefetch,
        expected_speedup=now_step / new_step,
    )
