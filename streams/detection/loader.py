"""What keeps a starved rank's loader from keeping up: its workers wait on storage, or compute.

The host sampler reports each rank's loader workers, the CPU they burn together
(``loader_cpu_pct``, 100 = one core; smoothed in `JobState`) and their memory. A worker busy
most of the wall time computes (``loader_cpu_pct / (100 × workers) ≥ busy_util``): the loader
is **CPU-bound**, and so it is when the rank's own processes keep its whole CPU budget busy
while the workers get at least ``contended_util`` of a core each (on a full budget a worker
cannot burn more than its share). Otherwise the workers wait — on storage, a network file
system, a remote store: the loader is **I/O-bound**, and more workers than CPUs help. With no
workers the loading runs in the training loop and there is no such signal. Nor is there one
just after the workers changed: their CPU counts only from the second host reading of the new
count on (`JobState`: a new worker's first reading covers its start), and until then the loader
is not judged (``loader_settling``).

`loader_evidence` gives the starvation diagnosis its loader facts (``loader_bound``: 1 I/O,
2 CPU, 0 unknown) and the words for its summary; the data-wait rule acts on them.

Public through `perfloop.streams.detection`: the data-wait rule reads the verdict.
"""

from __future__ import annotations

import numpy as np

from perfloop.streams.detection.job_state import JobState

__all__ = ["BOUND_CPU", "BOUND_IO", "BOUND_UNKNOWN", "loader_evidence"]

BOUND_UNKNOWN, BOUND_IO, BOUND_CPU = 0.0, 1.0, 2.0
BUSY_UTIL = 0.5
CONTENDED_UTIL = 0.25
FULL_BUDGET = 0.85


def _mean(a: np.ndarray) -> float:
    a = a[~np.isnan(a)]
    return float(a.mean()) if len(a) else np.nan


def loader_evidence(job: JobState, ranks: np.ndarray, node: int) -> tuple[dict[str, float], str]:
    """The loader facts of ``ranks`` (on ``node``) and a phrase saying what bounds it."""
    rk, nd = job.rank, job.node
    ranks = ranks[ranks < len(rk["loader_workers"])]
    ev: dict[str, float] = {}
    workers = _mean(rk["loader_workers"][ranks])
    cpu = _mean(rk["loader_cpu"][ranks])
    proc = _mean(rk["proc_cpu"][ranks])
    budget = float(np.nanmin(rk["budget"][ranks])) if (rk["budget"][ranks] >= 1).any() else np.nan
    rss = _mean(rk["loader_rss"][ranks])
    for name, v in (
        ("loader_workers", workers),
        ("loader_cpu_pct", cpu),
        ("proc_cpu_pct", proc),
        ("cpu_budget", budget),
        ("loader_rss_bytes", rss),
    ):
        if v == v:
            ev[name] = round(v, 3)
    if 0 <= node < len(nd["mem_total"]):
        used, total = float(nd["mem_used"][node]), float(nd["mem_total"][node])
        if total == total and total > 0:
            ev.update(sys_mem_used_bytes=used, sys_mem_total_bytes=total)
    bound, words = BOUND_UNKNOWN, ""
    if workers == workers and workers >= 1 and cpu != cpu:
        ev["loader_settling"] = 1.0
        words = f"its {workers:.0f} loader worker(s) just started: judged on the next readings"
    if workers == workers and workers >= 1 and cpu == cpu:
        util = cpu / (100.0 * workers)
        own = (cpu + (proc if proc == proc else 0.0)) / 100.0
        full = budget == budget and own >= FULL_BUDGET * budget
        ev["loader_util"] = round(util, 4)
        if util >= BUSY_UTIL or (full and util >= CONTENDED_UTIL):
            bound = BOUND_CPU
            words = (
                f"its {workers:.0f} loader worker(s) compute ({100 * util:.0f}% of a core each"
                + (f", the rank's {budget:.0f} CPU(s) busy" if full else "")
                + "): CPU-bound"
            )
        else:
            bound = BOUND_IO
            busy = nd["cpu"][node] if 0 <= node < len(nd["cpu"]) else np.nan
            words = f"its {workers:.0f} loader worker(s) use {100 * util:.0f}% of a core each: " + (
                f"I/O-bound, they wait (on storage, or for a CPU: the host is {busy:.0f}% busy)"
                if busy >= 90
                else "I/O-bound, they wait on storage"
            )
    ev["loader_bound"] = bound
    return ev, words
