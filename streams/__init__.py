"""Modeling tier, streaming part: ingest, windows, phases, cross-rank analysis, funnel, sink.

Contract: the stream worker (`perfloop.streams.app`, a Faust app; imported on demand because it
pulls in Faust) consumes the telemetry topics and ``perfloop.control`` at least once and hosts
one `StreamEngine`. The engine validates every message (bad input goes to ``perfloop.dlq`` with
its reason) and feeds its components — `WindowSet` (1 s / 10 s / 60 s tumbling and hopping
windows), `StepAnalysis` (per-step busy/idle and stragglers), `PhaseMachine` and `Funnel` (the
top-down bottleneck funnel) and the rules (`DataWaitRule`, `ThreadRule`, `StragglerRule`) —
whose output goes to ``perfloop.windows``, ``perfloop.phases``, ``perfloop.diagnoses`` and
``perfloop.recommendations``. State is snapshotted to disk before
input is acknowledged. The sink (`perfloop.warehouse.sink`) lands every topic in the warehouse.

Layout, one concept per subpackage or module:

- ``app``: the Faust stream worker (`StreamsService`); ``_publisher``: what it publishes, through
  a librdkafka producer off its event loop;
- ``engine``: `StreamEngine`, the worker's pure core (validation, routing, snapshots);
  ``_event_time``: each job's event-time clock and how the engine runs the analyses on it;
- ``windows/``: the event-time windows (`WindowSet`); ``sketch``: the mergeable quantile
  sketches their quantiles come from;
- ``steps/``: the per-step analysis (`StepAnalysis`); ``phases/``: the run and step phases
  (`PhaseMachine`); ``_batch_groups``: the batch grouping both apply their input with;
  ``_spans``: which nested comm spans are blocked time (steps and detection);
- ``funnel``: the top-down bottleneck funnel (`Funnel`); ``detection/``: the per-job state and
  the detectors it runs;
- ``rules/``: diagnoses to recommendations; ``outcomes``: what applied changes did;
- ``predict/``: the online models (`PredictionHost`) and the history they start from;
- ``evaluation``, ``sink``: moved names, kept for one release.
"""

from perfloop.streams.engine import Outputs, StreamEngine
from perfloop.streams.funnel import DetectConfig, Funnel, actionable
from perfloop.streams.phases import PhaseMachine
from perfloop.streams.rules import KNOB_NUM_WORKERS, DataWaitRule, StragglerRule, ThreadRule
from perfloop.streams.steps import StepAnalysis
from perfloop.streams.windows import NS, WindowSet, WindowSpec, parse_specs, split_by_job

__all__ = [
    "KNOB_NUM_WORKERS",
    "NS",
    "DataWaitRule",
    "DetectConfig",
    "Funnel",
    "Outputs",
    "PhaseMachine",
    "StepAnalysis",
    "StragglerRule",
    "StreamEngine",
    "ThreadRule",
    "WindowSet",
    "WindowSpec",
    "actionable",
    "parse_specs",
    "split_by_job",
]
