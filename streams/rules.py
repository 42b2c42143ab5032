"""From diagnoses and job facts to recommendations, each with its expected gain and evidence.

`DataWaitRule` (`perfloop.streams._rule_data`) answers an actionable data-loader starvation
with loader workers: fitted to the rank's CPUs for a loader that computes, grown one verified
step at a time past the CPUs for one that waits on storage, and says why it stops.

`ThreadRule` (`perfloop.streams._rule_threads`) fits a CPU training job's intra-op threads
to each rank's real CPU budget.

`StragglerRule` (`perfloop.streams._rule_straggler`) names a persistent straggler's node in
one slow-loop ``cluster.drain_node`` recommendation per episode, for the actuator's hook.

The data and thread rules consult `Outcomes` (what similar changes did when applied: prefer
what worked) and leave out a kind of change that was rolled back repeatedly and never kept.
Cooldowns are measured in event time (the diagnoses' or steps' ``ts_ns``), so a backlog read
fast is answered as the same data read live.
"""

from __future__ import annotations

from perfloop.streams._rule_data import KNOB_NUM_WORKERS, DataWaitRule
from perfloop.streams._rule_straggler import KNOB_DRAIN, StragglerRule
from perfloop.streams._rule_threads import KNOB_THREADS, ThreadRule, rank_budget

__all__ = [
    "KNOB_DRAIN",
    "KNOB_NUM_WORKERS",
    "KNOB_THREADS",
    "DataWaitRule",
    "StragglerRule",
    "ThreadRule",
    "rank_budget",
]
