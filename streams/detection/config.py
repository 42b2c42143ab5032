"""Detector settings: one frozen dataclass per detector, grouped in `DetectConfig`.

Every setting is addressed live as ``detect.<detector>.<param>`` (`DetectConfig.replace_key`);
each field declares its bounds in its metadata, so a bad value is refused with a one-line
`ConfigError` that names the value and the valid range.

Public through `perfloop.streams.detection`: the funnel and the engine set these live.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from perfloop.exceptions import ConfigError

__all__ = ["DetectConfig"]


def _p(default: float, lo: float, hi: float, doc: str) -> Any:
    return field(default=default, metadata={"lo": lo, "hi": hi, "doc": doc})


_PERSIST = "hold without a break at least this long to open (s)"
_MAX_PERSIST = "at most this long, however noisy the job has been (s)"
_WARMUP = "the job's first steps (its noisiest) open nothing"


def _flag(default: bool = True) -> Any:
    return field(default=default, metadata={"doc": "run this detector"})


@dataclass(frozen=True)
class FunnelParams:
    update_s: float = _p(10.0, 1.0, 3600.0, "least seconds between two updates of a diagnosis")
    min_step_share: float = _p(0.05, 0.0, 1.0, "share of step time that puts a cause on the path")
    hold_s: float = _p(1.5, 0.0, 30.0, "hold a symptom this long while its cause is unconfirmed")
    idle_job_s: float = _p(600.0, 10.0, 86400.0, "forget a job silent this long (wall time)")


@dataclass(frozen=True)
class HangParams:
    enabled: bool = _flag()
    floor_s: float = _p(1.0, 0.1, 3600.0, "shortest stall called a hang when GPUs spin")
    k: float = _p(8.0, 1.0, 1000.0, "stall ≥ k x recent p99 step time (GPUs spinning)")
    slow_floor_s: float = _p(30.0, 1.0, 86400.0, "shortest stall called a hang without spin")
    slow_k: float = _p(50.0, 1.0, 10000.0, "stall ≥ slow_k x p99 step time (no spin evidence)")
    spin_util_pct: float = _p(50.0, 1.0, 100.0, "median GPU util at or above: ranks spin")
    idle_util_pct: float = _p(15.0, 0.0, 100.0, "a GPU at or below this idles (the culprit)")
    min_steps: int = _p(8, 2, 10000, "steps needed before the timeout is learned")
    progress_floor_s: float = _p(
        4.0, 0.1, 3600.0, "shortest stall called a hang when ranks report waiting in comm"
    )
    fresh_s: float = _p(6.0, 0.5, 3600.0, "a rank's progress report counts this long")
    max_pause_s: float = _p(
        900.0, 1.0, 86400.0, "a checkpoint or evaluation longer than this is a hang"
    )


@dataclass(frozen=True)
class ThrottleParams:
    enabled: bool = _flag()
    persist_s: float = _p(0.2, 0.0, 600.0, "throttled without a break this long to open")
    clear_s: float = _p(2.0, 0.1, 3600.0, "unthrottled this long to resolve")
    min_clock_drop: float = _p(0.05, 0.0, 0.9, "SM clock this far below the device's baseline")


@dataclass(frozen=True)
class GpuErrorParams:
    enabled: bool = _flag()
    clear_s: float = _p(60.0, 1.0, 86400.0, "no new XID or ECC DBE this long to resolve")


@dataclass(frozen=True)
class StragglerParams:
    enabled: bool = _flag()
    score_threshold: float = _p(
        0.12, 0.01, 0.99, "a slow step: lateness over the on-time ranks, share of the step"
    )
    median_steps: int = _p(15, 1, 100, "steps whose median lateness counts: noise and contention")
    persist_s: float = _p(1.0, 0.0, 3600.0, _PERSIST)
    level_persist_s: float = _p(
        2.0, 0.0, 3600.0, "and this long for each score_threshold the latest rank is late (s)"
    )
    max_persist_s: float = _p(6.0, 0.0, 3600.0, _MAX_PERSIST)
    persist_steps: int = _p(3, 1, 1000, "consecutive slow steps to open")
    clear_steps: int = _p(4, 1, 1000, "consecutive normal steps to resolve")
    warmup_steps: int = _p(20, 0, 100000, _WARMUP)
    stage_slowdown: float = _p(
        0.25, 0.05, 10.0, "a pipeline's: rise of a rank's own compute over its baseline"
    )
    baseline_steps: int = _p(48, 4, 100000, "a pipeline's: steps that set each rank's baseline")
    stage_wait_pct: float = _p(
        20.0, 1.0, 10000.0, "a pipeline's: rise of a rank's wait for a CPU (% of a core)"
    )


@dataclass(frozen=True)
class LoadImbalanceParams:
    enabled: bool = _flag()
    threshold: float = _p(0.15, 0.01, 0.99, "1 - median/max compute of an imbalanced step")
    window_steps: int = _p(8, 2, 1000, "steps looked at")
    min_flagged: int = _p(6, 1, 1000, "imbalanced steps in the window to open")
    persist_s: float = _p(2.0, 0.0, 3600.0, _PERSIST)
    max_persist_s: float = _p(8.0, 0.0, 3600.0, _MAX_PERSIST)
    persist_steps: int = _p(3, 1, 1000, "consecutive imbalanced windows to open")
    clear_steps: int = _p(1, 1, 1000, "balanced windows to resolve")
    warmup_steps: int = _p(20, 0, 100000, _WARMUP)
    stage_threshold: float = _p(
        0.15,
        0.01,
        0.99,
        "a pipeline's: 1 - mean/max compute over its ranks (its step's share lost)",
    )
    stage_share: float = _p(
        0.75,
        0.5,
        1.0,
        "a pipeline's: share of the window's steps in which the heaviest ranks compute most",
    )


@dataclass(frozen=True)
class DataloaderParams:
    enabled: bool = _flag()
    share_threshold: float = _p(0.15, 0.01, 0.99, "data-wait share of a starved step")
    min_wait_ms: float = _p(
        2.0, 0.0, 60000.0, "and its data wait at least this long (ms): less is not worth a worker"
    )
    persist_steps: int = _p(3, 1, 1000, "consecutive starved steps to open")
    clear_steps: int = _p(4, 1, 1000, "consecutive fed steps to resolve")
    clear_s: float = _p(2.0, 0.0, 3600.0, "and fed this long (event time) to resolve")


@dataclass(frozen=True)
class CommParams:
    enabled: bool = _flag()
    ratio_threshold: float = _p(1.5, 1.01, 100.0, "pure comm time / baseline of a slow step")
    persist_steps: int = _p(3, 1, 1000, "consecutive slow steps to open")
    clear_steps: int = _p(4, 1, 1000, "consecutive normal steps to resolve")
    baseline_steps: int = _p(8, 2, 10000, "steps that set the first baseline")
    persist_s: float = _p(0.5, 0.0, 3600.0, _PERSIST)
    max_persist_s: float = _p(6.0, 0.0, 3600.0, _MAX_PERSIST)
    warmup_steps: int = _p(0, 0, 100000, "steps after the baseline that open nothing")


@dataclass(frozen=True)
class ExposedCommParams:
    enabled: bool = _flag()
    share_threshold: float = _p(0.2, 0.01, 0.99, "exposed (unhidden) comm share of the step")
    persist_steps: int = _p(4, 1, 1000, "consecutive steps to open")
    persist_s: float = _p(0.0, 0.0, 3600.0, _PERSIST)
    max_persist_s: float = _p(6.0, 0.0, 3600.0, _MAX_PERSIST)
    warmup_steps: int = _p(20, 0, 100000, _WARMUP)
    clear_steps: int = _p(4, 1, 1000, "consecutive steps to resolve")


@dataclass(frozen=True)
class CpuParams:
    enabled: bool = _flag()
    threshold_pct: float = _p(90.0, 1.0, 100.0, "node CPU at or above: saturated")
    persist_s: float = _p(1.0, 0.0, 3600.0, "saturated without a break this long to open")
    clear_s: float = _p(5.0, 0.1, 3600.0, "below the threshold this long to resolve")


@dataclass(frozen=True)
class MemoryParams:
    enabled: bool = _flag()
    window_steps: int = _p(5, 3, 1000, "steps whose allocated memory must keep growing")
    min_growth_bytes: float = _p(float(1 << 20), 1.0, 1e15, "least growth per step (bytes)")
    clear_steps: int = _p(4, 1, 1000, "steps without growth to resolve")
    clear_s: float = _p(3.0, 0.0, 3600.0, "and this long without growth (event time)")
    warmup_steps: int = _p(50, 0, 100000, "a CPU job's first steps (its RSS settles) say nothing")
    rss_points: int = _p(5, 3, 32, "fewest one-second RSS points a CPU job's leak is judged on")
    rss_up_share: float = _p(0.6, 0.0, 1.0, "share of their seconds RSS must rise in")
    rss_min_growth_bytes_per_s: float = _p(
        float(2 << 20), 1.0, 1e15, "least RSS growth a second over them (bytes; Theil-Sen)"
    )
    rss_min_rise_bytes: float = _p(float(32 << 20), 1.0, 1e15, "least RSS rise over them (bytes)")
    rss_noise_factor: float = _p(4.0, 0.0, 100.0, "rise ≥ this x the points' scatter")
    rss_settle_s: float = _p(5.0, 0.0, 3600.0, "RSS points count this long after a start or change")


@dataclass(frozen=True)
class ThreadsParams:
    enabled: bool = _flag()
    min_compute_share: float = _p(0.3, 0.0, 1.0, "compute share of the step the threads matter at")
    persist_steps: int = _p(3, 1, 1000, "consecutive oversubscribed steps to open")
    clear_steps: int = _p(3, 1, 1000, "consecutive steps that fit to resolve")


@dataclass(frozen=True)
class RooflineParams:
    enabled: bool = _flag()
    min_samples: int = _p(50, 1, 1_000_000, "GPU samples (or kernel steps) before classifying")


@dataclass(frozen=True)
class DetectConfig:
    """Settings of every detector; ``detect.<detector>.<param>`` names one of them.

    >>> cfg = DetectConfig()
    >>> cfg.straggler.score_threshold
    0.12
    >>> cfg.replace_key("straggler.score_threshold", 0.2).straggler.score_threshold
    0.2
    >>> cfg.replace_key("straggler.nope", 1)
    Traceback (most recent call last):
    ...
    perfloop.exceptions.ConfigError: unknown setting detect.straggler.nope; valid: \
baseline_steps, clear_steps, enabled, level_persist_s, max_persist_s, median_steps, persist_s, \
persist_steps, score_threshold, stage_slowdown, stage_wait_pct, warmup_steps
    """

    funnel: FunnelParams = field(default_factory=FunnelParams)
    hang: HangParams = field(default_factory=HangParams)
    throttle: ThrottleParams = field(default_factory=ThrottleParams)
    gpu_error: GpuErrorParams = field(default_factory=GpuErrorParams)
    straggler: StragglerParams = field(default_factory=StragglerParams)
    load_imbalance: LoadImbalanceParams = field(default_factory=LoadImbalanceParams)
    dataloader: DataloaderParams = field(default_factory=DataloaderParams)
    comm: CommParams = field(default_factory=CommParams)
    exposed_comm: ExposedCommParams = field(default_factory=ExposedCommParams)
    cpu: CpuParams = field(default_factory=CpuParams)
    memory: MemoryParams = field(default_factory=MemoryParams)
    roofline: RooflineParams = field(default_factory=RooflineParams)
    threads: ThreadsParams = field(default_factory=ThreadsParams)

    def get_key(self, key: str) -> Any:
        """The value of ``<detector>.<param>`` (without the ``detect.`` prefix)."""
        group, name = self._split(key)
        return getattr(getattr(self, group), name)

    def replace_key(self, key: str, value: Any) -> DetectConfig:
        """A copy with ``<detector>.<param>`` set to ``value``; `ConfigError` if invalid."""
        group, name = self._split(key)
        params = getattr(self, group)
        f = next(f for f in dataclasses.fields(params) if f.name == name)
        new = _coerce(f"detect.{key}", f, value)
        return dataclasses.replace(self, **{group: dataclasses.replace(params, **{name: new})})

    def _split(self, key: str) -> tuple[str, str]:
        groups = sorted(f.name for f in dataclasses.fields(self))
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in groups:
            raise ConfigError(f"unknown setting detect.{key}; valid detectors: {', '.join(groups)}")
        names = sorted(f.name for f in dataclasses.fields(getattr(self, parts[0])))
        if parts[1] not in names:
            raise ConfigError(f"unknown setting detect.{key}; valid: {', '.join(names)}")
        return parts[0], parts[1]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (for snapshots)."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, doc: dict[str, dict[str, Any]]) -> DetectConfig:
        """Inverse of `to_dict`; settings missing from ``doc`` keep their defaults."""
        cfg = cls()
        for group, values in doc.items():
            for name, value in values.items():
                cfg = cfg.replace_key(f"{group}.{name}", value)
        return cfg


def _coerce(key: str, f: dataclasses.Field[Any], value: Any) -> Any:
    kind = type(f.default)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    lo, hi = f.metadata["lo"], f.metadata["hi"]
    if kind is int:
        if value != int(value):
            raise ConfigError(f"{key} must be a whole number in [{lo:g}, {hi:g}], got {value!r}")
        value = int(value)
    value = kind(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError(f"{key} must be in [{lo:g}, {hi:g}], got {value!r}")
    return value
