"""Telemetry samples published by producers on training nodes."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from perfloop.schemas.base import Event

__all__ = ["GpuSample", "StepEvent"]


class GpuSample(Event):
    """One reading of one GPU.

    >>> GpuSample(ts_ns=1, job_id="j", node="n", rank=0, device=0, sm_util_pct=97.0).power_w
    0.0
    """

    KIND: ClassVar[str] = "gpu"

    rank: int = Field(ge=0, le=1 << 20)
    device: int = Field(ge=0, le=1023)
    sm_util_pct: float = Field(0.0, ge=0, le=100)
    mem_util_pct: float = Field(0.0, ge=0, le=100)
    mem_used_bytes: int = Field(0, ge=0)
    mem_total_bytes: int = Field(0, ge=0)
    power_w: float = Field(0.0, ge=0, allow_inf_nan=False)
    temp_c: float = Field(0.0, ge=-50, le=200)
    sm_clock_mhz: float = Field(0.0, ge=0, allow_inf_nan=False)


class StepEvent(Event):
    """One finished training step of one rank; ``ts_ns`` is the step's end.

    >>> s = StepEvent(ts_ns=1, job_id="j", node="n", rank=0, step=3, step_time_ms=120.0,
    ...               data_wait_ms=30.0)
    >>> s.data_wait_share
    0.25
    """

    KIND: ClassVar[str] = "step"

    rank: int = Field(ge=0, le=1 << 20)
    step: int = Field(ge=0)
    step_time_ms: float = Field(gt=0, allow_inf_nan=False)
    data_wait_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    batch_size: int = Field(0, ge=0)
    num_workers: int = Field(0, ge=0, le=1024)

    @property
    def data_wait_share(self) -> float:
        """Fraction of the step spent waiting for the input pipeline (0..1)."""
        return min(1.0, self.data_wait_ms / self.step_time_ms)
