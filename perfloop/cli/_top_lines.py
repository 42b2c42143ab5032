"""The lines `perfloop top` draws, each a frozen record `perfloop.cli._top_state` answers
with: a job in the picker (`JobLine`), one job at a glance (`Summary`), a rank (`RankLine`), a
recommendation (`RecLine`), a change (`ChangeLine`); and the mark a feed leaves for a job
whose telemetry it did not decode (`Seen`)."""

from __future__ import annotations

from dataclasses import dataclass

from perfloop.cli._jobs_rows import DiagnosisSummary, verdict

__all__ = ["ChangeLine", "JobLine", "RankLine", "RecLine", "Seen", "Summary"]


@dataclass(frozen=True, slots=True)
class Seen:
    """A job was heard from at ``ts_ns`` (telemetry the feed did not decode)."""

    job_id: str
    ts_ns: int


@dataclass(frozen=True, slots=True)
class RecLine:
    """A recommendation and what the actuator decided about it (``outcome``)."""

    ts_ns: int
    rec_id: str
    knob: str
    from_value: str
    to_value: str
    expected_gain_pct: float
    confidence: float
    rationale: str
    outcome: str = ""


@dataclass(frozen=True, slots=True)
class ChangeLine:
    """A command sent to the job and how far it got: ``sent``, ``applied`` (at ``step``),
    ``rejected``, ``kept`` or ``rolled_back`` (with the step times before and after)."""

    ts_ns: int
    command_id: str
    seq: int
    knob: str
    from_value: str
    to_value: str
    status: str = "sent"
    reason: str = ""
    step: int = 0
    before_ms: float | None = None
    after_ms: float | None = None

    def text(self) -> str:
        """``dataloader.num_workers 0→1 kept``, as `perfloop jobs` says it."""
        return f"{self.knob} {self.from_value or '?'}→{self.to_value} {verdict(self.status)}"


@dataclass(frozen=True, slots=True)
class JobLine:
    """A job in the picker: what `perfloop jobs` says of it, live."""

    job_id: str
    state: str
    exit_code: int | None
    ranks: int
    step_ms: float | None
    steps_per_s: float | None
    diagnoses: tuple[DiagnosisSummary, ...]
    last_change: str
    last_ns: int


@dataclass(frozen=True, slots=True)
class Summary:
    """One job at a glance."""

    job_id: str
    state: str
    exit_code: int | None
    ranks: int
    nodes: int
    model: str
    run_phase: str
    step_ms: float | None
    steps_per_s: float | None
    last_ns: int


@dataclass(frozen=True, slots=True)
class RankLine:
    """One rank: its last step, recent step time and phase shares, its GPU use and the CPU
    use of its process and of its data-loader workers."""

    rank: int
    node: str
    step: int
    step_ms: float | None
    last_ms: float | None
    steps_per_s: float | None
    shares: dict[str, float]
    gpu_util_pct: float | None
    gpu_mem_pct: float | None
    cpu_pct: float | None
    loader_cpu_pct: float | None = None
