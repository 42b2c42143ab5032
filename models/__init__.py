"""perfloop's models: pure functions and online models, no I/O.

Contract: a model is deterministic given its inputs (and its seed, for learned ones), reads
and writes nothing, and is picklable, so stream workers can host, persist and swap it. The
foundation ships the analytical data-pipeline model the data-wait rule relies on; the online
predictors follow the same contract.
"""

from perfloop.models.datapipe import expected_step_gain, loader_workers_needed

__all__ = ["expected_step_gain", "loader_workers_needed"]
