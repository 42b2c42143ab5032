"""Steps: per-step analysis of each job, rank by rank, once a step is complete.

Contract: `StepAnalysis` (no I/O, picklable state) reads decoded step, span, kernel and
collective batches and, once a step of a job is complete, keeps a `StepRecord` of it (step
time, GPU busy and idle time, phase times, collective time, each rank's lateness and straggler
score) and returns its per-rank metrics (`DERIVED_METRICS`, as `METRIC_COLUMNS`) for the
windows. The prediction host reads the records (`PHASE_NAMES` orders their phase columns).

Modules:

- ``analysis``: `StepAnalysis`: when a step is complete, what it is computed from, its bounds;
- ``records``: `StepRecord` and the metric columns made of the records.
"""

from perfloop.streams.steps.analysis import StepAnalysis
from perfloop.streams.steps.records import DERIVED_METRICS, METRIC_COLUMNS, PHASE_NAMES, StepRecord

__all__ = ["DERIVED_METRICS", "METRIC_COLUMNS", "PHASE_NAMES", "StepAnalysis", "StepRecord"]
