"""Fakes that ship with perfloop, for tests, simulations and demos on machines without a GPU.

`FakeGpuBackend` is a `GpuBackend` that generates GPU readings (a busy GPU by default, or any
function of device and read number), replays recorded rows, or plays the failures a real node
shows: a driver that is missing, signals a device does not support, a GPU lost mid-run. It
keeps what it was asked for (``requests``) so tests can check which signals were read. Its power
limits can be set within a range (100–700 W unless told otherwise), and the readings then report
the new limit; setting them can be made to fail as NVML does without root.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.producers.gpu import (
    GPU_SIGNALS,
    GpuBackend,
    GpuCapability,
    check_watts,
    power_limit_permission_text,
)
from perfloop.schemas.telemetry import GpuSample

__all__ = ["POWER_LIMIT_RANGE_W", "FakeGpuBackend", "busy_gpu"]

Reading = Callable[[int, int], Mapping[str, Any]]
POWER_LIMIT_RANGE_W = (100.0, 700.0)
"""The fake GPUs' power-limit range unless told otherwise (W)."""


def busy_gpu(device: int, n: int) -> dict[str, Any]:
    """A plausible busy 80 GB GPU on read ``n``: utilisation and power wave, energy grows.

    >>> r = busy_gpu(0, 10)
    >>> 0 <= r["sm_util_pct"] <= 100, r["mem_total_bytes"]
    (True, 85899345920)
    """
    wave = math.sin(n / 5.0 + device)
    return {
        "sm_util_pct": 90.0 + 8.0 * wave,
        "mem_util_pct": 45.0 + 5.0 * wave,
        "mem_used_bytes": (60 << 30) + device * (1 << 28),
        "mem_total_bytes": 80 << 30,
        "power_w": 550.0 + 100.0 * wave,
        "power_limit_w": 700.0,
        "energy_mj": 600_000 * n,
        "temp_c": 70.0 + 3.0 * wave,
        "sm_clock_mhz": 1980.0,
        "mem_clock_mhz": 2619.0,
        "throttle_reasons": 0,
        "pcie_rx_bytes_per_s": 2.0e9,
        "pcie_tx_bytes_per_s": 1.0e9,
        "nvlink_rx_bytes_per_s": 1.0e11,
        "nvlink_tx_bytes_per_s": 1.0e11,
        "ecc_sbe_total": 0,
        "ecc_dbe_total": 0,
        "xid_events": 0,
        "last_xid": 0,
        "process_mem_bytes": (58 << 30) + device * (1 << 28),
    }


class FakeGpuBackend(GpuBackend):
    """A GPU backend without hardware.

    ``reading(device, n)`` gives the fields of read ``n`` of ``device`` (default `busy_gpu`);
    ``replay`` instead gives rows to play in order (each a list with one mapping per device),
    repeating when they run out. ``missing`` maps signals to the reason they are unsupported;
    ``unavailable`` makes ``open()`` report no GPU with that reason; ``lose_after`` loses every
    device after that many reads.

    ``power_limit_range_w`` is every device's power-limit range in W, or a mapping of device to
    its range (devices it leaves out: `POWER_LIMIT_RANGE_W`); ``deny_power_limit`` makes setting
    the limit fail as it does without root, on every device (True) or on those listed. Once a
    device's limit is set, its readings report it (``power_limit_w``) and ``power_limits_w``
    holds it; before, its limit is the top of its range (what the first `set_power_limit_w`
    returns) and its readings are ``reading``'s.

    >>> gpu = FakeGpuBackend(devices=2, missing={"nvlink": "no NVLink"})
    >>> cap = gpu.open()
    >>> cap.available, cap.devices, cap.missing
    (True, 2, ('nvlink',))
    >>> rows = gpu.sample({"power"})
    >>> [r["device"] for r in rows], rows[0]["nvlink_rx_bytes_per_s"]
    ([0, 1], 0.0)
    >>> FakeGpuBackend(unavailable="no NVIDIA driver").open().available
    False
    >>> gpu.set_power_limit_w(1, 450.0), gpu.sample({"power_limit"})[1]["power_limit_w"]
    (700.0, 450.0)
    """

    name = "fake"

    def __init__(
        self,
        devices: int = 1,
        *,
        reading: Reading | None = None,
        replay: Sequence[Sequence[Mapping[str, Any]]] | None = None,
        missing: Mapping[str, str] | None = None,
        unavailable: str | None = None,
        lose_after: int | None = None,
        floors: Mapping[str, float] | None = None,
        power_limit_range_w: tuple[float, float]
        | Mapping[int, tuple[float, float]] = POWER_LIMIT_RANGE_W,
        deny_power_limit: bool | Collection[int] = False,
    ) -> None:
        unknown = set(missing or {}) - set(GPU_SIGNALS)
        if unknown:
            raise ValueError(f"unknown GPU signals {sorted(unknown)}; valid: {sorted(GPU_SIGNALS)}")
        self.devices = devices
        self._reading = reading or busy_gpu
        self._replay = [list(r) for r in replay] if replay is not None else None
        self._missing = dict(missing or {})
        self._unavailable = unavailable
        self._lose_after = lose_after
        self._floors = dict(floors or {})
        self._lock = threading.Lock()
        self._last: list[dict[str, Any]] = []
        self._cap = GpuCapability(available=False, reason="not opened")
        self.reads = 0
        self.requests: list[frozenset[str]] = []
        """The signals asked for by each ``sample`` call."""
        self.opened = self.closed = False
        if isinstance(power_limit_range_w, Mapping):
            given = {int(d): _range(r) for d, r in power_limit_range_w.items()}
            default = _range(POWER_LIMIT_RANGE_W)
        else:
            given, default = {}, _range(power_limit_range_w)
        self._power_ranges = {d: given.get(d, default) for d in range(max(devices, 0))}
        self._deny_power = (
            set(range(max(devices, 0))) if deny_power_limit is True else set(deny_power_limit or ())
        )
        self.power_limits_w: dict[int, float] = {}
        """The power limit each device was set to (devices never set are absent)."""

    def open(self) -> GpuCapability:
        self.opened = True
        if self._unavailable is not None or self.devices < 1:
            reason = self._unavailable or "no GPU"
            self._cap = GpuCapability(
                available=False, reason=reason, missing=("gpu",), generation=1
            )
            return self._cap
        zero = {f: GpuSample.model_fields[f].default for fs in GPU_SIGNALS.values() for f in fs}
        self._last = [dict(zero, device=d) for d in range(self.devices)]
        self._cap = GpuCapability(
            available=True,
            devices=self.devices,
            signals=tuple(s for s in GPU_SIGNALS if s not in self._missing),
            missing=tuple(self._missing),
            details=dict(self._missing, gpu_name="FakeGPU"),
            generation=1,
        )
        return self._cap

    def capability(self) -> GpuCapability:
        return self._cap

    def min_interval_s(self) -> Mapping[str, float]:
        return dict(self._floors)

    def _fields(self, device: int, n: int) -> Mapping[str, Any]:
        if self._replay is not None:
            if not self._replay:
                return {}
            tick = self._replay[n % len(self._replay)]
            return tick[device] if device < len(tick) else {}
        return self._reading(device, n)

    def sample(
        self, signals: Collection[str] | None = None, pids: Collection[int] = ()
    ) -> list[dict[str, Any]]:
        with self._lock:
            if not self._cap.available:
                return []
            wanted = set(GPU_SIGNALS) if signals is None else set(signals)
            self.requests.append(frozenset(wanted))
            if self._lose_after is not None and self.reads >= self._lose_after:
                self._cap = GpuCapability(
                    available=False,
                    missing=("gpu",),
                    reason="all GPUs lost (GPU is lost)",
                    generation=self._cap.generation + 1,
                )
                return []
            n = self.reads
            self.reads += 1
            for d, last in enumerate(self._last):
                fields = self._fields(d, n)
                for signal in wanted - set(self._missing):
                    for f in GPU_SIGNALS.get(signal, ()):
                        if f in fields:
                            last[f] = fields[f]
                    if signal == "power_limit" and d in self.power_limits_w:
                        last["power_limit_w"] = self.power_limits_w[d]
            return [dict(r) for r in self._last]

    def close(self) -> None:
        self.closed = True

    def power_limit_range_w(self, device: int) -> tuple[float, float]:
        if not self._cap.available:
            raise ConfigError(f"GPU {device}: no GPU is open ({self._cap.reason})")
        r = self._power_ranges.get(device)
        if r is None:
            raise ConfigError(
                f"GPU {device} is not one this backend opened; opened: "
                + ", ".join(map(str, range(self.devices)))
            )
        return r

    def set_power_limit_w(self, device: int, watts: float) -> float:
        check_watts(device, watts)
        lo, hi = self.power_limit_range_w(device)
        if not lo <= watts <= hi:
            raise ConfigError(
                f"power limit {watts:g} W is outside GPU {device}'s range [{lo:g}, {hi:g}] W"
            )
        if device in self._deny_power:
            raise ConfigError(
                f"{power_limit_permission_text(device)} (NVML: Insufficient Permissions)"
            )
        with self._lock:
            before = self.power_limits_w.get(device, hi)
            self.power_limits_w[device] = float(watts)
        return before


def _range(r: tuple[float, float]) -> tuple[float, float]:
    lo, hi = float(r[0]), float(r[1])
    if not 0 <= lo <= hi:
        raise ValueError(
            f"power limit range {r!r}: use (lowest, highest) W with 0 ≤ lowest ≤ highest"
        )
    return lo, hi
