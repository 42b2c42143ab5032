"""`perfloop report`: one self-contained HTML page about a job, and its accounting.

- `perfloop.report.accounting`: pure accounting over warehouse rows: where each rank's wall
  time went (goodput and badput by cause, summing to the wall time exactly), MFU, energy and
  money; `perfloop.report.collectives`: each rank's waits and lateness at collectives;
- `perfloop.report.data`: what the report reads about a job (`load_job`);
- `perfloop.report.summary`: the job's figures from what was read (`summarise`);
- `perfloop.report.plots`: the plots; `perfloop.report.html`: the page (`build_html`);
- `perfloop.report.make`: all of it for one job (`make_report`);
- `perfloop.report.accountant`: the service that stores each ended job's accounting in the
  warehouse (``job_accounting``).

docs/report.md says what each plot and figure means and how they are computed.

The page's names (`build_html`, `PLOT_IDS`, `make_report`, `Report`) load the plotting library
when first used, so the accountant, which draws nothing, does not carry it.
"""

from __future__ import annotations

import importlib
from typing import Any

from perfloop.report.accounting import CATEGORIES, Prices, TimeAccount, time_accounting
from perfloop.report.data import JobData, load_job
from perfloop.report.exceptions import UnknownJobError
from perfloop.report.summary import FLOPS_KEY, Peaks, Summary, summarise

_LAZY = {
    "PLOT_IDS": "perfloop.report.html",
    "build_html": "perfloop.report.html",
    "Report": "perfloop.report.make",
    "make_report": "perfloop.report.make",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CATEGORIES",
    "FLOPS_KEY",
    "PLOT_IDS",
    "JobData",
    "Peaks",
    "Prices",
    "Report",
    "Summary",
    "TimeAccount",
    "UnknownJobError",
    "build_html",
    "load_job",
    "make_report",
    "summarise",
    "time_accounting",
]
