"""Completed-step records and the metric columns made of them (`StepAnalysis`,
`perfloop.streams.steps.analysis`, documents both). Public through `perfloop.streams.steps`:
the engine windows the metrics, the prediction host reads the records."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from perfloop.schemas.telemetry import STANDARD_PHASES

__all__ = [
    "DERIVED_METRICS",
    "METRIC_COLUMNS",
    "PHASE_NAMES",
    "StepRecord",
    "median",
    "metric_columns",
    "nanmean0",
    "record_state",
]

PHASE_NAMES: tuple[str, ...] = (*STANDARD_PHASES, "user")
"""Depth-0 phases in the order of `StepRecord.phase_ms` columns; other names count as user."""
SHARE_PHASES = ("data_wait", "forward", "backward", "comm", "optimizer")
DERIVED_METRICS: tuple[str, ...] = (
    "gpu_busy_ms",
    "gpu_idle_ms",
    "idle_share",
    "collective_ms",
    "lateness_ms",
    "straggler_score",
    *(f"{p}_share" for p in SHARE_PHASES),
)
"""Per-rank metrics `StepAnalysis.tick` returns (one row per rank and completed step)."""
METRIC_COLUMNS = ("job_id", "node", "rank", "ts_ns", "step", "metric", "value")
"""Columns of `StepAnalysis.tick`'s output; ``ts_ns`` is the step's end on that rank."""

_PH = {p: i for i, p in enumerate(PHASE_NAMES)}
_USER = _PH["user"]
_COMM = _PH["comm"]
_SHARE_IDX = [_PH[p] for p in SHARE_PHASES]


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """One completed step of one job: per-rank arrays aligned with ``ranks``.

    Float figures are NaN where unknown (no kernel summary, no spans, a single rank).
    """

    job_id: str
    step: int
    ranks: np.ndarray  # int64
    nodes: tuple[str, ...]
    end_ns: np.ndarray  # int64
    step_ms: np.ndarray
    busy_ms: np.ndarray
    busy_streams_sum_ms: np.ndarray
    idle_ms: np.ndarray
    idle_share: np.ndarray
    phase_ms: np.ndarray  # (ranks, len(PHASE_NAMES))
    collective_ms: np.ndarray
    lateness_ms: np.ndarray
    straggler_score: np.ndarray  # the rank's score over its recent steps, this one included
    missing_ranks: tuple[int, ...] = ()

    @property
    def slowest_rank(self) -> int:
        """The rank that arrived last at this step (-1 with fewer than two ranks)."""
        if len(self.ranks) < 2 or not np.isfinite(self.lateness_ms).any():
            return -1
        return int(self.ranks[int(np.nanargmax(self.lateness_ms))])

    def phase_share(self, phase: str) -> np.ndarray:
        """Each rank's share of the step spent in ``phase`` (NaN without spans)."""
        return self.phase_ms[:, _PH[phase]] / self.step_ms


def median(a: np.ndarray) -> float:
    """Median of a small array (sorting beats `np.median`'s overhead at this size)."""
    s = np.sort(a)
    m = len(s) // 2
    return float(s[m]) if len(s) % 2 else (float(s[m - 1]) + float(s[m])) / 2


def nanmean0(a: np.ndarray) -> np.ndarray:
    """Mean over axis 0 ignoring NaN; NaN (without a warning) where a column has no value."""
    n = np.isfinite(a).sum(axis=0)
    total = np.nansum(a, axis=0)
    return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def record_state(r: StepRecord) -> dict[str, Any]:
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}


def metric_columns(records: list[StepRecord]) -> dict[str, np.ndarray]:
    """One row per (record, rank, metric) with a finite value."""
    parts: dict[str, list[np.ndarray]] = {c: [] for c in METRIC_COLUMNS}
    for r in records:
        n = len(r.ranks)
        with np.errstate(all="ignore"):
            shares = r.phase_ms[:, _SHARE_IDX] / r.step_ms[:, None]
        values = np.stack(
            [
                r.busy_ms,
                r.idle_ms,
                r.idle_share,
                r.collective_ms,
                r.lateness_ms,
                r.straggler_score,
                *shares.T,
            ]
        )  # (metrics, ranks)
        ok = np.isfinite(values)
        m_idx, r_idx = np.nonzero(ok)
        parts["value"].append(values[ok])
        parts["metric"].append(np.asarray(DERIVED_METRICS, dtype=object)[m_idx])
        parts["rank"].append(r.ranks[r_idx])
        parts["ts_ns"].append(r.end_ns[r_idx])
        parts["node"].append(np.asarray(r.nodes, dtype=object)[r_idx] if n else np.empty(0, object))
        parts["job_id"].append(np.full(len(r_idx), r.job_id, dtype=object))
        parts["step"].append(np.full(len(r_idx), r.step, dtype=np.int64))
    dtypes = {"job_id": object, "node": object, "metric": object, "rank": np.int64,
              "ts_ns": np.int64, "step": np.int64, "value": np.float64}  # fmt: skip
    return {
        c: (np.concatenate(parts[c]) if parts[c] else np.empty(0, dtypes[c])).astype(dtypes[c])
        for c in METRIC_COLUMNS
    }
