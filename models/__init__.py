"""perfloop's models: online models and analytical ones, pure functions and classes, no I/O.

Online (`perfloop.models.base` is their one protocol): an online model learns with
``learn_one(x, y=None)`` and answers with ``predict_one(x)`` or ``score_one(x)``; its
hyperparameters are its constructor's arguments; it is deterministic given its inputs and its
seed, reads and writes nothing, and pickles, so stream workers host, persist and swap it. Every
online model class is registered, and the contract suite (`perfloop.models.checks`) runs over
all of them:

- `StepTimeForecaster` (next step's time and each phase's), with the `LastValue` and `Ewma`
  baselines; `RegimeDetector` (ADWIN / Page–Hinkley on step time and phase shares);
  `WindowAnomaly` (multivariate window features); `TimeToOOM` (memory trend and per-step
  peaks); `PhaseTransitionForecaster` (time to the next phase); `CrossRunPredictor` (a new
  job's step time and peak memory from similar past jobs); `GradientNoiseScale`.

Analytical (plain functions of their inputs):

- memory and communication of DDP, ZeRO-1/2/3 and FSDP (`perfloop.models.memory`: `estimate`,
  `plan`), behind ``perfloop plan``;
- the device catalog (`device`) and roofline classification (`roofline_point`);
- mixed-precision benefit (`precision_speedup`), goodput and batch size
  (`recommend_batch_size`), the data-pipeline requirement (`pipeline_requirement`,
  `loader_workers_needed`).
"""

from perfloop.models.anomaly import WindowAnomaly
from perfloop.models.base import (
    Features,
    Forecaster,
    Model,
    Predictor,
    Scorer,
    register,
    registered,
)
from perfloop.models.batch_size import (
    BatchSizeRecommendation,
    GradientNoiseScale,
    StepTimeModel,
    goodput,
    recommend_batch_size,
    statistical_efficiency,
)
from perfloop.models.crossrun import CrossRunPredictor
from perfloop.models.datapipe import (
    PipelineRequirement,
    expected_step_gain,
    loader_workers_needed,
    pipeline_requirement,
)
from perfloop.models.devices import Device, device, devices, match_device
from perfloop.models.drift import RegimeDetector
from perfloop.models.memory import Plan, StrategyEstimate, TransformerShape
from perfloop.models.memory import estimate as memory_estimate
from perfloop.models.memory import plan as memory_plan
from perfloop.models.oom import TimeToOOM
from perfloop.models.phase import PhaseTransitionForecaster
from perfloop.models.precision import PrecisionEstimate, precision_estimates, precision_speedup
from perfloop.models.roofline import RooflinePoint, roofline_point
from perfloop.models.steptime import Ewma, LastValue, StepTimeForecaster

__all__ = [
    "BatchSizeRecommendation",
    "CrossRunPredictor",
    "Device",
    "Ewma",
    "Features",
    "Forecaster",
    "GradientNoiseScale",
    "LastValue",
    "Model",
    "PhaseTransitionForecaster",
    "PipelineRequirement",
    "Plan",
    "PrecisionEstimate",
    "Predictor",
    "RegimeDetector",
    "RooflinePoint",
    "Scorer",
    "StepTimeForecaster",
    "StepTimeModel",
    "StrategyEstimate",
    "TimeToOOM",
    "TransformerShape",
    "WindowAnomaly",
    "device",
    "devices",
    "expected_step_gain",
    "goodput",
    "loader_workers_needed",
    "match_device",
    "memory_estimate",
    "memory_plan",
    "pipeline_requirement",
    "precision_estimates",
    "precision_speedup",
    "recommend_batch_size",
    "register",
    "registered",
    "roofline_point",
    "statistical_efficiency",
]
