"""Phases: where each job is in its run and, within its steps, which phase it is in.

Contract: `PhaseMachine` (no I/O, picklable state) reads decoded step, span and GPU batches and
job lifecycle events, on each job's event-time clock, and emits `PhaseChange` events: every
run-level change (warmup, steady, eval, checkpoint, stalled, finished) and a per-job summary of
the dominant step phase (`STEP_PHASES`), from spans or from GPU samples alone.

Modules:

- ``machine``: `PhaseMachine`, the hierarchical state machine per job, and its settings;
- ``_run_state``: the run-level state machine of one job (`RunState`);
- ``_signatures``: the GPU phase signatures learned online per job (`SignatureLibrary`).
"""

from perfloop.streams.phases.machine import STEP_PHASES, PhaseMachine

__all__ = ["STEP_PHASES", "PhaseMachine"]
