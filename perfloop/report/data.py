"""What the report reads about one job from the warehouse (`load_job`), every query through
`perfloop.warehouse.query` with the job id bound server-side.

Steps, checkpoint and evaluation spans and collectives are read row by row (the accounting
needs each one); GPU samples are averaged into at most `GPU_POINTS` buckets per device, and
their energy is summarised per device in the warehouse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perfloop.report.accounting import Spans, Steps
from perfloop.report.collectives import Collectives
from perfloop.report.exceptions import UnknownJobError
from perfloop.settings import BaseServiceSettings
from perfloop.warehouse import query

__all__ = ["GPU_POINTS", "GpuSeries", "JobData", "load_job"]

GPU_POINTS = 1500
"""GPU samples are averaged into at most this many time buckets per device."""


@dataclass(frozen=True)
class GpuSeries:
    """One GPU's samples, averaged per time bucket (``t_ms``: Unix milliseconds)."""

    node: str
    device: int
    t_ms: list[int]
    sm_util_pct: list[float]
    power_w: list[float]
    mem_used_bytes: list[float]
    mem_total_bytes: int


@dataclass(frozen=True)
class JobData:
    """Everything the report shows about one job, as read from the warehouse."""

    job_id: str
    info: dict[str, Any]
    """The job's latest `JobInfo` (rank 0's where there is one)."""
    nodes: dict[str, dict[str, int]]
    """Per node: ``cpu_count`` and ``gpu_count`` from its latest `JobInfo`."""
    lifecycle: list[dict[str, Any]]
    steps: Steps
    phase_ms: list[dict[str, Any]]
    """Per rank and depth-0 phase: ``total_ms`` and ``steps`` (steps that had the phase)."""
    stalls: Spans
    """The checkpoint and evaluation spans."""
    collectives: Collectives
    gpus: list[GpuSeries]
    gpu_energy: list[dict[str, Any]]
    """Per GPU: first and last energy counter (mJ), mean power (W), span of samples (s)."""
    changes: list[dict[str, Any]]
    """Acks of the job's agents (``actuations``), with the command's ``from_value``."""
    diagnoses: list[dict[str, Any]]
    predictions: list[dict[str, Any]]
    """Realised predictions (``prediction_accuracy``)."""

    @property
    def start_ns(self) -> int:
        """When the job started: its first lifecycle event or its first step's start."""
        t = [int(e["ts_ns"]) for e in self.lifecycle]
        if len(self.steps):
            t.append(int((self.steps.end_ns - self.steps.step_ms * 1e6).min()))
        return min(t) if t else 0

    @property
    def end_ns(self) -> int:
        """When the job ended: its last lifecycle event or its last step's end."""
        t = [int(e["ts_ns"]) for e in self.lifecycle]
        if len(self.steps):
            t.append(int(self.steps.end_ns.max()))
        return max(t) if t else 0


def _columns(
    settings: BaseServiceSettings, sql: str, names: tuple[str, ...], **params: Any
) -> dict[str, list[Any]]:
    """The result of ``sql`` column by column, under ``names`` (the SELECT's order)."""
    rows = query(settings, sql, params).result_rows
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in names]
    return {n: list(c) for n, c in zip(names, cols, strict=True)}


def _rows(
    settings: BaseServiceSettings, sql: str, names: tuple[str, ...], **params: Any
) -> list[dict[str, Any]]:
    """The result of ``sql`` row by row, each a dict under ``names``."""
    return [dict(zip(names, r, strict=True)) for r in query(settings, sql, params).result_rows]


def _check_known(settings: BaseServiceSettings, job: str) -> None:
    (row,) = query(
        settings,
        "SELECT (SELECT count() FROM steps WHERE job_id = {j:String}), "
        "(SELECT count() FROM job_info WHERE job_id = {j:String}), "
        "(SELECT count() FROM job_lifecycle WHERE job_id = {j:String})",
        {"j": job},
    ).result_rows
    if any(row):
        return
    recent = [
        r[0]
        for r in query(
            settings,
            "SELECT job_id FROM job_lifecycle GROUP BY job_id ORDER BY max(ts) DESC LIMIT 5",
        ).result_rows
    ]
    known = f"; recent jobs: {', '.join(recent)}" if recent else "; it holds no job yet"
    raise UnknownJobError(f"unknown job {job!r}: the warehouse has no row of it{known}")


_INFO = (
    "node",
    "rank",
    "model_name",
    "model_params",
    "optimizer",
    "parallelism",
    "dp_size",
    "tp_size",
    "pp_size",
    "precision",
    "world_size",
    "nodes",
    "batch_size",
    "gpu_name",
    "gpu_count",
    "cpu_count",
    "framework",
    "framework_version",
    "command",
    "extra",
)


def _info(settings: BaseServiceSettings, job: str) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = _rows(
        settings,
        f"SELECT {', '.join(_INFO)} FROM job_info WHERE job_id = {{j:String}} ORDER BY ts",
        _INFO,
        j=job,
    )
    nodes: dict[str, dict[str, int]] = {}
    for r in rows:
        nodes[r["node"]] = {"cpu_count": int(r["cpu_count"]), "gpu_count": int(r["gpu_count"])}
    ranked = [r for r in rows if r["rank"] <= 0] or rows
    return (dict(ranked[-1]) if ranked else {}), nodes


def _gpus(settings: BaseServiceSettings, job: str) -> list[GpuSeries]:
    ((n, lo, hi),) = query(
        settings,
        "SELECT count(), toUnixTimestamp64Milli(min(ts)), toUnixTimestamp64Milli(max(ts)) "
        "FROM gpu_samples WHERE job_id = {j:String}",
        {"j": job},
    ).result_rows
    if not n:
        return []
    bucket = max(100, (int(hi) - int(lo)) // GPU_POINTS + 1)
    names = ("node", "device", "t_ms", "sm", "power", "mem", "total")
    rows = _rows(
        settings,
        "SELECT node, device, intDiv(toUnixTimestamp64Milli(ts), {b:UInt64}) * {b:UInt64} AS t, "
        "avg(sm_util_pct), avg(power_w), avg(mem_used_bytes), max(mem_total_bytes) "
        "FROM gpu_samples WHERE job_id = {j:String} GROUP BY node, device, t "
        "ORDER BY node, device, t",
        names,
        j=job,
        b=bucket,
    )
    series: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        s = series.setdefault(
            (r["node"], int(r["device"])), {"t": [], "sm": [], "p": [], "m": [], "total": 0}
        )
        s["t"].append(int(r["t_ms"]))
        s["sm"].append(float(r["sm"]))
        s["p"].append(float(r["power"]))
        s["m"].append(float(r["mem"]))
        s["total"] = max(s["total"], int(r["total"]))
    return [
        GpuSeries(node, dev, s["t"], s["sm"], s["p"], s["m"], s["total"])
        for (node, dev), s in series.items()
    ]


def load_job(settings: BaseServiceSettings, job: str) -> JobData:
    """Read what the report shows about ``job``.

    Raises `UnknownJobError` when the warehouse holds none of its steps, job info or
    lifecycle events, and `WarehouseError` (one line) when the warehouse cannot answer.
    """
    _check_known(settings, job)
    info, nodes = _info(settings, job)
    j = {"j": job}
    life = _rows(
        settings,
        "SELECT rank, toUnixTimestamp64Nano(ts), state, exit_code, message FROM job_lifecycle "
        "WHERE job_id = {j:String} ORDER BY ts",
        ("rank", "ts_ns", "state", "exit_code", "message"),
        **j,
    )
    st = _columns(
        settings,
        "SELECT rank, step, toUnixTimestamp64Nano(ts), step_time_ms, data_wait_ms, samples, "
        "tokens FROM steps WHERE job_id = {j:String} ORDER BY rank, ts",
        ("rank", "step", "end_ns", "step_ms", "data_wait_ms", "samples", "tokens"),
        **j,
    )
    phases = _rows(
        settings,
        "SELECT rank, phase, sum(duration_ms), uniqExact(step) FROM spans "
        "WHERE job_id = {j:String} AND depth = 0 GROUP BY rank, phase ORDER BY rank, phase",
        ("rank", "phase", "total_ms", "steps"),
        **j,
    )
    stalls = _columns(
        settings,
        "SELECT rank, toUnixTimestamp64Nano(ts), duration_ms, phase FROM spans "
        "WHERE job_id = {j:String} AND depth = 0 AND phase IN ('checkpoint', 'eval')",
        ("rank", "start_ns", "duration_ms", "phase"),
        **j,
    )
    coll = _columns(
        settings,
        "SELECT rank, step, group, toUnixTimestamp64Nano(ts), duration_ms FROM collectives "
        "WHERE job_id = {j:String}",
        ("rank", "step", "group", "start_ns", "duration_ms"),
        **j,
    )
    energy = _rows(
        settings,
        "SELECT node, device, argMin(energy_mj, ts), argMax(energy_mj, ts), avg(power_w), "
        "(toUnixTimestamp64Nano(max(ts)) - toUnixTimestamp64Nano(min(ts))) / 1e9 "
        "FROM gpu_samples WHERE job_id = {j:String} GROUP BY node, device",
        ("node", "device", "first_mj", "last_mj", "mean_power_w", "span_s"),
        **j,
    )
    changes = _rows(
        settings,
        "SELECT a.command_id, toUnixTimestamp64Nano(a.ts), a.rank, a.status, a.knob, a.value, "
        "a.step, a.reason, a.evidence, c.from_value FROM actuations AS a "
        "LEFT JOIN (SELECT command_id, any(from_value) AS from_value FROM commands "
        "WHERE job_id = {j:String} GROUP BY command_id) AS c ON c.command_id = a.command_id "
        "WHERE a.job_id = {j:String} ORDER BY a.ts",
        ("command_id", "ts_ns", "rank", "status", "knob", "value", "step", "reason", "evidence",
         "from_value"),
        **j,
    )  # fmt: skip
    diagnoses = _rows(
        settings,
        "SELECT diagnosis_id, bottleneck, level, state, toUnixTimestamp64Nano(ts), "
        "toUnixTimestamp64Nano(onset), step_share, confidence, ranks, explained_by, "
        "critical_path, summary FROM diagnoses WHERE job_id = {j:String} ORDER BY ts",
        ("diagnosis_id", "bottleneck", "level", "state", "ts_ns", "onset_ns", "step_share",
         "confidence", "ranks", "explained_by", "critical_path", "summary"),
        **j,
    )  # fmt: skip
    predictions = _rows(
        settings,
        "SELECT target, model, toUnixTimestamp64Nano(realised_at), predicted, realised, "
        "baseline, ape, baseline_ape FROM prediction_accuracy WHERE job_id = {j:String} "
        "ORDER BY realised_at LIMIT 20000",
        ("target", "model", "ts_ns", "predicted", "realised", "baseline", "ape", "baseline_ape"),
        **j,
    )
    return JobData(
        job_id=job,
        info=info,
        nodes=nodes,
        lifecycle=life,
        steps=Steps.of(**st),
        phase_ms=phases,
        stalls=Spans.of(**stalls),
        collectives=Collectives.of(**coll),
        gpus=_gpus(settings, job),
        gpu_energy=energy,
        changes=changes,
        diagnoses=diagnoses,
        predictions=predictions,
    )
