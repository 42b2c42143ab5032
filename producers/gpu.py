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
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

from perfloop.exceptions import ConfigError, PerfloopError

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
SLOW_PCIE_INTERVAL_S = 1.0
_KIB = 1024

# Captured at import: tests replace pynvml functions, never its error classes or constants.
_NVMLError = pynvml.NVMLError
_E = pynvml
_UNSUPPORTED = frozenset(
    {
        _E.NVML_ERROR_NOT_SUPPORTED,
        _E.NVML_ERROR_FUNCTION_NOT_FOUND,
        _E.NVML_ERROR_NO_PERMISSION,
        _E.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        _E.NVML_ERROR_NOT_FOUND,
        _E.NVML_ERROR_INVALID_ARGUMENT,
        _E.NVML_ERROR_DEPRECATED,
    }
)
_LOST = frozenset({_E.NVML_ERROR_GPU_IS_LOST, _E.NVML_ERROR_RESET_REQUIRED})
_FIELD_PCIE_TX, _FIELD_PCIE_RX = (
    _E.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
    _E.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
)
_FIELD_NVLINK_TX = _E.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
_FIELD_NVLINK_RX = _E.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
_FIELD_NVLINK_COUNT = _E.NVML_FI_DEV_NVLINK_LINK_COUNT
_XID_EVENT = _E.nvmlEventTypeXidCriticalError


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


def _signal_defaults() -> dict[str, Any]:
    return {f: 0 if f in _INT_FIELDS else 0.0 for fs in GPU_SIGNALS.values() for f in fs}


def _handle_key(handle: Any) -> int | None:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class _Value(ctypes.Union):
    _fields_ = (
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    )


class _FieldValue(ctypes.Structure):
    """pynvml's ``c_nvmlFieldValue_t`` layout as a plain ctypes structure: reading it is a
    descriptor lookup, where pynvml's printable structure runs Python on every attribute."""

    _fields_ = (
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_int),
        ("nvmlReturn", ctypes.c_int),
        ("value", _Value),
    )


_FAST_FIELDS = ctypes.sizeof(_FieldValue) == ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
_VALUE_READERS = {
    _E.NVML_VALUE_TYPE_DOUBLE: lambda v: v.dVal,
    _E.NVML_VALUE_TYPE_UNSIGNED_INT: lambda v: v.uiVal,
    _E.NVML_VALUE_TYPE_UNSIGNED_LONG: lambda v: v.ulVal,
    _E.NVML_VALUE_TYPE_SIGNED_LONG_LONG: lambda v: v.sllVal,
    _E.NVML_VALUE_TYPE_SIGNED_INT: lambda v: v.siVal,
    _E.NVML_VALUE_TYPE_UNSIGNED_SHORT: lambda v: v.usVal,
}


def _field_values(handle: Any, ids: Sequence[Any]) -> Any:
    """``nvmlDeviceGetFieldValues``, answered as fast plain structures where the layout allows."""
    values = pynvml.nvmlDeviceGetFieldValues(handle, list(ids))
    if _FAST_FIELDS and isinstance(values, ctypes.Array):
        return (_FieldValue * len(values)).from_buffer(values)
    return values  # pragma: no cover - a pynvml whose layout differs


def _field_value(fv: Any) -> float:
    """The value of one field as a float, whatever NVML type it carries."""
    v = fv.value
    read = _VALUE_READERS.get(fv.valueType)
    return float(read(v) if read is not None else v.ullVal)


def _err_text(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _power_error(
    e: Any, device: int, what: str, lo_mw: int | None = None, hi_mw: int | None = None
) -> ConfigError:
    """One line for an NVML error met while reading or setting a power limit."""
    code, text = getattr(e, "value", None), _err_text(e)
    if code == _E.NVML_ERROR_NO_PERMISSION:
        return ConfigError(f"{power_limit_permission_text(device)} (NVML: {text})")
    if code == _E.NVML_ERROR_NOT_SUPPORTED:
        return ConfigError(f"GPU {device} does not support power management limits (NVML: {text})")
    if code == _E.NVML_ERROR_INVALID_ARGUMENT and lo_mw is not None and hi_mw is not None:
        return ConfigError(
            f"GPU {device} refused {what}: outside its range "
            f"[{lo_mw / 1000:g}, {hi_mw / 1000:g}] W (NVML: {text})"
        )
    if code in _LOST:
        return ConfigError(f"GPU {device} is lost (NVML: {text}); its power limit cannot be set")
    return ConfigError(f"GPU {device}: {what} failed (NVML: {text})")


class _Rate:
    """Turns a cumulative counter into a rate per second over the interval between reads."""

    __slots__ = ("t", "v")

    def __init__(self) -> None:
        self.t: float | None = None
        self.v = 0.0

    def __call__(self, v: float, t: float) -> float:
        prev_t, prev_v = self.t, self.v
        self.t, self.v = t, v
        if prev_t is None or t <= prev_t or v < prev_v:
            return 0.0
        return (v - prev_v) / (t - prev_t)


@dataclass
class _Device:
    index: int
    handle: Any
    key: int | None
    readers: dict[str, Callable[[_Device, Collection[int]], dict[str, Any]]] = field(
        default_factory=dict
    )
    missing: dict[str, str] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=_signal_defaults)
    errors: dict[str, int] = field(default_factory=dict)
    rates: dict[str, _Rate] = field(default_factory=dict)
    nvlink_fields: list[tuple[int, int]] = field(default_factory=list)
    lost: str = ""

    def rate(self, name: str, v: float, t: float) -> float:
        r = self.rates.get(name)
        if r is None:
            r = self.rates[name] = _Rate()
        return r(v, t)


class NvmlBackend(GpuBackend):
    """Reads NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py).

    Without a driver (as on a CPU-only machine) it opens unavailable instead of failing:

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
        self._devices: list[_Device] = []
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
        except _NVMLError as e:
            raise GpuUnavailableError(f"NVML unavailable: {_err_text(e)}") from e
        except OSError as e:  # a broken library: still "no NVML" for the caller
            raise GpuUnavailableError(f"NVML unavailable: {_err_text(e)}") from e
        self._initialised = True
        try:
            count = int(pynvml.nvmlDeviceGetCount())
            try:
                driver = pynvml.nvmlSystemGetDriverVersion()
                self._details["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            except _NVMLError:
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
                self._devices.append(_Device(i, h, _handle_key(h)))
        except _NVMLError as e:
            self.close()
            raise GpuUnavailableError(f"NVML unavailable: {_err_text(e)}") from e
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
        except _NVMLError:
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
            with contextlib.suppress(_NVMLError):
                pynvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(_NVMLError):
                pynvml.nvmlShutdown()

    def capability(self) -> GpuCapability:
        return self._cap

    def min_interval_s(self) -> Mapping[str, float]:
        return dict(self._floors)

    # -- power limits ----------------------------------------------------------------------

    def _opened(self, device: int) -> _Device:
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

    def _limits_mw(self, d: _Device) -> tuple[int, int]:
        try:
            lo, hi = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(d.handle)
        except _NVMLError as e:
            raise _power_error(e, d.index, "reading its power limit range") from e
        return int(lo), int(hi)

    def power_limit_range_w(self, device: int) -> tuple[float, float]:
        lo, hi = self._limits_mw(self._opened(device))
        return lo / 1000.0, hi / 1000.0

    def set_power_limit_w(self, device: int, watts: float) -> float:
        check_watts(device, watts)
        d = self._opened(device)
        lo, hi = self._limits_mw(d)
        mw = round(watts * 1000)
        if not lo <= mw <= hi:
            raise ConfigError(
                f"power limit {watts:g} W is outside GPU {device}'s range "
                f"[{lo / 1000:g}, {hi / 1000:g}] W"
            )
        try:
            before = pynvml.nvmlDeviceGetPowerManagementLimit(d.handle)
            pynvml.nvmlDeviceSetPowerManagementLimit(d.handle, mw)
        except _NVMLError as e:
            raise _power_error(e, device, f"setting its power limit to {watts:g} W", lo, hi) from e
        return int(before) / 1000.0

    # -- probing ---------------------------------------------------------------------------

    def _open_event_set(self) -> None:
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except _NVMLError as e:
            self._xid_reason = f"NVML event sets unavailable: {_err_text(e)}"
            return
        for d in self._devices:
            try:
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(d.handle))
                if not supported & _XID_EVENT:
                    continue
                pynvml.nvmlDeviceRegisterEvents(d.handle, _XID_EVENT, self._event_set)
            except _NVMLError as e:
                if e.value in _LOST:
                    d.lost = _err_text(e)
                continue
            d.readers["xid"] = self._read_xid

    def _probe(self, d: _Device, now: float) -> None:
        candidates: dict[str, list[Callable[[_Device, Collection[int]], dict[str, Any]]]] = {
            "utilization": [self._read_util],
            "memory": [self._read_memory],
            "power": [self._read_power],
            "power_limit": [self._read_power_limit],
            "energy": [self._read_energy],
            "temperature": [self._read_temperature],
            "clocks": [self._read_clocks],
            "throttle": [self._read_clock_events, self._read_throttle_legacy],
            "pcie": [self._read_pcie_counters, self._read_pcie_throughput],
            "nvlink": [self._read_nvlink],
            "ecc": [self._read_ecc],
            "process_memory": [self._read_processes],
        }
        if "xid" in d.readers:
            candidates["xid"] = [d.readers.pop("xid")]
        else:
            d.missing["xid"] = self._xid_reason or "XID events not supported on this device"
        if not self._setup_nvlink(d):
            candidates.pop("nvlink")
        for signal, readers in candidates.items():
            reason = ""
            for reader in readers:
                if d.lost:
                    return
                try:
                    d.last.update(reader(d, ()))
                except _NVMLError as e:
                    if e.value in _LOST:
                        d.lost = _err_text(e)
                        return
                    reason = f"{_err_text(e)} ({getattr(reader, '__name__', signal)})"
                    continue
                except Exception as e:  # e.g. NVMLLibraryMismatchError: not an NVMLError
                    reason = f"{type(e).__name__}: {_err_text(e)}"
                    continue
                d.readers[signal] = reader
                if reader == self._read_pcie_throughput:
                    self._floors["pcie"] = SLOW_PCIE_INTERVAL_S
                break
            else:
                d.missing[signal] = reason

    def _setup_nvlink(self, d: _Device) -> bool:
        try:
            fv = _field_values(d.handle, [_FIELD_NVLINK_COUNT])[0]
            links = int(_field_value(fv)) if fv.nvmlReturn == _E.NVML_SUCCESS else 0
        except _NVMLError as e:
            if e.value in _LOST:
                d.lost = _err_text(e)
            d.missing["nvlink"] = f"NVLink link count: {_err_text(e)}"
            return False
        if links <= 0:
            d.missing["nvlink"] = "no NVLink on this device"
            return False
        d.nvlink_fields = [
            (f, link) for link in range(links) for f in (_FIELD_NVLINK_RX, _FIELD_NVLINK_TX)
        ]
        return True

    # -- readers: one per signal, each returns the fields it fills -------------------------

    def _read_util(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        u = pynvml.nvmlDeviceGetUtilizationRates(d.handle)
        return {"sm_util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

    def _read_memory(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        m = pynvml.nvmlDeviceGetMemoryInfo(d.handle)
        return {"mem_used_bytes": int(m.used), "mem_total_bytes": int(m.total)}

    def _read_power(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        return {"power_w": pynvml.nvmlDeviceGetPowerUsage(d.handle) / 1000.0}

    def _read_power_limit(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        return {"power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(d.handle) / 1000.0}

    def _read_energy(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        return {"energy_mj": int(pynvml.nvmlDeviceGetTotalEnergyConsumption(d.handle))}

    def _read_temperature(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        t = pynvml.nvmlDeviceGetTemperature(d.handle, _E.NVML_TEMPERATURE_GPU)
        return {"temp_c": float(t)}

    def _read_clocks(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        sm = pynvml.nvmlDeviceGetClockInfo(d.handle, _E.NVML_CLOCK_SM)
        mem = pynvml.nvmlDeviceGetClockInfo(d.handle, _E.NVML_CLOCK_MEM)
        return {"sm_clock_mhz": float(sm), "mem_clock_mhz": float(mem)}

    def _read_clock_events(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        return {"throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(d.handle))}

    def _read_throttle_legacy(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(d.handle)
        return {"throttle_reasons": int(reasons)}

    def _read_pcie_counters(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        rx, tx = _field_values(d.handle, (_FIELD_PCIE_RX, _FIELD_PCIE_TX))
        for fv in (rx, tx):
            if fv.nvmlReturn != _E.NVML_SUCCESS:
                raise _NVMLError(fv.nvmlReturn)
        t = self._clock()
        return {
            "pcie_rx_bytes_per_s": d.rate("pcie_rx", _field_value(rx), t),
            "pcie_tx_bytes_per_s": d.rate("pcie_tx", _field_value(tx), t),
        }

    def _read_pcie_throughput(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        rx = pynvml.nvmlDeviceGetPcieThroughput(d.handle, _E.NVML_PCIE_UTIL_RX_BYTES)
        tx = pynvml.nvmlDeviceGetPcieThroughput(d.handle, _E.NVML_PCIE_UTIL_TX_BYTES)
        return {"pcie_rx_bytes_per_s": rx * float(_KIB), "pcie_tx_bytes_per_s": tx * float(_KIB)}

    def _read_nvlink(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        values = _field_values(d.handle, d.nvlink_fields)
        rx = tx = 0.0
        ok = 0
        for fv in values:
            if fv.nvmlReturn != _E.NVML_SUCCESS:
                continue  # an inactive link
            ok += 1
            if fv.fieldId == _FIELD_NVLINK_RX:
                rx += _field_value(fv)
            else:
                tx += _field_value(fv)
        if not ok:
            raise _NVMLError(values[0].nvmlReturn if len(values) else _E.NVML_ERROR_NOT_SUPPORTED)
        t = self._clock()
        return {
            "nvlink_rx_bytes_per_s": d.rate("nvlink_rx", rx * _KIB, t),
            "nvlink_tx_bytes_per_s": d.rate("nvlink_tx", tx * _KIB, t),
        }

    def _read_ecc(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        sbe = pynvml.nvmlDeviceGetTotalEccErrors(
            d.handle, _E.NVML_MEMORY_ERROR_TYPE_CORRECTED, _E.NVML_VOLATILE_ECC
        )
        dbe = pynvml.nvmlDeviceGetTotalEccErrors(
            d.handle, _E.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _E.NVML_VOLATILE_ECC
        )
        return {"ecc_sbe_total": int(sbe), "ecc_dbe_total": int(dbe)}

    def _read_processes(self, d: _Device, pids: Collection[int]) -> dict[str, Any]:
        total = 0
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(d.handle):
            if (not pids or p.pid in pids) and p.usedGpuMemory:
                total += int(p.usedGpuMemory)
        return {"process_mem_bytes": total}

    def _read_xid(self, d: _Device, _: Collection[int]) -> dict[str, Any]:
        if not self._xid_drained:  # the probe; `sample` drains once for every device
            self._drain_xid()
        codes = self._xid_pending.pop(d.key, [])
        return {"xid_events": len(codes), "last_xid": codes[-1] if codes else d.last["last_xid"]}

    def _drain_xid(self) -> None:
        for _ in range(1024):  # bounded: a storm of events never stalls the sampler
            try:
                data = pynvml.nvmlEventSetWait(self._event_set, 0)
            except _NVMLError as e:
                if e.value == _E.NVML_ERROR_TIMEOUT:
                    return
                raise
            if data.eventType & _XID_EVENT:
                key = _handle_key(data.device)
                self._xid_pending.setdefault(key, []).append(int(data.eventData))

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
            except _NVMLError as e:  # a device's xid read will meet it too; say it there
                log.debug("XID event set: %s", _err_text(e))
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

    def _on_error(self, d: _Device, signal: str, e: Exception) -> bool:
        """Account one failed read; return True when the capability changed."""
        text = _err_text(e)
        code = getattr(e, "value", None) if isinstance(e, _NVMLError) else None
        if code in _LOST:
            d.lost = text
            log.warning("GPU %d lost (%s); it is no longer sampled", d.index, text)
            return True
        if code in _UNSUPPORTED:
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
