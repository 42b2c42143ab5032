"""How `perfloop.producers.gpu.NvmlBackend` reads each GPU signal through NVML.

`NvmlSignals` is the reading half of the backend (a mixin: it keeps no state of its own and
works on the backend's, declared on it): the XID event set opened once for every device, the
probe at ``open()`` that keeps, per device and signal, the first reader the device supports
(and says why for the others), the NVLink fields of each active link, and one reader per signal
that returns the `GpuSample` fields it fills. `Device` is what the backend keeps per device:
its handle, its readers, its missing signals, its last values, its error counts and the rates
made from its cumulative counters (`Rate`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import pynvml

from perfloop.producers._nvml_access import (
    FIELD_NVLINK_COUNT,
    FIELD_NVLINK_RX,
    FIELD_NVLINK_TX,
    FIELD_PCIE_RX,
    FIELD_PCIE_TX,
    LOST,
    XID_EVENT,
    E,
    NVMLError,
    err_text,
    field_value,
    field_values,
    handle_key,
)

__all__ = ["SLOW_PCIE_INTERVAL_S", "Device", "NvmlSignals", "Rate"]

SLOW_PCIE_INTERVAL_S = 1.0
"""The floor on the PCIe signal's interval where only ``nvmlDeviceGetPcieThroughput`` reads it
(each call blocks about 20 ms inside the driver)."""
_KIB = 1024


class Rate:
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
class Device:
    """One GPU the backend opened; ``last`` starts with every signal's field at zero."""

    index: int
    handle: Any
    key: int | None
    last: dict[str, Any]
    readers: dict[str, Callable[[Device, Collection[int]], dict[str, Any]]] = field(
        default_factory=dict
    )
    missing: dict[str, str] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    rates: dict[str, Rate] = field(default_factory=dict)
    nvlink_fields: list[tuple[int, int]] = field(default_factory=list)
    lost: str = ""

    def rate(self, name: str, v: float, t: float) -> float:
        r = self.rates.get(name)
        if r is None:
            r = self.rates[name] = Rate()
        return r(v, t)


class NvmlSignals:
    """Probing and reading GPU signals; `NvmlBackend` holds the state below."""

    _clock: Callable[[], float]
    _devices: list[Device]
    _event_set: Any
    _xid_reason: str
    _xid_pending: dict[int | None, list[int]]
    _xid_drained: bool
    _floors: dict[str, float]

    # -- probing ---------------------------------------------------------------------------

    def _open_event_set(self) -> None:
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
        except NVMLError as e:
            self._xid_reason = f"NVML event sets unavailable: {err_text(e)}"
            return
        for d in self._devices:
            try:
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(d.handle))
                if not supported & XID_EVENT:
                    continue
                pynvml.nvmlDeviceRegisterEvents(d.handle, XID_EVENT, self._event_set)
            except NVMLError as e:
                if e.value in LOST:
                    d.lost = err_text(e)
                continue
            d.readers["xid"] = self._read_xid

    def _probe(self, d: Device, now: float) -> None:
        candidates: dict[str, list[Callable[[Device, Collection[int]], dict[str, Any]]]] = {
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
                except NVMLError as e:
                    if e.value in LOST:
                        d.lost = err_text(e)
                        return
                    reason = f"{err_text(e)} ({getattr(reader, '__name__', signal)})"
                    continue
                except Exception as e:  # e.g. NVMLLibraryMismatchError: not an NVMLError
                    reason = f"{type(e).__name__}: {err_text(e)}"
                    continue
                d.readers[signal] = reader
                if reader == self._read_pcie_throughput:
                    self._floors["pcie"] = SLOW_PCIE_INTERVAL_S
                break
            else:
                d.missing[signal] = reason

    def _setup_nvlink(self, d: Device) -> bool:
        try:
            fv = field_values(d.handle, [FIELD_NVLINK_COUNT])[0]
            links = int(field_value(fv)) if fv.nvmlReturn == E.NVML_SUCCESS else 0
        except NVMLError as e:
            if e.value in LOST:
                d.lost = err_text(e)
            d.missing["nvlink"] = f"NVLink link count: {err_text(e)}"
            return False
        if links <= 0:
            d.missing["nvlink"] = "no NVLink on this device"
            return False
        d.nvlink_fields = [
            (f, link) for link in range(links) for f in (FIELD_NVLINK_RX, FIELD_NVLINK_TX)
        ]
        return True

    # -- readers: one per signal, each returns the fields it fills -------------------------

    def _read_util(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        u = pynvml.nvmlDeviceGetUtilizationRates(d.handle)
        return {"sm_util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

    def _read_memory(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        m = pynvml.nvmlDeviceGetMemoryInfo(d.handle)
        return {"mem_used_bytes": int(m.used), "mem_total_bytes": int(m.total)}

    def _read_power(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        return {"power_w": pynvml.nvmlDeviceGetPowerUsage(d.handle) / 1000.0}

    def _read_power_limit(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        return {"power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(d.handle) / 1000.0}

    def _read_energy(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        return {"energy_mj": int(pynvml.nvmlDeviceGetTotalEnergyConsumption(d.handle))}

    def _read_temperature(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        t = pynvml.nvmlDeviceGetTemperature(d.handle, E.NVML_TEMPERATURE_GPU)
        return {"temp_c": float(t)}

    def _read_clocks(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        sm = pynvml.nvmlDeviceGetClockInfo(d.handle, E.NVML_CLOCK_SM)
        mem = pynvml.nvmlDeviceGetClockInfo(d.handle, E.NVML_CLOCK_MEM)
        return {"sm_clock_mhz": float(sm), "mem_clock_mhz": float(mem)}

    def _read_clock_events(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        return {"throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(d.handle))}

    def _read_throttle_legacy(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(d.handle)
        return {"throttle_reasons": int(reasons)}

    def _read_pcie_counters(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        rx, tx = field_values(d.handle, (FIELD_PCIE_RX, FIELD_PCIE_TX))
        for fv in (rx, tx):
            if fv.nvmlReturn != E.NVML_SUCCESS:
                raise NVMLError(fv.nvmlReturn)
        t = self._clock()
        return {
            "pcie_rx_bytes_per_s": d.rate("pcie_rx", field_value(rx), t),
            "pcie_tx_bytes_per_s": d.rate("pcie_tx", field_value(tx), t),
        }

    def _read_pcie_throughput(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        rx = pynvml.nvmlDeviceGetPcieThroughput(d.handle, E.NVML_PCIE_UTIL_RX_BYTES)
        tx = pynvml.nvmlDeviceGetPcieThroughput(d.handle, E.NVML_PCIE_UTIL_TX_BYTES)
        return {"pcie_rx_bytes_per_s": rx * float(_KIB), "pcie_tx_bytes_per_s": tx * float(_KIB)}

    def _read_nvlink(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        values = field_values(d.handle, d.nvlink_fields)
        rx = tx = 0.0
        ok = 0
        for fv in values:
            if fv.nvmlReturn != E.NVML_SUCCESS:
                continue  # an inactive link
            ok += 1
            if fv.fieldId == FIELD_NVLINK_RX:
                rx += field_value(fv)
            else:
                tx += field_value(fv)
        if not ok:
            raise NVMLError(values[0].nvmlReturn if len(values) else E.NVML_ERROR_NOT_SUPPORTED)
        t = self._clock()
        return {
            "nvlink_rx_bytes_per_s": d.rate("nvlink_rx", rx * _KIB, t),
            "nvlink_tx_bytes_per_s": d.rate("nvlink_tx", tx * _KIB, t),
        }

    def _read_ecc(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        sbe = pynvml.nvmlDeviceGetTotalEccErrors(
            d.handle, E.NVML_MEMORY_ERROR_TYPE_CORRECTED, E.NVML_VOLATILE_ECC
        )
        dbe = pynvml.nvmlDeviceGetTotalEccErrors(
            d.handle, E.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, E.NVML_VOLATILE_ECC
        )
        return {"ecc_sbe_total": int(sbe), "ecc_dbe_total": int(dbe)}

    def _read_processes(self, d: Device, pids: Collection[int]) -> dict[str, Any]:
        total = 0
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(d.handle):
            if (not pids or p.pid in pids) and p.usedGpuMemory:
                total += int(p.usedGpuMemory)
        return {"process_mem_bytes": total}

    def _read_xid(self, d: Device, _: Collection[int]) -> dict[str, Any]:
        if not self._xid_drained:  # the probe; `sample` drains once for every device
            self._drain_xid()
        codes = self._xid_pending.pop(d.key, [])
        return {"xid_events": len(codes), "last_xid": codes[-1] if codes else d.last["last_xid"]}

    def _drain_xid(self) -> None:
        for _ in range(1024):  # bounded: a storm of events never stalls the sampler
            try:
                data = pynvml.nvmlEventSetWait(self._event_set, 0)
            except NVMLError as e:
                if e.value == E.NVML_ERROR_TIMEOUT:
                    return
                raise
            if data.eventType & XID_EVENT:
                key = handle_key(data.device)
                self._xid_pending.setdefault(key, []).append(int(data.eventData))
