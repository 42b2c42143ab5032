"""Scale: the stream tier with 1, 2 and 3 workers on the embedded stack — CPU per sample per
worker, window coverage and duplicates, and what a takeover costs.

    python bench/scale.py                                # 1, 2, 3 workers; 8 jobs; 20k samples/s
    python bench/scale.py --workers 1,3 --rate 40000 --steady-s 45

For each worker count a private embedded stack (``PERFLOOP_STREAM_WORKERS``) takes ``--jobs``
simulated jobs (4 ranks each; half healthy, half with a fault) publishing together at
``--rate`` samples/s. After a warm-up, ``--steady-s`` seconds are measured: the CPU seconds
of every stream worker (from /proc) over the samples published, and how evenly the workers
share them. Then the first worker is SIGKILLed (the supervisor restarts it) and, with more
than one worker, its partitions move to the others: the takeover is the time from the kill
until every job has a 1 s window closed after it again (the sink's fast flush included); a
job whose partition did not move counts too, so with one worker it is the restart's cost.
After ``--after-s`` more seconds the jobs stop; from the warehouse: the step samples the 1 s
windows cover (each window once), the windows emitted twice, and where they closed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/scale.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import free_port, isolate_env, raise_on_sigterm, save_result, say

NS = 1_000_000_000
FAULTS = ("dataloader_starvation", "straggler", "thermal_throttle", "comm_degradation")


@contextlib.contextmanager
def _stack(workers: int) -> Iterator[Any]:
    from perfloop.settings import StackSettings

    home = Path(tempfile.mkdtemp(prefix=f"perfloop-scale-{workers}-"))
    env = isolate_env(home, free_port(), free_port())
    env |= {"PERFLOOP_STREAM_WORKERS": str(workers), "PERFLOOP_METRICS_PORT": str(free_port())}
    os.environ.update(env)
    cli = [sys.executable, "-m", "perfloop.cli"]
    subprocess.run([*cli, "up", "--detach"], env=env, check=True, cwd=home.parent)
    try:
        yield StackSettings()
    finally:
        subprocess.run([*cli, "down"], env=env, check=False, cwd=home.parent)
        say(f"  logs in {home / 'logs'}")


def _workers(settings: Any) -> dict[str, int]:
    from perfloop.stack import read_state

    state = read_state(settings) or {}
    return {
        n: int(s["pid"])
        for n, s in state.get("services", {}).items()
        if n.split("-")[0] == "streams"
    }


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:13]) / os.sysconf("SC_CLK_TCK")


def _rows(settings: Any, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    from perfloop.warehouse import client

    ch = client(settings)
    try:
        return [tuple(r) for r in ch.query(sql, parameters=params).result_rows]
    finally:
        ch.close()


def run_one(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    from perfloop.producers import Publisher
    from perfloop.producers.scenarios import scenario_config
    from perfloop.producers.simulator import SimConfig, SimulatedJob

    run = uuid.uuid4().hex[:6]
    total_s = args.warmup_s + args.steady_s + args.after_s + 30
    with _stack(workers) as settings:
        pub = Publisher(settings, producer_id=f"scale-{run}")
        jobs = []
        for i in range(args.jobs):
            scenario = "healthy" if i % 2 == 0 else FAULTS[(i // 2) % len(FAULTS)]
            shape = {"job_id": f"scale-{run}-{i}-{scenario}", "nodes": 1, "ranks_per_node": 4}
            pace = args.rate / args.jobs / SimConfig(**shape).natural_rate
            sim_s = total_s * pace
            cfg = scenario_config(
                scenario, **shape, duration_s=sim_s, seed=i, rate=args.rate / args.jobs,
                # event time ends before the start: a sped-up clock never runs ahead of ours
                t0_ns=time.time_ns() - int(2 * sim_s * NS),
            )  # fmt: skip
            jobs.append(SimulatedJob(cfg, pub))
        stop = threading.Event()
        threads = [
            threading.Thread(target=j.run, args=(1e9,), kwargs={"stop": stop.is_set}, daemon=True)
            for j in jobs
        ]
        for t in threads:
            t.start()
        time.sleep(args.warmup_s)
        pids = _workers(settings)
        cpu0 = {n: _cpu_s(p) for n, p in pids.items()}
        s0, t0 = sum(j.samples for j in jobs), time.monotonic()
        time.sleep(args.steady_s)
        cpu1 = {n: _cpu_s(p) for n, p in pids.items()}
        s1, t1 = sum(j.samples for j in jobs), time.monotonic()
        samples = s1 - s0
        cpu = {n: cpu1[n] - cpu0[n] for n in pids}
        say(
            f"  {workers} worker(s): {samples / (t1 - t0):,.0f} samples/s; worker CPU "
            + ", ".join(f"{n} {v / (t1 - t0):.2f} cores" for n, v in cpu.items())
        )
        # the takeover: the first worker killed
        killed_at = time.time_ns()
        os.kill(pids["streams"], signal.SIGKILL)
        ids = [j.cfg.job_id for j in jobs]

        def resumed() -> bool:
            (n,) = _rows(
                settings,
                "SELECT uniqExact(job_id) FROM windows WHERE job_id IN {j:Array(String)} AND "
                "metric = 'step_time_ms' AND window_s = 1 AND closed > fromUnixTimestamp64Nano"
                "({k:Int64})",
                j=ids,
                k=killed_at,
            )[0]
            return n == len(ids)

        deadline = time.monotonic() + 120
        while not resumed() and time.monotonic() < deadline:
            time.sleep(0.25)
        takeover_s = (time.time_ns() - killed_at) / NS
        say(f"  takeover: every job's windows closing again {takeover_s:.1f} s after the kill")
        time.sleep(args.after_s)
        stop.set()
        for t in threads:
            t.join(30)
        pub.flush(30)
        pub.close()
        time.sleep(15)  # the last windows close and land
        steps, covered = _rows(
            settings,
            "SELECT (SELECT count() FROM steps WHERE job_id IN {j:Array(String)}), "
            "(SELECT sum(c) FROM (SELECT any(count) AS c FROM windows WHERE job_id IN "
            "{j:Array(String)} AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1 "
            "GROUP BY job_id, node, rank, device, ts))",
            j=ids,
        )[0]
        twice = _rows(
            settings,
            "SELECT (toUnixTimestamp64Nano(min(closed)) - {k:Int64}) / 1e9 FROM windows WHERE "
            "job_id IN {j:Array(String)} AND metric = 'step_time_ms' AND window_s = 1 AND "
            "hop_s = 1 GROUP BY job_id, node, rank, device, ts HAVING count() > 1",
            j=ids,
            k=killed_at,
        )
        moved = sum(
            (settings.home_dir / "logs" / f"{n}.log").read_text().count("restored from its")
            for n in pids
        )
    out = {
        "workers": workers,
        "jobs": args.jobs,
        "samples_per_s": samples / (t1 - t0),
        "worker_cores": {n: v / (t1 - t0) for n, v in cpu.items()},
        "cpu_us_per_sample": sum(cpu.values()) / max(samples, 1) * 1e6,
        "takeover_s": takeover_s,
        "step_samples": steps,
        "coverage": covered / max(steps, 1),
        "windows_twice": len(twice),
        "twice_closed_s_from_kill": [round(float(t), 2) for (t,) in twice[:20]],
        "restores": moved,
    }
    at = [float(t) for (t,) in twice] or [0.0]
    say(
        f"  coverage {covered}/{steps} = {out['coverage']:.5f}; {len(twice)} windows twice "
        f"(closed {min(at):.1f}..{max(at):.1f} s from the kill); {moved} partition restores"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", default="1,2,3", help="worker counts to measure (1,2,3)")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--rate", type=float, default=20_000.0, help="samples/s, all jobs together")
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--steady-s", type=float, default=40.0)
    p.add_argument("--after-s", type=float, default=20.0)
    args = p.parse_args(argv)
    raise_on_sigterm()
    results = []
    for n in (int(w) for w in args.workers.split(",")):
        say(f"{n} stream worker(s), {args.jobs} jobs at {args.rate:,.0f} samples/s")
        results.append(run_one(args, n))
    save_result("scale", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
