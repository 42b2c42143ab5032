"""Rules: from diagnoses and job facts to recommendations, each with its expected gain and
evidence.

Contract: each rule is a stream-engine component (no I/O, picklable state) that the engine
hands the funnel's diagnoses and the job facts it needs, and that returns `Recommendation`
events; cooldowns are measured in event time (the diagnoses' or steps' ``ts_ns``), so a
backlog read fast is answered as the same data read live. The data and thread rules consult
`Outcomes` (`perfloop.streams.outcomes`: what similar changes did when applied, so prefer what
worked) and leave out a kind of change that was rolled back repeatedly and never kept.

Modules, one rule each (their public names are re-exported here):

- ``data_wait``: `DataWaitRule` answers an actionable data-loader starvation with loader
  workers: fitted to the rank's CPUs for a loader that computes, grown one verified step at a
  time past the CPUs for one that waits on storage, and says why it stops;
- ``threads``: `ThreadRule` fits a CPU training job's intra-op threads to each rank's real
  CPU budget (`rank_budget`);
- ``straggler``: `StragglerRule` names a persistent straggler's node in one slow-loop
  ``cluster.drain_node`` recommendation per episode, for the actuator's hook.
"""

from __future__ import annotations

from perfloop.streams.rules.data_wait import KNOB_NUM_WORKERS, DataWaitRule
from perfloop.streams.rules.straggler import KNOB_DRAIN, StragglerRule
from perfloop.streams.rules.threads import KNOB_THREADS, ThreadRule, rank_budget

__all__ = [
    "KNOB_DRAIN",
    "KNOB_NUM_WORKERS",
    "KNOB_THREADS",
    "DataWaitRule",
    "StragglerRule",
    "ThreadRule",
    "rank_budget",
]
