"""A job's telemetry as a Chrome trace (the Trace Event Format that Perfetto and
``chrome://tracing`` open): `chrome_trace` builds it from warehouse rows, `check_trace` checks
one against the format's rules.

One process per rank (``rank N (node)``), and in it:

- thread 1, ``steps``: each step a complete (``X``) event from its start to its end, with its
  time, data wait, samples, tokens and loss;
- thread 2, ``phases``: the step's spans (data wait, forward, backward, optimizer, comm, …),
  nested by their depth;
- threads 3 and up, ``collectives``: each collective from the rank's arrival to its completion
  with its op, bytes and group (DDP's bucket all-reduces overlap: overlapping ones go on
  further threads, so each thread's events nest);
- counters (``C``): each GPU's SM use, memory and power, and the process's CPU use and RSS
  (the host sampler's rows for that rank).

Times are microseconds from the first row exported; ``otherData.start_unix_ns`` is that moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["check_trace", "chrome_trace"]

STEPS_TID, PHASES_TID, COMM_TID = 1, 2, 3

Row = Sequence[Any]


def _us(ns: int, t0: int) -> float:
    return round((ns - t0) / 1000.0, 3)


def _lanes(intervals: list[tuple[int, int, int]]) -> dict[int, int]:
    """Interval index → lane: the first lane whose last interval ended before this one starts
    (greedy, by start), so intervals on one lane never overlap.

    >>> _lanes([(0, 10, 0), (5, 12, 1), (11, 20, 2)])
    {0: 0, 1: 1, 2: 0}
    """
    ends: list[int] = []
    out: dict[int, int] = {}
    for start, end, i in sorted(intervals):
        for lane, last in enumerate(ends):
            if last <= start:
                ends[lane] = end
                out[i] = lane
                break
        else:
            out[i] = len(ends)
            ends.append(end)
    return out


def chrome_trace(
    job_id: str,
    *,
    steps: Iterable[Row] = (),
    spans: Iterable[Row] = (),
    collectives: Iterable[Row] = (),
    gpu: Iterable[Row] = (),
    host: Iterable[Row] = (),
) -> dict[str, Any]:
    """The Chrome trace of a job's rows, each an iterable of tuples as the warehouse gives them:

    - ``steps``: (rank, node, step, end_ns, step_time_ms, data_wait_ms, samples, tokens, loss)
    - ``spans``: (rank, step, start_ns, duration_ms, phase, name, depth)
    - ``collectives``: (rank, step, start_ns, duration_ms, op, size_bytes, group, group_size,
      dtype)
    - ``gpu``: (rank, node, device, ts_ns, sm_util_pct, mem_used_bytes, power_w)
    - ``host``: (rank, node, ts_ns, proc_cpu_pct, proc_rss_bytes)

    >>> t = chrome_trace("j", steps=[(0, "n0", 0, 2_000_000, 2.0, 0.5, 32, 0, 1.5)],
    ...                  spans=[(0, 0, 0, 0.5, "data_wait", "", 0), (0, 0, 500_000, 1.5,
    ...                          "forward", "", 0)])
    >>> [(e["name"], e["ts"], e["dur"]) for e in t["traceEvents"] if e["ph"] == "X"]
    [('step 0', 0.0, 2000.0), ('data_wait', 0.0, 500.0), ('forward', 500.0, 1500.0)]
    >>> check_trace(t)["steps"]
    1
    """
    steps, spans, collectives = list(steps), list(spans), list(collectives)
    gpu, host = list(gpu), list(host)
    starts = (
        [int(s[3]) - round(float(s[4]) * 1e6) for s in steps]
        + [int(s[2]) for s in spans]
        + [int(c[2]) for c in collectives]
        + [int(g[3]) for g in gpu]
        + [int(h[2]) for h in host]
    )
    t0 = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    nodes: dict[int, str] = {}
    for rank, node, *_ in steps:
        nodes.setdefault(int(rank), str(node))
    for rank, node, *_ in gpu:
        nodes.setdefault(int(rank), str(node))
    for rank, node, *_ in host:
        nodes.setdefault(int(rank), str(node))
    ranks = sorted(nodes.keys() | {int(s[0]) for s in spans} | {int(c[0]) for c in collectives})

    for rank, _node, step, end_ns, step_ms, wait_ms, samples, tokens, loss in steps:
        dur = float(step_ms) * 1000.0
        args = {"step": int(step), "step_time_ms": float(step_ms), "data_wait_ms": float(wait_ms),
                "samples": int(samples), "tokens": int(tokens)}  # fmt: skip
        if loss is not None:
            args["loss"] = float(loss)
        events.append({"name": f"step {int(step)}", "cat": "step", "ph": "X", "pid": int(rank),
                       "tid": STEPS_TID, "ts": _us(int(end_ns), t0) - round(dur, 3),
                       "dur": round(dur, 3), "args": args})  # fmt: skip
    # deeper spans after their parents at the same start: a viewer nests them in that order
    for rank, step, start, dur_ms, phase, name, depth in sorted(
        spans, key=lambda s: (int(s[0]), int(s[2]), int(s[6]))
    ):
        label = str(name) if phase == "user" and name else str(phase)
        events.append({"name": label, "cat": str(phase), "ph": "X", "pid": int(rank),
                       "tid": PHASES_TID, "ts": _us(int(start), t0),
                       "dur": round(float(dur_ms) * 1000.0, 3),
                       "args": {"step": int(step), "depth": int(depth),
                                "name": str(name)}})  # fmt: skip
    lanes_used: dict[int, int] = {}
    by_rank: dict[int, list[tuple[int, int, int]]] = {}
    for i, c in enumerate(collectives):
        start = int(c[2])
        by_rank.setdefault(int(c[0]), []).append((start, start + int(float(c[3]) * 1e6), i))
    lane_of: dict[int, int] = {}
    for rank, intervals in by_rank.items():
        lanes = _lanes(intervals)
        lane_of.update(lanes)
        lanes_used[rank] = max(lanes.values()) + 1
    for i, (rank, step, start, dur_ms, op, size, group, gsize, dtype) in enumerate(collectives):
        events.append({"name": str(op), "cat": "collective", "ph": "X", "pid": int(rank),
                       "tid": COMM_TID + lane_of[i], "ts": _us(int(start), t0),
                       "dur": round(float(dur_ms) * 1000.0, 3),
                       "args": {"step": int(step), "size_bytes": int(size), "group": str(group),
                                "group_size": int(gsize), "dtype": str(dtype)}})  # fmt: skip
    for rank, _node, device, ts, sm, mem, power in gpu:
        events.append({"name": f"gpu {int(device)}", "ph": "C", "pid": int(rank),
                       "ts": _us(int(ts), t0),
                       "args": {"sm_util_pct": float(sm), "mem_used_gib": int(mem) / 2**30,
                                "power_w": float(power)}})  # fmt: skip
    for rank, _node, ts, cpu, rss in host:
        events.append({"name": "process", "ph": "C", "pid": int(rank), "ts": _us(int(ts), t0),
                       "args": {"cpu_pct": float(cpu), "rss_gib": int(rss) / 2**30}})  # fmt: skip

    meta: list[dict[str, Any]] = []
    for rank in ranks:
        where = f" ({nodes[rank]})" if rank in nodes else ""
        name = "job" if rank < 0 else f"rank {rank}"
        meta.append({"name": "process_name", "ph": "M", "pid": rank,
                     "args": {"name": f"{name}{where}"}})  # fmt: skip
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                     "args": {"sort_index": rank}})  # fmt: skip
        threads = [(STEPS_TID, "steps"), (PHASES_TID, "phases")]
        threads += [(COMM_TID + k, "collectives" + (f" {k + 1}" if k else ""))
                    for k in range(lanes_used.get(rank, 0))]  # fmt: skip
        for tid, tname in threads:
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                         "args": {"name": tname}})  # fmt: skip
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                         "args": {"sort_index": tid}})  # fmt: skip
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"job_id": job_id, "start_unix_ns": t0, "made_by": "perfloop export"},
    }


_PHASES = {"X", "C", "M", "B", "E", "i", "I", "b", "e", "n"}


def check_trace(trace: Any) -> dict[str, int]:
    """Check ``trace`` against the Trace Event Format's rules that trace viewers rely on:
    a ``traceEvents`` list of objects, each with a known ``ph`` and integer ``pid``; timed
    events with a finite, non-negative ``ts``; complete events (``X``) with a non-negative
    ``dur`` and an integer ``tid``, and on each thread properly nested (an event that starts
    inside another ends inside it); counters with numeric ``args``. Raise ValueError with one
    line naming the first event that breaks a rule; return counts (events, steps, ranks).
    """
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a trace: no traceEvents list")
    open_by_thread: dict[tuple[int, int], list[float]] = {}
    xs: list[tuple[int, int, float, float, int]] = []
    steps, ranks = 0, set()
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict) or e.get("ph") not in _PHASES:
            raise ValueError(f"event {i}: no known ph")
        if not isinstance(e.get("pid"), int):
            raise ValueError(f"event {i}: pid is not an integer")
        if e["ph"] == "M":
            continue
        ts = e.get("ts")
        if not isinstance(ts, int | float) or ts != ts or ts < 0:
            raise ValueError(f"event {i} ({e.get('name')}): ts {ts!r} is not a time")
        if e["ph"] == "X":
            dur = e.get("dur")
            if not isinstance(dur, int | float) or dur != dur or dur < 0:
                raise ValueError(f"event {i} ({e.get('name')}): dur {dur!r}")
            if not isinstance(e.get("tid"), int):
                raise ValueError(f"event {i} ({e.get('name')}): tid is not an integer")
            xs.append((e["pid"], e["tid"], float(ts), float(ts) + float(dur), i))
            if e.get("cat") == "step":
                steps += 1
                ranks.add(e["pid"])
        elif e["ph"] == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not all(
                isinstance(v, int | float) for v in args.values()
            ):
                raise ValueError(f"event {i} ({e.get('name')}): a counter's args are not numbers")
    eps = 1e-3  # the microsecond rounding of the times
    for pid, tid, start, end, i in sorted(xs, key=lambda x: (x[0], x[1], x[2], -x[3])):
        stack = open_by_thread.setdefault((pid, tid), [])
        while stack and stack[-1] <= start + eps:
            stack.pop()
        if stack and end > stack[-1] + eps:
            raise ValueError(
                f"event {i} on pid {pid} tid {tid} overlaps another without nesting in it"
            )
        stack.append(end)
    return {"events": len(trace["traceEvents"]), "steps": steps, "ranks": len(ranks)}
