"""`make_report`: read a job from the warehouse, account for it and build its page."""

from __future__ import annotations

from dataclasses import dataclass

from perfloop.report.accounting import Prices
from perfloop.report.data import JobData, load_job
from perfloop.report.html import build_html
from perfloop.report.summary import Peaks, Summary, summarise
from perfloop.settings import ReportSettings

__all__ = ["Report", "make_report"]


@dataclass(frozen=True)
class Report:
    """A job's report: its page, its figures and what they were computed from."""

    html: str
    summary: Summary
    data: JobData


def make_report(
    settings: ReportSettings, job: str, *, flops_per_step: float | None = None
) -> Report:
    """The report of ``job``, priced and peaked by ``settings``.

    Raises `UnknownJobError` for a job the warehouse does not hold and `WarehouseError`
    when the warehouse cannot answer (one line each).
    """
    data = load_job(settings, job)
    summary = summarise(
        data,
        Prices(settings.price_per_gpu_hour, settings.price_per_cpu_hour, settings.currency),
        peaks=Peaks(settings.peak_flops, settings.cpu_peak_flops),
        flops_per_step=flops_per_step,
        warmup_steps=settings.report_warmup_steps,
    )
    return Report(build_html(data, summary), summary, data)
