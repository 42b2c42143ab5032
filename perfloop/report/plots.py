"""The report's plots, one function each, as plotly figures (or None with a line saying why
there is nothing to show): step time with every change and its verdict, phases per rank, GPU
use, per-rank lateness, predictions against what came, the diagnoses' timeline, and where the
wall time went.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from perfloop.report.accounting import CATEGORIES, TimeAccount
from perfloop.report.collectives import lateness
from perfloop.report.data import JobData

__all__ = [
    "MAX_POINTS",
    "Plot",
    "change_rows",
    "diagnoses_plot",
    "gpu_plot",
    "lateness_plot",
    "phases_plot",
    "predictions_plot",
    "step_time_plot",
    "wall_time_plot",
]

MAX_POINTS = 4000
"""Steps of a rank beyond this many are shown as means of consecutive steps."""

Plot = tuple[go.Figure | None, str]
"""A figure, or None and the reason there is none; the text is a caption either way."""

_VERDICT_COLOURS = {"kept": "#2ca02c", "rolled_back": "#d62728", "rejected": "#7f7f7f"}
_LEVEL_COLOURS = {
    "cluster_health": "#9467bd",
    "network": "#1f77b4",
    "host": "#ff7f0e",
    "memory": "#8c564b",
    "kernel": "#17becf",
}
_CATEGORY_COLOURS = {
    "productive": "#2ca02c",
    "data_wait": "#ff7f0e",
    "straggler_wait": "#1f77b4",
    "hang": "#d62728",
    "restart": "#e377c2",
    "checkpoint": "#8c564b",
    "eval": "#bcbd22",
    "warmup": "#17becf",
    "startup": "#9467bd",
    "idle": "#c7c7c7",
}
_PHASE_ORDER = ("data_wait", "forward", "backward", "comm", "optimizer", "checkpoint", "eval")


def _times(ns: Any) -> np.ndarray:
    return np.asarray(ns, dtype=np.int64).astype("datetime64[ns]")


def _layout(fig: go.Figure, height: int, **kw: Any) -> go.Figure:
    fig.update_layout(
        template="plotly_white",
        height=height,
        margin={"l": 70, "r": 30, "t": 40, "b": 50},
        legend={"orientation": "h", "y": -0.18},
        **kw,
    )
    return fig


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """At most `MAX_POINTS` points: means of consecutive runs of points."""
    if x.size <= MAX_POINTS:
        return x, y
    k = -(-x.size // MAX_POINTS)
    n = x.size // k * k
    return x[:n].reshape(-1, k)[:, -1], y[:n].reshape(-1, k).mean(axis=1)


def change_rows(data: JobData) -> list[dict[str, Any]]:
    """One row per command the job's agents answered: the knob, from and to, when and at which
    step it was applied, and the verdict (``kept``, ``rolled_back``, ``rejected``, or
    ``applied`` while unverified) with its evidence."""
    by_id: dict[str, dict[str, Any]] = {}
    for a in data.changes:
        c = by_id.setdefault(
            a["command_id"],
            {"command_id": a["command_id"], "knob": a["knob"], "from": a["from_value"] or "",
             "to": a["value"], "ts_ns": int(a["ts_ns"]), "step": int(a["step"]),
             "verdict": a["status"], "evidence": {}, "reason": a["reason"]},
        )  # fmt: skip
        if a["status"] == "applied":
            c.update(ts_ns=int(a["ts_ns"]), step=int(a["step"]), to=a["value"])
        else:
            c.update(verdict=a["status"], evidence=dict(a["evidence"] or {}), reason=a["reason"])
    return sorted(by_id.values(), key=lambda c: c["ts_ns"])


def step_time_plot(data: JobData) -> Plot:
    """Step time of every rank over time, each change a vertical line coloured by verdict."""
    s = data.steps
    if not len(s):
        return None, "no steps recorded"
    fig = go.Figure()
    for r in np.unique(s.rank):
        m = s.rank == r
        o = np.argsort(s.end_ns[m], kind="stable")
        x, y = _thin(s.end_ns[m][o], s.step_ms[m][o])
        fig.add_trace(
            go.Scattergl(x=_times(x), y=y, mode="lines", name=f"rank {r}", line={"width": 1})
        )
    changes = change_rows(data)
    top = float(np.percentile(s.step_ms, 99.5)) * 1.15
    for i, c in enumerate(changes, 1):
        colour = _VERDICT_COLOURS.get(c["verdict"], "#555555")
        t = _times([c["ts_ns"]])[0]
        fig.add_vline(x=t, line={"color": colour, "dash": "dash", "width": 2})
        ratio = c["evidence"].get("ratio")
        gain = f" {(ratio - 1) * 100:+.0f} %" if ratio else ""
        fig.add_annotation(
            x=t, y=top, text=f"#{i} {c['verdict']}{gain}", showarrow=False, yshift=10 * (i % 2),
            font={"color": colour, "size": 11}, xanchor="left",
        )  # fmt: skip
        fig.add_trace(
            go.Scatter(
                x=[t], y=[top], mode="markers", marker={"color": colour, "size": 9},
                name=f"#{i} {c['knob']} {c['from']} → {c['to']}", showlegend=True,
                hovertext=f"#{i} {c['knob']} {c['from']} → {c['to']} at step {c['step']}: "
                f"{c['verdict']} {c['reason']}"[:300], hoverinfo="text",
            )
        )  # fmt: skip
    _layout(fig, 430, xaxis_title="time (UTC)", yaxis_title="step time (ms)")
    fig.update_yaxes(range=[0, top * 1.12])
    caption = f"{len(changes)} change(s) applied" if changes else "no change was applied"
    return fig, caption


def phases_plot(data: JobData) -> Plot:
    """Mean time per step of each phase, stacked, per rank (``unattributed``: the rest)."""
    if not data.phase_ms:
        return None, "no phase spans recorded"
    s = data.steps
    ranks = sorted({int(p["rank"]) for p in data.phase_ms})
    names = Counter(str(p["phase"]) for p in data.phase_ms)
    order = [p for p in _PHASE_ORDER if p in names] + sorted(set(names) - set(_PHASE_ORDER))
    per = {(int(p["rank"]), str(p["phase"])): float(p["total_ms"]) for p in data.phase_ms}
    n = {r: max(1, int((s.rank == r).sum())) for r in ranks}
    mean = {r: float(s.step_ms[s.rank == r].mean()) if (s.rank == r).any() else 0.0 for r in ranks}
    labels = [f"rank {r}" for r in ranks]
    fig = go.Figure()
    for ph in order:
        fig.add_trace(go.Bar(name=ph, x=labels, y=[per.get((r, ph), 0.0) / n[r] for r in ranks]))
    rest = [max(0.0, mean[r] - sum(per.get((r, ph), 0.0) for ph in order) / n[r]) for r in ranks]
    fig.add_trace(go.Bar(name="unattributed", x=labels, y=rest, marker_color="#dddddd"))
    _layout(fig, 380, barmode="stack", yaxis_title="ms per step (mean)")
    return fig, "mean milliseconds per step of each depth-0 phase span, per rank"


def gpu_plot(data: JobData) -> Plot:
    """SM use, power and memory of every GPU over time."""
    if not data.gpus:
        return None, "no GPU samples: this job ran without GPUs, or without the NVML sampler"
    fig = make_subplots(
        rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
        subplot_titles=("SM use (%)", "power (W)", "memory used (GiB)"),
    )  # fmt: skip
    for g in data.gpus:
        x = _times(np.asarray(g.t_ms, dtype=np.int64) * 1_000_000)
        name = f"{g.node}/gpu{g.device}"
        fig.add_trace(go.Scattergl(x=x, y=g.sm_util_pct, name=name, legendgroup=name), 1, 1)
        fig.add_trace(
            go.Scattergl(x=x, y=g.power_w, name=name, legendgroup=name, showlegend=False), 2, 1
        )
        mem = np.asarray(g.mem_used_bytes) / 2**30
        fig.add_trace(go.Scattergl(x=x, y=mem, name=name, legendgroup=name, showlegend=False), 3, 1)
    _layout(fig, 620)
    return fig, f"{len(data.gpus)} GPU(s), samples averaged per time bucket"


def lateness_plot(data: JobData, max_columns: int = 400) -> Plot:
    """How late each rank arrived at each step's collectives (a heatmap, ranks × steps)."""
    ranks_seen = np.unique(data.steps.rank)
    if ranks_seen.size < 2:
        return None, "one rank: nobody to be late for"
    if not len(data.collectives):
        return None, "no collectives recorded"
    ranks, steps, ms = lateness(data.collectives)
    if ranks.size < 2:
        return None, "collectives of one rank only"
    x = steps
    if steps.size > max_columns:
        k = -(-steps.size // max_columns)
        pad = (-steps.size) % k
        ms = np.pad(ms, ((0, 0), (0, pad)), constant_values=np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a column of NaNs stays NaN
            ms = np.nanmean(ms.reshape(ranks.size, -1, k), axis=2)
        x = steps[::k]
    fig = go.Figure(
        go.Heatmap(
            z=ms, x=x, y=[f"rank {r}" for r in ranks], colorscale="Reds", zmin=0,
            colorbar={"title": "ms late"},
            hovertemplate="%{y}, step %{x}: %{z:.1f} ms late<extra></extra>",
        )
    )  # fmt: skip
    _layout(fig, max(220, 60 + 28 * ranks.size), xaxis_title="step", yaxis_title="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        worst = np.nan_to_num(np.nanmean(ms, axis=1), nan=0.0)
    culprit = int(ranks[int(np.argmax(worst))])
    return fig, (
        f"the most any collective of the step waited for the rank; latest on average: rank "
        f"{culprit} ({float(worst.max()):.1f} ms a step)"
    )


def _mean_pct(rows: list[dict[str, Any]], key: str) -> str:
    """The mean of ``key`` over ``rows`` (finite values only) as a percentage, or ``n/a``."""
    v = [float(r[key]) for r in rows if r[key] is not None and np.isfinite(float(r[key]))]
    return f"{np.mean(v) * 100:.1f} %" if v else "n/a"


def predictions_plot(data: JobData, max_targets: int = 4) -> Plot:
    """Each online model's forecasts against what came, for the most forecast targets."""
    if not data.predictions:
        return None, "no realised predictions (the stream worker forecasts once it has history)"
    counts = Counter(p["target"] for p in data.predictions)
    targets = sorted(counts, key=lambda t: (t != "step_time_ms", -counts[t], t))[:max_targets]
    titles = []
    for t in targets:
        rows = [p for p in data.predictions if p["target"] == t]
        ape, base = _mean_pct(rows, "ape"), _mean_pct(rows, "baseline_ape")
        titles.append(f"{t}: error {ape} (moving average: {base})")
    fig = make_subplots(rows=len(targets), cols=1, shared_xaxes=True, subplot_titles=titles,
                        vertical_spacing=0.08)  # fmt: skip
    for i, t in enumerate(targets, 1):
        rows = [p for p in data.predictions if p["target"] == t]
        x = _times([p["ts_ns"] for p in rows])
        first = i == 1
        fig.add_trace(go.Scatter(x=x, y=[p["realised"] for p in rows], name="came",
                                 mode="lines+markers", line={"color": "#222222"},
                                 legendgroup="came", showlegend=first), i, 1)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=[p["predicted"] for p in rows], name="predicted",
                                 mode="lines+markers", line={"color": "#1f77b4"},
                                 legendgroup="predicted", showlegend=first), i, 1)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=[p["baseline"] for p in rows], name="moving average",
                                 mode="lines", line={"color": "#aaaaaa", "dash": "dot"},
                                 legendgroup="baseline", showlegend=first), i, 1)  # fmt: skip
    _layout(fig, 200 + 190 * len(targets))
    return fig, f"{len(data.predictions)} realised predictions of {len(counts)} target(s)"


def diagnoses_plot(data: JobData) -> Plot:
    """Every diagnosis from its onset to its resolution (or the job's end), by level."""
    if not data.diagnoses:
        return None, "no diagnosis: the funnel found nothing on the critical path to name"
    by_id: dict[str, dict[str, Any]] = {}
    for d in data.diagnoses:
        e = by_id.setdefault(d["diagnosis_id"], {**d, "first_ts": int(d["ts_ns"]), "shares": []})
        e.update(state=d["state"], last_ts=int(d["ts_ns"]))
        e["shares"].append(float(d["step_share"]))
    fig = go.Figure()
    seen: set[str] = set()
    labels = []
    for e in sorted(by_id.values(), key=lambda e: int(e["onset_ns"])):
        end = e["last_ts"] if e["state"] == "resolved" else data.end_ns
        ranks = ",".join(map(str, e["ranks"])) or "job"
        label = f"{e['bottleneck']} (ranks {ranks})"
        labels.append(label)
        colour = _LEVEL_COLOURS.get(e["level"], "#555555")
        hover = (f"{e['bottleneck']} [{e['level']}] {e['state']}<br>mean share "
                 f"{np.mean(e['shares']) * 100:.1f} %, confidence {float(e['confidence']):.2f}"
                 f"<br>{str(e['summary'])[:200]}")  # fmt: skip
        fig.add_trace(go.Scatter(
            x=_times([int(e["onset_ns"]), end]), y=[label, label], mode="lines",
            line={"color": colour, "width": 14}, name=e["level"],
            legendgroup=e["level"], showlegend=e["level"] not in seen,
            hovertext=hover, hoverinfo="text",
        ))  # fmt: skip
        fig.add_trace(go.Scatter(
            x=_times([e["first_ts"]]), y=[label], mode="markers", showlegend=False,
            marker={"symbol": "diamond", "size": 11, "color": "#000000"},
            hovertext="detected", hoverinfo="text",
        ))  # fmt: skip
        seen.add(e["level"])
    _layout(fig, max(220, 120 + 34 * len(set(labels))), xaxis_title="time (UTC)")
    fig.update_xaxes(range=list(_times([data.start_ns, data.end_ns])))
    return fig, f"{len(by_id)} diagnosis(es); a diamond marks when each was decided"


def wall_time_plot(time: TimeAccount) -> Plot:
    """Where the wall time went, one stacked bar (mean over the ranks)."""
    fig = go.Figure()
    for c in CATEGORIES:
        if time.rank_ns[c]:
            fig.add_trace(go.Bar(
                y=["wall time"], x=[time.seconds(c)], name=c, orientation="h",
                marker_color=_CATEGORY_COLOURS[c],
                hovertemplate=f"{c}: %{{x:.2f}} s ({time.share(c) * 100:.1f} %)<extra></extra>",
            ))  # fmt: skip
    _layout(fig, 240, barmode="stack", xaxis_title="seconds (mean over ranks)")
    fig.update_layout(legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"})
    return fig, f"goodput {time.goodput * 100:.1f} % of {time.wall_ns / 1e9:,.1f} s"
