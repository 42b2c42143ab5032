"""The accountant service (`perfloop service accountant`): each ended job's accounting, stored
in the warehouse's ``job_accounting`` table, one row per job and end.

Every ``accounting_interval_s`` it asks the warehouse (`DUE`) for the jobs whose end is in
``job_lifecycle`` (a ``finished``, ``failed`` or ``killed`` event of the job, rank -1, or of
any of its ranks) and that have no accounting row for that end yet. A job first seen so waits
``accounting_settle_s`` on the accountant's own clock (the sink holds telemetry up to its flush
interval; the events' clocks may be any job's), then it is read and accounted for exactly as
`perfloop report` does (`load_job`, `summarise`, with the same prices and peaks) and one row is
inserted (`row`). A job that ends again later (restarted under the same id) gets a new row;
``ReplacingMergeTree(computed)`` keeps the latest per job.

The table is the accountant's only memory: a restarted accountant (or one of several) finds
what is still due and does it; two that account for the same job at once write the same
figures twice, which the table's merge folds into one. A job the warehouse cannot answer for is
tried again at the next interval, with one line in the log; a job whose rows cannot be
accounted for (`summarise` raises) is logged once and skipped until it ends again.

Jobs that never say they ended (a launcher killed with SIGKILL) are not accounted for here;
`perfloop report JOB` accounts for any job on demand.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from perfloop.exceptions import WarehouseError
from perfloop.report.accounting import CATEGORIES, Prices
from perfloop.report.data import JobData, load_job
from perfloop.report.summary import Peaks, Summary, summarise
from perfloop.service_heap import libc_trim
from perfloop.settings import AccountantSettings

__all__ = ["COLUMNS", "DUE", "Accountant", "job_state", "row"]

log = logging.getLogger("perfloop.accountant")

NS = 1_000_000_000

DUE = """
SELECT e.job_id, toUnixTimestamp64Nano(e.ended) FROM (
    SELECT job_id, max(ts) AS ended FROM job_lifecycle
    WHERE state IN ('finished', 'failed', 'killed')
      AND ts >= fromUnixTimestamp64Nano({since:Int64})
    GROUP BY job_id
) AS e
WHERE (e.job_id, e.ended) NOT IN (
    SELECT job_id, lifecycle_end FROM job_accounting
    WHERE lifecycle_end >= fromUnixTimestamp64Nano({since:Int64})
)
ORDER BY e.ended LIMIT 1000
"""
"""The jobs that ended since ``since`` (ns) with no accounting of that end: job, end (ns)."""

# Figure name (`perfloop.report.summary`) → column.
_FIGURES = {
    "mean step time": "mean_step_ms",
    "samples/s": "samples_per_s",
    "tokens/s": "tokens_per_s",
    "MFU": "mfu",
    "MFU over wall time": "mfu_wall",
    "energy": "energy_wh",
    "energy per step": "energy_per_step_j",
    "price per hour": "price_per_hour",
    "cost": "cost",
    "cost per step": "cost_per_step",
    "cost per million tokens": "cost_per_million_tokens",
    "cost of badput": "cost_of_badput",
}

COLUMNS: tuple[str, ...] = (
    "job_id",
    "computed",
    "lifecycle_end",
    "state",
    "started",
    "ended",
    "wall_s",
    "ranks",
    "gpus",
    "cpus",
    "steps_per_rank",
    "goodput",
    *(f"{c}_s" for c in CATEGORIES),
    *_FIGURES.values(),
    "currency",
    "diagnosis_ids",
    "diagnosis_bottlenecks",
    "diagnosis_hours",
    "diagnosis_costs",
    "notes",
)
"""The columns of ``job_accounting`` the accountant fills, in `row`'s order."""

_END_STATES = ("failed", "killed", "finished")  # the worst first


def job_state(lifecycle: list[dict[str, Any]]) -> str:
    """How the job ended: the latest end of the job as a whole (rank -1), else the worst end
    of its ranks (failed, then killed, then finished); ``''`` when nothing ended.

    >>> job_state([{"rank": 0, "state": "finished"}, {"rank": 1, "state": "failed"}])
    'failed'
    >>> job_state([{"rank": 1, "state": "failed"}, {"rank": -1, "state": "finished"}])
    'finished'
    """
    ends = [e for e in lifecycle if e["state"] in _END_STATES]
    whole = [e["state"] for e in ends if int(e["rank"]) == -1]
    if whole:
        return str(whole[-1])
    states = {e["state"] for e in ends}
    return next((s for s in _END_STATES if s in states), "")


def row(data: JobData, summary: Summary, *, lifecycle_end_ns: int, computed_ns: int) -> list[Any]:
    """The ``job_accounting`` row of one job, in `COLUMNS`' order: the report's figures (None
    where the report says n/a, with its reason in ``notes``)."""
    t = summary.time
    figures = {f.name: f for f in summary.figures}
    notes = {f.name: f.note for f in summary.figures if f.note}
    steps = figures["steps per rank"].value or 0.0
    return [
        data.job_id,
        computed_ns,
        lifecycle_end_ns,
        job_state(data.lifecycle),
        data.start_ns,
        data.end_ns,
        t.wall_ns / NS,
        t.ranks,
        summary.gpus,
        summary.cpus,
        float(steps),
        t.goodput,
        *(t.seconds(c) for c in CATEGORIES),
        *(figures[name].value if name in figures else None for name in _FIGURES),
        summary.currency,
        [d.diagnosis_id for d in summary.diagnoses],
        [d.bottleneck for d in summary.diagnoses],
        [d.hours for d in summary.diagnoses],
        [d.total for d in summary.diagnoses],
        notes,
    ]


class Accountant:
    """Finds the jobs that ended, waits for their rows to land, stores their accounting (see
    the module docstring)."""

    def __init__(self, settings: AccountantSettings) -> None:
        self.settings = settings
        self.prices = Prices(
            settings.price_per_gpu_hour, settings.price_per_cpu_hour, settings.currency
        )
        self.peaks = Peaks(settings.peak_flops, settings.cpu_peak_flops)
        self.accounted = 0
        self._seen: dict[tuple[str, int], float] = {}  # (job, end) → when first seen
        self._failed: set[tuple[str, int]] = set()  # could not be accounted for: skip
        self._stop = threading.Event()
        self._down = False
        self._trim = libc_trim()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        s = self.settings
        log.info("accountant: ended jobs every %.0f s, %.0f s after their end is seen, priced "
                 "at %g %s/GPU-hour, %g %s/CPU-hour", s.accounting_interval_s,
                 s.accounting_settle_s, s.price_per_gpu_hour, s.currency,
                 s.price_per_cpu_hour, s.currency)  # fmt: skip
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(s.accounting_interval_s)
        log.info("accountant: stopped; %d job(s) accounted for", self.accounted)

    def tick(self, now: float | None = None) -> list[str]:
        """One round: account for every due job whose settle time has passed; returns them."""
        from perfloop.warehouse import query

        now = time.monotonic() if now is None else now
        since = time.time_ns() - int(self.settings.accounting_lookback_s * NS)
        try:
            found = query(self.settings, DUE, {"since": since}).result_rows
        except WarehouseError as e:
            self._warehouse_down(e)
            return []
        self._warehouse_up()
        due = [(str(j), int(e)) for j, e in found]
        keys = set(due)
        self._seen = {k: t for k, t in self._seen.items() if k in keys}
        self._failed &= keys
        done = []
        for key in due:
            first = self._seen.setdefault(key, now)
            if key in self._failed or now - first < self.settings.accounting_settle_s:
                continue
            if self.account(*key):
                done.append(key[0])
            if self._stop.is_set():
                break
        if done and self._trim is not None:
            self._trim(0)  # a long job's rows were columns of millions: give them back
        return done

    def account(self, job: str, lifecycle_end_ns: int) -> bool:
        """Account for ``job`` as it is in the warehouse now and insert its row; False (with
        one log line) when the warehouse could not answer or the job could not be accounted
        for."""
        from perfloop.warehouse import client

        s = self.settings
        try:
            data = load_job(s, job)
            summary = summarise(
                data, self.prices, peaks=self.peaks, warmup_steps=s.report_warmup_steps
            )
            values = row(data, summary, lifecycle_end_ns=lifecycle_end_ns,
                         computed_ns=time.time_ns())  # fmt: skip
        except WarehouseError as e:
            self._warehouse_down(e)
            return False
        except Exception as e:  # one job's rows never stop the service
            self._failed.add((job, lifecycle_end_ns))
            log.warning("accountant: job %s not accounted for: %s: %s", job, type(e).__name__,
                        " ".join(str(e).split())[:300])  # fmt: skip
            return False
        try:
            ch = client(s)
            try:
                ch.insert("job_accounting", [values], column_names=list(COLUMNS))
            finally:
                ch.close()
        except Exception as e:  # the insert's failure is the warehouse's: try again later
            self._warehouse_down(e)
            return False
        self.accounted += 1
        log.info("accountant: job %s (%s): %.1f s, goodput %.1f %%, cost %s %s", job, values[3],
                 values[6], 100 * values[11], _money(values[COLUMNS.index("cost")]),
                 s.currency)  # fmt: skip
        return True

    def _warehouse_down(self, e: Exception) -> None:
        if not self._down:
            log.warning("accountant: the warehouse does not answer (%s); trying again every "
                        "%.0f s", " ".join(str(e).split())[:300],
                        self.settings.accounting_interval_s)  # fmt: skip
        self._down = True

    def _warehouse_up(self) -> None:
        if self._down:
            log.info("accountant: the warehouse answers again")
        self._down = False


def _money(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"
