"""`perfloop report`: one self-contained HTML page about a job, and its accounting.

- `perfloop.report.accounting`: pure accounting over warehouse rows: where each rank's wall
  time went (goodput and badput by cause, summing to the wall time exactly), MFU, energy and
  money; `perfloop.report.collectives`: each rank's waits and lateness at collectives;
- `perfloop.report.data`: what the report reads about a job (`load_job`);
- `perfloop.report.summary`: the job's figures from what was read (`summarise`);
- `perfloop.report.plots`: the plots; `perfloop.report.html`: the page (`build_html`);
- `perfloop.report.make`: all of it for one job (`make_report`).

docs/report.md says what each plot and figure means and how they are computed.
"""

from perfloop.report.accounting import CATEGORIES, Prices, TimeAccount, time_accounting
from perfloop.report.data import JobData, load_job
from perfloop.report.exceptions import UnknownJobError
from perfloop.report.html import PLOT_IDS, build_html
from perfloop.report.make import Report, make_report
from perfloop.report.summary import FLOPS_KEY, Peaks, Summary, summarise

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
