"""GPU power limits, the hardware side of the ``gpu.power_limit_w`` knob (whose handler is
`perfloop.producers._power`).

What every `perfloop.producers.gpu.GpuBackend` shares: `check_watts` (is the value a number of
watts) and `power_limit_permission_text` (what to do without root). And how
`perfloop.producers.gpu.NvmlBackend` reads a device's range and sets its limit through NVML
(`nvml_limits_mw`, `nvml_set_limit_w`), in W outside and mW inside, each NVML error turned into
one `ConfigError` line that names the device, the value and the valid range, or what is missing
(root, support); the NVML error is kept as its cause.
"""

from __future__ import annotations

import math
from typing import Any

import pynvml

from perfloop.exceptions import ConfigError
from perfloop.producers._nvml_access import LOST, E, NVMLError, err_text

__all__ = [
    "check_watts",
    "nvml_limits_mw",
    "nvml_set_limit_w",
    "power_limit_permission_text",
]


def check_watts(device: int, watts: object) -> None:
    """Raise `ConfigError` unless ``watts`` is a finite number (a power limit for ``device``)."""
    if isinstance(watts, bool) or not isinstance(watts, int | float) or not math.isfinite(watts):
        raise ConfigError(f"power limit {watts!r} for GPU {device} is not a number of watts")


def power_limit_permission_text(device: int) -> str:
    """What to do when this process may not set ``device``'s power limit (one line)."""
    return (
        f"setting the power limit of GPU {device} needs root: run the job as root, or have an "
        f"administrator set it (nvidia-smi -i {device} -pl WATTS, with nvidia-smi -pm 1 so it "
        "stays)"
    )


def _power_error(
    e: Any, device: int, what: str, lo_mw: int | None = None, hi_mw: int | None = None
) -> ConfigError:
    """One line for an NVML error met while reading or setting a power limit."""
    code, text = getattr(e, "value", None), err_text(e)
    if code == E.NVML_ERROR_NO_PERMISSION:
        return ConfigError(f"{power_limit_permission_text(device)} (NVML: {text})")
    if code == E.NVML_ERROR_NOT_SUPPORTED:
        return ConfigError(f"GPU {device} does not support power management limits (NVML: {text})")
    if code == E.NVML_ERROR_INVALID_ARGUMENT and lo_mw is not None and hi_mw is not None:
        return ConfigError(
            f"GPU {device} refused {what}: outside its range "
            f"[{lo_mw / 1000:g}, {hi_mw / 1000:g}] W (NVML: {text})"
        )
    if code in LOST:
        return ConfigError(f"GPU {device} is lost (NVML: {text}); its power limit cannot be set")
    return ConfigError(f"GPU {device}: {what} failed (NVML: {text})")


def nvml_limits_mw(handle: Any, device: int) -> tuple[int, int]:
    """The power limits, in mW, the device behind ``handle`` accepts: ``(lowest, highest)``."""
    try:
        lo, hi = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    except NVMLError as e:
        raise _power_error(e, device, "reading its power limit range") from e
    return int(lo), int(hi)


def nvml_set_limit_w(handle: Any, device: int, watts: float) -> float:
    """Set the power limit of the device behind ``handle`` to ``watts`` once it is known to be
    in the device's range; return the limit it had before, in W."""
    lo, hi = nvml_limits_mw(handle, device)
    mw = round(watts * 1000)
    if not lo <= mw <= hi:
        raise ConfigError(
            f"power limit {watts:g} W is outside GPU {device}'s range "
            f"[{lo / 1000:g}, {hi / 1000:g}] W"
        )
    try:
        before = pynvml.nvmlDeviceGetPowerManagementLimit(handle)
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, mw)
    except NVMLError as e:
        raise _power_error(e, device, f"setting its power limit to {watts:g} W", lo, hi) from e
    return int(before) / 1000.0
