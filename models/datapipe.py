"""Data-pipeline requirement: how many loader workers keep the device fed.

A step takes ``compute + wait`` where ``wait`` is the time the training loop spends waiting
for its next batch. With ``W`` workers loading in parallel, a batch is ready every
``load / W``; the loop stops waiting once ``load / W <= compute``. From one observed step
(share ``s = wait / step``, ``W`` workers) the load time is ``W * step`` and the compute time
is ``(1 - s) * step``, so the workers needed are ``ceil(W / (1 - s))``, plus headroom for
jitter. A loop with no workers (loading in the main process) counts as one worker that also
blocks compute, which the same bound covers.
"""

from __future__ import annotations

import math

__all__ = ["expected_step_gain", "loader_workers_needed"]


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
    """
    if not 0.0 <= data_wait_share < 1.0:
        raise ValueError(f"data_wait_share must be in [0, 1), got {data_wait_share!r}")
    if current_workers < 0 or max_workers < 1:
        raise ValueError(f"workers must be >= 0 and max >= 1, got {current_workers}, {max_workers}")
    workers = max(current_workers, 1)
    if data_wait_share == 0.0:
        return current_workers
    needed = math.ceil(workers / (1.0 - data_wait_share) * (1.0 + headroom))
    return max(current_workers, min(needed, max_workers))


def expected_step_gain(data_wait_share: float, current_workers: int, new_workers: int) -> float:
    """Expected fraction of step time saved by going from ``current`` to ``new`` workers.

    >>> round(expected_step_gain(0.5, 2, 4), 3)
    0.5
    >>> round(expected_step_gain(0.5, 2, 3), 3)
    0.333
    """
    if not 0.0 <= data_wait_share <= 1.0:
        raise ValueError(f"data_wait_share must be in [0, 1], got {data_wait_share!r}")
    if current_workers < 0 or new_workers < 0:
        raise ValueError(f"workers must be >= 0, got {current_workers}, {new_workers}")
    if new_workers <= current_workers or data_wait_share == 0.0:
        return 0.0
    w0, w1 = max(current_workers, 1), max(new_workers, 1)
    compute = 1.0 - data_wait_share  # in units of the current step time
    load = float(w0)  # load time of one batch by one worker, same units
    new_step = max(compute, load / w1)
    return max(0.0, 1.0 - new_step)
