"""Cost of the node samplers: per-sample cost of NVML and host reads, and the sampler's overhead
with adaptive sampling against fixed intervals, measured in the same run.

1. ``NvmlBackend.sample()`` per device: with a real GPU when NVML answers (``--real``, the
   default when one is there), else with NVML's functions replaced by instant stubs, which
   measures perfloop's own Python around the calls against a baseline that makes the same
   number of bare stub calls.
2. ``HostSampler.sample()`` for one watched process (this one) and node-level.
3. ``NodeSampler`` on the shipped fake GPU (``--devices`` GPUs, a job whose utilisation moves
   and whose other signals are flat) for ``--seconds``, adaptive vs fixed intervals: samples/s,
   CPU time of the sampler threads as a share of wall time (its `OverheadMeter`), and rates.

    python bench/sampler.py                 # ~10 s
    python bench/sampler.py --seconds 2     # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pynvml

from bench._common import save_result, say
from perfloop.producers.gpu import NvmlBackend
from perfloop.producers.host import HostSampler
from perfloop.producers.node_sampler import NodeSampler
from perfloop.settings import ProducerSettings
from perfloop.testing import FakeGpuBackend, busy_gpu


def _per_call_us(fn: Any, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


class _Stubs:
    """Instant stand-ins for the NVML calls (no GPU here): they count calls."""

    def __init__(self, devices: int) -> None:
        import ctypes

        self.calls = 0
        self.handles = [
            ctypes.cast(ctypes.c_void_p(0x1000 + 16 * i), pynvml.c_nvmlDevice_t)
            for i in range(devices)
        ]
        self.util = pynvml.c_nvmlUtilization_t(gpu=90, memory=40)
        self.mem = pynvml.c_nvmlMemory_t(total=80 << 30, free=20 << 30, used=60 << 30)
        self.devices = devices

    def _n(self, value: Any) -> Any:
        self.calls += 1
        return value

    def fields(self, handle: Any, ids: list[Any]) -> Any:
        self.calls += 1
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for v, fid in zip(values, ids, strict=True):
            fid = fid[0] if isinstance(fid, tuple) else fid
            v.fieldId, v.valueType, v.nvmlReturn = fid, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0
            v.value.ullVal = 4 if fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT else 1000
        return values

    def timeout(self, *_: Any) -> Any:
        self.calls += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def patches(self) -> list[Any]:
        n = self._n
        self.table = table = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: self.devices,
            "nvmlSystemGetDriverVersion": lambda: "stub",
            "nvmlDeviceGetHandleByIndex": lambda i: self.handles[i],
            "nvmlDeviceGetName": lambda h: "stub",
            "nvmlEventSetCreate": lambda: object(),
            "nvmlEventSetFree": lambda s: None,
            "nvmlDeviceGetSupportedEventTypes": lambda h: pynvml.nvmlEventTypeXidCriticalError,
            "nvmlDeviceRegisterEvents": lambda h, t, s: None,
            "nvmlEventSetWait": self.timeout,
            "nvmlDeviceGetFieldValues": self.fields,
            "nvmlDeviceGetUtilizationRates": lambda h: n(self.util),
            "nvmlDeviceGetMemoryInfo": lambda h: n(self.mem),
            "nvmlDeviceGetPowerUsage": lambda h: n(300_000),
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: n(700_000),
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: n(10**9),
            "nvmlDeviceGetTemperature": lambda h, s: n(70),
            "nvmlDeviceGetClockInfo": lambda h, t: n(1980),
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: n(0),
            "nvmlDeviceGetTotalEccErrors": lambda h, e, c: n(0),
            "nvmlDeviceGetComputeRunningProcesses": lambda h: n([]),
        }
        return [mock.patch.object(pynvml, k, new=v) for k, v in table.items()]


def bench_nvml(devices: int, rounds: int, real: bool) -> dict[str, Any]:
    if real:
        gpu = NvmlBackend()
        cap = gpu.open()
        full = _per_call_us(gpu.sample, rounds)
        power = _per_call_us(lambda: gpu.sample({"power"}), rounds)
        gpu.close()
        n = max(cap.devices, 1)
        say(
            f"NVML (real, {cap.devices} × {cap.details.get('gpu_name', '?')}): full sample "
            f"{full / n:.0f} µs per device, power only {power / n:.1f} µs per device; "
            f"missing {list(cap.missing)}"
        )
        return {"mode": "real", "devices": cap.devices, "full_us_per_device": full / n,
                "power_us_per_device": power / n, "missing": list(cap.missing)}  # fmt: skip
    stubs = _Stubs(devices)
    patches = stubs.patches()
    for p in patches:
        p.start()
    try:
        gpu = NvmlBackend()
        gpu.open()
        stubs.calls = 0
        full = _per_call_us(gpu.sample, rounds)
        calls = stubs.calls / (rounds + 1) / devices
        power = _per_call_us(lambda: gpu.sample({"power"}), rounds)
        # the baseline: the very NVML calls one sample makes, replayed with no perfloop code
        recorded: list[tuple[Any, tuple[Any, ...]]] = []
        originals = {n: getattr(pynvml, n) for n in stubs.table}  # the stubs, patched in

        def recorder(fn: Any) -> Any:
            def call(*a: Any) -> Any:
                recorded.append((fn, a))
                return fn(*a)

            return call

        for n, fn in originals.items():
            setattr(pynvml, n, recorder(fn))
        gpu.sample()
        for n, fn in originals.items():
            setattr(pynvml, n, fn)

        def bare() -> None:
            for fn, a in recorded:
                with contextlib.suppress(pynvml.NVMLError):
                    fn(*a)

        baseline = _per_call_us(bare, rounds)
    finally:
        for p in patches:
            p.stop()
    say(
        f"NVML (stubbed, no GPU here): full sample {full / devices:.1f} µs per device for "
        f"{calls:.0f} NVML calls; the same calls bare {baseline / devices:.1f} µs → perfloop's "
        f"own cost {(full - baseline) / devices:.1f} µs per device ({full / baseline:.2f}× the "
        f"bare calls); power only {power / devices:.1f} µs per device. A real NVML call adds "
        "its driver time (µs to tens of µs each)."
    )
    return {"mode": "stubbed", "devices": devices, "nvml_calls_per_device": calls,
            "full_us_per_device": full / devices, "bare_us_per_device": baseline / devices,
            "power_us_per_device": power / devices}  # fmt: skip


def bench_host(rounds: int) -> dict[str, Any]:
    import os

    watched = HostSampler({os.getpid(): 0})
    node = HostSampler()
    w = _per_call_us(watched.sample, rounds)
    n = _per_call_us(node.sample, rounds)
    say(f"host sampler: {w:.0f} µs per sample watching 1 process, {n:.0f} µs node-level")
    return {"watched_us": w, "node_us": n}


class _Null:
    def publish(self, topic: str, key: str, value: bytes) -> bool:
        return True


def bench_node(devices: int, seconds: float, adaptive: bool) -> dict[str, Any]:
    from perfloop.producers.emitter import Emitter

    def reading(d: int, n: int) -> dict[str, Any]:  # utilisation moves, the rest is flat
        return busy_gpu(d, 0) | {"sm_util_pct": 30.0 if n % 2 else 95.0}

    settings = ProducerSettings(adaptive_sampling=adaptive, host_interval_ms=1000)
    em = Emitter(_Null(), job_id="bench", node="n0", producer_id="bench")
    s = NodeSampler(settings, em, gpu_backend=FakeGpuBackend(devices, reading=reading), flush=True)
    s.start()  # first half: the controller settles; second half: steady state
    time.sleep(seconds / 2)
    cpu0, n0 = s.meter.total_s, s.samples
    time.sleep(seconds / 2)
    cpu1, n1 = s.meter.total_s, s.samples
    rates = s.controller.rates_hz()
    s.stop()
    half = seconds / 2
    doc = {
        "adaptive": adaptive,
        "samples_per_s": (n1 - n0) / half,
        "cpu_ms_per_s": (cpu1 - cpu0) * 1e3 / half,
        "overhead_pct": 100 * (cpu1 - cpu0) / half,
        "overhead_pct_whole_run": 100 * s.meter.total_s / seconds,
        "rate_utilization_hz": rates["gpu.utilization"],
        "rate_power_limit_hz": rates["gpu.power_limit"],
        "scale": s.controller.scale,
    }
    say(
        f"node sampler, {devices} fake GPUs, {'adaptive' if adaptive else 'fixed'} (steady "
        f"state, 2nd half): {doc['samples_per_s']:.0f} samples/s, sampler CPU "
        f"{doc['overhead_pct']:.2f}% of wall (budget {settings.overhead_budget_pct}%; whole run "
        f"{doc['overhead_pct_whole_run']:.2f}%), moving signal {rates['gpu.utilization']:.0f} "
        f"Hz, flat signal {rates['gpu.power_limit']:.1f} Hz, budget scale {s.controller.scale:.1f}"
    )
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=None,
                    help="sample a real GPU (default: when NVML answers)")  # fmt: skip
    args = ap.parse_args()
    real = args.real
    if real is None:
        probe = NvmlBackend()
        real = probe.open().available
        probe.close()
    doc: dict[str, Any] = {"nvml": bench_nvml(args.devices, args.rounds, real)}
    doc["host"] = bench_host(max(50, args.rounds // 20))
    fixed = bench_node(args.devices, args.seconds, adaptive=False)
    adaptive = bench_node(args.devices, args.seconds, adaptive=True)
    doc["node"] = {"fixed": fixed, "adaptive": adaptive}
    say(
        f"adaptive vs fixed at the same budget: moving signal "
        f"{adaptive['rate_utilization_hz'] / fixed['rate_utilization_hz']:.1f}× the rate, flat "
        f"signals {adaptive['rate_power_limit_hz'] / fixed['rate_power_limit_hz']:.2f}×, sampler "
        f"CPU {adaptive['cpu_ms_per_s'] / max(fixed['cpu_ms_per_s'], 1e-9):.2f}×"
    )
    save_result("sampler", doc)


if __name__ == "__main__":
    main()
