"""Sections 1a and 1b of the models bench: step-time forecasting, one step ahead.

`StepTimeForecaster` against `LastValue`, `Ewma` (alpha 0.2) and the best EWMA alpha in
hindsight, on the simulator's per-step series (`sim_forecast_cases`, split around
ground-truth changes) and on real torch CPU runs trained in this process (`torch_section`).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench._common import say
from bench._models_sim import FORECAST_SCENARIOS, PHASES, SimRun, _changes, _f

SKIP = 20  # steps every forecaster sees before it is scored
CHANGE_STEPS = 30  # steps after a ground-truth change scored apart ("after change")
EWMA_GRID = (0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
TORCH_LIMIT_S = 20.0


# -- 1. step-time forecasting -----------------------------------------------------------------
def _forecast_errors(y: np.ndarray, near: np.ndarray | None = None) -> dict[str, Any]:
    """Absolute percentage errors of each forecaster, one step ahead, on series ``y``; with
    ``near`` (steps within ``CHANGE_STEPS`` after a ground-truth change) also split there."""
    from perfloop.models import Ewma, LastValue, StepTimeForecaster

    models = {
        "last": LastValue(target="y"),
        "ewma": Ewma(target="y", alpha=0.2),
        "learned": StepTimeForecaster(target="y"),
    }
    preds = {k: np.empty(len(y)) for k in models}
    for t, v in enumerate(y):
        x = {"y": float(v)}
        for k, m in models.items():
            preds[k][t] = m.predict_one({})
            m.learn_one(x)
    grid = np.array(EWMA_GRID)
    g = np.empty((len(y), len(grid)))
    mean = np.full(len(grid), float(y[0]) if len(y) else 0.0)
    for t, v in enumerate(y):
        g[t] = mean
        mean += grid * (v - mean)
    scored = np.arange(len(y)) >= SKIP
    scored &= y > 0
    yy = y[scored]
    out: dict[str, Any] = {"n": int(scored.sum()), "sum_y": float(yy.sum())}
    for k, p in preds.items():
        e = np.abs(p[scored] - yy)
        out[k] = (float((e / yy).sum()), float(e.sum()))
    ge = np.abs(g[scored] - yy[:, None])
    out["grid"] = ((ge / yy[:, None]).sum(axis=0), ge.sum(axis=0))
    if near is not None:
        for part, mask in (("after_change", near), ("calm", ~near)):
            m = scored & mask
            out[part] = {
                "n": int(m.sum()),
                **{
                    k: float((np.abs(preds[k][m] - y[m]) / y[m]).sum()) for k in ("ewma", "learned")
                },
            }
    return out


@dataclass
class _Pool:
    """Errors pooled over the seeds of one (source, case, series)."""

    n: int = 0
    sum_y: float = 0.0
    ape: dict[str, float] = field(default_factory=dict)
    ae: dict[str, float] = field(default_factory=dict)
    grid_ape: np.ndarray = field(default_factory=lambda: np.zeros(len(EWMA_GRID)))
    grid_ae: np.ndarray = field(default_factory=lambda: np.zeros(len(EWMA_GRID)))
    median_y: list[float] = field(default_factory=list)
    split: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, e: dict[str, Any], y: np.ndarray) -> None:
        for part in ("after_change", "calm"):
            if part in e:
                acc = self.split.setdefault(part, {"n": 0, "ewma": 0.0, "learned": 0.0})
                for k in acc:
                    acc[k] += e[part][k]
        self.n += e["n"]
        self.sum_y += e["sum_y"]
        for k in ("last", "ewma", "learned"):
            self.ape[k] = self.ape.get(k, 0.0) + e[k][0]
            self.ae[k] = self.ae.get(k, 0.0) + e[k][1]
        self.grid_ape += e["grid"][0]
        self.grid_ae += e["grid"][1]
        self.median_y.append(float(np.median(y)) if len(y) else math.nan)

    def result(self) -> dict[str, Any]:
        n = max(self.n, 1)
        mape = {k: 100 * v / n for k, v in self.ape.items()}
        wape = {k: 100 * v / max(self.sum_y, 1e-12) for k, v in self.ae.items()}
        gm = 100 * self.grid_ape / n
        best = int(np.argmin(gm))
        split = {}
        for part, acc in self.split.items():
            k = max(acc["n"], 1)
            split[part] = {
                "steps": int(acc["n"]),
                "mape_pct": {"ewma": 100 * acc["ewma"] / k, "learned": 100 * acc["learned"] / k},
                "learned_over_ewma": acc["learned"] / acc["ewma"] if acc["ewma"] > 0 else math.nan,
            }
        return {
            "steps": self.n,
            "median_value": float(np.median(self.median_y)),
            "mape_pct": mape,
            "wape_pct": wape,
            "oracle_ewma_alpha": EWMA_GRID[best],
            "oracle_ewma_mape_pct": float(gm[best]),
            "ewma_grid_mape_pct": {str(a): float(v) for a, v in zip(EWMA_GRID, gm, strict=True)},
            "learned_over_ewma": mape["learned"] / mape["ewma"] if mape["ewma"] > 0 else math.nan,
            "learned_beats_ewma": mape["learned"] < mape["ewma"],
            "learned_over_oracle": mape["learned"] / gm[best] if gm[best] > 0 else math.nan,
            **split,
        }


def forecast_section(
    cases: dict[str, list[dict[str, np.ndarray]]], source: str
) -> dict[str, dict[str, Any]]:
    """``cases``: case name → one dict of series (``step_time`` and phases) per seed/run."""
    out: dict[str, dict[str, Any]] = {}
    for case, seriess in cases.items():
        pools: dict[str, _Pool] = {}
        for series in seriess:
            near = series.get("_near")
            for name, y in series.items():
                if not name.startswith("_"):
                    pools.setdefault(name, _Pool()).add(_forecast_errors(y, near), y)
        out[case] = {name: p.result() for name, p in pools.items()}
    _print_forecast(out, source)
    return out


def _print_forecast(res: dict[str, dict[str, Any]], source: str) -> None:
    say(f"\n[1] step-time forecasting, {source}: MAPE % of the next value (steps after {SKIP})")
    split = any("calm" in s.get("step_time", {}) for s in res.values())
    head = (
        f"{'case':<24}{'steps':>7}{'med ms':>8}{'last':>7}{'ewma.2':>8}{'oracle(α)':>13}"
        f"{'learned':>9}{'l/ewma':>8}  beats" + ("  l/ewma calm | after change" if split else "")
    )
    say(head)
    say("-" * len(head))
    for case, series in res.items():
        r = series.get("step_time")
        if r is None:
            continue
        m = r["mape_pct"]
        say(
            f"{case:<24}{r['steps']:>7}{r['median_value']:>8.1f}{m['last']:>7.2f}{m['ewma']:>8.2f}"
            f"{r['oracle_ewma_mape_pct']:>7.2f}({r['oracle_ewma_alpha']:<4g})"
            f"{m['learned']:>9.2f}{r['learned_over_ewma']:>8.3f}  "
            f"{'yes' if r['learned_beats_ewma'] else 'NO ':<5}"
            + (
                f"{_f(r['calm']['learned_over_ewma'], 3):>13} | "
                f"{_f(r['after_change']['learned_over_ewma'], 3)}"
                f" ({r['after_change']['steps']} steps)"
                if "calm" in r
                else ""
            )
        )
    say(
        "phases: learned/ewma MAPE ratio (learned MAPE %); '*' = the phase's median is < 1 ms,"
        " MAPE of noise"
    )
    phases = [p for p in PHASES if any(p in s for s in res.values())]
    say(f"{'case':<24}" + "".join(f"{p:>17}" for p in phases))
    for case, series in res.items():
        cells = []
        for p in phases:
            r = series.get(p)
            if r is None:
                cells.append(f"{'—':>17}")
                continue
            mark = "*" if r["median_value"] < 1.0 else " "
            flag = "" if r["learned_beats_ewma"] else "!"
            cells.append(
                f"{r['learned_over_ewma']:>7.3f}{flag:1}({r['mape_pct']['learned']:6.1f}){mark}"
            )
        say(f"{case:<24}" + "".join(cells))
    say("  '!' = learned not below EWMA(0.2)")


def sim_forecast_cases(runs: Sequence[SimRun]) -> dict[str, list[dict[str, np.ndarray]]]:
    cases: dict[str, list[dict[str, np.ndarray]]] = {}
    for r in runs:
        if r.scenario not in FORECAST_SCENARIOS:
            continue
        near = np.zeros(len(r.step_ms), dtype=bool)
        for _, t in _changes(r):
            i = int(np.searchsorted(r.step_end_s, t))
            near[i : i + CHANGE_STEPS] = True
        cases.setdefault(r.scenario, []).append(
            {"step_time": r.step_ms, **r.phase_ms, "_near": near}
        )
    return cases


# -- 1b. real torch CPU runs ------------------------------------------------------------------
def _torch_run(config: str, steps: int, limit_s: float) -> dict[str, np.ndarray]:
    """Train a 3-layer MLP on synthetic data in this process; each step's phases, ms."""
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, Dataset

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if config == "threads_2_to_1" else 1)

    class Data(Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int, transform_rounds: int, stall_every: int) -> None:
            g = torch.Generator().manual_seed(1)
            self.x = torch.randn(n, 784, generator=g)
            self.y = torch.randint(0, 10, (n,), generator=g)
            self.rounds, self.stall_every = transform_rounds, stall_every
            self.batch = 64

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            v = self.x[i]
            if self.stall_every and i % (self.batch * self.stall_every) == 0:
                time.sleep(0.015)  # a slow shard: one batch in `stall_every` waits on storage
            if self.rounds:
                a = v.numpy()
                for _ in range(self.rounds):  # a costly augmentation, in the main process
                    a = np.tanh(a * 1.01) + 0.001 * np.roll(a, 1)
                v = torch.from_numpy(a.astype(np.float32))
            return v, self.y[i]

    rounds = 12 if config == "slow_loader" else 0
    stall = 8 if config == "periodic_stall" else 0
    data = Data(256 * steps + 4096, rounds, stall)
    model = nn.Sequential(
        nn.Linear(784, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def loader(bs: int) -> Iterator[Any]:
        data.batch = bs
        return iter(DataLoader(data, batch_size=bs, shuffle=False, num_workers=0))

    it = loader(64)
    out = {k: np.empty(steps) for k in ("step_time", *[p for p in PHASES if p != "comm"])}
    t_start = time.perf_counter()
    n = 0
    switched, switch_at = False, -1
    for i in range(steps):
        # the change half-way: at half the steps, or half the time limit on a slow machine
        if not switched and (i >= steps // 2 or time.perf_counter() - t_start > limit_s / 2):
            switched, switch_at = True, i
            if config == "threads_2_to_1":
                torch.set_num_threads(1)
            if config == "batch_64_to_256":
                it = loader(256)
        t0 = time.perf_counter()
        xb, yb = next(it)
        t1 = time.perf_counter()
        loss = loss_fn(model(xb), yb)
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        for k, v in (
            ("step_time", t4 - t0),
            ("data_wait", t1 - t0),
            ("forward", t2 - t1),
            ("backward", t3 - t2),
            ("optimizer", t4 - t3),
        ):
            out[k][i] = v * 1000
        n = i + 1
        if t4 - t_start > limit_s:
            break
    torch.set_num_threads(threads)
    return {k: v[:n] for k, v in out.items()} | {"_switch": np.array([switch_at])}


HIDDEN = 1536
TORCH_CONFIGS = ("slow_loader", "threads_2_to_1", "batch_64_to_256", "periodic_stall")


def torch_section(args: argparse.Namespace) -> dict[str, Any]:
    cases: dict[str, list[dict[str, np.ndarray]]] = {}
    info: dict[str, Any] = {}
    for cfg in TORCH_CONFIGS:
        t = time.perf_counter()
        series = _torch_run(cfg, args.torch_steps, TORCH_LIMIT_S)
        wall = time.perf_counter() - t
        switch_at = int(series.pop("_switch")[0])
        y = series["step_time"]
        n = len(y)
        # one-off stalls (the shared machine, the allocator): > 3x the median of the 20 before
        spikes = [i for i in range(20, n) if y[i] > 3 * np.median(y[i - 20 : i])]
        info[cfg] = {
            "steps": n,
            "wall_s": wall,
            "median_step_ms": float(np.median(y)),
            "max_step_ms": float(y.max()),
            "change_at_step": switch_at if cfg in ("threads_2_to_1", "batch_64_to_256") else None,
            "spikes_over_3x": spikes,
            "step_time_ms": [round(float(v), 3) for v in y],  # to re-score or inspect later
        }
        change = info[cfg]["change_at_step"]
        say(
            f"torch {cfg}: {n} steps in {wall:.1f} s"
            + (f" (change at step {change})" if change is not None else "")
            + f", median step {np.median(y):.1f} ms (max "
            f"{y.max():.1f}), data wait {np.median(series['data_wait']):.1f} ms; one-off "
            f"stalls > 3x the last 20 steps' median: {len(spikes)}"
            + (f" (steps {', '.join(map(str, spikes[:8]))})" if spikes else "")
        )
        cases[cfg] = [series]
    res = forecast_section(
        cases,
        f"real torch CPU runs (3-layer MLP, hidden {HIDDEN}, 1 thread; 2 → 1 in threads_2_to_1)",
    )
    return {"runs": info, "forecast": res}
