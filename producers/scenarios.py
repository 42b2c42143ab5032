"""Fault scenarios for the simulated job, and the ``perfloop simulate`` command.

Its faults are `perfloop.producers.faults.Fault`s (kind, onset, end, ranks, strength).
`plan_faults` turns a scenario name into faults whose onsets, ends, ranks
and strengths are drawn from the seed within the run's duration: the same seed gives the same
plan. ``perfloop simulate`` (`perfloop.cli.simulate`) runs a scenario on the stack.

>>> from perfloop.producers import SimConfig
>>> cfg = SimConfig(job_id="doc", nodes=2, ranks_per_node=2)
>>> [f.kind for f in plan_faults("mixed", cfg, duration_s=60.0, seed=1)]
['dataloader_starvation', 'straggler', 'thermal_throttle', 'comm_degradation']
>>> plan_faults("straggler", cfg, duration_s=60.0, seed=1) == plan_faults(
...     "straggler", cfg, duration_s=60.0, seed=1)
True
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from perfloop.deprecation import moved
from perfloop.exceptions import ConfigError
from perfloop.producers.faults import FAULT_FACTORS, INJECTABLE_FAULTS, Fault

if TYPE_CHECKING:
    from perfloop.producers.simulator import SimConfig

__all__ = [
    "FAULT_FACTORS",
    "INJECTABLE_FAULTS",
    "SCENARIOS",
    "Fault",
    "plan_faults",
    "scenario_config",
]

__getattr__ = moved(__name__, {"simulate_command": "perfloop.cli.simulate"})

SCENARIOS = ("healthy", *INJECTABLE_FAULTS, "mixed")
"""A healthy job, one scenario per injectable fault, and ``mixed`` (several at once)."""


def _window(rng: np.random.Generator, duration_s: float, lo: float, hi: float) -> float:
    return round(float(rng.uniform(lo, hi)) * duration_s, 3)


def plan_faults(
    scenario: str, config: SimConfig, *, duration_s: float, seed: int
) -> tuple[Fault, ...]:
    """The faults of ``scenario`` for a job shaped like ``config``, drawn from ``seed``.

    Onsets and ends fall inside ``duration_s``; a memory leak is sized to run the GPU out of
    memory at about 45–65% of the time left after its onset.
    """
    if scenario not in SCENARIOS:
        raise ConfigError(f"unknown scenario {scenario!r}; valid: {', '.join(SCENARIOS)}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ConfigError(f"duration must be > 0 s, got {duration_s!r}")
    rng = np.random.default_rng([seed, 0x5CE7])  # independent of the job's own stream
    world, g, nodes = config.world, config.ranks_per_node, config.nodes
    rank_order = [int(r) for r in rng.permutation(world)]
    node_order = [int(n) for n in rng.permutation(nodes)]

    def node_ranks(n: int) -> tuple[int, ...]:
        return tuple(range(n * g, (n + 1) * g))

    def span(lo: float, hi: float, length: tuple[float, float]) -> tuple[float, float]:
        onset = _window(rng, duration_s, lo, hi)
        end = min(onset + _window(rng, duration_s, *length), round(0.95 * duration_s, 3))
        return onset, end

    if scenario in ("comm_degradation",) and world < 2:
        raise ConfigError("comm_degradation needs at least 2 ranks (nothing to all-reduce)")
    if scenario == "healthy":
        return ()
    if scenario == "dataloader_starvation":
        onset, end = span(0.2, 0.4, (0.3, 0.45))
        f = round(float(rng.uniform(3.0, 4.0)), 2)
        return (Fault(scenario, onset, end, node_ranks(node_order[0]), f),)
    if scenario == "straggler":
        onset, end = span(0.2, 0.4, (0.3, 0.45))
        f = round(float(rng.uniform(1.4, 2.0)), 2)
        return (Fault(scenario, onset, end, (rank_order[0],), f),)
    if scenario == "thermal_throttle":
        onset, end = span(0.25, 0.45, (0.3, 0.45))
        f = round(float(rng.uniform(0.55, 0.75)), 2)
        return (Fault(scenario, onset, end, (rank_order[0],), f),)
    if scenario == "comm_degradation":
        onset, end = span(0.2, 0.4, (0.3, 0.45))
        f = round(float(rng.uniform(3.0, 6.0)), 2)
        return (Fault(scenario, onset, end, node_ranks(node_order[0]), f),)
    if scenario == "memory_leak":
        onset = _window(rng, duration_s, 0.15, 0.3)
        to_oom_s = float(rng.uniform(0.45, 0.65)) * (duration_s - onset)
        steps = max(1.0, to_oom_s * 1000 / config.nominal_step_ms)
        per_step = float(math.ceil(config.leak_headroom_bytes / steps))
        return (Fault(scenario, onset, None, (rank_order[0],), per_step),)
    if scenario == "hang":
        return (Fault(scenario, _window(rng, duration_s, 0.35, 0.6), None, (rank_order[0],)),)
    # mixed: staggered, partly overlapping, on different ranks and nodes where there are any
    s_on, s_end = span(0.06, 0.1, (0.18, 0.22))
    st_on, st_end = span(0.26, 0.3, (0.18, 0.22))
    th_on, th_end = span(0.46, 0.5, (0.18, 0.22))
    faults = [
        Fault("dataloader_starvation", s_on, s_end, node_ranks(node_order[0]), 3.5),
        Fault("straggler", st_on, st_end, (rank_order[0],), 1.6),
        Fault("thermal_throttle", th_on, th_end, (rank_order[1 % world],), 0.6),
    ]
    if world > 1:
        c_on, c_end = span(0.68, 0.72, (0.18, 0.22))
        faults.append(
            Fault("comm_degradation", c_on, c_end, node_ranks(node_order[-1]), 4.0),
        )
    return tuple(faults)


def scenario_config(
    scenario: str,
    *,
    job_id: str,
    nodes: int,
    ranks_per_node: int,
    duration_s: float,
    seed: int = 0,
    **overrides: Any,
) -> SimConfig:
    """A `SimConfig` for ``scenario``, its faults planned from ``seed``."""
    from perfloop.producers.simulator import SimConfig

    base = SimConfig(
        job_id=job_id, nodes=nodes, ranks_per_node=ranks_per_node, seed=seed, **overrides
    )
    faults = plan_faults(scenario, base, duration_s=duration_s, seed=seed)
    return replace(base, scenario=scenario, faults=faults)
