"""The warehouse's history of finished jobs, for the cross-run models (`PredictionHost`); the
stream worker (`perfloop.streams.app`) reads it at start.

`load_history` reads, for the last ``limit`` jobs that ended (a ``job_lifecycle`` row of the
job, rank -1, finished, failed or killed), what each said about itself at start (its first
``job_info``), the median of its step times and the highest per-step memory peak of any rank
(``steps``), oldest first. A job without step rows has NaN there (the models skip it). Query
parameters are bound server-side.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pydantic import ValidationError

from perfloop.exceptions import WarehouseError
from perfloop.schemas.job import JobInfo
from perfloop.settings import BaseServiceSettings
from perfloop.streams.predict.features import job_features
from perfloop.warehouse import query

__all__ = ["HISTORY_SQL", "load_history"]

log = logging.getLogger("perfloop.streams")

_INFO = (
    "model_params",
    "world_size",
    "batch_size",
    "grad_accum_steps",
    "gpu_mem_bytes",
    "tp_size",
    "pp_size",
    "precision",
)
HISTORY_SQL = f"""
SELECT i.job_id, {", ".join(f"i.{c}" for c in _INFO)}, s.med, s.peak
FROM
(
    SELECT job_id, max(ts) AS ended
    FROM job_lifecycle
    WHERE rank = -1 AND state IN ('finished', 'failed', 'killed')
    GROUP BY job_id
    ORDER BY ended DESC
    LIMIT {{limit:UInt32}}
) AS e
INNER JOIN
(
    SELECT job_id, {", ".join(f"argMin({c}, ts) AS {c}" for c in _INFO)}
    FROM job_info
    GROUP BY job_id
) AS i ON i.job_id = e.job_id
LEFT JOIN
(
    SELECT job_id, quantile(0.5)(step_time_ms) AS med, max(mem_peak_bytes) AS peak
    FROM steps
    WHERE job_id IN (
        SELECT job_id FROM job_lifecycle
        WHERE rank = -1 AND state IN ('finished', 'failed', 'killed')
    )
    GROUP BY job_id
) AS s ON s.job_id = e.job_id
ORDER BY e.ended
"""


def load_history(
    settings: BaseServiceSettings, limit: int = 512
) -> list[tuple[dict[str, float], float, float]]:
    """``(features, median step ms, peak bytes)`` of the last ``limit`` finished jobs.

    Raise `WarehouseError` (one line) if the warehouse cannot be asked.
    """
    try:
        rows = query(settings, HISTORY_SQL, {"limit": limit}, timeout_s=10.0).result_rows
    except Exception as e:  # WarehouseError's one line, or whatever else went wrong
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise WarehouseError(f"cannot read the job history: {first}") from e
    out = []
    for row in rows:
        job_id, *info, med, peak = row
        try:
            fields = dict(zip(_INFO, info, strict=True))
            ji = JobInfo(ts_ns=1, job_id=job_id, node="history", rank=-1, **fields)
        except ValidationError:
            log.debug("job %s: unreadable job_info in the history, skipped", job_id)
            continue
        out.append((job_features(ji), _num(med), _num(peak)))
    return out


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) and f > 0 else math.nan
