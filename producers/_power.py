"""The ``gpu.power_limit_w`` knob: one power limit for every GPU a training process uses.

`power_limit_handler` makes the job agent's handler over a `perfloop.producers.gpu.GpuBackend`
(`NvmlBackend` on a node, `perfloop.testing.FakeGpuBackend` in tests): the value is checked
against each device's own range, read from the hardware, before anything changes; then every
device is set, and when one refuses (no permission, not supported, lost) the devices already
set are put back to the limit they had, so the GPUs never stay half changed. `power_limit_range`
is the range that suits all of them (the agent's bounds for the knob).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from perfloop.exceptions import ConfigError
from perfloop.producers.gpu import GpuBackend
from perfloop.schemas import KnobValue

__all__ = ["KNOB", "power_limit_handler", "power_limit_range"]

log = logging.getLogger("perfloop.producers")

KNOB = "gpu.power_limit_w"


def _devices(devices: Sequence[int]) -> tuple[int, ...]:
    out = tuple(devices)
    if not out:
        raise ConfigError(f"{KNOB}: no GPU to set (the process uses none)")
    return out


def power_limit_range(backend: GpuBackend, devices: Sequence[int]) -> tuple[float, float]:
    """The power limits, in W, that every one of ``devices`` accepts.

    >>> from perfloop.testing import FakeGpuBackend
    >>> gpu = FakeGpuBackend(devices=2, power_limit_range_w={0: (100, 700), 1: (150, 600)})
    >>> _ = gpu.open()
    >>> power_limit_range(gpu, [0, 1])
    (150.0, 600.0)
    """
    devs = _devices(devices)
    ranges = [backend.power_limit_range_w(d) for d in devs]
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if lo > hi:
        each = ", ".join(
            f"GPU {d}: [{r[0]:g}, {r[1]:g}] W" for d, r in zip(devs, ranges, strict=True)
        )
        raise ConfigError(f"{KNOB}: the GPUs' power-limit ranges do not overlap ({each})")
    return float(lo), float(hi)


def power_limit_handler(backend: GpuBackend, devices: Sequence[int]) -> Callable[[KnobValue], None]:
    """A knob handler that sets the power limit of every one of ``devices`` to the value (W).

    Raises `ConfigError` (one line; the agent acks the command as rejected) for a value that is
    not a number or is outside any device's range (nothing is set then), and when a device
    refuses: the devices set before it are restored first.

    >>> from perfloop.testing import FakeGpuBackend
    >>> gpu = FakeGpuBackend(devices=2)
    >>> _ = gpu.open()
    >>> set_limit = power_limit_handler(gpu, [0, 1])
    >>> set_limit(450)
    >>> gpu.power_limits_w
    {0: 450.0, 1: 450.0}
    >>> set_limit(900)
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: gpu.power_limit_w=900 is outside GPU 0's range [100, 700] W
    """
    devs = _devices(devices)

    def set_power_limit(value: KnobValue) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{KNOB}={value!r} is not a number of watts")
        if not math.isfinite(value):
            raise ConfigError(f"{KNOB}={value!r} is not a number of watts")
        watts = float(value)
        for d in devs:  # every device's own range, from the hardware, before any change
            lo, hi = backend.power_limit_range_w(d)
            if not lo <= watts <= hi:
                raise ConfigError(f"{KNOB}={value!r} is outside GPU {d}'s range [{lo:g}, {hi:g}] W")
        done: list[tuple[int, float]] = []
        for d in devs:
            try:
                done.append((d, backend.set_power_limit_w(d, watts)))
            except Exception as e:
                raise ConfigError(_undo(backend, done, d, value, e)) from e

    return set_power_limit


def _undo(
    backend: GpuBackend, done: list[tuple[int, float]], failed: int, value: KnobValue, e: Exception
) -> str:
    """Put the devices already set back; the one-line reason for the refusal."""
    why = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, ConfigError):  # the backend's own errors name the GPU
        why = f"GPU {failed}: {type(e).__name__}: {why}"
    left: list[str] = []
    for d, before in reversed(done):
        try:
            backend.set_power_limit_w(d, before)
        except Exception as e2:
            left.append(f"GPU {d} stays at {value!r} W ({' '.join(str(e2).split())})")
    msg = f"{KNOB}={value!r} not applied: {why}"
    if left:
        msg += "; restoring failed: " + "; ".join(left)
        log.warning("%s", msg)
    elif done:
        msg += "; restored the previous limit of GPU " + ", ".join(str(d) for d, _ in done)
    return msg
