"""Where a healthy job's slowdown under `perfloop run` comes from (issue 21).

`realworld.py` measures a healthy job's steps/s under ``perfloop run --tier observe`` against
the plain run; this bench splits that ratio. The same job (a scenario of
`bench/realworld_jobs`, by default ``healthy_ddp``: 2 DDP ranks over gloo on this machine's
CPUs) runs plain and under ``perfloop run --tier observe``, alternating, while parts of
perfloop are taken away in turn:

- ``full``: everything, as a user runs it;
- ``no_history``: the warehouse and the sink paused (SIGSTOP) for the pair: what storing
  the job's telemetry costs it;
- ``broker_only``: the stream worker and the actuator paused as well: what is left is the
  broker and the job's own perfloop work (its hooks and threads, the launcher's sampler);
- ``no_ddp_hook``: everything, with ``PERFLOOP_DDP_COMM_HOOK=0`` (DDP keeps its own reducer:
  no bucket timing);
- ``no_agent``: everything, with ``PERFLOOP_AGENT=0`` (no job agent in the ranks: no control
  consumer, no knobs);
- ``no_hooks``: everything but the job's own perfloop: ``perfloop run`` (its node sampler,
  publisher and live-config listener) and the stack as a user runs them, the job's processes
  started with ``PERFLOOP_RUN_HOOKS=0`` (no training hooks, so no telemetry threads, no job
  agent, no DDP timing hook): what perfloop costs the job from outside its processes;
- ``autogroups``: everything, with the services moved out of the idle CPU control groups the
  supervisor made for them (`perfloop._cpugroup`) into its own group for the pair: they yield
  through their autogroups at nice 19 only, as on a machine where no group can be made (the
  same as ``full`` where none was made);
- ``loop_idle`` and ``loop_raised``: everything, with the loop's CPU group (broker, stream
  worker, actuator) held idle, or held raised to the catch-up's weight, for the pair whatever
  the worker's catch-up decides (`perfloop.autogroup.CatchUp`): what the catch-up costs the
  job (the same as ``full`` where the supervisor made no groups).

Each round runs one pair per variant (the variants' order rotates, and so does plain's place
in each pair), so that a stack growing costlier with what it holds (the embedded broker
does: `perfloop.stack.broker`) weighs on every variant alike. Paused services are resumed after
each pair, also on error or Ctrl-C. Reported per variant: the pairs' observe/plain ratios of
second-half steps/s and their median, and the CPU seconds each stack service used during the
observe runs (of the whole process, from ``/proc/<pid>/stat``).

    python bench/overhead_split.py            # ~35 min: 9 variants x 4 rounds of 2 x 22 s
    python bench/overhead_split.py --rounds 2 --seconds 15 --variants full,no_history

The stack is a private one (`bench._common.embedded_stack`, free ports); the result is
``bench/results/overhead_split-<utc time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import embedded_stack, free_port, raise_on_sigterm, save_result, say
from bench.realworld import job_env, read_truth, second_half_rate
from bench.realworld_jobs.scenarios import SCENARIOS, perfloop_run
from perfloop._cpugroup import cpu_dir, set_idle

PAUSED = {
    "full": (),
    "no_history": ("warehouse", "sink"),
    "broker_only": ("warehouse", "sink", "streams", "actuator"),
    "no_ddp_hook": (),
    "no_agent": (),
    "no_hooks": (),
    "autogroups": (),
    "loop_idle": (),
    "loop_raised": (),
}
HELD = {"loop_idle": True, "loop_raised": False}
EXTRA_ENV = {"no_ddp_hook": {"PERFLOOP_DDP_COMM_HOOK": "0"}, "no_agent": {"PERFLOOP_AGENT": "0"}}


def service_pids(home: Path) -> dict[str, int]:
    """The stack's running services by name (from ``perfloop status --json``)."""
    out = subprocess.run(
        [sys.executable, "-m", "perfloop.cli", "status", "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=home.parent,
        check=False,
    ).stdout
    doc = json.loads(out or "{}")
    return {
        name: int(svc["pid"])
        for name, svc in (doc.get("services") or {}).items()
        if svc.get("pid") and svc.get("state") != "dead"
    }


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; NaN once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def paused(pids: dict[str, int], names: tuple[str, ...]) -> Iterator[None]:
    """SIGSTOP the named services for the block; SIGCONT them after, whatever happens."""
    stopped = [pids[n] for n in names if n in pids]
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def out_of_cpu_groups(pids: dict[str, int], on: bool) -> Iterator[None]:
    """With ``on``, move the services out of the supervisor's idle CPU control groups into
    the groups' parent for the block, and back after, whatever happens."""
    moved: list[tuple[int, Path]] = []
    try:
        for pid in pids.values() if on else ():
            group = cpu_dir(Path(f"/proc/{pid}"))
            if group is not None and group.name.startswith("perfloop-"):
                (group.parent / "cgroup.procs").write_text(str(pid))
                moved.append((pid, group))
        yield
    finally:
        for pid, group in moved:
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(pid))


def _worker_raised(home: Path) -> bool:
    """Whether the stream worker last raised the loop's group (its log's last word on it)."""
    raised = False
    with contextlib.suppress(OSError), open(home / "logs" / "streams.log") as f:
        for line in f:
            if "scheduling group" in line:
                raised = "input behind" in line
    return raised


@contextlib.contextmanager
def loop_group_held(pids: dict[str, int], home: Path, idle: bool | None) -> Iterator[None]:
    """With ``idle`` True or False, hold the loop's CPU group idle or raised for the block
    (set again every 100 ms, over whatever the worker's catch-up sets), then leave it as the
    worker last set it, so that the next pair starts where the worker believes it is."""
    group = cpu_dir(Path(f"/proc/{pids.get('streams', 0)}"))
    if idle is None or group is None or not group.name.endswith("-loop"):
        yield
        return
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            set_idle(group, idle=idle)
            stop.wait(0.1)

    t = threading.Thread(target=hold, name="hold-loop-group", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        set_idle(group, idle=not _worker_raised(home))


def run_once(
    scenario: str, variant: str, tier: str | None, seed: int, seconds: float, home: Path
) -> float | None:
    """One run of the scenario's job, plain (``tier`` None) or under ``perfloop run``; its
    second-half steps/s (None when it wrote no steps)."""
    scen = SCENARIOS[scenario]
    job = f"ovh-{variant}-{tier or 'plain'}-{uuid.uuid4().hex[:6]}"
    truth = home / "truth" / job
    cmd, _ = scen.command(seed=seed, seconds=seconds, truth_dir=truth, python=sys.executable)
    if tier is not None:
        if variant == "no_hooks":  # `perfloop run` sets PERFLOOP_RUN_HOOKS=1; `env` undoes it
            cmd = ["env", "PERFLOOP_RUN_HOOKS=0", *cmd]
        cmd = perfloop_run(sys.executable, job, tier, cmd)
    env = job_env("plain" if tier is None else "observe") | (
        EXTRA_ENV.get(variant, {}) if tier else {}
    )
    subprocess.run(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        timeout=seconds + 120,
        check=False,
    )
    return second_half_rate(read_truth(truth).get("step_ms", []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="pairs per variant (default 4)")
    p.add_argument("--seconds", type=float, default=22.0, help="training time of each run")
    p.add_argument("--variants", default=",".join(PAUSED), help="comma-separated, in order")
    p.add_argument("--scenario", default="healthy_ddp", help="a healthy realworld scenario")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in PAUSED]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; valid: {', '.join(PAUSED)}")
    if args.scenario not in SCENARIOS or not SCENARIOS[args.scenario].healthy:
        healthy = [n for n, s in SCENARIOS.items() if s.healthy]
        p.error(f"--scenario must be a healthy scenario: {', '.join(healthy)}")
    raise_on_sigterm()
    os.environ.setdefault("PERFLOOP_BENCH_KAFKA_PORT", str(free_port()))
    os.environ.setdefault("PERFLOOP_BENCH_CLICKHOUSE_PORT", str(free_port()))
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, dict[str, float]] = {v: {} for v in variants}
    t0 = time.perf_counter()
    with embedded_stack(say) as home:
        pids = service_pids(home)
        say(f"stack services: {', '.join(f'{n} {pid}' for n, pid in sorted(pids.items()))}")
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
            for i, variant in enumerate(order):
                seed = args.seed + 100 * rnd + i
                rates: dict[str, float | None] = {}
                with (
                    paused(pids, PAUSED[variant]),
                    out_of_cpu_groups(pids, variant == "autogroups"),
                    loop_group_held(pids, home, HELD.get(variant)),
                ):
                    for tier in (None, "observe") if (rnd + i) % 2 == 0 else ("observe", None):
                        before = {n: cpu_s(pid) for n, pid in pids.items()}
                        rates[tier or "plain"] = run_once(
                            args.scenario, variant, tier, seed, args.seconds, home
                        )
                        if tier is not None:
                            for n, pid in pids.items():
                                used = cpu_s(pid) - before[n]
                                cpu[variant][n] = cpu[variant].get(n, 0.0) + used
                plain, observe = rates.get("plain"), rates.get("observe")
                ratio = observe / plain if plain and observe else None
                if ratio is not None:
                    ratios[variant].append(ratio)
                say(
                    f"round {rnd} {variant:12s} plain {plain or 0:6.1f} observe "
                    f"{observe or 0:6.1f} steps/s, ratio "
                    f"{'-' if ratio is None else f'{ratio:.3f}'} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
    lines = ["| variant | pairs | observe/plain (median) | pairs | stack CPU s in observe runs |"]
    lines.append("|---|---|---|---|---|")
    summary: dict[str, Any] = {}
    for v in variants:
        med = statistics.median(ratios[v]) if ratios[v] else None
        summary[v] = {
            "ratio_median": med,
            "ratios": [round(r, 3) for r in ratios[v]],
            "stack_cpu_s": {n: round(s, 2) for n, s in sorted(cpu[v].items())},
        }
        used = ", ".join(f"{n} {s:.1f}" for n, s in sorted(cpu[v].items()))
        lines.append(
            f"| {v} | {len(ratios[v])} | {'-' if med is None else f'{med:.3f}×'} | "
            f"{', '.join(f'{r:.3f}' for r in ratios[v])} | {used} |"
        )
    table = "\n".join(lines)
    say("\n" + table)
    save_result(
        "overhead_split",
        {
            "bench": "overhead_split",
            "args": vars(args),
            "cpus": len(os.sched_getaffinity(0)),
            "wall_s": round(time.perf_counter() - t0, 1),
            "variants": summary,
            "table": table,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
