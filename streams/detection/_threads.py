"""Thread oversubscription: a rank runs more threads than the CPUs it may use.

Each rank's job info says its intra-op threads (``torch.num_threads``) and its CPU budget
(``cpu_budget``: its affinity and its container's quota, shared among the launcher's local
ranks; an older producer's affinity or node CPUs over its local ranks). Its host samples say
how much CPU its loader workers burn (``loader_cpu_pct``, 100 = one core), counting no more
workers than its steps say the loader runs (``num_workers``: the sampler sees every child
process of the rank, and a process the script started beside its loader is none). A rank is
oversubscribed when its threads plus the cores its loader workers keep busy exceed its budget
while compute is a large share of its step (at least ``min_compute_share``: the threads are
what the step waits for). Loader workers that wait on storage burn little CPU and count for
what they burn; without host samples each worker counts as a core. Workers that just started
(the sampler has not measured them yet) leave the rank unjudged until their next readings:
a new worker is not a busy core, and perfloop's own loader change must not read as
oversubscription.

Parallel ops then wait for descheduled threads: the step slows by about the share of compute
the extra threads cost, ``compute share × (1 − budget / (threads + loader cores))``, which is
the diagnosis's step share. One diagnosis per node (level host), naming its oversubscribed
ranks, once the condition has held ``persist_steps`` steps; it resolves after ``clear_steps``
steps without it (a change of threads is republished in the job info at once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.streams.detection._common import nanmean, replace_findings, step_start
from perfloop.streams.detection.job_state import Finding, JobState

__all__ = ["thread_detector"]


def thread_detector(job: JobState, p: Any, win: dict, d: dict, new: np.ndarray) -> None:
    """Update the job's ``thread_oversubscription:<node>`` findings."""
    rk = job.rank
    w = d["st"].shape[1]
    threads, budget = rk["threads"][:w], rk["budget"][:w]
    known = (threads >= 1) & (budget >= 1)
    st = job.det.setdefault("threads", {})
    if not known.any():
        replace_findings(job, "thread_oversubscription:", {})
        return
    # the loader runs the workers its steps say (the host sees every child process of the rank:
    # a tool or a compiler the script started is no loader worker)
    seen, said = rk["loader_workers"][:w], rk["num_workers"][:w]
    workers = np.nan_to_num(np.where(said >= 0, np.minimum(seen, said), seen))
    unmeasured = np.isnan(rk["loader_cpu"][:w])
    cores = np.where(unmeasured, workers, rk["loader_cpu"][:w] / 100.0)
    load = threads + np.minimum(cores, workers)
    # workers the host sampler sees but has not measured yet (they just started: perfloop or
    # the script changed their count) are judged on their next readings, not as full cores;
    # threads past the budget on their own need no reading of the workers
    settling = unmeasured & (workers >= 1) & ~np.isnan(rk["proc_cpu"][:w])
    settling &= ~(threads > budget + 0.5)
    k = min(len(d["st"]), 3)
    with np.errstate(all="ignore"):
        busy = d["comp"][-k:] / d["st"][-k:]
        compute = nanmean(np.where(np.isnan(busy), 1.0 - d["share"][-k:], busy), axis=0)
    over = known & (load > budget + 0.5) & (compute >= p.min_compute_share)
    run = _count(st, "on", w, over & ~settling, new, hold=settling)
    off = _count(st, "off", w, ~over & ~settling, new, hold=settling)
    active = st.setdefault("active", np.zeros(0, dtype=bool))
    if len(active) < w:
        active = st["active"] = np.concatenate([active, np.zeros(w - len(active), bool)])
    active[:w] = (active[:w] | (run >= p.persist_steps)) & ~(off >= p.clear_steps)
    found = {}
    node_of = rk["node"][:w]
    for node in np.unique(node_of[active[:w]]):
        ranks = np.flatnonzero(active[:w] & (node_of == node))
        name = job.nodes[int(node)] if node >= 0 else "unknown"
        r0 = int(ranks[np.argmin(budget[ranks])])
        share = float(np.nanmax(compute[ranks] * (1.0 - budget[ranks] / load[ranks])))
        key = f"thread_oversubscription:{name}"
        n = len(win["step"])
        found[key] = Finding(
            key=key,
            bottleneck="thread_oversubscription",
            onset_ns=int(np.min(step_start(win, max(0, n - int(run[ranks].max())), ranks))),
            step_share=float(np.clip(share, 0, 1)),
            confidence=0.8,
            ranks=[int(r) for r in ranks],
            nodes=[name],
            rank=int(ranks[0]) if len(ranks) == 1 else -1,
            step=int(win["step"][-1]),
            evidence={
                "num_threads": float(threads[r0]),
                "cpu_budget": float(budget[r0]),
                "loader_workers": float(workers[r0]),
                "loader_cores": round(float(np.minimum(cores, workers)[r0]), 3),
                "compute_share": round(float(compute[r0]), 4),
                "by_script": float(rk["by_script"][r0]),
                "ranks": float(len(ranks)),
            },
            summary=f"{len(ranks)} rank(s) on {name} run {threads[r0]:.0f} threads"
            + (f" and {workers[r0]:.0f} loader workers" if workers[r0] else "")
            + f" on {budget[r0]:.0f} CPU(s) each while compute is {100 * compute[r0]:.0f}% "
            "of the step: parallel ops wait for descheduled threads",
        )
    replace_findings(job, "thread_oversubscription:", found)


def _count(
    st: dict[str, Any], key: str, w: int, cond: np.ndarray, new: np.ndarray, *, hold: Any = False
) -> Any:
    """Consecutive new steps each rank had ``cond`` (the condition of the latest state); a rank
    in ``hold`` keeps its count (neither condition can be judged now)."""
    a = st.get(key)
    if a is None or len(a) < w:
        old = a if a is not None else np.zeros(0, dtype=np.int64)
        a = st[key] = np.concatenate([old, np.zeros(w - len(old), dtype=np.int64)])
    steps = int(new.sum())
    a[:w] = np.where(hold, a[:w], np.where(cond, a[:w] + steps, 0))
    return a[:w]
