"""The report's figures for one job (`summarise`): where its wall time went, its throughput,
MFU, energy and money, and what each diagnosis costs; pure over a `JobData` (no I/O).

How each figure is computed is in the figure's ``note`` and in docs/report.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.models.devices import match_device
from perfloop.report.accounting import (
    DiagnosisCost,
    Prices,
    TimeAccount,
    diagnosis_costs,
    energy_joules,
    hourly_price,
    mfu,
    time_accounting,
)
from perfloop.report.data import JobData

__all__ = ["FLOPS_KEY", "Figure", "Peaks", "Summary", "summarise"]

FLOPS_KEY = "flops_per_step"
"""The `JobInfo` ``extra`` key a job publishes the FLOPs of one step of one rank under."""

# JobInfo.precision → the device catalog's precision
_PRECISION = {
    "": "fp32",
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "amp_bf16": "bf16",
    "fp16": "fp16",
    "amp_fp16": "fp16",
    "fp8": "fp8",
}


@dataclass(frozen=True)
class Figure:
    """One accounting figure for the report: ``value`` is None where it cannot be computed,
    and ``note`` then says why (else how it was computed)."""

    name: str
    value: float | None
    unit: str = ""
    note: str = ""

    def text(self) -> str:
        """The value with its unit, or ``n/a``."""
        if self.value is None:
            return "n/a"
        v = self.value
        if self.unit == "%":
            return f"{v * 100:.1f} %"
        if v == int(v) and abs(v) < 1e15:
            num = f"{int(v):,}"
        elif abs(v) < 1:
            num = f"{v:.3g}"
        else:
            num = f"{v:,.{3 if abs(v) < 10 else 1 if abs(v) < 1000 else 0}f}"
        return f"{num} {self.unit}".strip()


@dataclass(frozen=True)
class Peaks:
    """Peak FLOP/s set by the user: ``device`` for any job (over the catalog), ``cpu`` for
    the CPUs one rank of a job without GPUs runs on."""

    device: float | None = None
    cpu: float | None = None


@dataclass(frozen=True)
class Summary:
    """The accounting of one job, ready to show."""

    time: TimeAccount
    figures: list[Figure]
    diagnoses: list[DiagnosisCost]
    price_per_hour: float | None
    currency: str
    gpus: int = 0
    """The job's GPUs (its nodes' job info, else the GPUs it sent samples of)."""
    cpus: int = 0
    """Its nodes' CPUs (the job info's ``cpu_count`` of each node)."""

    def figure(self, name: str) -> Figure:
        """The figure called ``name``."""
        for f in self.figures:
            if f.name == name:
                return f
        raise KeyError(name)


def _peak(data: JobData, peaks: Peaks) -> tuple[float | None, str]:
    """The peak FLOP/s of one device of the job, and where it comes from (or why none)."""
    if peaks.device is not None:
        return peaks.device, "PERFLOOP_PEAK_FLOPS"
    gpu = str(data.info.get("gpu_name") or "")
    if gpu or data.gpus:
        if not gpu:
            return None, "the job info names no GPU: set PERFLOOP_PEAK_FLOPS"
        dev = match_device(gpu)
        if dev is None:
            return None, f"no catalog entry for GPU {gpu!r}: set PERFLOOP_PEAK_FLOPS"
        raw = str(data.info.get("precision") or "").lower()
        precision = _PRECISION.get(raw, "fp32")
        try:
            return dev.peak(precision), f"{dev.name} {precision} dense peak"
        except ConfigError as e:
            return None, f"{e}: set PERFLOOP_PEAK_FLOPS"
    if peaks.cpu is not None:
        return peaks.cpu, "PERFLOOP_CPU_PEAK_FLOPS"
    return None, "a CPU job: set PERFLOOP_CPU_PEAK_FLOPS (the peak of the CPUs one rank uses)"


def _flops(data: JobData, given: float | None) -> tuple[float | None, str]:
    if given is not None:
        return given, "--flops-per-step"
    raw = (data.info.get("extra") or {}).get(FLOPS_KEY)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            return None, f"job info {FLOPS_KEY}={raw!r} is not a number"
        if value > 0 and np.isfinite(value):
            return value, f"job info {FLOPS_KEY}"
    return None, (
        f"MFU needs the FLOPs of one step: publish job info extra {FLOPS_KEY} "
        "or pass --flops-per-step"
    )


def _hangs(data: JobData, end_ns: int) -> list[tuple[int, int]]:
    """Intervals of ``hang`` diagnoses: from onset to resolution (or the job's end)."""
    spans: dict[str, tuple[int, int]] = {}
    for d in data.diagnoses:
        if d["bottleneck"] != "hang":
            continue
        did = d["diagnosis_id"]
        a = spans.get(did, (int(d["onset_ns"]), end_ns))[0]
        spans[did] = (a, int(d["ts_ns"]) if d["state"] == "resolved" else end_ns)
    return list(spans.values())


def summarise(
    data: JobData,
    prices: Prices,
    *,
    peaks: Peaks = Peaks(),
    flops_per_step: float | None = None,
    warmup_steps: int = 3,
) -> Summary:
    """Every figure of the report for ``data``."""
    t0, t1 = data.start_ns, data.end_ns
    starts = [(int(e["rank"]), int(e["ts_ns"])) for e in data.lifecycle if e["state"] == "started"]
    time = time_accounting(
        data.steps,
        start_ns=t0,
        end_ns=t1,
        spans=data.stalls,
        collectives=data.collectives,
        hangs=_hangs(data, t1),
        starts=[(r, t) for r, t in starts if r >= 0],
        warmup_steps=warmup_steps,
    )
    wall_s = time.wall_ns / 1e9
    steps = data.steps
    n_steps = len(steps) / time.ranks
    mean_step_s = float(steps.step_ms.mean()) / 1e3 if len(steps) else 0.0
    replicas = max(1, int(data.info.get("tp_size") or 1) * int(data.info.get("pp_size") or 1))
    samples = float(steps.samples.sum()) / replicas
    tokens = float(steps.tokens.sum()) / replicas
    per = f"over {wall_s:,.1f} s of wall time" + (
        f", counted once per {replicas} tensor/pipeline-parallel ranks" if replicas > 1 else ""
    )
    figs = [
        Figure(
            "wall time",
            wall_s,
            "s",
            "from the job's first lifecycle event or step start to its last",
        ),
        Figure("steps per rank", n_steps, "", f"{len(steps)} steps of {time.ranks} rank(s)"),
        Figure("mean step time", mean_step_s * 1e3 if len(steps) else None, "ms", "every step"),
        Figure("goodput", time.goodput, "%", "productive step time over wall time"),
        Figure(
            "samples/s",
            samples / wall_s if samples and wall_s else None,
            "",
            per if samples else "the job reports no samples",
        ),
        Figure(
            "tokens/s",
            tokens / wall_s if tokens and wall_s else None,
            "",
            per if tokens else "the job reports no tokens (steps.tokens is 0)",
        ),
    ]
    flops, flops_from = _flops(data, flops_per_step)
    peak, peak_from = _peak(data, peaks)
    if flops is None or peak is None or not mean_step_s or not wall_s:
        why = flops_from if flops is None else peak_from if peak is None else "no steps"
        figs += [Figure("MFU", None, "%", why), Figure("MFU over wall time", None, "%", why)]
    else:
        how = f"{flops:.4g} FLOP/step ({flops_from}), peak {peak:.4g} FLOP/s ({peak_from})"
        figs += [
            Figure("MFU", mfu(flops, mean_step_s, peak), "%", f"over mean step time; {how}"),
            Figure(
                "MFU over wall time",
                mfu(flops * n_steps, wall_s, peak),
                "%",
                "the steps' FLOPs over the whole wall time",
            ),
        ]
    if data.gpu_energy:
        joules = sum(
            energy_joules(e["first_mj"], e["last_mj"], e["mean_power_w"], e["span_s"])
            for e in data.gpu_energy
        )
        how = f"{len(data.gpu_energy)} GPU(s), NVML energy counter (else mean power × time)"
        figs += [
            Figure("energy", joules / 3600.0, "Wh", how),
            Figure("energy per step", joules / n_steps if n_steps else None, "J", how),
        ]
    else:
        figs += [
            Figure("energy", None, "Wh", "no GPU samples (energy comes from NVML)"),
            Figure("energy per step", None, "J", "no GPU samples (energy comes from NVML)"),
        ]
    gpus = sum(n["gpu_count"] for n in data.nodes.values()) or len(data.gpu_energy)
    cpus = sum(n["cpu_count"] for n in data.nodes.values())
    cur = prices.currency
    price: float | None = None
    costs: list[DiagnosisCost] = []
    if gpus or cpus:
        price = hourly_price(gpus, cpus, prices)
        what = (
            f"{gpus} GPU(s) × {prices.gpu_hour:g} {cur}/GPU-hour"
            if gpus
            else f"{cpus} CPU(s) × {prices.cpu_hour:g} {cur}/CPU-hour"
        )
        total = price * wall_s / 3600.0
        figs += [
            Figure("price per hour", price, cur, what),
            Figure("cost", total, cur, "price per hour × wall time"),
            Figure("cost per step", total / n_steps if n_steps else None, cur, "cost / steps"),
            Figure(
                "cost per million tokens",
                total / tokens * 1e6 if tokens else None,
                cur,
                "cost / tokens × 10⁶" if tokens else "the job reports no tokens",
            ),
            Figure(
                "cost of badput",
                total * (1.0 - time.goodput),
                cur,
                "cost × the share of wall time not productive",
            ),
        ]
        costs = diagnosis_costs(data.diagnoses, price, t1)
    else:
        why = "the job info gives no GPU or CPU count"
        figs += [Figure(n, None, cur, why) for n in ("price per hour", "cost", "cost per step")]
    return Summary(time, figs, costs, price, cur, gpus, cpus)
