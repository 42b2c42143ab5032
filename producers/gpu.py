"""GPU telemetry behind one interface: `GpuBackend`, and its NVML implementation `NvmlBackend`.

A backend reads every GPU of the node (or the ``devices`` it was given) as rows whose keys are
`GpuSample` field names plus ``device``. Readings are grouped into *signals* (`GPU_SIGNALS`):
each signal is one or two NVML calls and the fields they fill, and the node sampler may ask for
only the signals that are due (adaptive sampling). Fields of signals not read this time carry
their last value, so every row is complete.

`NvmlBackend` contract:

- ``open()`` never raises. Without a driver or GPU it answers a `GpuCapability` with
  ``available=False`` and the reason (``NVML Shared Library Not Found``, ``Driver Not Loaded``,
  no device); the caller publishes it once and carries on without GPU telemetry.
- Handles are fetched once. Each signal is *probed once per device* at ``open()``; one that the
  device does not support (``NotSupported``, ``FunctionNotFound``, ``NoPermission``…) is never
  called again on that device and is listed in the capability's ``missing``.
- ``sample()`` never raises an NVML error: a device that is lost mid-run (``GpuIsLost``) is
  dropped and the capability changes (its ``generation`` grows, ``available`` turns false when
  no device is left); a transient error keeps the last value, and a signal that fails
  `MAX_CONSECUTIVE_ERRORS` times in a row is dropped as missing.
- Units follow `GpuSample`: power in W (NVML: mW), energy in mJ, clocks in MHz, PCIe and NVLink
  in bytes/s. PCIe comes from NVML's cumulative byte counters (field values 197/198) as a rate
  over the interval; where they are missing, from ``nvmlDeviceGetPcieThroughput`` (KB/s, times
  1024; each call blocks about 20 ms inside the driver, so the signal is then floored at
  `SLOW_PCIE_INTERVAL_S`, see ``min_interval_s``). NVLink comes from the per-link
  ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{RX,TX}`` counters (KiB) as a rate. XID errors come from
  an NVML event set (``xid_events`` counts those seen since the previous read); where event sets
  are not available the capability says so under ``missing``/``details``.
- ``process_mem_bytes`` sums the device memory of the given pids among the device's compute
  processes (all compute processes when no pid is given).
- Power limits (the ``gpu.power_limit_w`` knob): `GpuBackend.power_limit_range_w` and
  `GpuBackend.set_power_limit_w` work on an opened device, in W (NVML: mW); they raise
  `ConfigError` with one line naming the device, the value and the valid range, or what is
  missing (root, support), the NVML error wrapped (``raise … from e``). Backends without power
  control inherit defaults that refuse.

Device indices are NVML's (PCI bus order), not CUDA's (``CUDA_VISIBLE_DEVICES``): a caller that
knows its CUDA device maps it by UUID or PCI bus id before passing ``devices``.
`perfloop.testing.FakeGpuBackend` is the shipped fake for tests and simulations.

This module is the public one: it holds the interface and `NvmlBackend`'s lifecycle and
sampling, and re-exports what the others import. `NvmlBackend`'s parts live beside it in private
modules: the lowest level of NVML (error codes, field values, one-line errors) in
``_nvml_access``; the per-device state, the probe and one reader per signal in
``_nvml_signals``; the power limits (`check_watts`, `power_limit_permission_text`, NVML's range
and set calls) in ``_gpu_power_limit``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

from perfloop.exceptions import ConfigError, PerfloopError
from perfloop.producers._gpu_power_limit import (
    check_watts,
    nvml_limits_mw,
    nvml_set_limit_w,
    power_limit_permission_text,
)
from perfloop.producers._nvml_access import LOST, UNSUPPORTED, NVMLError, err_text, handle_key
from perfloop.producers._nvml_signals import SLOW_PCIE_INTERVAL_S, Device, NvmlSignals

__all__ = [
    "GPU_SIGNALS",
    "MAX_CONSECUTIVE_ERRORS",
    "SLOW_PCIE_INTERVAL_S",
    "GpuBackend",
    "GpuCapability",
    "GpuUnavailableError",
    "NvmlBackend",
    "check_watts",
    "power_limit_permission_text",
]

log = logging.getLogger("perfloop.producers.gpu")

GPU_SIGNALS: dict[str, tuple[str, ...]] = {
    "utilization": ("sm_util_pct", "mem_util_pct"),
    "memory": ("mem_used_bytes", "mem_total_bytes"),
    "power": ("power_w",),
    "power_limit": ("power_limit_w",),
    "energy": ("energy_mj",),
    "temperature": ("temp_c",),
    "clocks": ("sm_clock_mhz", "mem_clock_mhz"),
    "throttle": ("throttle_reasons",),
    "pcie": ("pcie_rx_bytes_per_s", "pcie_tx_bytes_per_s"),
    "nvlink": ("nvlink_rx_bytes_per_s", "nvlink_tx_bytes_per_s"),
    "ecc": ("ecc_sbe_total", "ecc_dbe_total"),
    "xid": ("xid_events", "last_xid"),
    "process_memory": ("process_mem_bytes",),
}
"""Signal name → the `GpuSample` fields one read of it fills."""

_INT_FIELDS = frozenset(
    {
        "mem_used_bytes",
        "mem_total_bytes",
        "energy_mj",
        "throttle_reasons",
        "ecc_sbe_total",
        "ecc_dbe_total",
        "xid_events",
        "last_xid",
        "process_mem_bytes",
    }
)
MAX_CONSECUTIVE_ERRORS = 5


class GpuUnavailableError(PerfloopError):
    """NVML cannot be used on this node (no library, no driver, no device, or the GPU is lost)."""


@dataclass(frozen=True)
class GpuCapability:
    """What a GPU backend can read now; ``generation`` grows whenever this changes.

    ``missing`` names a signal missing on every device (``"ecc"``), or on some of them
    (``"ecc:1,3"``); ``details`` holds the reason per missing signal and facts about the node.

    >>> GpuCapability(available=False, reason="no NVIDIA driver").devices
    0
    """

    available: bool
    devices: int = 0
    signals: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    reason: str = ""
    details: Mapping[str, str] = field(default_factory=dict)
    generation: int = 0


class GpuBackend(abc.ABC):
    """A source of GPU readings. Implementations never raise vendor errors out of `sample`."""

    name: str = "gpu"

    @abc.abstractmethod
    def open(self) -> GpuCapability:
        """Initialise, probe what each device supports, and say so. Never raises."""

    @abc.abstractmethod
    def capability(self) -> GpuCapability:
        """The current capability (changes when a device is lost or a signal is dropped)."""

    @abc.abstractmethod
    def sample(
        self, signals: Collection[str] | None = None, pids: Collection[int] = ()
    ) -> list[dict[str, Any]]:
        """One row per live device: ``device`` and every `GpuSample` field in `GPU_SIGNALS`.

        Only ``signals`` (all when ``None``) are read; the other fields keep their last value.
        """

    def min_interval_s(self) -> Mapping[str, float]:
        """Per-signal floors on the sampling interval (signals that are costly to read)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the backend's resources."""

    def power_limit_range_w(self, device: int) -> tuple[float, float]:
        """The power limits ``device`` accepts, in W: ``(lowest, highest)``.

        Raises `ConfigError` when the backend or the device cannot say (by default).
        """
        raise ConfigError(f"GPU power limits are not supported by this backend ({self.name})")

    def set_power_limit_w(self, device: int, watts: float) -> float:
        """Set ``device``'s power limit to ``watts``; return the limit it had before, in W.

        Raises `ConfigError` (nothing changed) for a value outside `power_limit_range_w`, a
        device without power management, or a process without the permission (by default).
        """
        raise ConfigError(f"GPU power limits are not supported by this backend ({self.name})")


def _signal_defaults() -> dict[str, Any]:
    """Every signal's fields at zero: a device's values before its first read."""
    return {f: 0 if f in _INT_FIELDS else 0.0 for fs in GPU_SIGNALS.values() for f in fs}


class NvmlBackend(NvmlSignals, GpuBackend):
    """Reads NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py).

    It opens, samples and closes here; it probes and reads each signal as `NvmlSignals`
    (``_nvml_signals``) does. Without a driver (as on a CPU-only machine) it opens unavailable
    instead of failing:

    >>> import pynvml
    >>> from unittest import mock
    >>> err = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    >>> with mock.patch.object(pynvml, "nvmlInit", autospec=True, side_effect=err):
    ...     cap = NvmlBackend().open()
    >>> cap.available, cap.reason
    (False, 'NVML unavailable: NVML Shared Library Not Found')
    """

    name = "nvml"

    def __init__(
        self,
        devices: Sequence[int] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wanted = None if devices is None else tuple(devices)
        self._clock = clock
        self._devices: list[Device] = []
        self._initialised = False
        self._cap = GpuCapability(available=False, reason="not opened")
        self._generation = 0
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._xid_reason = ""
        self._xid_pending: dict[int | None, list[int]] = {}
        self._xid_drained = False
        self._details: dict[str, str] = {}
        self._floors: dict[str, float] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def init(self) -> None:
        """Initialise NVML and fetch the device handles; raise `GpuUnavailableError` if not."""
        try:
            pynvml.nvmlInit()
        except NVMLError as e:
            raise GpuUnavailableError(f"NVML unavailable: {err_text(e)}") from e
        except OSError as e:  # a broken library: still "no NVML" for the caller
            raise GpuUnavailableError(f"NVML unavailable: {err_text(e)}") from e
        self._initialised = True
        try:
            count = int(pynvml.nvmlDeviceGetCount())
            try:
                driver = pynvml.nvmlSystemGetDriverVersion()
                self._details["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            except NVMLError:
                pass
            indices = range(count) if self._wanted is None else self._wanted
            for i in indices:
                if not 0 <= i < count:
                    raise GpuUnavailableError(
                        f"GPU index {i} does not exist; this node has GPUs 0..{count - 1}"
                        if count
                        else f"GPU index {i} does not exist; this node has no GPU"
                    )
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                self._devices.append(Device(i, h, handle_key(h), _signal_defaults()))
        except NVMLError as e:
            self.close()
            raise GpuUnavailableError(f"NVML unavailable: {err_text(e)}") from e
        except GpuUnavailableError:
            self.close()
            raise
        if not self._devices:
            self.close()
            raise GpuUnavailableError("NVML unavailable: no NVIDIA GPU on this node")

    def open(self) -> GpuCapability:
        try:
            self.init()
        except GpuUnavailableError as e:
            with self._lock:
                self._generation += 1
                self._cap = GpuCapability(
                    available=False,
                    reason=str(e),
                    missing=("gpu",),
                    details=dict(self._details),
                    generation=self._generation,
                )
            return self._cap
        try:
            name = pynvml.nvmlDeviceGetName(self._devices[0].handle)
            self._details["gpu_name"] = name.decode() if isinstance(name, bytes) else str(name)
        except NVMLError:
            pass
        self._open_event_set()
        now = self._clock()
        for d in self._devices:
            self._probe(d, now)
        with self._lock:
            self._refresh_capability()
        return self._cap

    def close(self) -> None:
        if self._event_set is not None:
            with contextlib.suppress(NVMLError):
                pynvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(NVMLError):
                pynvml.nvmlShutdown()

    def capability(self) -> GpuCapability:
        return self._cap

    def min_interval_s(self) -> Mapping[str, float]:
        return dict(self._floors)

    # -- power limits ----------------------------------------------------------------------

    def _opened(self, device: int) -> Device:
        for d in self._devices:
            if d.index == device:
                if d.lost:
                    raise ConfigError(
                        f"GPU {device} is lost ({d.lost}); its power limit cannot be set"
                    )
                return d
        opened = ", ".join(str(d.index) for d in self._devices)
        raise ConfigError(
            f"GPU {device} is not one this backend opened; opened: {opened}"
            if opened
            else f"GPU {device}: NVML is not open (call open() first)"
        )

    def power_limit_range_w(self, device: int) -> tuple[float, float]:
        d = self._opened(device)
        lo, hi = nvml_limits_mw(d.handle, d.index)
        return lo / 1000.0, hi / 1000.0

    def set_power_limit_w(self, device: int, watts: float) -> float:
        check_watts(device, watts)
        return nvml_set_limit_w(self._opened(device).handle, device, watts)

    # -- sampling --------------------------------------------------------------------------

    def sample(
        self, signals: Collection[str] | None = None, pids: Collection[int] = ()
    ) -> list[dict[str, Any]]:
        rows = []
        changed = False
        self._xid_drained = False
        if self._event_set is not None and (signals is None or "xid" in signals):
            try:
                self._drain_xid()
            except NVMLError as e:  # a device's xid read will meet it too; say it there
                log.debug("XID event set: %s", err_text(e))
            self._xid_drained = True
        for d in self._devices:
            if d.lost:
                continue
            for signal, reader in list(d.readers.items()):
                if signals is not None and signal not in signals:
                    continue
                try:
                    d.last.update(reader(d, pids))
                    d.errors.pop(signal, None)
                except Exception as e:  # NVML errors and a library that does not match
                    changed |= self._on_error(d, signal, e)
                    if d.lost:
                        break
            if not d.lost:
                row = dict(d.last)
                row["device"] = d.index
                rows.append(row)
        if changed:
            with self._lock:
                self._refresh_capability()
        return rows

    def _on_error(self, d: Device, signal: str, e: Exception) -> bool:
        """Account one failed read; return True when the capability changed."""
        text = err_text(e)
        code = getattr(e, "value", None) if isinstance(e, NVMLError) else None
        if code in LOST:
            d.lost = text
            log.warning("GPU %d lost (%s); it is no longer sampled", d.index, text)
            return True
        if code in UNSUPPORTED:
            d.readers.pop(signal, None)
            d.missing[signal] = text
            return True
        n = d.errors[signal] = d.errors.get(signal, 0) + 1
        if n >= MAX_CONSECUTIVE_ERRORS:
            d.readers.pop(signal, None)
            d.missing[signal] = f"{n} consecutive errors, last: {text}"
            return True
        return False

    def _refresh_capability(self) -> None:
        live = [d for d in self._devices if not d.lost]
        details = dict(self._details)
        for d in self._devices:
            if d.lost:
                details[f"gpu{d.index}"] = f"lost: {d.lost}"
        missing: list[str] = []
        signals: list[str] = []
        for signal in GPU_SIGNALS:
            without = [d.index for d in live if signal in d.missing]
            if live and len(without) < len(live):
                signals.append(signal)
            if not without:
                continue
            if len(without) == len(live):
                missing.append(signal)
            else:
                missing.append(f"{signal}:{','.join(map(str, without))}")
            reasons = {d.missing[signal] for d in live if signal in d.missing}
            details[signal] = "; ".join(sorted(reasons))[:500]
        if not live:
            lost = "; ".join(f"GPU {d.index}: {d.lost}" for d in self._devices)
            reason = f"all GPUs lost ({lost})"
            missing = ["gpu"]
        else:
            reason = ""
        self._generation += 1
        self._cap = GpuCapability(
            available=bool(live),
            devices=len(live),
            signals=tuple(signals),
            missing=tuple(missing),
            reason=reason,
            details=details,
            generation=self._generation,
        )
