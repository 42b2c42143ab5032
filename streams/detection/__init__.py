"""Detection: the funnel's per-job state and the detectors that read it.

Contract: `JobState` folds one job's decoded telemetry into bounded numpy arrays; each
detector (`step_detectors`, `device_detectors`, `hang_detector`) reads a job's state with its
`DetectConfig` and writes its active conditions into ``job.findings`` as `Finding` objects.
The funnel (`perfloop.streams.funnel`) runs them, ranks the findings and emits diagnoses; the
data-wait rule reads the loader verdict (`BOUND_IO`, `BOUND_CPU`) a starvation carries. No I/O,
and everything a detector keeps is builtins and numpy, so the funnel's snapshots carry it.

Public modules (their names are re-exported here):

- ``config``: `DetectConfig`, one frozen dataclass of bounded settings per detector;
- ``job_state``: `JobState`, the per-job ring of steps x ranks and latest readings, and the
  `Finding` a detector writes;
- ``steps``: the step-based detectors and their dispatch (`step_detectors`): load imbalance,
  data-loader starvation, comm degradation, exposed comm, memory;
- ``device``: throttling, GPU errors, CPU saturation and the roofline class
  (`device_detectors`);
- ``hang``: the hang watchdog (`hang_detector`);
- ``loader``: what bounds a starved rank's loader, storage or CPU (`BOUND_IO`, `BOUND_CPU`).

Private helpers:

- ``_state_parts``: the ring's array specs, `Finding` and episode bookkeeping;
- ``_feeds``: the GPU, host and job-event handlers of `JobState` (a mixin);
- ``_arrival``: each rank's arrival at the collectives, step by step (`ArrivalRing`);
- ``_persistence``: conditions that must outlast the job's own noise (`Persistence`);
- ``_common``: NaN-aware statistics over (steps x ranks) and findings bookkeeping;
- ``_straggler``: the data-parallel straggler;
- ``_pipeline``: a pipeline's straggler and load imbalance;
- ``_threads``: thread oversubscription;
- ``_rss_leak``: a CPU job's memory leak from its resident memory.
"""

from perfloop.streams.detection.config import DetectConfig
from perfloop.streams.detection.device import device_detectors
from perfloop.streams.detection.hang import hang_detector
from perfloop.streams.detection.job_state import NS, Finding, JobState
from perfloop.streams.detection.loader import BOUND_CPU, BOUND_IO, BOUND_UNKNOWN
from perfloop.streams.detection.steps import step_detectors

__all__ = [
    "BOUND_CPU",
    "BOUND_IO",
    "BOUND_UNKNOWN",
    "NS",
    "DetectConfig",
    "Finding",
    "JobState",
    "device_detectors",
    "hang_detector",
    "step_detectors",
]
