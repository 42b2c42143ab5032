"""The accountant's row (`perfloop.report.accountant.row`): the report's figures in the
``job_accounting`` columns, None where the report says n/a (its reason kept in ``notes``), and
the wall time's categories summing to the wall time."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from perfloop.report.accountant import COLUMNS, job_state, row
from perfloop.report.accounting import CATEGORIES, Prices
from perfloop.report.data import JobData
from perfloop.report.summary import summarise
from perfloop.warehouse.migrations import MIGRATIONS

PRICES = Prices(2.5, 0.05, "EUR")


def _row(job: JobData) -> dict[str, object]:
    values = row(job, summarise(job, PRICES), lifecycle_end_ns=7, computed_ns=9)
    assert len(values) == len(COLUMNS)
    return dict(zip(COLUMNS, values, strict=True))


def test_the_row_holds_the_report_s_figures(make_job: Callable[..., JobData]) -> None:
    job = make_job()
    summary = summarise(job, PRICES)
    r = _row(job)
    assert (r["job_id"], r["state"], r["ranks"], r["gpus"], r["cpus"]) == (
        "unit-job", "finished", 2, 2, 32,
    )  # fmt: skip
    assert r["wall_s"] == pytest.approx(12.0)
    assert sum(r[f"{c}_s"] for c in CATEGORIES) == pytest.approx(r["wall_s"])  # type: ignore[misc]
    assert r["goodput"] == pytest.approx(summary.time.goodput)
    assert r["checkpoint_s"] == pytest.approx(0.25)  # 0.5 s on one rank of two
    assert r["mfu"] == pytest.approx(summary.figure("MFU").value)
    assert r["price_per_hour"] == pytest.approx(5.0) and r["currency"] == "EUR"
    assert r["cost"] == pytest.approx(5.0 * 12 / 3600)
    assert (r["lifecycle_end"], r["computed"]) == (7, 9)
    assert r["diagnosis_bottlenecks"] == [d.bottleneck for d in summary.diagnoses]


def test_what_the_report_cannot_compute_is_null_with_its_reason(
    make_job: Callable[..., JobData],
) -> None:
    info = {"model_name": "Net", "world_size": 2, "cpu_count": 8, "extra": {}}
    job = make_job(info=info, gpus=[], gpu_energy=[],
                   nodes={"n0": {"cpu_count": 8, "gpu_count": 0}})  # fmt: skip
    r = _row(job)
    assert r["mfu"] is None and "FLOPs of one step" in r["notes"]["MFU"]  # type: ignore[index]
    assert r["energy_wh"] is None and "NVML" in r["notes"]["energy"]  # type: ignore[index]
    assert r["gpus"] == 0 and r["price_per_hour"] == pytest.approx(8 * 0.05)  # by its CPUs


def test_a_job_that_gives_no_gpu_or_cpu_count_is_not_priced(
    make_job: Callable[..., JobData],
) -> None:
    """The report leaves out the money figures it cannot compute; the row holds NULLs."""
    job = make_job(info={"model_name": "Net", "extra": {}}, gpus=[], gpu_energy=[], nodes={})
    r = _row(job)
    for column in ("price_per_hour", "cost", "cost_per_step", "cost_per_million_tokens",
                   "cost_of_badput"):  # fmt: skip
        assert r[column] is None, column
    assert "no GPU or CPU count" in r["notes"]["cost"]  # type: ignore[index]
    assert r["wall_s"] == pytest.approx(12.0)


def test_how_a_job_ended() -> None:
    ended = [{"rank": 0, "state": "finished"}, {"rank": 1, "state": "killed"}]
    assert job_state(ended) == "killed"
    assert job_state([*ended, {"rank": -1, "state": "finished"}]) == "finished"
    assert job_state([{"rank": -1, "state": "started"}]) == ""


def test_every_column_the_accountant_fills_is_in_the_table() -> None:
    ddl = next(m for m in MIGRATIONS if "job_accounting" in m.name).statements[0]
    declared = [line.split()[0] for line in ddl.splitlines()[1:] if line.startswith("    ")]
    assert list(COLUMNS) == declared
