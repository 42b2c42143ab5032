"""Soak: the stream worker's and the sink's memory over a long run at a steady rate, and the
latency from a window's close to its row in the warehouse.

    python bench/soak.py                       # 10 minutes at 100k samples/s
    python bench/soak.py --minutes 2 --rate 50000

A private embedded stack (as in bench/e2e.py). ``--jobs`` simulated jobs (scenario
``--scenario``, faults included) publish together at ``--rate`` samples/s for ``--minutes``.
Every ``--every-s`` seconds the RSS of the stream worker and of the sink is read from /proc.
Each minute: the cores each service used and the host's steal (the share of the machine's
time a virtual machine's host took for others; a minute with high steal was slow for reasons
outside the stack). Reported: RSS at each sample; the least-squares slope of RSS over the
run after the first ``--warmup-min`` minutes (MiB per minute) and the growth from the end of
the warm-up to the end; the samples that reached the warehouse and the step samples the 1 s
windows cover (every one, unless the stream worker dropped or rejected some); how fast the
jobs' clocks ran against the planned pace; and, from the ``windows``
table, the seconds from each window's close in the stream worker (``closed``) to its row
being inserted (``inserted``) — p50/p99/max — and from the window's end plus the allowed
lateness (the moment it may close) to its row.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/soak.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench._common import (
    embedded_stack,
    host_cpu_ticks,
    raise_on_sigterm,
    rss_bytes,
    save_result,
    say,
    service_cpu_s,
)

NS = 1_000_000_000
SETTLE_S = 20.0
SETTLE_MAX_S = 180.0
PUBLISHER_COUNTS = ("broker_losses", "resent", "dropped", "dropped_samples", "failed", "spooled",
                    "replayed")  # fmt: skip


def _pids(settings: Any) -> dict[str, int]:
    from perfloop.stack import read_state

    state = read_state(settings)
    assert state is not None, "the stack is not up"
    wanted = ("streams", "sink", "broker")
    return {n: int(s["pid"]) for n, s in state["services"].items() if n in wanted}


_Mark = tuple[float, dict[str, float], tuple[int, int]]


def _cpu_mark(home: Any) -> _Mark:
    return time.monotonic(), service_cpu_s(home), host_cpu_ticks()


def _cpu_since(mark: _Mark, home: Any) -> tuple[dict[str, Any], _Mark]:
    """Cores each service used since ``mark``, and the share of the machine's time its host
    took away (steal): a slow minute with high steal says the machine, not the stack, was
    slow. Also the mark to measure the next interval from."""
    now = _cpu_mark(home)
    (t0, cpu0, (steal0, total0)), (t1, cpu1, (steal1, total1)) = mark, now
    dt = max(t1 - t0, 1e-9)
    # a service that restarted (the broker, recycled) counts from its new process's start
    used = {k: v - cpu0.get(k, 0.0) if v >= cpu0.get(k, 0.0) else v for k, v in cpu1.items()}
    cores = {k: v / dt for k, v in used.items() if k != "actuator"}
    steal = (steal1 - steal0) / max(total1 - total0, 1)
    return {"cores": cores, "seconds": dt, "steal_share": steal}, now


def run(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from perfloop.producers import Publisher
    from perfloop.producers.scenarios import scenario_config
    from perfloop.producers.simulator import SimConfig, SimulatedJob
    from perfloop.settings import StreamsSettings
    from perfloop.stack import read_state
    from perfloop.warehouse import client

    run_id = uuid.uuid4().hex[:6]
    duration = args.minutes * 60
    pub = Publisher(settings, producer_id=f"soak-{run_id}")
    jobs = []
    for j in range(args.jobs):
        shape = {"job_id": f"soak-{run_id}-j{j}", "nodes": args.nodes, "ranks_per_node": args.ranks}
        pace = args.rate / args.jobs / SimConfig(**shape).natural_rate
        sim_s = duration * pace  # simulated seconds the run covers: faults fall inside it
        cfg = scenario_config(
            args.scenario,
            **shape,
            duration_s=sim_s,
            seed=j,
            rate=args.rate / args.jobs,
            # Event time ends well before the soak's start at the planned pace: a job slowed by
            # its faults makes fewer samples per simulated second, so at a fixed sample rate its
            # clock runs ahead of the plan (29 % in 10 minutes at 100k samples/s), and the
            # stream worker rejects what is more than `max_skew_s` ahead of its own clock.
            t0_ns=time.time_ns() - int(2 * sim_s * NS),
        )
        jobs.append(SimulatedJob(cfg, pub))
    stop = threading.Event()
    deadline = time.monotonic() + duration

    def drive(job: Any) -> None:
        job.run(1e9, stop=lambda: stop.is_set() or time.monotonic() > deadline)

    threads = [threading.Thread(target=drive, args=(j,), daemon=True) for j in jobs]
    say(
        f"soak: {args.jobs} jobs × {args.nodes} nodes × {args.ranks} ranks ({args.scenario}) at "
        f"{args.rate:,.0f} samples/s for {args.minutes:g} min; RSS every {args.every_s:g} s"
    )
    pids = _pids(settings)
    series: dict[str, list[tuple[float, int]]] = {n: [] for n in pids}
    restarts: dict[str, int] = {}  # services (not the broker) that had to be restarted
    t0 = time.monotonic()
    mark = _cpu_mark(settings.home_dir)
    minutes: list[dict[str, Any]] = []
    counted = 0  # samples generated up to the last minute's mark
    for t in threads:
        t.start()
    try:
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            for name, pid in _pids(settings).items():
                if pid != pids[name]:
                    say(f"  ! {name} restarted (pid {pids[name]} → {pid})")
                    pids[name] = pid
                    if name != "broker":  # the broker is recycled on purpose; the rest crash
                        restarts[name] = restarts.get(name, 0) + 1
                try:
                    series[name].append((now, rss_bytes(pid)))
                except (OSError, RuntimeError):  # gone, its replacement not recorded yet
                    say(f"  ! {name} (pid {pid}) is gone; the supervisor restarts it")
            if len(series["streams"]) % max(1, int(60 / args.every_s)) == 1:
                samples = sum(j.samples for j in jobs)
                line = (
                    f"  {now:6.0f} s: {samples / max(now, 1e-9):9,.0f} samples/s generated; RSS "
                    + ", ".join(
                        f"{n} {series[n][-1][1] / 2**20:.0f} MiB" for n in series if series[n]
                    )
                )
                if now >= args.every_s:  # not at the start: nothing to measure yet
                    minute, mark = _cpu_since(mark, settings.home_dir)
                    minute["samples"] = samples - counted
                    counted = samples
                    minutes.append(minute)
                    line += "; cores " + ", ".join(
                        f"{k} {v:.2f}" for k, v in minute["cores"].items()
                    )
                    line += f"; host steal {minute['steal_share']:.0%}"
                say(line)
            time.sleep(args.every_s)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    left = pub.flush(120)  # what a recycle in the last minute left in the spool goes out too
    pub_stats = pub.stats
    pub.close()  # before the stack goes down, or its thread reports the broker lost
    say(
        f"  publisher at the end: {left} message(s) not delivered; broker losses "
        f"{pub_stats.broker_losses}, resent {pub_stats.resent:,}, dropped {pub_stats.dropped} "
        f"({pub_stats.dropped_samples:,} samples), failed {pub_stats.failed}"
    )
    samples = sum(j.samples for j in jobs)
    elapsed = time.monotonic() - t0
    job_ids = [j.cfg.job_id for j in jobs]
    ahead = max(j.clock_s for j in jobs) / max(j.pace * elapsed for j in jobs)
    say(f"  the jobs' clocks ran {ahead:.2f}× the planned pace (event time ends before the start)")
    lateness = StreamsSettings().allowed_lateness_s
    time.sleep(lateness + 5)  # the last windows close and land
    ch = client(settings)
    try:
        q = {"jobs": job_ids}

        def landed() -> int:
            return int(ch.query(
                "SELECT (SELECT count() FROM steps WHERE job_id IN {jobs:Array(String)}) + "
                "(SELECT count() FROM gpu_samples WHERE job_id IN {jobs:Array(String)}) + "
                "(SELECT count() FROM host_samples WHERE job_id IN {jobs:Array(String)}) + "
                "(SELECT count() FROM spans WHERE job_id IN {jobs:Array(String)}) + "
                "(SELECT count() FROM collectives WHERE job_id IN {jobs:Array(String)})",
                parameters=q,
            ).result_rows[0][0])  # fmt: skip

        # Late rows (a recycle in the last minute: what was resent lands after the end) are
        # told from lost ones: the count is read again until it reaches the samples or has
        # not moved for SETTLE_S (at most SETTLE_MAX_S).
        at_end = rows = landed()
        since, settle_t0 = time.monotonic(), time.monotonic()
        while rows < samples and time.monotonic() - settle_t0 < SETTLE_MAX_S:
            time.sleep(2)
            now_rows = landed()
            if now_rows != rows:
                rows, since = now_rows, time.monotonic()
            elif time.monotonic() - since >= SETTLE_S:
                break
        settled_s = time.monotonic() - settle_t0
        say(f"  rows landed: {at_end:,} at the first count, {rows:,} {settled_s:.0f} s later "
            f"(of {samples:,} generated)")  # fmt: skip
        steps, covered = ch.query(
            "SELECT (SELECT count() FROM steps WHERE job_id IN {jobs:Array(String)}), "
            "(SELECT sum(count) FROM windows WHERE job_id IN {jobs:Array(String)} "
            "AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1)",
            parameters=q,
        ).result_rows[0]
        lat = ch.query(
            "SELECT toUnixTimestamp64Nano(inserted) - toUnixTimestamp64Nano(closed), "
            "toUnixTimestamp64Nano(inserted) - toUnixTimestamp64Nano(window_end), "
            "toUnixTimestamp64Nano(inserted) "
            "FROM windows WHERE job_id IN {jobs:Array(String)} AND window_s = 1",
            parameters=q,
        ).result_rows
    finally:
        ch.close()
    close_to_row = np.array([r[0] for r in lat], dtype=float) / NS
    end_to_row = np.array([r[1] for r in lat], dtype=float) / NS - lateness
    inserted = np.array([r[2] for r in lat], dtype=np.int64)
    out: dict[str, Any] = {
        "samples": samples,
        "samples_per_s": samples / elapsed,
        "rows_landed": rows,
        "rows_landed_at_first_count": at_end,
        "settle_s": settled_s,
        "publisher_undelivered": left,
        "publisher": {k: getattr(pub_stats, k) for k in PUBLISHER_COUNTS},
        "service_restarts": restarts,
        "windows_1s": len(lat),
        "step_samples": steps,
        "step_samples_windowed": covered,
        "clock_vs_plan": ahead,
        "cpu_by_minute": minutes,
    }

    def q3(a: np.ndarray) -> dict[str, float]:
        if not len(a):
            return {}
        p50, p99 = np.percentile(a, [50, 99])
        return {"p50_s": float(p50), "p99_s": float(p99), "max_s": float(a.max())}

    out["close_to_row"] = q3(close_to_row)
    state = read_state(settings) or {}
    out["broker_recycling"] = state.get("broker_recycling")
    per_sample = [
        {k: v * m["seconds"] / m["samples"] * 1e6 for k, v in m["cores"].items()}
        for m in minutes
        if m.get("samples")
    ]
    out["cpu_us_per_sample_by_minute"] = per_sample
    if per_sample:
        say(
            "  broker CPU µs per sample by minute: "
            + ", ".join(f"{m.get('broker', float('nan')):.1f}" for m in per_sample)
        )
        say(
            "  stack CPU µs per sample by minute: "
            + ", ".join(f"{sum(m.values()):.1f}" for m in per_sample)
        )
    if out["broker_recycling"]:
        say(f"  broker recycling: {out['broker_recycling']}")
    if restarts:
        say(f"  ! services the supervisor had to restart: {restarts}")
    if len(inserted) and (inserted.max() - inserted.min()) >= 20 * 60 * NS:
        first = close_to_row[inserted < inserted.min() + 10 * 60 * NS]
        last = close_to_row[inserted > inserted.max() - 10 * 60 * NS]
        out["close_to_row_first_10_min"], out["close_to_row_last_10_min"] = q3(first), q3(last)
        say(
            f"  window close → row p99: first 10 min {q3(first)['p99_s']:.2f} s, last 10 min "
            f"{q3(last)['p99_s']:.2f} s"
        )
    if len(inserted):  # the tail minute by minute: a steady tail or bursts?
        minute = (inserted - inserted.min()) // (60 * NS)
        out["close_to_row_by_minute"] = [
            q3(close_to_row[minute == m]) for m in range(int(minute.max()) + 1)
        ]
        say(
            "  window close → row p99 by minute: "
            + ", ".join(
                f"{d.get('p99_s', float('nan')):.2f}" for d in out["close_to_row_by_minute"]
            )
        )
    # Only where the jobs' event time runs at wall speed is a window's end a wall-clock time.
    out["event_time_pace"] = pace
    out["may_close_to_row"] = q3(end_to_row) if pace <= 1.05 else {}
    if pace > 1.05:
        say(
            f"  (event time ran {pace:.1f}× wall speed: window end → row is not a wall-clock "
            "latency, not reported; use --jobs so that --rate / jobs is a job's natural rate)"
        )
    say(
        f"  generated {samples:,} samples ({samples / elapsed:,.0f}/s), {rows:,} rows landed; "
        f"{len(lat):,} 1 s window rows, covering {int(covered or 0):,} of {steps:,} step samples"
    )
    for name, s in series.items():
        t = np.array([x[0] for x in s]) / 60
        m = np.array([x[1] for x in s]) / 2**20
        keep = t >= args.warmup_min
        slope = float(np.polyfit(t[keep], m[keep], 1)[0]) if keep.sum() >= 3 else float("nan")
        growth = float(m[keep][-1] - m[keep][0]) if keep.any() else float("nan")
        out[f"rss_{name}"] = {
            "mib": [round(float(v), 1) for v in m],
            "minutes": [round(float(v), 2) for v in t],
            "slope_mib_per_min_after_warmup": slope,
            "growth_mib_after_warmup": growth,
            "max_mib": float(m.max()),
        }
        say(
            f"  {name}: RSS {m[0]:.0f} → {m[-1]:.0f} MiB (max {m.max():.0f}); after "
            f"{args.warmup_min:g} min warm-up: slope {slope:+.2f} MiB/min, growth {growth:+.1f} MiB"
        )
    for what, key in (
        ("window close", "close_to_row"),
        ("window end + lateness", "may_close_to_row"),
    ):
        d = out[key]
        if d:
            say(
                f"  {what} → row in the warehouse: p50 {d['p50_s']:.2f} s, p99 {d['p99_s']:.2f} s, "
                f"max {d['max_s']:.2f} s"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=100_000.0, help="samples/s, all jobs together")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--scenario", default="mixed")
    p.add_argument("--every-s", type=float, default=10.0)
    p.add_argument("--warmup-min", type=float, default=2.0)
    p.add_argument(
        "--broker-recycle-mb",
        type=float,
        default=None,
        help="PERFLOOP_BROKER_RECYCLE_MB for the stack (default: the setting's; 0: never)",
    )
    args = p.parse_args(argv)
    raise_on_sigterm()
    result: dict[str, Any] = {"bench": "soak", "args": vars(args), "cpus": os.cpu_count()}
    extra = {}
    if args.broker_recycle_mb is not None:
        extra["PERFLOOP_BROKER_RECYCLE_MB"] = str(args.broker_recycle_mb)
    with embedded_stack(say, extra):
        from perfloop.settings import StackSettings

        result.update(run(args, StackSettings()))
    save_result("soak", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
