"""Observation tier: publish typed telemetry from training nodes; never slow or break the job.

Contract: publishing returns at once and never raises into the training loop; every message
is accounted for (`PublisherStats`). Producers batch samples per kind through an `Emitter`.
`SimulatedJob` is a multi-node data-parallel job with injectable faults (`Fault`; named
scenarios in `SCENARIOS`, planned from a seed by `scenario_config`), used by
``perfloop simulate``, the demo, the tests and the benchmarks. A script declares values its
job agent may change between steps with `tunable` (``perfloop.producers.knobs``).
"""

from perfloop.producers.emitter import Emitter
from perfloop.producers.knobs import Tunable, tunable
from perfloop.producers.publisher import Publisher, PublisherStats
from perfloop.producers.scenarios import SCENARIOS, Fault, plan_faults, scenario_config
from perfloop.producers.simulator import SimConfig, SimulatedJob, StepReport

__all__ = [
    "SCENARIOS",
    "Emitter",
    "Fault",
    "Publisher",
    "PublisherStats",
    "SimConfig",
    "SimulatedJob",
    "StepReport",
    "Tunable",
    "plan_faults",
    "scenario_config",
    "tunable",
]
