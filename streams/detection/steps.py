"""Step-based detectors: straggler, load imbalance, data-loader starvation, comm degradation,
exposed comm and memory leak (time to OOM).

They read the job's last complete steps (`JobState.window`) as (steps x ranks) matrices and
keep hysteresis per rank or per job: a condition opens after ``persist_steps`` consecutive
bad steps and resolves after ``clear_steps`` good ones, so a diagnosis can open within a few
steps of the onset without flapping. Each detector writes its active conditions into
``job.findings`` under its own key prefix.

What each one reads (data-parallel semantics: every rank shares the step time):

* straggler — compute per rank against the job median of the same step; score
  ``1 − median / compute`` (0–1). Compute is forward + backward + optimizer spans less the
  comm in flight inside them (DDP's all-reduce nests in backward); without spans, step time −
  data wait − checkpoint/eval − collective time. When the job reports collectives (or comm
  spans), the ranks that arrive on time set the compute and a rank's own lateness at the
  collectives (`perfloop.streams.detection._arrival`) less its data wait and checkpoint/eval
  time is added to it: the rank the others wait for is slow, the ranks that wait are not, and
  a checkpoint saved by one rank is no straggler. In a pipeline, whose stages do different
  work, a rank is compared with its own past instead (`perfloop.streams.detection._pipeline`).
* load_imbalance — ``1 − median / max`` compute per step stays high while the slowest rank
  rotates (no rank is persistently slow: that is a straggler). In a pipeline (its ranks send
  and receive point to point) the other way round: the same ranks compute well above the
  mean, by their medians over the window (a stage cut heavier than the others costs the whole
  pipeline its pace; `perfloop.streams.detection._pipeline`).
* dataloader_starvation — data wait / step time per rank, grouped by node; a step is starved
  when that share and the wait itself (``min_wait_ms``) are both large enough.
* comm_degradation — pure comm time per step: the shortest collective time over ranks (the
  last rank to arrive does not wait for anyone), against a baseline learned from the job's own
  first steps and tracked while healthy; waiting for a straggler or a starved node does not
  move it. Only for jobs with GPUs or on several nodes: the collectives of a CPU job on one
  node move memory over loopback with the same CPUs that compute, so they slow down with its
  compute (its stragglers and contention), not with a network.
* exposed_comm — the shortest comm span over ranks (comm not hidden and not waiting), as a
  share of the step; a pipeline's point-to-point sends and receives left out (they wait out
  the pipeline's bubble, a matter of its schedule, not of overlap).
* memory_leak — allocated memory at step end grows at every step of a window.

Public through `perfloop.streams.detection` (`step_detectors`): the funnel runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from perfloop.streams.detection._common import (
    nanmean,
    nanmedian,
    node_of,
    nz,
    replace_findings,
    step_start,
    trailing,
)
from perfloop.streams.detection._persistence import Persistence
from perfloop.streams.detection._pipeline import stage_imbalance, stage_straggler
from perfloop.streams.detection._rss_leak import rss_leak_detector
from perfloop.streams.detection._straggler import straggler_detector
from perfloop.streams.detection._threads import thread_detector
from perfloop.streams.detection.job_state import NS, Finding, JobState
from perfloop.streams.detection.loader import loader_evidence

if TYPE_CHECKING:
    from perfloop.streams.detection.config import DetectConfig

__all__ = ["pipeline", "step_detectors"]

WINDOW = 16  # complete steps the detectors look at


def _active(state: dict[str, Any], key: str, n: int) -> np.ndarray:
    a = state.get(key)
    if a is None or len(a) < n:
        old = a if a is not None else np.zeros(0, dtype=bool)
        a = np.concatenate([old, np.zeros(n - len(old), dtype=bool)])
        state[key] = a
    return a


def _hysteresis(active: np.ndarray, run_on: Any, run_off: Any, need: int, clear: int) -> Any:
    return (active | (run_on >= need)) & ~(active & (run_off >= clear))


def _derive(job: JobState, win: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per step and rank: compute, data-wait share, straggler score; per step: medians, pure
    and exposed comm. Ranks that do not report steps (``need`` False) are NaN."""
    r = win
    need = None if r["need"].all() else r["need"][None, :]

    def masked(a: np.ndarray, present: np.ndarray | None = None) -> np.ndarray:
        m = present if need is None else (need if present is None else need & present)
        return a if m is None else np.where(m, a, np.nan)

    shape = r["st"].shape
    st, wait = masked(r["st"]), masked(r["wait"])
    comm = masked(r["comm"], r["n_comm"] > 0) if job.flags["comm_spans"] else None
    # a pipeline's sends and receives wait out its bubble, which no overlap can hide
    unhidden = comm - masked(r["p2p"]) if comm is not None else None
    coll = masked(r["coll"], r["n_coll"] > 0) if job.flags["coll"] else None
    if job.flags["spans"]:  # less the all-reduce in flight inside backward (DDP)
        comp = masked(r["compute"] - np.minimum(r["incomm"], r["compute"]), r["n_compute"] > 0)
    elif coll is not None:
        comp = st - wait - r["aside"] - coll
    else:
        comp = np.full(shape, np.nan)
    raw = comp  # each rank's own compute, before the others' waits for it are read in
    late = _lateness(job, r, masked, unhidden)
    if late is not None:
        comp = _effective(comp, late - nz(wait) - r["aside"])
    med = nanmedian(comp, 1)
    step_ms = nanmedian(st, 1)
    nan_steps = np.full(shape[0], np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        d: dict[str, Any] = {
            "st": st,
            "wait": wait,
            "comp": comp,
            "raw": raw,
            "comm": comm if comm is not None else np.full(shape, np.nan),
            "med": med,
            "step_ms": step_ms,
            "score": np.maximum(1.0 - med[:, None] / comp, 0.0),  # 0–1; NaN: no data
            "share": wait / st,
            "pure": np.fmin.reduce(coll if coll is not None else comm, axis=1)
            if (coll is not None or comm is not None)
            else nan_steps,
            "exposed": np.fmin.reduce(unhidden, axis=1) if unhidden is not None else nan_steps,
        }
        d["excess"] = comp - np.fmin.reduce(comp, axis=1)[:, None]  # over the on-time ranks
        last = slice(-3, None)
        excess = nanmean((comp[last] - med[last, None]) / step_ms[last, None], axis=0)
        job.det["excess_share"] = np.minimum(np.maximum(nz(excess), 0.0), 1.0)
        job.det["wait_share"] = nz(nanmean(d["share"][last], axis=0))
        job.det["compute_share"] = float(nz(nanmean(med[last] / step_ms[last])))
        if job.flags["kernels"]:
            ratio = (masked(r["busy"]) / comp).ravel()
            job.det["busy_ratio"] = float(np.nan_to_num(nanmedian(ratio[None, :], 1)[0], nan=-1.0))
    return d


def _lateness(job: JobState, r: dict[str, np.ndarray], masked: Any, comm: Any) -> Any:
    """(steps, ranks): how long after the first rank each rank arrived at the step's
    collectives (`perfloop.streams.detection._arrival`), else at its comm spans (the rank that
    spent the least time in them came last; ``comm`` less point-to-point spans); None
    without either."""
    if job.flags["arrivals"]:
        return masked(job.arrival.lateness(r["slot"]))
    if comm is None:
        return None
    blocked = comm + masked(r["incomm"])
    return np.fmax.reduce(blocked, axis=1)[:, None] - blocked


def _effective(comp: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Each rank's compute per step as the on-time ranks' compute plus its own lateness.

    ``own``: lateness less the rank's own data wait and checkpoint/eval time (known causes
    that are not compute). The ranks arriving by the lower median are on time; their compute
    less their lateness is the reference, read off the rank with the most of it (the one that
    waited least, whose time in collectives hides the least of its own work).
    """
    own = np.where(np.isnan(comp), np.nan, own)
    ok = ~np.isnan(own).all(axis=1)
    if not ok.any():
        return comp
    s = np.sort(own, axis=1)
    n = (~np.isnan(own)).sum(axis=1)
    lower = s[np.arange(len(s)), np.maximum(n - 1, 0) // 2]
    extra = np.maximum(own - lower[:, None], 0.0)
    ref = np.fmax.reduce(comp - extra, axis=1)
    return np.where(ok[:, None], ref[:, None] + extra, comp)


def _persistence(state: dict[str, Any], p: Any, width: int) -> Persistence:
    return Persistence(
        state,
        width=width,
        persist_s=p.persist_s,
        max_persist_s=p.max_persist_s,
        persist_steps=p.persist_steps,
        clear_steps=p.clear_steps,
        warmup_steps=p.warmup_steps,
    )


def step_detectors(job: JobState, cfg: DetectConfig) -> None:
    """Run the step-based detectors if new steps completed since the last call."""
    if not job.complete_steps():
        return
    win = job.window(WINDOW)
    if not len(win["step"]):
        return
    new = win["step"] > job.last_eval_step
    job.last_eval_step = int(win["step"][-1])
    d = _derive(job, win)
    seen = job.det["steps_seen"] = job.det.get("steps_seen", 0) + int(new.sum())
    if seen >= job.det.get("p99_at", 0):  # the hang timeout's statistics, every few steps
        job.det["p99_at"] = seen + 8
        st_all = job.ring["st"][job.usable].ravel()
        st_all = st_all[~np.isnan(st_all)]
        if len(st_all):
            job.det["p99_ms"] = float(np.percentile(st_all, 99))
            job.det["median_step_ms"] = float(np.median(st_all))
    pipe = pipeline(job)
    for name, fn in (
        ("straggler", straggler_detector),
        ("load_imbalance", _load_imbalance),
        ("dataloader", _dataloader),
        ("comm", _comm),
        ("exposed_comm", _exposed),
        ("memory", _memory),
        ("threads", thread_detector),
    ):
        if pipe:  # its stages do different work: each rank against its own past
            fn = {"straggler": stage_straggler, "load_imbalance": stage_imbalance}.get(name, fn)
        if getattr(cfg, name).enabled:
            fn(job, getattr(cfg, name), win, d, new)
        else:
            replace_findings(job, _PREFIX[name], {})


PIPELINE_STEPS = 8


def pipeline(job: JobState) -> bool:
    """Whether the job is a pipeline: its ranks sent or received point to point in at least
    `PIPELINE_STEPS` steps (a data-parallel job's one-off send leaves its detectors on).

    The straggler and load-imbalance detectors compare the ranks' compute as peers doing the
    same work (data parallel). A pipeline's stages do different work by design, and which
    ranks are one stage's replicas is not known: a pipeline's straggler is a rank whose own
    compute rose against its own past (`stage_straggler`), its load imbalance a stage that
    computes well above the others (`stage_imbalance`)."""
    return int(job.det.get("p2p_steps", 0)) >= PIPELINE_STEPS


_PREFIX = {
    "straggler": "straggler:",
    "load_imbalance": "load_imbalance",
    "dataloader": "dataloader_starvation:",
    "comm": "comm_degradation",
    "exposed_comm": "exposed_comm",
    "memory": "memory_leak:",
    "threads": "thread_oversubscription:",
}


def _load_imbalance(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    st = job.det.setdefault("load_imbalance", {"active": False})
    comp = d["comp"][-p.window_steps :]
    med, top = d["med"][-p.window_steps :], np.fmax.reduce(comp, axis=1)
    imb = nz(1.0 - med / top)
    flagged = imb >= p.threshold
    count = int(flagged.sum())
    if not st["active"] and count < p.min_flagged:
        replace_findings(job, "load_imbalance", {})
        return
    slow = d["score"][-p.window_steps :] >= job.det.get("straggler_threshold", 0.12)
    # rotating: no single rank is slow in most of the flagged steps (that is a straggler)
    tops = np.argmax(np.where(comp == comp, comp, -1.0), axis=1)[flagged]
    rotating = (
        count > 0
        and slow[flagged].sum(axis=0).max() <= count / 2
        and len(np.unique(tops)) >= min(3, comp.shape[1])
    )
    held = bool(len(comp) >= p.window_steps and count >= p.min_flagged and rotating)
    end = int(np.nanmax(win["end"][-1]))
    # noise rotates too: it must last longer than the job's own (`Persistence`)
    pers = _persistence(st.setdefault("persist", {}), p, 1)
    was = bool(st["active"])
    st["active"] = bool(pers.update(np.array([held]), start=end, end=end)[0])
    if was and (count <= len(comp) - p.min_flagged or not rotating):
        st["active"] = False
        pers.stop()
    found = {}
    if st["active"]:
        argmax = tops
        step_ms = d["step_ms"][-p.window_steps :]
        first = int(np.argmax(flagged))
        found["load_imbalance"] = Finding(
            key="load_imbalance",
            bottleneck="load_imbalance",
            onset_ns=int(
                np.min(step_start(win, len(win["step"]) - len(comp) + first, slice(None)))
            ),
            step_share=float(np.clip(np.mean(((top - med) / step_ms)[flagged]), 0, 1)),
            confidence=min(1.0, 0.4 + 0.6 * count / len(comp)),
            ranks=sorted({int(x) for x in argmax}),
            step=int(win["step"][-1]),
            evidence={
                "imbalance": round(float(imb[flagged].mean()), 4),
                "imbalanced_steps": float(count),
                "slowest_ranks": float(len(set(argmax.tolist()))),
            },
            summary=f"compute differs across ranks by {100 * imb[flagged].mean():.0f}% per step, "
            "the slowest rank changing from step to step",
        )
    replace_findings(job, "load_imbalance", found)


def _dataloader(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    st = job.det.setdefault("dataloader", {})
    share = d["share"]
    n, w = share.shape
    # worth acting on: a share of the step, and time (a loader worker hands each batch over
    # between processes, which costs about a millisecond itself: a step of 2 ms whose data
    # wait is a third of it has nothing a worker could win back)
    flag = (share >= p.share_threshold) & (nz(d["wait"]) >= p.min_wait_ms)
    active = _active(st, "active", w)[:w]
    if not flag.any() and not active.any():
        replace_findings(job, "dataloader_starvation:", {})
        return
    run_on, run_off = trailing(flag), trailing(~flag)
    # fed for clear_steps steps and clear_s of event time: a loader that keeps up for a
    # moment between two slow batches is still starving
    first_fed = np.clip(n - run_off, 0, n - 1)
    fed_ns = win["end"][-1, :w] - step_start(win, first_fed, np.arange(w))
    run_off = np.where((run_off >= n) | (fed_ns >= p.clear_s * NS), run_off, 0)
    st["active"][:w] = act = _hysteresis(active, run_on, run_off, p.persist_steps, p.clear_steps)
    found = {}
    node_of = job.rank["node"][:w]
    for node in np.unique(node_of[act]):
        ranks = np.flatnonzero(act & (node_of == node))
        k = int(min(n, 3))
        sh = np.nan_to_num(share[-k:, ranks].mean(axis=0))
        runs = np.clip(run_on[ranks], 1, n)
        onset = int(min(step_start(win, n - int(x), r) for x, r in zip(runs, ranks, strict=True)))
        name = job.nodes[int(node)] if node >= 0 else "unknown"
        key = f"dataloader_starvation:{name}"
        loader, words = loader_evidence(job, ranks, int(node))
        window = float(np.nan_to_num(nanmean(share[:, ranks], axis=0)).max())
        found[key] = Finding(
            key=key,
            bottleneck="dataloader_starvation",
            onset_ns=onset,
            step_share=float(np.clip(sh.max(), 0, 1)),
            confidence=float(min(1.0, 0.5 + sh.max())),
            ranks=[int(r) for r in ranks],
            nodes=[name],
            rank=int(ranks[0]) if len(ranks) == 1 else -1,
            step=int(win["step"][-1]),
            evidence={
                "data_wait_share": round(float(sh.max()), 4),
                "data_wait_share_window": round(window, 4),
                "data_wait_ms": round(float(nanmean(d["wait"][-k:, ranks])), 3),
                "step_time_ms": round(float(d["step_ms"][-k:].mean()), 3),
                "ranks": float(len(ranks)),
                **_node_evidence(job, int(node)),
                **loader,
            },
            summary=f"{len(ranks)} rank(s) on {name} wait for input {100 * sh.max():.0f}% "
            "of each step" + (f"; {words}" if words else ""),
            mark=_mark(st, key, loader, max(sh.max(), window) >= 2 * p.share_threshold),
        )
    replace_findings(job, "dataloader_starvation:", found)


def _mark(st: dict[str, Any], key: str, loader: dict[str, float], high: bool) -> str:
    """What makes a starvation diagnosis update at once: a change of workers together with
    what bounds them (once the new workers are judged: while they settle, the mark stays),
    and while the loop loads its own batches the share crossing twice the threshold (where the
    data rule acts by default: its first worker need not wait for the next update)."""
    marks = st.setdefault("marks", {})
    workers = loader.get("loader_workers", -1)
    if loader.get("loader_settling") and key in marks:
        return str(marks[key])
    mark = f"{workers:.0f}/{loader['loader_bound']:.0f}" + (
        f"/{int(high)}" if not workers >= 1 else ""
    )
    marks[key] = mark
    return mark


def _node_evidence(job: JobState, node: int) -> dict[str, float]:
    out = {}
    for key, name in (("iowait", "sys_iowait_pct"), ("cpu", "sys_cpu_pct")):
        v = job.node[key][node] if 0 <= node < len(job.node[key]) else np.nan
        if v == v:
            out[name] = float(v)
    return out


def _comm(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    st = job.det.setdefault(
        "comm", {"base": 0.0, "exp_base": 0.0, "learn": [], "learn_exp": [], "active": False}
    )
    if not (job.gpus or len(job.dev["node"]) or len(job.nodes) > 1):
        replace_findings(job, "comm_degradation", {})
        return
    pure, exposed = d["pure"], d["exposed"]
    for v, e in zip(pure[new], exposed[new], strict=True):
        if v != v:  # no collective or comm data for this step
            continue
        if st["base"] <= 0:
            st["learn"].append(float(v))
            st["learn_exp"].append(float(e))
            if len(st["learn"]) >= p.baseline_steps:
                st["base"] = float(np.median(st["learn"]))
                exp = np.asarray(st["learn_exp"], dtype=np.float64)[None, :]
                st["exp_base"] = float(np.nan_to_num(nanmedian(exp, 1)[0]))
                st["learn"], st["learn_exp"] = [], []
        elif v / st["base"] < 1 + (p.ratio_threshold - 1) / 2:  # healthy: track slow drift
            st["base"] += 0.05 * (v - st["base"])
            if e == e:
                st["exp_base"] += 0.05 * (e - st["exp_base"])
    found = {}
    if st["base"] > 0:
        ratio = nz(pure / st["base"])
        flag = ratio >= p.ratio_threshold
        run_on = int(trailing(flag))
        pers = _persistence(st.setdefault("persist", {}), p, 1)
        for i in np.flatnonzero(new):
            start = int(np.nanmin(step_start(win, i, slice(None))))
            pers.update(flag[i : i + 1], start=start, end=int(np.nanmax(win["end"][i])))
        st["active"] = bool(pers.active[0])
        if st["active"]:
            n = len(pure)
            k = int(min(max(run_on, 1), n))
            recent = slice(n - min(k, 4), None)
            step_ms = float(d["step_ms"][recent].mean())
            exp_now = float(nanmean(exposed[recent]))
            if exp_now == exp_now:
                extra = exp_now - st["exp_base"]
            else:
                extra = float(pure[recent].mean()) - st["base"]
            found["comm_degradation"] = Finding(
                key="comm_degradation",
                bottleneck="comm_degradation",
                onset_ns=int(np.min(step_start(win, n - k, slice(None)))),
                step_share=float(np.clip(extra / step_ms, 0, 1)),
                confidence=float(min(1.0, 0.5 + 0.25 * (ratio[recent].mean() - 1))),
                step=int(win["step"][-1]),
                evidence={
                    "comm_ms": round(float(pure[recent].mean()), 3),
                    "baseline_ms": round(st["base"], 3),
                    "ratio": round(float(ratio[recent].mean()), 3),
                    "slow_steps": float(run_on),
                    "step_time_ms": round(step_ms, 3),
                    **({"exposed_comm_ms": round(exp_now, 3)} if exp_now == exp_now else {}),
                },
                summary=f"collectives take {ratio[recent].mean():.1f}x their baseline "
                f"({pure[recent].mean():.1f} ms vs {st['base']:.1f} ms), not waiting on a rank",
            )
    replace_findings(job, "comm_degradation", found)


def _exposed(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    st = job.det.setdefault("exposed_comm", {"active": False})
    share = nz(d["exposed"] / d["step_ms"])
    flag = share >= p.share_threshold
    run_on = int(trailing(flag))
    pers = _persistence(st.setdefault("persist", {}), p, 1)
    for i in np.flatnonzero(new):
        start = int(np.nanmin(step_start(win, i, slice(None))))
        pers.update(flag[i : i + 1], start=start, end=int(np.nanmax(win["end"][i])))
    st["active"] = bool(pers.active[0])
    found = {}
    if st["active"]:
        n = len(share)
        k = int(min(max(run_on, 1), n))
        sh = float(share[-min(k, 4) :].mean())
        found["exposed_comm"] = Finding(
            key="exposed_comm",
            bottleneck="exposed_comm",
            onset_ns=int(np.min(step_start(win, n - k, slice(None)))),
            step_share=float(np.clip(sh, 0, 1)),
            confidence=float(min(1.0, 0.5 + sh)),
            step=int(win["step"][-1]),
            evidence={
                "exposed_comm_ms": round(float(d["exposed"][-min(k, 4) :].mean()), 3),
                "exposed_comm_share": round(sh, 4),
                "step_time_ms": round(float(d["step_ms"][-min(k, 4) :].mean()), 3),
            },
            summary=f"{100 * sh:.0f}% of each step is communication no rank hides",
        )
    replace_findings(job, "exposed_comm", found)


def _memory(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    if job.flags.get("rss"):  # a CPU job: its processes' RSS, judged over time
        rss_leak_detector(job, p, win)
        return
    st = job.det.setdefault("memory", {})
    mem = np.where(win["need"][None, :], win["mem"], np.nan)
    n, w = mem.shape
    active = _active(st, "active", w)[:w]
    if n < 2:
        return
    delta = np.diff(mem, axis=0)
    up = delta > 0
    if not up[-1].any() and not active.any():
        replace_findings(job, "memory_leak:", {})
        return
    run = trailing(up)
    slope = nanmedian(np.where(up, delta, np.nan)[-p.window_steps + 1 :], 0)
    grows = (run >= p.window_steps - 1) & (nz(slope) >= p.min_growth_bytes)
    flat = trailing(~up)  # steps without growth; and how long (RSS grows in chunks)
    flat_ns = win["end"][-1, :w] - step_start(win, np.clip(n - 1 - flat, 0, n - 1), np.arange(w))
    still = (flat < p.clear_steps) | ((flat < n - 1) & (flat_ns < p.clear_s * NS))
    st["active"][:w] = act = (active | grows) & still
    found = {}
    for r in np.flatnonzero(act):
        rate = float(np.nan_to_num(slope[r]))
        step_s = float(d["step_ms"][-1]) / 1000
        total = _device_total(job, int(r))
        peak = win["peak"][-1, r]
        used = float(peak if peak > 0 else mem[-1, r])
        headroom = max(0.0, total - used) if total > 0 else np.nan
        tto = headroom / rate * step_s if rate > 0 and headroom == headroom else np.nan
        k = int(min(max(run[r], 1), n - 1))
        ev = {
            "growth_bytes_per_step": round(rate, 1),
            "growth_bytes_per_s": round(rate / max(step_s, 1e-9), 1),
            "allocated_bytes": float(mem[-1, r]),
            "steps_growing": float(run[r]),
        }
        if tto == tto:
            ev.update(headroom_bytes=float(headroom), time_to_oom_s=round(float(tto), 2))
        found[f"memory_leak:r{r}"] = Finding(
            key=f"memory_leak:r{r}",
            bottleneck="memory_leak",
            onset_ns=int(step_start(win, n - k, r)),
            step_share=0.0,
            confidence=float(min(1.0, 0.5 + 0.5 * run[r] / (2 * p.window_steps))),
            ranks=[int(r)],
            nodes=node_of(job, int(r)),
            rank=int(r),
            step=int(win["step"][-1]),
            evidence=ev,
            summary=f"rank {r} keeps {rate / 2**20:.1f} MiB more each step"
            + (f"; out of memory in about {tto:.0f} s" if tto == tto else ""),
        )
    replace_findings(job, "memory_leak:", found)


def _device_total(job: JobState, rank: int) -> float:
    mine = job.dev["rank"] == rank
    total = float(job.dev["mem_total"][mine].max()) if mine.any() else 0.0
    return total if total > 0 else float(job.gpu_mem_bytes)
