"""The knobs of a traced training process: what its job agent may change, between two steps.

`TorchKnobs` gives the job agent (`perfloop.actuators.JobAgent`) a handler per knob, the job's
own bounds (what its hardware allows) and the current values (published in its job info):

- ``torch.num_threads``: ``torch.set_num_threads``, 1 … the rank's CPU budget (its affinity and
  its container's quota, shared with the launcher's other ranks on the node:
  `perfloop.producers._cpu`);
- ``dataloader.num_workers`` / ``dataloader.prefetch_factor`` / ``dataloader.pin_memory``: the
  DataLoader the training data comes from, changed mid-epoch: the iterator the script holds
  keeps giving the same batches in the same order (`perfloop.producers._loader_swap`); workers
  up to four times the rank's CPUs (loader workers that wait on storage can outnumber them);
- ``profiler.capture_steps``: a PyTorch-profiler capture of the next N steps, published
  (`perfloop.producers._capture`);
- ``gpu.power_limit_w``: the NVML power limit of the GPUs this process uses, within each one's
  range, where the process is permitted to set it;
- the script's own tunables (`tunable`), e.g. ``train.grad_accum_steps`` or
  ``train.checkpoint_every_steps``: values a script reads each step, for knobs no hook can
  reach in an unmodified script.

Every handler runs on the training thread at a step boundary and raises `ConfigError` (one
line naming the value and what is valid) to refuse; the agent acks the refusal and changes
nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from perfloop.exceptions import ConfigError
from perfloop.producers._cpu import cpu_budget
from perfloop.producers.world import launcher_world

__all__ = ["TorchKnobs", "Tunable", "start_agent", "tunable", "tunables", "use_patch"]

log = logging.getLogger("perfloop.producers")

KnobValue = int | float | bool | str
V = TypeVar("V")
LiveLoader = Callable[[], "tuple[Any, Any] | None"]
"""Returns ``(iterator, loader)`` of the training data's current pass, or None."""


class Tunable:
    """A value a script reads at each step and the job agent may change between steps.

    >>> accum = Tunable("train.grad_accum_steps", 4, lo=1, hi=64)
    >>> accum.value
    4
    >>> accum.set(8); accum.value
    8
    >>> accum.set(0)
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: train.grad_accum_steps=0 is outside [1, 64]
    """

    def __init__(self, name: str, default: int | float, *, lo: float, hi: float) -> None:
        if not lo <= default <= hi:
            raise ConfigError(f"{name} default {default!r} is outside [{lo:g}, {hi:g}]")
        self.name, self.lo, self.hi = name, lo, hi
        self._integer = isinstance(default, int)
        self.value: int | float = default

    def set(self, value: KnobValue) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.name}={value!r} is not a number")
        if self._integer and not float(value).is_integer():
            raise ConfigError(f"{self.name}={value!r} is not a whole number")
        if not self.lo <= value <= self.hi:
            raise ConfigError(f"{self.name}={value!r} is outside [{self.lo:g}, {self.hi:g}]")
        self.value = int(value) if self._integer else float(value)


_TUNABLES: dict[str, Tunable] = {}
_PATCHED: dict[str, KnobValue] = {}  # the job's config patch, read at start
_LOCK = threading.Lock()


def use_patch(values: Mapping[str, KnobValue]) -> None:
    """The values of the job's config patch (slow-loop changes): tunables declared from now on
    start from them (`perfloop.actuators.config_patch`; `perfloop run`'s hooks call this)."""
    with _LOCK:
        _PATCHED.clear()
        _PATCHED.update(values)


def tunable(name: str, default: int | float, *, lo: float, hi: float) -> Tunable:
    """Declare (or get) the process's tunable ``name``; read ``.value`` at each step. It starts
    from the job's config patch when that holds a valid value for it (a slow-loop change),
    else from ``default``.

    >>> t = tunable("train.checkpoint_every_steps", 500, lo=1, hi=100_000)
    >>> t is tunable("train.checkpoint_every_steps", 500, lo=1, hi=100_000), t.value
    (True, 500)
    """
    with _LOCK:
        t = _TUNABLES.get(name)
        if t is None:
            t = _TUNABLES[name] = Tunable(name, default, lo=lo, hi=hi)
            if name in _PATCHED:
                try:
                    t.set(_PATCHED[name])
                except ConfigError as e:
                    log.warning("perfloop: the config patch's value not used: %s", e)
        return t


def tunables() -> dict[str, Tunable]:
    """The tunables this process declared, by name."""
    with _LOCK:
        return dict(_TUNABLES)


def _setter(t: Tunable) -> Callable[[KnobValue], None]:
    return t.set


def _range(t: Tunable) -> tuple[float, float]:
    return (t.lo, t.hi)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Live(Mapping[str, V]):
    """A mapping rebuilt on each read: the built-in entries over the tunables declared so far
    (a tunable declared after the agent started is a knob at once)."""

    def __init__(self, builtin: dict[str, V], of_tunable: Callable[[Tunable], V]) -> None:
        self._builtin, self._of = builtin, of_tunable

    def _all(self) -> dict[str, V]:
        return {**{n: self._of(t) for n, t in tunables().items()}, **self._builtin}

    def __getitem__(self, knob: str) -> V:
        return self._all()[knob]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class TorchKnobs:
    """The knobs of this process, for its job agent.

    ``torch`` is the imported module (None: no torch knobs); ``live_loader`` finds the
    training data's iterator and DataLoader (the hooks know which one fed the last step;
    None: no DataLoader knobs). ``capture`` (a
    `perfloop.producers._capture.ProfileCapture`) and ``power`` (a knob handler for the GPUs'
    power limit, with ``power_range`` its bounds) are optional.
    """

    def __init__(
        self,
        torch: Any,
        live_loader: LiveLoader | None,
        *,
        capture: Any = None,
        power: Callable[[KnobValue], None] | None = None,
        power_range: tuple[float, float] | None = None,
    ) -> None:
        self.torch = torch
        self._live: LiveLoader = live_loader if live_loader is not None else (lambda: None)
        self.capture = capture
        self.cpus = _cpus()
        self.budget = cpu_budget(launcher_world()["local_world_size"])
        builtin: dict[str, Callable[[KnobValue], None]] = {}
        bounds: dict[str, tuple[float, float]] = {}
        if torch is not None:
            builtin["torch.num_threads"] = self._set_threads
            # never more threads than the rank's CPUs (its share when ranks share them)
            bounds["torch.num_threads"] = (1.0, float(self.budget.cpus))
        if live_loader is not None:
            for name in ("num_workers", "prefetch_factor", "pin_memory"):
                builtin[f"dataloader.{name}"] = self._loader_setter(name)
            # workers that wait on storage can outnumber the CPUs (the stream tier grows them
            # one verified step at a time, within the host's memory)
            bounds["dataloader.num_workers"] = (0.0, float(max(8, 4 * self.budget.cpus)))
        if capture is not None:
            builtin["profiler.capture_steps"] = capture.request
        if power is not None:
            builtin["gpu.power_limit_w"] = power
            if power_range is not None:
                bounds["gpu.power_limit_w"] = power_range
        self.handlers: Mapping[str, Callable[[KnobValue], None]] = _Live(builtin, _setter)
        self.bounds: Mapping[str, tuple[float, float]] = _Live(bounds, _range)

    def _set_threads(self, value: KnobValue) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"torch.num_threads={value!r}: use a whole number ≥ 1")
        set_threads = self.torch.set_num_threads  # the hooks' wrapper notes the script's calls
        getattr(set_threads, "__perfloop_wrapped__", set_threads)(int(value))

    def _loader_setter(self, name: str) -> Callable[[KnobValue], None]:
        def set_(value: KnobValue) -> None:
            from perfloop.producers._loader_swap import rebuild_iterator

            live = self._live()
            if live is None:
                raise ConfigError(
                    f"dataloader.{name}: no training DataLoader is being iterated in this process"
                )
            it, loader = live
            rebuild_iterator(it, loader, **{name: value})

        return set_

    def current(self) -> dict[str, KnobValue]:
        """The knobs' current values (what the job info reports)."""
        values: dict[str, KnobValue] = {}
        if self.torch is not None:
            values["torch.num_threads"] = int(self.torch.get_num_threads())
        live = self._live()
        if live is not None:
            from perfloop.producers._loader_swap import loader_settings

            for k, v in loader_settings(live[1]).items():
                if v is not None:
                    values[f"dataloader.{k}"] = v
        for name, t in tunables().items():
            values[name] = t.value
        return values

    def value(self, knob: str) -> KnobValue | None:
        """One knob's current value (None when unknown): what a rollback restores."""
        try:
            return self.current().get(knob)
        except Exception:
            return None

    def step_boundary(self, step: int) -> None:
        """Between two steps: a requested profiler capture starts or ends here."""
        if self.capture is not None:
            self.capture.step_boundary(step)

    def close(self) -> None:
        """Training ends: a capture still running is cut short and published."""
        if self.capture is not None:
            self.capture.close(timeout_s=30.0)


def start_agent(
    settings: Any,
    knobs: TorchKnobs,
    *,
    job_id: str,
    node: str,
    rank: int,
    on_result: Callable[[Any], None] | None = None,
) -> Any:
    """Start the job agent of a training process over ``knobs``, with the job's config patch
    for slow-loop commands, the key in ``settings.signing_key`` (or, where there is one, only
    the public keys in ``settings.command_keyring_path``), the knobs the user pinned
    (``settings.pinned_knobs``) and a line on stderr per change unless ``settings.quiet``;
    returns the `perfloop.actuators.JobAgent` (listening within a second, never blocking
    here)."""
    from perfloop.actuators.agent import JobAgent, keyring_for
    from perfloop.actuators.config_patch import ConfigPatch, patch_path

    path = settings.config_patch or patch_path(settings.home_dir, job_id)
    agent = JobAgent(
        settings,
        job_id=job_id,
        node=node,
        rank=rank,
        signing_key=settings.signing_key.get_secret_value().encode(),
        keyring=keyring_for(settings),
        handlers=knobs.handlers,
        bounds=knobs.bounds,
        read=knobs.value,
        patch=ConfigPatch(path, job_id=job_id),
        on_result=on_result,
        pinned=getattr(settings, "pinned_knobs", ()),
        announce=not getattr(settings, "quiet", False),
    )
    agent.start(wait_assigned_s=0)
    return agent
