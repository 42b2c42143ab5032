"""The ``gpu.power_limit_w`` knob: the handler over the shipped fake GPU (range checks, a
refusal leaves every limit as it was, readings report the new limit), and NvmlBackend's power
calls against pynvml patched with autospec (units, errors wrapped with a clear line)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pynvml
import pytest

from perfloop.exceptions import ConfigError
from perfloop.producers._power import power_limit_handler, power_limit_range
from perfloop.producers.gpu import GpuBackend, GpuCapability, NvmlBackend
from perfloop.testing import FakeGpuBackend


def _fake(devices: int = 3, **kw: Any) -> FakeGpuBackend:
    gpu = FakeGpuBackend(devices=devices, **kw)
    gpu.open()
    return gpu


def _limits(gpu: FakeGpuBackend) -> list[float]:
    return [r["power_limit_w"] for r in gpu.sample({"power_limit"})]


# -- the handler over the fake ------------------------------------------------------------------


def test_the_handler_sets_every_device_and_the_readings_report_it() -> None:
    gpu = _fake()
    assert _limits(gpu) == [700.0, 700.0, 700.0]
    set_limit = power_limit_handler(gpu, [0, 1, 2])
    set_limit(450)
    assert _limits(gpu) == [450.0, 450.0, 450.0]
    assert gpu.power_limits_w == {0: 450.0, 1: 450.0, 2: 450.0}
    set_limit(512.5)  # watts need not be whole
    assert _limits(gpu) == [512.5] * 3


def test_only_the_given_devices_change() -> None:
    gpu = _fake()
    power_limit_handler(gpu, [1])(300)
    assert _limits(gpu) == [700.0, 300.0, 700.0]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (99, r"gpu.power_limit_w=99 is outside GPU 0's range \[100, 700\] W"),
        (650, r"gpu.power_limit_w=650 is outside GPU 2's range \[150, 600\] W"),
        ("300", r"gpu.power_limit_w='300' is not a number of watts"),
        (True, r"gpu.power_limit_w=True is not a number of watts"),
        (float("nan"), r"gpu.power_limit_w=nan is not a number of watts"),
    ],
)
def test_a_value_outside_any_devices_range_changes_nothing(value: Any, why: str) -> None:
    gpu = _fake(power_limit_range_w={2: (150, 600)})  # GPUs 0 and 1 keep 100-700 W
    set_limit = power_limit_handler(gpu, [0, 1, 2])
    with pytest.raises(ConfigError, match=why):
        set_limit(value)
    assert gpu.power_limits_w == {}
    assert _limits(gpu) == [700.0, 700.0, 700.0]


def test_without_permission_every_limit_stays() -> None:
    gpu = _fake(deny_power_limit=True)
    with pytest.raises(ConfigError, match=r"=400 not applied: setting the power limit of GPU 0 "):
        power_limit_handler(gpu, [0, 1, 2])(400)
    assert gpu.power_limits_w == {} and _limits(gpu) == [700.0] * 3


def test_a_partial_failure_restores_the_devices_already_set() -> None:
    gpu = _fake(deny_power_limit={2})
    power_limit_handler(gpu, [0, 1])(500)  # GPUs 0 and 1 start from 500 W
    with pytest.raises(ConfigError) as err:
        power_limit_handler(gpu, [0, 1, 2])(300)
    msg = str(err.value)
    assert "needs root" in msg and "nvidia-smi" in msg and "\n" not in msg
    assert msg.endswith("restored the previous limit of GPU 0, 1")
    assert gpu.power_limits_w == {0: 500.0, 1: 500.0}  # GPU 2 was never set
    assert _limits(gpu) == [500.0, 500.0, 700.0]


def test_a_restore_that_fails_is_named() -> None:
    class Flaky(FakeGpuBackend):
        calls = 0

        def set_power_limit_w(self, device: int, watts: float) -> float:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("GPU 1 fell off the bus")
            if self.calls == 3:
                raise ConfigError("GPU 0 is lost")
            return super().set_power_limit_w(device, watts)

    gpu = Flaky(devices=2)
    gpu.open()
    with pytest.raises(ConfigError) as err:
        power_limit_handler(gpu, [0, 1])(300)
    assert str(err.value) == (
        "gpu.power_limit_w=300 not applied: GPU 1: RuntimeError: GPU 1 fell off the bus; "
        "restoring failed: GPU 0 stays at 300 W (GPU 0 is lost)"
    )


def test_the_knobs_range_is_what_every_device_accepts() -> None:
    gpu = _fake(power_limit_range_w={0: (100, 700), 1: (150, 650), 2: (120, 600)})
    assert power_limit_range(gpu, [0, 1, 2]) == (150.0, 600.0)
    apart = _fake(2, power_limit_range_w={0: (100, 200), 1: (300, 400)})
    with pytest.raises(ConfigError, match=r"do not overlap \(GPU 0: \[100, 200\] W, GPU 1: "):
        power_limit_range(apart, [0, 1])
    with pytest.raises(ConfigError, match="no GPU to set"):
        power_limit_handler(gpu, [])


def test_an_unknown_or_closed_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="GPU 5 is not one this backend opened; opened: 0, 1"):
        power_limit_handler(_fake(2), [5])(300)
    closed = FakeGpuBackend(devices=1, unavailable="no NVIDIA driver")
    closed.open()
    with pytest.raises(ConfigError, match=r"no GPU is open \(no NVIDIA driver\)"):
        power_limit_range(closed, [0])


def test_a_backend_without_power_control_refuses() -> None:
    class Bare(GpuBackend):
        name = "bare"

        def open(self) -> GpuCapability:
            return GpuCapability(available=True, devices=1)

        def capability(self) -> GpuCapability:
            return GpuCapability(available=True, devices=1)

        def sample(self, signals: Any = None, pids: Any = ()) -> list[dict[str, Any]]:
            return []

    with pytest.raises(ConfigError, match=r"not supported by this backend \(bare\)"):
        power_limit_handler(Bare(), [0])(300)
    with pytest.raises(ConfigError, match="not supported by this backend"):
        Bare().set_power_limit_w(0, 300)


# -- NvmlBackend, pynvml patched ----------------------------------------------------------------


class Nvml:
    """Two GPUs as NVML shows their power management (limits in mW)."""

    def __init__(self) -> None:
        self.handles = [
            ctypes.cast(ctypes.c_void_p(0x1000 + i), pynvml.c_nvmlDevice_t) for i in (0, 1)
        ]
        self.limit_mw = [700_000, 400_000]
        self.range_mw = [(200_000, 700_000), (150_000, 450_000)]
        self.error: dict[str, int] = {}  # function -> NVML error code
        self.set_calls: list[tuple[int, int]] = []

    def _dev(self, handle: Any, func: str) -> int:
        if func in self.error:
            raise pynvml.NVMLError(self.error[func])
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        return next(
            i for i, h in enumerate(self.handles) if ctypes.cast(h, ctypes.c_void_p).value == addr
        )

    def nvmlInit(self) -> None:
        return None

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return len(self.handles)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.handles[index]

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any) -> list[int]:
        return list(self.range_mw[self._dev(handle, "constraints")])

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return self.limit_mw[self._dev(handle, "get")]

    def nvmlDeviceSetPowerManagementLimit(self, handle: Any, limit: int) -> None:
        i = self._dev(handle, "set")
        self.set_calls.append((i, limit))
        self.limit_mw[i] = limit


@pytest.fixture
def nvml() -> Iterator[tuple[Nvml, NvmlBackend]]:
    fake = Nvml()
    with ExitStack() as stack:
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlSystemGetDriverVersion",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetPowerManagementLimitConstraints",
            "nvmlDeviceGetPowerManagementLimit",
            "nvmlDeviceSetPowerManagementLimit",
        ):
            stack.enter_context(
                mock.patch.object(pynvml, name, autospec=True, side_effect=getattr(fake, name))
            )
        backend = NvmlBackend()
        backend.init()
        yield fake, backend
        backend.close()


def test_nvml_ranges_and_limits_are_in_watts(nvml: tuple[Nvml, NvmlBackend]) -> None:
    fake, backend = nvml
    assert backend.power_limit_range_w(0) == (200.0, 700.0)
    assert backend.power_limit_range_w(1) == (150.0, 450.0)
    assert backend.set_power_limit_w(1, 312.5) == 400.0  # the previous limit
    assert fake.set_calls == [(1, 312_500)]
    assert power_limit_range(backend, [0, 1]) == (200.0, 450.0)
    power_limit_handler(backend, [0, 1])(250)
    assert fake.limit_mw == [250_000, 250_000]


def test_nvml_out_of_range_is_refused_before_any_call(nvml: tuple[Nvml, NvmlBackend]) -> None:
    fake, backend = nvml
    with pytest.raises(
        ConfigError, match=r"power limit 500 W is outside GPU 1's range \[150, 450\] W"
    ):
        backend.set_power_limit_w(1, 500)
    with pytest.raises(ConfigError, match="is not a number of watts"):
        backend.set_power_limit_w(1, float("inf"))
    assert fake.set_calls == []


@pytest.mark.parametrize(
    ("func", "code", "why"),
    [
        (
            "set",
            pynvml.NVML_ERROR_NO_PERMISSION,
            r"setting the power limit of GPU 0 needs root: .*nvidia-smi -i 0 -pl WATTS.*"
            r"\(NVML: Insufficient Permissions\)",
        ),
        (
            "constraints",
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            r"GPU 0 does not support power management limits \(NVML: Not Supported\)",
        ),
        (
            "set",
            pynvml.NVML_ERROR_INVALID_ARGUMENT,
            r"GPU 0 refused setting its power limit to 300 W: outside its range \[200, 700\] W",
        ),
        ("get", pynvml.NVML_ERROR_GPU_IS_LOST, r"GPU 0 is lost \(NVML: GPU is lost\)"),
        (
            "set",
            pynvml.NVML_ERROR_UNKNOWN,
            r"GPU 0: setting its power limit to 300 W failed \(NVML: Unknown Error\)",
        ),
    ],
)
def test_nvml_errors_are_wrapped_in_one_clear_line(
    func: str, code: int, why: str, nvml: tuple[Nvml, NvmlBackend]
) -> None:
    fake, backend = nvml
    fake.error[func] = code
    with pytest.raises(ConfigError, match=why) as err:
        backend.set_power_limit_w(0, 300)
    assert isinstance(err.value.__cause__, pynvml.NVMLError)
    assert "\n" not in str(err.value)
    assert fake.limit_mw == [700_000, 400_000]


def test_nvml_devices_must_be_opened() -> None:
    with pytest.raises(ConfigError, match=r"GPU 0: NVML is not open \(call open\(\) first\)"):
        NvmlBackend().power_limit_range_w(0)


def test_nvml_only_the_devices_it_opened(nvml: tuple[Nvml, NvmlBackend]) -> None:
    _, backend = nvml
    with pytest.raises(ConfigError, match="GPU 7 is not one this backend opened; opened: 0, 1"):
        backend.set_power_limit_w(7, 300)
