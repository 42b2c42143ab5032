"""Observation tier: publish typed telemetry from training nodes; never slow or break the job.

Contract: publishing returns at once and never raises into the training loop; every message
is accounted for (`PublisherStats`). `SimulatedJob` is a data-parallel job of N ranks with an
injectable data-loader starvation fault, used by the demo, the tests and the benchmarks.
"""

from perfloop.producers.publisher import Publisher, PublisherStats
from perfloop.producers.simulator import SimConfig, SimulatedJob, StepReport

__all__ = ["Publisher", "PublisherStats", "SimConfig", "SimulatedJob", "StepReport"]
