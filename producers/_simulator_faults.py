"""What the faults of a simulated job do (a mixin of `perfloop.producers.simulator.SimulatedJob`,
private to it): which are active when, how they change a chunk of steps (slower loading or
compute, a leak, a slower all-reduce), the clock the power cap leaves, and each GPU's clocks,
throttle reasons and temperature around a thermal throttle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfloop.producers._simulator_config import (
    IDLE_W,
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    THROTTLE_SW_THERMAL,
    SimConfig,
)
from perfloop.producers.faults import Fault

__all__ = ["FaultEffects", "FaultState"]


@dataclass
class FaultState:
    """The faults' effect on the steps of one chunk."""

    load_mult: np.ndarray
    compute_mult: np.ndarray
    leak: np.ndarray
    comm_div: float = 1.0


class FaultEffects:
    """The faults' side of `SimulatedJob`, which holds the state below and ``active_faults``."""

    cfg: SimConfig
    world: int
    power_limit_w: float

    def _ranks(self, f: Fault) -> list[int]:
        return list(f.ranks) if f.ranks else list(range(self.world))

    def _fault_state(self, t_ms: float) -> FaultState:
        w = self.world
        st = FaultState(np.ones(w), np.full(w, 1.0 / self._power_clock()), np.zeros(w))
        for f in self.active_faults(t_ms / 1000):
            r, x = self._ranks(f), f.strength
            if f.kind == "dataloader_starvation":
                st.load_mult[r] *= x
            elif f.kind == "straggler":
                st.compute_mult[r] *= x
            elif f.kind == "thermal_throttle":
                st.compute_mult[r] /= x
            elif f.kind == "memory_leak":
                st.leak[r] += x
            elif f.kind == "comm_degradation":
                st.comm_div = max(st.comm_div, x)
        return st

    def _power_clock(self) -> float:
        """Clock multiplier the power cap imposes (dynamic power ~ clock³)."""
        need = self.cfg.power_limit_w - IDLE_W
        return min(1.0, max(0.3, (self.power_limit_w - IDLE_W) / need) ** (1 / 3))

    def _boundaries(self, after_ms: float) -> list[float]:
        times = []
        for f in self.cfg.faults:
            for t in (f.onset_s, f.end_s):
                if t is not None and t * 1000 > after_ms:
                    times.append(t * 1000)
        return times

    def _clocks(
        self, ticks: np.ndarray, shape: tuple[int, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each GPU's clock multiplier, throttle reasons and temperature floor at ``ticks`` (ms),
        each of ``shape`` (ticks, ranks): the power cap lowers every clock, a thermal throttle
        its ranks' clocks from its onset, after they heated up."""
        w = self.world
        clock = np.full(shape, self._power_clock())
        throttle = np.full(shape, THROTTLE_SW_POWER_CAP if clock[0, 0] < 1 else 0, dtype=np.int64)
        temp_floor = np.zeros(shape)
        for f in self.cfg.faults:
            if f.kind != "thermal_throttle":
                continue
            r = self._ranks(f)
            on = (ticks >= f.onset_s * 1000) & (
                ticks < (f.end_s * 1000 if f.end_s is not None else np.inf)
            )
            mask = on[:, None] & np.isin(np.arange(w), r)[None, :]
            clock = np.where(mask, np.minimum(clock, f.strength), clock)
            bits = THROTTLE_SW_THERMAL | (THROTTLE_HW_THERMAL if f.strength < 0.7 else 0)
            throttle = np.where(mask, throttle | bits, throttle)
            # the GPU heats up over the 15 s before it throttles
            ramp = np.clip(1 - (f.onset_s * 1000 - ticks) / 15000, 0, 1) * (
                ticks < f.onset_s * 1000
            )
            heat = np.where(ramp > 0, 66.0 + 20.0 * ramp, 0.0)
            temp_floor = np.maximum(
                temp_floor, np.where(np.isin(np.arange(w), r)[None, :], heat[:, None], 0.0)
            )
            temp_floor = np.where(mask, 87.0, temp_floor)
        return clock, throttle, temp_floor
