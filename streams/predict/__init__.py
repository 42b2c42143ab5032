"""Predictions: the online models hosted in the stream worker, forecasts per job, published with
what came.

`PredictionHost` is a stream-tier component (no I/O, picklable state) that the engine feeds on
each job's event-time clock, as it feeds the other analyses:

- **next window** — a job's completed steps (`StepAnalysis`) are gathered per second of event
  time (the second its steps ended in). Each second's window features — the median over
  every rank's steps of the step time and of each phase's time, the phase shares and the idle
  share — teach one `StepTimeForecaster` per target (`STEP_TARGETS`) and its `Ewma`
  baseline, which forecast the same median for the next second's steps: what the next step
  will take, as the fast loop sees it. At most every ``every_s`` (5 s) of event time, one
  `Prediction` per target goes out (``baseline`` = the moving average's forecast, ``step`` =
  the next step); the next window realises it. Working on windows, not single steps, keeps
  the cost per job and second flat however many ranks and steps it has: 8 jobs × 16 ranks at
  ~9 steps/s cost the worker ~1.3-2.7 µs more per sample when every step was forecast.
- **regime change** — the same window features go to a `RegimeDetector`; a change is
  published as target ``regime_change`` (value 1, the features that moved in ``evidence``):
  the slow loop's trigger.
- **time to OOM** — every rank's step events (peak or allocated memory; the highest of each
  batch, ~0.25 s of steps) with the device memory from its GPU samples teach a `TimeToOOM` per
  rank; when it warns (the forecast is
  under ``oom_horizon_s``) a ``time_to_oom_s`` prediction is published, at most every
  ``oom_every_s`` per rank. A job that then fails out of memory realises each warning with the
  seconds it actually had.
- **anomaly** — per job and second of event time, the window features above and the mean SM
  utilisation and power of its GPU samples are scored by a `WindowAnomaly`; a score at or
  above ``anomaly_threshold`` is published as ``anomaly_score``, at most every
  ``anomaly_every_s`` per job.
- **next phase** — each run-level `PhaseChange` teaches a `PhaseTransitionForecaster`, which
  forecasts the seconds until the new phase ends (``next_phase_s``), realised at the next
  change.
- **cross-run** — a job's `JobInfo` (model size, world size, batch size, GPU memory,
  precision, …; `job_features`) asks two `CrossRunPredictor` shared by all jobs for its median
  step time and its peak memory (``job_step_time_ms``, ``job_mem_peak_bytes``); when the job
  ends (or is forgotten) they learn what it realised — the median of its last
  ``_RING_STEPS`` job-level step times and the highest per-step peak of any rank — and the
  predictions are realised. The stream worker first teaches them the warehouse's history of
  finished jobs (`learn_history`, fed by the app).

Models live as long as their job (forgotten with it) and travel in `snapshot`, so a restarted
worker keeps what it learned. Live settings: ``predict.enabled`` and the ``predict.*`` numbers
above (`configure`).

Modules:

- ``host``: `PredictionHost`, which feeds the models and emits and realises the predictions;
- ``features``: the window features and a job's features (`job_features`) the models read;
- ``history``: the warehouse's history of finished jobs for the cross-run models
  (`load_history`; the stream worker reads it at start; not imported here, as it needs the
  warehouse client).
"""

from perfloop.streams.predict.features import job_features
from perfloop.streams.predict.host import STEP_TARGETS, PredictionHost

__all__ = ["STEP_TARGETS", "PredictionHost", "job_features"]
