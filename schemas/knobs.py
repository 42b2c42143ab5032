"""The knobs the actuator acts on, and the values each takes: the allow-list and its bounds,
the switches, the one-off actions, the actions the actuator takes itself (its action hook) and
what a user may pin. Part of the contract between the actuator and the jobs it commands; pure:
the policy, the job agent, the settings and the CLI check values here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from perfloop.exceptions import ConfigError

__all__ = [
    "ACTION_KNOBS",
    "BOOL_KNOBS",
    "HOOK_KNOBS",
    "HOST_NAME",
    "INT_KNOBS",
    "KNOB_BOUNDS",
    "PINNABLE_KNOBS",
    "SPEED_KNOBS",
    "knob_problem",
    "name_list",
    "pinned_knobs",
]

# Knobs the actuator may command, with their inclusive bounds (the allow-list). The job agent
# narrows them by what the job's hardware allows (threads and workers by its CPUs, the power
# limit by the GPU's range) and refuses knobs its process does not handle.
KNOB_BOUNDS: dict[str, tuple[float, float]] = {
    "torch.num_threads": (1, 1024),
    "dataloader.num_workers": (0, 64),
    "dataloader.prefetch_factor": (1, 64),
    "train.grad_accum_steps": (1, 1024),
    "train.checkpoint_every_steps": (1, 10_000_000),
    "profiler.capture_steps": (1, 50),
    "gpu.power_limit_w": (100, 700),
    "train.batch_size": (1, 1 << 20),  # slow loop: a config patch read at the next start
}
BOOL_KNOBS: frozenset[str] = frozenset({"dataloader.pin_memory"})
"""Knobs that are switched on or off."""
SPEED_KNOBS: frozenset[str] = frozenset(
    {
        "torch.num_threads",
        "dataloader.num_workers",
        "dataloader.prefetch_factor",
        "dataloader.pin_memory",
    }
)
"""Knobs changed only to make steps faster: a change of one is kept only when the steps after
it were measurably faster (`perfloop.actuators.verification.ChangeVerifier`'s ``must_help``); the
others (a power limit, the checkpoint cadence, …) are kept when they did not hurt."""
ACTION_KNOBS: frozenset[str] = frozenset({"profiler.capture_steps"})
"""Knobs that do something once rather than hold a value: applied, never judged or undone."""
INT_KNOBS: frozenset[str] = frozenset(KNOB_BOUNDS) - {"gpu.power_limit_w"}
"""Knobs that take whole numbers."""
HOOK_KNOBS: frozenset[str] = frozenset({"cluster.drain_node"})
"""Actions the actuator takes itself through its action hook (the value names the node);
never sent to a job."""
PINNABLE_KNOBS: tuple[str, ...] = tuple(sorted({*KNOB_BOUNDS, *BOOL_KNOBS, *HOOK_KNOBS}))
"""What a user may pin (``perfloop run --pin``, ``actuator.pinned``): every knob the actuator
acts on."""
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
"""What a node named in a hook recommendation must look like (it becomes an argument)."""


def name_list(value: Any, what: str) -> list[str]:
    """Names from a list, a JSON list or a comma-separated string, in order, once each, blanks
    dropped (how a setting takes a list: ``PERFLOOP_PINNED_KNOBS``, ``PERFLOOP_WEBHOOK_URLS``);
    `ValueError` naming ``what`` for anything else.

    >>> name_list('["b", "a", "b"]', "knobs"), name_list(" a, , b ", "knobs")
    (['b', 'a'], ['a', 'b'])
    >>> name_list("[1", "knobs")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: knobs '[1' are not a JSON list: ...
    """
    names: Any = value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                names = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{what} {value!r} are not a JSON list: {e}") from None
        else:
            names = text.split(",")
    if not isinstance(names, list | tuple | set | frozenset) or not all(
        isinstance(n, str) for n in names
    ):
        raise ValueError(f"{what} must be a list or comma-separated names, got {value!r}")
    return list(dict.fromkeys(n.strip() for n in names if n.strip()))


def pinned_knobs(value: Any) -> tuple[str, ...]:
    """Pinned knob names from a list, a JSON list or a comma-separated string, checked and
    sorted; `ConfigError` naming the valid knobs for an unknown one.

    >>> pinned_knobs('["torch.num_threads"]')
    ('torch.num_threads',)
    >>> pinned_knobs("dataloader.num_workers, torch.num_threads"), pinned_knobs("")
    (('dataloader.num_workers', 'torch.num_threads'), ())
    >>> pinned_knobs("threads")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: unknown knob 'threads' to pin; valid: cluster.drain_node, ...
    """
    try:
        names = name_list(value, "pinned knobs")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in names:
        if name not in PINNABLE_KNOBS:
            raise ConfigError(f"unknown knob {name!r} to pin; valid: {', '.join(PINNABLE_KNOBS)}")
    return tuple(sorted(set(names)))


def knob_problem(knob: str, value: Any, bounds: tuple[float, float] | None = None) -> str:
    """Why ``value`` is not a valid setting of ``knob`` ("" if it is); ``bounds`` narrows the
    allow-list's range (a job's own limits).

    >>> knob_problem("torch.num_threads", 4), knob_problem("dataloader.pin_memory", True)
    ('', '')
    >>> knob_problem("torch.num_threads", 4, bounds=(1, 2))
    'torch.num_threads=4 is outside [1, 2]'
    >>> knob_problem("dataloader.pin_memory", 1)
    'dataloader.pin_memory must be true or false, got 1'
    """
    if knob in BOOL_KNOBS:
        return "" if isinstance(value, bool) else f"{knob} must be true or false, got {value!r}"
    allowed = KNOB_BOUNDS.get(knob)
    if allowed is None:
        return f"knob {knob!r} is not allowed; allowed: {sorted([*KNOB_BOUNDS, *BOOL_KNOBS])}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return f"{knob}={value!r} is not a number"
    if knob in INT_KNOBS and not float(value).is_integer():
        return f"{knob}={value!r} is not a whole number"
    lo, hi = allowed if bounds is None else (max(allowed[0], bounds[0]), min(allowed[1], bounds[1]))
    if not lo <= value <= hi:
        return f"{knob}={value!r} is outside [{lo:g}, {hi:g}]"
    return ""
