"""An injected fault of the simulated job: its kind, onset, end, ranks and strength.

A `Fault` is one injected problem: its kind (one of `perfloop.schemas.FAULT_KINDS` but
``oom``, which a memory leak ends in), its onset and optional end in simulated seconds, the
ranks it is injected on (its root cause: the straggling rank, the throttled GPU, the node with
the degraded link; empty means every rank) and its strength (`Fault.factor`, see
`FAULT_FACTORS`). `perfloop.producers.scenarios` plans faults for a named scenario;
`perfloop.producers.simulator` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perfloop.exceptions import ConfigError
from perfloop.schemas.job import FAULT_KINDS

__all__ = ["FAULT_FACTORS", "INJECTABLE_FAULTS", "Fault"]

INJECTABLE_FAULTS = tuple(k for k in FAULT_KINDS if k != "oom")
"""The kinds a scenario injects: every fault kind but ``oom``, which a memory leak ends in."""

FAULT_FACTORS: dict[str, tuple[float, str]] = {
    "dataloader_starvation": (10 / 3, "per-batch load time multiplier (> 1)"),
    "straggler": (1.5, "compute time multiplier (> 1)"),
    "thermal_throttle": (0.65, "SM clock multiplier (0 < f < 1)"),
    "memory_leak": (float(256 << 20), "bytes leaked per step (> 0)"),
    "comm_degradation": (4.0, "all-reduce bandwidth divisor (> 1)"),
    "hang": (1.0, "unused"),
}
"""Each kind's default strength and what its ``factor`` means."""


@dataclass(frozen=True)
class Fault:
    """One injected fault; times are simulated seconds from the job's start.

    >>> f = Fault("straggler", onset_s=10.0, end_s=20.0, ranks=(3,), factor=1.6)
    >>> f.active(9.999), f.active(10.0), f.active(20.0), f.strength
    (False, True, False, 1.6)
    >>> Fault("oom", onset_s=1.0)
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: unknown fault 'oom'; valid: dataloader_starvation, \
straggler, thermal_throttle, memory_leak, comm_degradation, hang
    """

    kind: str
    onset_s: float
    end_s: float | None = None
    ranks: tuple[int, ...] = ()
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in INJECTABLE_FAULTS:
            raise ConfigError(f"unknown fault {self.kind!r}; valid: {', '.join(INJECTABLE_FAULTS)}")
        if not (math.isfinite(self.onset_s) and self.onset_s >= 0):
            raise ConfigError(f"{self.kind} onset must be ≥ 0 s, got {self.onset_s!r}")
        if self.end_s is not None and not self.end_s > self.onset_s:
            raise ConfigError(
                f"{self.kind} end ({self.end_s!r} s) must come after its onset ({self.onset_s} s)"
            )
        if any(r < 0 for r in self.ranks):
            raise ConfigError(f"{self.kind} ranks must be ≥ 0, got {list(self.ranks)}")
        f = self.strength
        ok = {
            "thermal_throttle": 0 < f < 1,
            "memory_leak": f > 0,
            "hang": True,
        }.get(self.kind, f > 1)
        if not (math.isfinite(f) and ok):
            raise ConfigError(
                f"{self.kind} factor {f!r} is out of range: {FAULT_FACTORS[self.kind][1]}"
            )

    @property
    def strength(self) -> float:
        """``factor``, or the kind's default."""
        return FAULT_FACTORS[self.kind][0] if self.factor is None else float(self.factor)

    def active(self, t_s: float) -> bool:
        """Whether the fault is in effect at simulated time ``t_s``."""
        return self.onset_s <= t_s and (self.end_s is None or t_s < self.end_s)

    def describe(self) -> str:
        """What the fault does, in a few words (the ground truth's ``detail``)."""
        f = self.strength
        return {
            "dataloader_starvation": f"each batch takes {f:.2f}x as long to load",
            "straggler": f"compute {f:.2f}x slower",
            "thermal_throttle": f"SM clock x{f:.2f} (thermal slowdown)",
            "memory_leak": f"{f / 2**20:.1f} MiB leaked per step until out of memory",
            "comm_degradation": f"all-reduce bandwidth / {f:.2f}",
            "hang": "the rank stops making progress; every rank blocks at the next all-reduce",
        }[self.kind]
