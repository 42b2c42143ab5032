"""The families `perfloop.streams.metrics` exports: names, types, labels and help (docs/alerts.md
lists them too). Private to the stream tier; `perfloop.streams.metrics` re-exports them."""

from __future__ import annotations

from typing import Literal

__all__ = ["CATALOG", "COUNTER", "EXPORTED_NAMES", "GAUGE", "JOB", "RANK", "Kind"]

RANK = ("job_id", "node", "rank")
JOB = ("job_id",)
Kind = Literal["gauge", "counter"]
GAUGE: Kind = "gauge"
COUNTER: Kind = "counter"

CATALOG: dict[str, tuple[Kind, tuple[str, ...], str]] = {
    # per rank, from the closed windows
    "perfloop_step_time_seconds": (
        GAUGE,
        RANK,
        "Median step time of the rank in its latest closed window, s.",
    ),
    "perfloop_steps_per_second": (GAUGE, RANK, "Steps a second the rank completed in that window."),
    "perfloop_data_wait_share": (
        GAUGE,
        RANK,
        "Share of the rank's step spent waiting for data (mean in that window), 0 to 1.",
    ),
    "perfloop_phase_share": (
        GAUGE,
        (*RANK, "phase"),
        "Share of the rank's step in each phase, from its phase spans (mean in that window).",
    ),
    "perfloop_gpu_sm_utilization_ratio": (
        GAUGE,
        RANK,
        "SM utilisation of the rank's GPUs (mean in that window), 0 to 1.",
    ),
    "perfloop_gpu_mem_used_bytes": (
        GAUGE,
        RANK,
        "Memory used on the rank's GPUs (most in that window), bytes.",
    ),
    "perfloop_rss_bytes": (
        GAUGE,
        RANK,
        "Resident memory of the rank's process (most in that window), bytes.",
    ),
    # per rank, from the recent steps and the predictions
    "perfloop_straggler_lateness_seconds": (
        GAUGE,
        RANK,
        "How late the rank arrives at its steps against the median rank (recent median), s.",
    ),
    "perfloop_straggler_score": (
        GAUGE,
        RANK,
        "The rank's straggler score over its recent steps, 0 to 1.",
    ),
    "perfloop_time_to_oom_seconds": (
        GAUGE,
        RANK,
        "Predicted time until the rank runs out of memory, while a warning stands, s.",
    ),
    # per job
    "perfloop_job_ranks": (GAUGE, JOB, "Ranks of the job in the worker's latest windows."),
    "perfloop_job_state": (
        GAUGE,
        (*JOB, "state"),
        "1 for the job's run-level phase (warmup, steady, eval, checkpoint, stalled, finished).",
    ),
    "perfloop_diagnosis_open": (
        GAUGE,
        (*JOB, "bottleneck", "level"),
        "Open diagnoses of the job, by bottleneck.",
    ),
    "perfloop_rollbacks": (
        COUNTER,
        JOB,
        "Changes to the job its agent rolled back after verifying them.",
    ),
    "perfloop_pending_approvals": (
        GAUGE,
        JOB,
        "Recommendations for the job waiting for perfloop approve or reject.",
    ),
    "perfloop_pending_approval_age_seconds": (
        GAUGE,
        JOB,
        "How long the oldest of them has waited, s.",
    ),
    # per worker
    "perfloop_worker_samples": (COUNTER, (), "Telemetry samples the worker ingested."),
    "perfloop_worker_samples_per_second": (
        GAUGE,
        (),
        "Samples ingested a second, since the previous scrape.",
    ),
    "perfloop_worker_messages": (COUNTER, (), "Telemetry messages the worker ingested."),
    "perfloop_worker_dead_letters": (
        COUNTER,
        ("topic",),
        "Input messages the worker refused (dead-lettered by it, or by the sink), by topic.",
    ),
    "perfloop_worker_late_samples": (
        COUNTER,
        (),
        "Samples that came after their window closed (dropped).",
    ),
    "perfloop_worker_lag_messages": (
        GAUGE,
        (),
        "Messages waiting in the worker's telemetry partitions.",
    ),
    "perfloop_worker_ingest_delay_seconds": (
        GAUGE,
        (),
        "From the latest message's send to its reading, s.",
    ),
    "perfloop_worker_publish_failures": (
        COUNTER,
        (),
        "Outputs the worker could not deliver to the broker.",
    ),
    "perfloop_worker_jobs": (GAUGE, (), "Jobs the worker holds series of."),
    "perfloop_metrics_series": (GAUGE, (), "Series this endpoint exports (these included)."),
    "perfloop_metrics_max_series": (GAUGE, (), "The budget: the most series it exports."),
    "perfloop_metrics_series_dropped": (
        GAUGE,
        (),
        "Series the budget kept out: per-rank ones folded into per-job ones, and left-out jobs'.",
    ),
    "perfloop_metrics_jobs_folded": (
        GAUGE,
        (),
        "Jobs whose ranks are folded into one series (rank=all).",
    ),
}
"""Every family: name → (type, labels, help). Counters are exposed with ``_total``."""
EXPORTED_NAMES = frozenset(
    n + "_total" if kind == "counter" else n for n, (kind, _, _) in CATALOG.items()
)
"""The sample names a scrape can hold (what an alert rule may use)."""
