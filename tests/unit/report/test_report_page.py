"""The report page: self-contained (plotly.js inline, no external script), every plot in its
div, each missing kind of data said in words; and `perfloop report`'s one-line failures."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from perfloop.cli.parser import main
from perfloop.cli.report import default_output
from perfloop.report import PLOT_IDS, build_html, summarise
from perfloop.report.accounting import Prices
from perfloop.report.data import JobData
from perfloop.report.plots import change_rows


def _page(job: JobData) -> str:
    return build_html(job, summarise(job, Prices(2.5, 0.05)))


def test_the_page_has_every_plot_and_loads_nothing_from_outside(
    make_job: Callable[..., JobData],
) -> None:
    page = _page(make_job())
    for div in PLOT_IDS:
        assert f'<div id="{div}" class="plotly-graph-div"' in page, div
        assert f'document.getElementById("{div}")' in page, div
    assert not re.search(r"<script[^>]*\bsrc=", page), "a script loaded from elsewhere"
    assert not re.search(r"<link[^>]*\bhref=", page)
    assert "Plotly.newPlot" in page and len(page) > 3_000_000  # plotly.js itself is inline
    assert page.count("<script") == page.count("</script>")
    # the figures, the change and the diagnosis a user looks for
    assert "perfloop report: unit-job" in page
    for text in ("goodput", "66.5 %", "MFU", "2.0 %", "energy per step", "100 J",
                 "cost per million tokens", "straggler_wait", "dataloader.num_workers",
                 "0 → 2", "kept", "p50 120.0 → 100.0 ms", "What each diagnosis costs"):  # fmt: skip
        assert text in page, text


def test_what_is_missing_is_said_instead_of_plotted(make_job: Callable[..., JobData]) -> None:
    from perfloop.report.accounting import Steps
    from perfloop.report.collectives import Collectives

    one = make_job(
        gpus=[], gpu_energy=[], predictions=[], diagnoses=[], changes=[],
        collectives=Collectives.of(rank=[], step=[], start_ns=[], duration_ms=[]),
        steps=Steps.of(rank=[0, 0], step=[0, 1], end_ns=[2 * 10**9, 3 * 10**9],
                       step_ms=[100.0, 100.0]),
    )  # fmt: skip
    page = _page(one)
    for div, why in (
        ("plot-gpu", "no GPU samples"),
        ("plot-lateness", "one rank"),
        ("plot-predictions", "no realised predictions"),
        ("plot-diagnoses", "no diagnosis"),
    ):
        assert f'<div id="{div}"' not in page
        assert re.search(f'<p class="none" id="{div}-none">[^<]*{why}', page), div
    assert '<div id="plot-step-time"' in page and "no change was applied" in page


def test_a_change_is_one_row_with_its_last_verdict(make_job: Callable[..., JobData]) -> None:
    (c,) = change_rows(make_job())
    assert (c["knob"], c["from"], c["to"], c["step"], c["verdict"]) == (
        "dataloader.num_workers", "0", "2", 30, "kept",
    )  # fmt: skip
    assert c["evidence"]["ratio"] == pytest.approx(0.83)


def test_the_default_file_is_named_after_the_job() -> None:
    assert default_output("my-job") == Path("perfloop-report-my-job.html")
    assert default_output("a/b:c@d").name == "perfloop-report-a_b_c_d.html"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_warehouse_that_is_down_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in ("PERFLOOP_CLICKHOUSE_URL", "PERFLOOP_CLICKHOUSE_URL_OVERRIDE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_PORT", str(_free_port()))
    monkeypatch.setenv("PERFLOOP_HOME", str(tmp_path))
    assert main(["report", "some-job", "-o", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("perfloop: ClickHouse at http://127.0.0.1:")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "many"])
def test_a_bad_flop_count_is_refused_by_the_parser(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["report", "j", "--flops-per-step", bad])
    assert e.value.code == 2
    assert "--flops-per-step" in capsys.readouterr().err
