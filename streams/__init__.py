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
