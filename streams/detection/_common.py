"""What the step-based detectors share: NaN-aware statistics over (steps x ranks) matrices and
the bookkeeping of a detector's findings in `JobState.findings`."""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.streams.detection.job_state import Finding, JobState

__all__ = ["nanmean", "nanmedian", "node_of", "nz", "replace_findings", "step_start", "trailing"]


def trailing(flag: np.ndarray) -> np.ndarray:
    """Length of the run of True at the end of each column (axis 0).

    >>> trailing(np.array([[1, 0], [1, 1], [0, 1], [1, 1]], dtype=bool)).tolist()
    [1, 3]
    """
    if not len(flag):
        return np.zeros(flag.shape[1:], dtype=np.int64)
    return np.cumprod(flag[::-1], axis=0).sum(axis=0)


def nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """Median along ``axis`` (0 or 1) of a 2-D array, ignoring NaN; NaN where all are NaN.

    Much cheaper than `numpy.nanmedian` on the small matrices the detectors use.

    >>> nanmedian(np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, np.nan]]), 1).tolist()
    [2.0, nan]
    """
    if axis == 0:
        a = a.T
    s = np.sort(a, axis=1)  # NaN sorts last, so with no value both picks are NaN
    n = a.shape[1] - np.isnan(a).sum(axis=1)
    rows = np.arange(len(s))
    return 0.5 * (s[rows, (n - 1) // 2] + s[rows, n // 2])


def nz(x: Any) -> Any:
    """NaN → 0 (cheaper than `numpy.nan_to_num` on small arrays)."""
    return np.where(x == x, x, 0.0)


def nanmean(a: np.ndarray, axis: int | None = None) -> Any:
    """Mean ignoring NaN, without the warning numpy gives for an all-NaN slice."""
    ok = ~np.isnan(a)
    n = ok.sum(axis=axis)
    total = np.where(ok, a, 0.0).sum(axis=axis)
    return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def replace_findings(job: JobState, prefix: str, found: dict[str, Finding]) -> None:
    """Set ``prefix`` findings to ``found``, keeping each open one's first onset."""
    for key in [k for k in job.findings if k.startswith(prefix) and k not in found]:
        del job.findings[key]
    for key, f in found.items():
        old = job.findings.get(key)
        if old is not None:
            f.onset_ns = old.onset_ns
        job.findings[key] = f


def step_start(win: dict[str, np.ndarray], i: int, r: Any) -> Any:
    """Event time at which step row ``i`` of rank(s) ``r`` started."""
    return win["end"][i, r] - np.nan_to_num(win["st"][i, r] * 1e6).astype(np.int64)


def node_of(job: JobState, rank: int) -> list[str]:
    """The name of the node ``rank`` runs on, as a list (empty when unknown)."""
    n = int(job.rank["node"][rank]) if 0 <= rank < len(job.rank["node"]) else -1
    return [job.nodes[n]] if 0 <= n < len(job.nodes) else []
