"""NvmlBackend against pynvml patched with autospec: capability, unsupported calls, no driver,
a GPU lost mid-run, unit conversions, XID events; and one real-GPU test (marker ``gpu``)."""

from __future__ import annotations

import contextlib
import ctypes
import types
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pynvml
import pytest

from perfloop.exceptions import PerfloopError
from perfloop.producers.gpu import (
    GPU_SIGNALS,
    MAX_CONSECUTIVE_ERRORS,
    SLOW_PCIE_INTERVAL_S,
    GpuUnavailableError,
    NvmlBackend,
)
from perfloop.schemas.telemetry import GpuSample

ALL_FIELDS = {f for fs in GPU_SIGNALS.values() for f in fs}


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """A node of GPUs as NVML shows it; every pynvml function used is patched with autospec.

    ``unsupported`` maps a pynvml function name to the device indices where it answers
    NotSupported (``None`` = every device); ``lost`` devices answer GpuIsLost.
    """

    FUNCS = (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetName",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetComputeRunningProcesses",
    )

    def __init__(
        self,
        devices: int = 2,
        *,
        unsupported: dict[str, set[int] | None] | None = None,
        init_error: int | None = None,
        nvlinks: int = 4,
        pcie_counters: bool = True,
    ) -> None:
        self.n = devices
        self.unsupported = dict(unsupported or {})
        self.init_error = init_error
        self.nvlinks = nvlinks
        self.pcie_counters = pcie_counters
        self.handles = [
            ctypes.cast(ctypes.c_void_p(0x1000 + 0x100 * i), pynvml.c_nvmlDevice_t)
            for i in range(devices)
        ]
        self.lost: set[int] = set()
        self.errors: dict[tuple[str, int], int] = {}  # (func, device) -> NVML error code
        self.calls: Counter[tuple[str, int]] = Counter()
        self.events: list[tuple[int, int]] = []  # (device, xid)
        self.event_set = object()
        self.power_mw = [300_000 + 1000 * i for i in range(devices)]
        self.energy_mj = [1_000_000] * devices
        self.pcie_rx = [0] * devices  # cumulative bytes
        self.pcie_tx = [0] * devices
        self.nvlink_rx_kib = [0] * devices  # cumulative KiB per link
        self.nvlink_tx_kib = [0] * devices
        self.sbe = [0] * devices
        self.procs: list[list[tuple[int, int | None]]] = [[] for _ in range(devices)]

    @contextlib.contextmanager
    def patched(self) -> Iterator[FakeNvml]:
        with ExitStack() as stack:
            for name in self.FUNCS:
                stack.enter_context(
                    mock.patch.object(pynvml, name, autospec=True, side_effect=getattr(self, name))
                )
            yield self

    # -- helpers ---------------------------------------------------------------------------

    def _dev(self, handle: Any, func: str) -> int:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        i = next(
            i for i, h in enumerate(self.handles) if ctypes.cast(h, ctypes.c_void_p).value == addr
        )
        self.calls[(func, i)] += 1
        if i in self.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        code = self.errors.get((func, i))
        if code is not None:
            raise _err(code)
        where = self.unsupported.get(func, ())
        if func in self.unsupported and (where is None or i in where):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return i

    # -- the pynvml API --------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _err(self.init_error)

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return self.n

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self.calls[("nvmlDeviceGetHandleByIndex", index)] += 1
        return self.handles[index]

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._dev(handle, "nvmlDeviceGetName")
        return "NVIDIA H100 80GB HBM3"

    def nvmlEventSetCreate(self) -> Any:
        if "nvmlEventSetCreate" in self.unsupported:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.event_set

    def nvmlEventSetFree(self, event_set: Any) -> None:
        return None

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._dev(handle, "nvmlDeviceGetSupportedEventTypes")
        return pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeClock

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        self._dev(handle, "nvmlDeviceRegisterEvents")
        assert eventSet is self.event_set

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        assert timeoutms == 0, "the sampler must never block on the event set"
        if not self.events:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)
        dev, xid = self.events.pop(0)
        data = pynvml.c_nvmlEventData_t()
        data.device = self.handles[dev]
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid
        return data

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        i = self._dev(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for v, fid in zip(values, fieldIds, strict=True):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            v.fieldId, v.scopeId = fid, scope
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            v.nvmlReturn = pynvml.NVML_SUCCESS
            if fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = self.nvlinks
            elif fid in (
                pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
                pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            ):
                if not self.pcie_counters:
                    v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                rx = fid == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
                v.value.ullVal = self.pcie_rx[i] if rx else self.pcie_tx[i]
            elif fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
                v.value.ullVal = self.nvlink_rx_kib[i]
            elif fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
                v.value.ullVal = self.nvlink_tx_kib[i]
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        i = self._dev(handle, "nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(gpu=90 + i, memory=40 + i)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        self._dev(handle, "nvmlDeviceGetMemoryInfo")
        return pynvml.c_nvmlMemory_t(total=80 << 30, free=20 << 30, used=60 << 30)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self.power_mw[self._dev(handle, "nvmlDeviceGetPowerUsage")]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._dev(handle, "nvmlDeviceGetEnforcedPowerLimit")
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self.energy_mj[self._dev(handle, "nvmlDeviceGetTotalEnergyConsumption")]

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._dev(handle, "nvmlDeviceGetTemperature")
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 71

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        self._dev(handle, "nvmlDeviceGetClockInfo")
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[type]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        self._dev(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        return 0x4  # SW power cap

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        self._dev(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return 0x20  # SW thermal slowdown

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        self._dev(device, "nvmlDeviceGetPcieThroughput")
        return {pynvml.NVML_PCIE_UTIL_RX_BYTES: 1000, pynvml.NVML_PCIE_UTIL_TX_BYTES: 500}[counter]

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        i = self._dev(handle, "nvmlDeviceGetTotalEccErrors")
        assert counterType == pynvml.NVML_VOLATILE_ECC
        return self.sbe[i] if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        i = self._dev(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.procs[i]]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _calls(fake: FakeNvml, func: str, device: int) -> int:
    return fake.calls[(func, device)]


def test_full_capability_and_unit_conversions() -> None:
    fake, clock = FakeNvml(devices=2), Clock()
    fake.procs[0] = [(111, 30 << 30), (222, 2 << 30), (333, None)]
    with fake.patched():
        gpu = NvmlBackend(clock=clock)
        cap = gpu.open()
        assert cap.available and cap.devices == 2
        assert cap.missing == ()
        assert set(cap.signals) == set(GPU_SIGNALS)
        assert cap.details["gpu_name"] == "NVIDIA H100 80GB HBM3"
        assert cap.details["driver"] == "550.54.15"

        clock.t += 0.5
        fake.pcie_rx[0] += 4_000_000  # 4 MB in 0.5 s -> 8 MB/s
        fake.pcie_tx[0] += 1_000_000
        fake.nvlink_rx_kib[0] += 1000  # per link, 4 links: 4000 KiB in 0.5 s
        rows = gpu.sample(pids={111, 333})
        gpu.close()

    assert [r["device"] for r in rows] == [0, 1]
    r = rows[0]
    assert set(r) == ALL_FIELDS | {"device"}
    assert r["power_w"] == pytest.approx(300.0)  # NVML mW -> W
    assert rows[1]["power_w"] == pytest.approx(301.0)
    assert r["power_limit_w"] == pytest.approx(700.0)
    assert r["energy_mj"] == 1_000_000  # already mJ
    assert (r["sm_util_pct"], r["mem_util_pct"]) == (90.0, 40.0)
    assert (r["mem_used_bytes"], r["mem_total_bytes"]) == (60 << 30, 80 << 30)
    assert (r["temp_c"], r["sm_clock_mhz"], r["mem_clock_mhz"]) == (71.0, 1980.0, 2619.0)
    assert r["throttle_reasons"] == 0x4
    assert r["pcie_rx_bytes_per_s"] == pytest.approx(8e6)  # counter bytes -> bytes/s
    assert r["pcie_tx_bytes_per_s"] == pytest.approx(2e6)
    assert r["nvlink_rx_bytes_per_s"] == pytest.approx(4000 * 1024 / 0.5)  # KiB -> bytes/s
    assert r["nvlink_tx_bytes_per_s"] == 0.0
    assert r["process_mem_bytes"] == 30 << 30  # only watched pids; None memory ignored
    assert rows[1]["process_mem_bytes"] == 0
    GpuSample(ts_ns=1, job_id="j", node="n", rank=0, **r)  # every value fits the schema


def test_handles_are_cached_and_only_due_signals_are_read() -> None:
    fake = FakeNvml(devices=2)
    with fake.patched():
        gpu = NvmlBackend()
        gpu.open()
        before = Counter(fake.calls)
        fake.power_mw[1] = 450_000
        rows = gpu.sample({"power"})
        after = fake.calls - before
    assert _calls(fake, "nvmlDeviceGetHandleByIndex", 0) == 1
    assert set(after) == {("nvmlDeviceGetPowerUsage", 0), ("nvmlDeviceGetPowerUsage", 1)}
    assert rows[1]["power_w"] == pytest.approx(450.0)
    assert rows[1]["temp_c"] == 71.0  # not read this time: carries the probed value


def test_all_processes_count_when_no_pid_is_watched() -> None:
    fake = FakeNvml(devices=1)
    fake.procs[0] = [(1, 1 << 30), (2, 3 << 30)]
    with fake.patched():
        gpu = NvmlBackend()
        gpu.open()
        assert gpu.sample({"process_memory"})[0]["process_mem_bytes"] == 4 << 30


def test_unsupported_calls_are_probed_once_and_reported_missing() -> None:
    fake = FakeNvml(
        devices=2,
        unsupported={
            "nvmlDeviceGetTotalEccErrors": {1},
            "nvmlDeviceGetTotalEnergyConsumption": None,
        },
        nvlinks=0,
    )
    with fake.patched():
        gpu = NvmlBackend()
        cap = gpu.open()
        for _ in range(3):
            rows = gpu.sample()
    assert cap.available
    assert set(cap.missing) == {"ecc:1", "energy", "nvlink"}
    assert "ecc" in cap.signals and "energy" not in cap.signals and "nvlink" not in cap.signals
    assert cap.details["energy"].startswith("Not Supported")
    assert cap.details["nvlink"] == "no NVLink on this device"
    # probed once, never called again on the device that does not support it
    assert _calls(fake, "nvmlDeviceGetTotalEccErrors", 1) == 1
    assert _calls(fake, "nvmlDeviceGetTotalEccErrors", 0) == 2 * 4  # 2 calls x (probe + 3)
    assert _calls(fake, "nvmlDeviceGetTotalEnergyConsumption", 0) == 1
    assert rows[0]["energy_mj"] == 0 and rows[0]["power_w"] > 0


def test_pcie_falls_back_to_throughput_in_kb_per_s_with_a_floor() -> None:
    fake = FakeNvml(devices=1, pcie_counters=False)
    with fake.patched():
        gpu = NvmlBackend()
        cap = gpu.open()
        row = gpu.sample({"pcie"})[0]
    assert "pcie" in cap.signals
    assert row["pcie_rx_bytes_per_s"] == 1000 * 1024.0
    assert row["pcie_tx_bytes_per_s"] == 500 * 1024.0
    assert gpu.min_interval_s() == {"pcie": SLOW_PCIE_INTERVAL_S}


def test_throttle_reasons_fall_back_to_the_legacy_call() -> None:
    fake = FakeNvml(devices=1)
    fake.errors[("nvmlDeviceGetCurrentClocksEventReasons", 0)] = (
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    with fake.patched():
        gpu = NvmlBackend()
        cap = gpu.open()
        assert gpu.sample({"throttle"})[0]["throttle_reasons"] == 0x20
    assert "throttle" in cap.signals


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    ],
)
def test_no_driver_opens_unavailable_and_never_raises(code: int, text: str) -> None:
    fake = FakeNvml(init_error=code)
    with fake.patched():
        gpu = NvmlBackend()
        cap = gpu.open()
        assert gpu.sample() == []
        gpu.close()
    assert not cap.available and cap.devices == 0
    assert cap.missing == ("gpu",)
    assert cap.reason == f"NVML unavailable: {text}"


def test_init_wraps_the_vendor_error() -> None:
    fake = FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with fake.patched(), pytest.raises(GpuUnavailableError, match="Driver Not Loaded") as ei:
        NvmlBackend().init()
    assert isinstance(ei.value, PerfloopError)
    assert isinstance(ei.value.__cause__, pynvml.NVMLError_DriverNotLoaded)


def test_no_device_and_a_bad_index_are_unavailable() -> None:
    with FakeNvml(devices=0).patched():
        cap = NvmlBackend().open()
    assert not cap.available and "no NVIDIA GPU" in cap.reason
    with FakeNvml(devices=2).patched():
        cap = NvmlBackend(devices=[5]).open()
    assert not cap.available and "GPU index 5 does not exist" in cap.reason


def test_devices_restricts_what_is_sampled() -> None:
    with FakeNvml(devices=4).patched():
        gpu = NvmlBackend(devices=[2])
        cap = gpu.open()
        rows = gpu.sample()
    assert cap.devices == 1 and [r["device"] for r in rows] == [2]


def test_gpu_lost_mid_run_degrades_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(devices=2)
    with fake.patched():
        gpu = NvmlBackend()
        cap0 = gpu.open()
        fake.lost.add(0)
        rows = gpu.sample()
        cap1 = gpu.capability()
        calls_after_loss = _calls(fake, "nvmlDeviceGetPowerUsage", 0)
        gpu.sample()
        assert _calls(fake, "nvmlDeviceGetPowerUsage", 0) == calls_after_loss  # not retried
        fake.lost.add(1)
        assert gpu.sample() == []
        cap2 = gpu.capability()
    assert [r["device"] for r in rows] == [1]
    assert cap1.available and cap1.devices == 1 and cap1.generation > cap0.generation
    assert cap1.details["gpu0"] == "lost: GPU is lost"
    assert not cap2.available and cap2.missing == ("gpu",)
    assert "all GPUs lost" in cap2.reason
    assert sum("GPU 0 lost" in r.getMessage() for r in caplog.records) == 1


def test_transient_errors_keep_the_last_value_then_drop_the_signal() -> None:
    fake = FakeNvml(devices=1)
    with fake.patched():
        gpu = NvmlBackend()
        gen = gpu.open().generation
        fake.errors[("nvmlDeviceGetTemperature", 0)] = pynvml.NVML_ERROR_UNKNOWN
        for _ in range(MAX_CONSECUTIVE_ERRORS - 1):
            assert gpu.sample({"temperature"})[0]["temp_c"] == 71.0
        assert gpu.capability().generation == gen  # nothing changed yet
        gpu.sample({"temperature"})
        cap = gpu.capability()
    assert "temperature" in cap.missing
    assert "consecutive errors" in cap.details["temperature"]


def test_xid_events_are_counted_per_device() -> None:
    fake = FakeNvml(devices=2)
    with fake.patched():
        gpu = NvmlBackend()
        cap = gpu.open()
        fake.events += [(1, 79), (1, 48)]
        rows = gpu.sample({"xid"})
        again = gpu.sample({"xid"})
    assert "xid" in cap.signals
    assert (rows[0]["xid_events"], rows[0]["last_xid"]) == (0, 0)
    assert (rows[1]["xid_events"], rows[1]["last_xid"]) == (2, 48)
    assert (again[1]["xid_events"], again[1]["last_xid"]) == (0, 48)  # last code is kept


def test_without_event_sets_xid_is_reported_missing() -> None:
    fake = FakeNvml(devices=1, unsupported={"nvmlEventSetCreate": None})
    with fake.patched():
        cap = NvmlBackend().open()
    assert cap.available and "xid" in cap.missing
    assert "event sets unavailable" in cap.details["xid"]


def test_ecc_counts_new_errors() -> None:
    fake = FakeNvml(devices=1)
    with fake.patched():
        gpu = NvmlBackend()
        gpu.open()
        fake.sbe[0] = 3
        assert gpu.sample({"ecc"})[0]["ecc_sbe_total"] == 3


@pytest.mark.gpu
def test_real_gpu_sample() -> None:
    gpu = NvmlBackend()
    cap = gpu.open()
    if not cap.available:
        pytest.skip(f"no usable GPU: {cap.reason}")
    try:
        rows = gpu.sample()
        rows = gpu.sample()
    finally:
        gpu.close()
    assert len(rows) == cap.devices >= 1
    for r in rows:
        GpuSample(ts_ns=1, job_id="j", node="n", rank=-1, **r)
        assert r["mem_total_bytes"] > 0
