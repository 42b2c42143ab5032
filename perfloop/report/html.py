"""One self-contained HTML page for a job (`build_html`): plotly.js inline (the page opens
without a network), each plot in a ``<div id="plot-…">`` (`PLOT_IDS`), and the accounting
figures, the changes and the diagnoses' costs in small tables."""

from __future__ import annotations

import datetime
import html
from typing import Any

from plotly.offline import get_plotlyjs

from perfloop import __version__
from perfloop.report import plots
from perfloop.report.accounting import CATEGORIES
from perfloop.report.data import JobData
from perfloop.report.summary import Summary

__all__ = ["PLOT_IDS", "build_html"]

PLOT_IDS: tuple[str, ...] = (
    "plot-wall-time",
    "plot-step-time",
    "plot-phases",
    "plot-gpu",
    "plot-lateness",
    "plot-predictions",
    "plot-diagnoses",
)
"""The ``id`` of each plot's ``<div>``, in page order (a plot with nothing to show has a
``<p class="none">`` saying why instead)."""

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto;
       max-width: 1320px; padding: 16px 28px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 4px; } h2 { font-size: 1.15em; margin: 28px 0 4px; }
.meta { color: #555; font-size: 0.92em; } .caption { color: #555; font-size: 0.88em; margin: 0; }
.none { color: #777; font-style: italic; padding: 10px 0; }
table { border-collapse: collapse; font-size: 0.9em; margin: 6px 0 10px; }
td, th { border-bottom: 1px solid #e3e3e3; padding: 4px 12px 4px 0; text-align: left;
         vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.cols { display: flex; gap: 40px; flex-wrap: wrap; } .note { color: #666; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _when(ns: int) -> str:
    t = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(head: list[str], rows: list[list[str]], num: set[int] | None = None) -> str:
    num = num or set()
    out = ["<table><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr>"]
    for r in rows:
        cells = "".join(
            f'<td class="num">{_e(v)}</td>' if i in num else f"<td>{_e(v)}</td>"
            for i, v in enumerate(r)
        )
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "".join(out)


def _section(title: str, div_id: str, plot: plots.Plot) -> str:
    fig, caption = plot
    if fig is None:
        return f'<h2>{_e(title)}</h2><p class="none" id="{div_id}-none">{_e(caption)}</p>'
    height = int(fig.layout.height or 400)
    body = fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        default_height=f"{height}px",
        config={"displaylogo": False, "responsive": True},
    )
    return f'<h2>{_e(title)}</h2><p class="caption">{_e(caption)}</p>{body}'


def _header(data: JobData) -> str:
    i = data.info
    facts = []
    if i.get("model_name"):
        params = int(i.get("model_params") or 0)
        facts.append(f"model {i['model_name']}" + (f" ({params:,} parameters)" if params else ""))
    if i:
        par = i.get("parallelism") or "none"
        facts.append(f"world size {i.get('world_size', 1)}, parallelism {par}")
        facts.append(f"precision {i.get('precision') or 'unknown'}")
        facts.append(
            f"GPU {i['gpu_name']} ×{i.get('gpu_count', 0)}"
            if i.get("gpu_name")
            else f"CPU ({i.get('cpu_count', 0)} per node)"
        )
    states = [e for e in data.lifecycle if int(e["rank"]) <= 0]
    state = states[-1]["state"] if states else "no lifecycle event"
    when = f"{_when(data.start_ns)} → {_when(data.end_ns)}, {state}"
    cmd = (
        f'<div class="meta">command: <code>{_e(i["command"])}</code></div>'
        if i.get("command")
        else ""
    )
    return (
        f"<h1>perfloop report: {_e(data.job_id)}</h1>"
        f'<div class="meta">{_e(" · ".join(facts))}</div><div class="meta">{_e(when)}</div>{cmd}'
    )


def _accounting(summary: Summary) -> str:
    figs = _table(
        ["figure", "value", "how"],
        [[f.name, f.text(), f.note] for f in summary.figures],
        {1},
    )
    t = summary.time
    where = _table(
        ["where the wall time went", "seconds", "share"],
        [[c, f"{t.seconds(c):,.2f}", f"{t.share(c) * 100:.1f} %"] for c in CATEGORIES]
        + [["total", f"{t.wall_ns / 1e9:,.2f}", "100.0 %"]],
        {1, 2},
    )
    return f'<h2>Accounting</h2><div class="cols"><div>{figs}</div><div>{where}</div></div>'


def _changes(data: JobData) -> str:
    rows = []
    for i, c in enumerate(plots.change_rows(data), 1):
        ev = c["evidence"]
        before, after, p = ev.get("before_ms"), ev.get("after_ms"), ev.get("p_value")
        evidence = (
            f"p50 {before:.1f} → {after:.1f} ms" + (f" (p = {p:.3g})" if p is not None else "")
            if before and after
            else c["reason"]
        )
        rows.append([f"#{i}", c["knob"], f"{c['from']} → {c['to']}", str(c["step"]),
                     _when(c["ts_ns"]), c["verdict"], evidence])  # fmt: skip
    if not rows:
        return ""
    return "<h3>Changes</h3>" + _table(
        ["", "knob", "change", "at step", "applied", "verdict", "evidence"], rows
    )


def _costs(summary: Summary) -> str:
    if not summary.diagnoses:
        return ""
    cur = summary.currency
    rows = [
        [d.bottleneck, "open" if d.is_open else "resolved", f"{d.share * 100:.1f} %",
         f"{d.per_hour:,.4g} {cur}/h", f"{d.hours * 60:,.1f} min", f"{d.total:,.4g} {cur}"]
        for d in sorted(summary.diagnoses, key=lambda d: (not d.is_open, -d.total))
    ]  # fmt: skip
    return "<h3>What each diagnosis costs</h3>" + _table(
        ["bottleneck", "state", "mean share of step time", "costs", "open for", "cost"],
        rows,
        {2, 3, 4, 5},
    )


def build_html(data: JobData, summary: Summary) -> str:
    """The report page of ``data`` with the figures of ``summary``."""
    sections = [
        _header(data),
        _accounting(summary),
        _section("Where the wall time went", "plot-wall-time", plots.wall_time_plot(summary.time)),
        _section("Step time and changes", "plot-step-time", plots.step_time_plot(data)),
        _changes(data),
        _section("Phases per rank", "plot-phases", plots.phases_plot(data)),
        _section("GPU use, power and memory", "plot-gpu", plots.gpu_plot(data)),
        _section("Lateness per rank", "plot-lateness", plots.lateness_plot(data)),
        _section("Predictions against what came", "plot-predictions", plots.predictions_plot(data)),
        _section("Diagnoses", "plot-diagnoses", plots.diagnoses_plot(data)),
        _costs(summary),
    ]
    made = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>perfloop report: {_e(data.job_id)}</title><style>{_CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        + "\n".join(s for s in sections if s)
        + f'<p class="meta">made by perfloop {_e(__version__)} on {made}</p></body></html>\n'
    )
