"""The closed loop on a real CPU torch job: how much faster it gets, and how fast the loop is.

    python bench/real_job.py                  # 3 runs in tier auto, 2 in tier observe, 60 s each
    python bench/real_job.py --runs 5 --seconds 90

A private embedded stack (as in bench/e2e.py). Each run is ``perfloop run --tier T --
python -m perfloop.examples.cpu_training --seconds S``: the unmodified example script (no
DataLoader workers for a costly augmentation, four times more torch threads than CPUs), as in
`perfloop demo --real`. Runs alternate between the tiers (auto, observe, auto, …) so the host's
drift falls on both.

Per run, from the warehouse's steps of rank 0 (steps/s = steps over their summed step time):

- tier auto: before the first applied change (without the first 5 steps) and after the last
  verdict (without the 2 settling steps): the job's **speedup, after / before**;
- tier observe (nothing is applied: the control): the first and the second half of the run,
  whose ratio shows what the job does on its own (warm-up, drift);
- tier auto against tier observe: steps/s after the last verdict over the unchanged job's
  steps/s over its whole run.

Reported: each run, and the median over runs of each figure. Fast-loop latency on the real
job, per applied change, from the Kafka timestamps (and the agent's stamp of the application):
the job's first critical-path diagnosis published → its first change applied (the fast loop),
recommendation published → applied, and command published → applied.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/real_job.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench._common import embedded_stack, raise_on_sigterm, save_result, say


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    from perfloop.demo_real import run_real_job, steps_per_s
    from perfloop.settings import StackSettings
    from perfloop.warehouse import client

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs in tier auto (default 3)")
    p.add_argument("--controls", type=int, default=2, help="runs in tier observe (default 2)")
    p.add_argument("--seconds", type=float, default=60.0, help="each run trains this long")
    args = p.parse_args(argv)
    raise_on_sigterm()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"bench": "real_job", "args": vars(args), "cpus": os.cpu_count()}
    plan = ["auto"] * args.runs + ["observe"] * args.controls
    plan = [t for pair in zip(plan[: args.runs], plan[args.runs :], strict=False) for t in pair]
    plan += ["auto"] * (args.runs - plan.count("auto"))
    plan += ["observe"] * (args.controls - plan.count("observe"))
    runs: list[dict[str, Any]] = []
    with embedded_stack(say):
        settings = StackSettings()
        for i, tier in enumerate(plan):
            job = f"bench-real-{tier}-{uuid.uuid4().hex[:6]}"
            say(f"run {i + 1} of {len(plan)}: {job}, tier {tier}, {args.seconds:g} s")
            run = run_real_job(settings, job_id=job, seconds=args.seconds, tier=tier,
                               show=lambda _: None)  # fmt: skip
            row: dict[str, Any] = {
                "job_id": job,
                "tier": tier,
                "exit_code": run.exit_code,
                "changes": [
                    {
                        "knob": a.knob,
                        "status": a.status,
                        "value": a.value,
                        "step": a.step,
                        "reason": a.reason,
                    }
                    for a in run.acks
                ],
                "before": run.before,
                "after": run.after,
                "latency": run.latencies(),
            }
            if tier == "observe":  # its whole run: the unchanged job's speed
                ch = client(settings)
                try:
                    rows = ch.query(
                        "SELECT step_time_ms FROM steps WHERE job_id = {j:String} AND rank = 0 "
                        "AND step >= 5 ORDER BY step",
                        parameters={"j": job},
                    ).result_rows
                    ms = [r[0] for r in rows]
                finally:
                    ch.close()
                row["whole"] = steps_per_s(ms)
            row["ratio"] = run.speedup
            runs.append(row)
            kept = [f"{c['knob']}={c['value']}" for c in row["changes"] if c["status"] == "kept"]
            say(f"  exit {run.exit_code}; steps/s {run.before.get('steps_per_s', 0):.2f} → "
                f"{run.after.get('steps_per_s', 0):.2f} ({(run.speedup or 0):.2f}×); "
                f"kept: {', '.join(kept) or 'nothing'}")  # fmt: skip
    auto = [r for r in runs if r["tier"] == "auto"]
    ctrl = [r for r in runs if r["tier"] == "observe"]
    unchanged = _median([r["whole"]["steps_per_s"] for r in ctrl if r.get("whole")])
    after = _median([r["after"]["steps_per_s"] for r in auto if r["after"]])
    summary = {
        "speedup_after_over_before_median": _median([r["ratio"] for r in auto if r["ratio"]]),
        "control_second_half_over_first_median": _median([r["ratio"] for r in ctrl if r["ratio"]]),
        "steps_per_s_before_median": _median(
            [r["before"]["steps_per_s"] for r in auto if r["before"]]
        ),
        "steps_per_s_after_median": after,
        "steps_per_s_unchanged_job_median": unchanged,
        "speedup_over_unchanged_job": after / unchanged if after and unchanged else None,
        "runs_with_a_kept_change": sum(
            any(c["status"] == "kept" for c in r["changes"]) for r in auto
        ),
    }
    lat = [x for r in auto for x in r["latency"]]
    for key in ("diagnosis_to_applied_s", "recommendation_to_applied_s", "command_to_applied_s"):
        values = [x[key] for x in lat if key in x]
        if values:
            p50, p99 = np.percentile(values, [50, 99])
            summary[key] = {"p50_s": float(p50), "p99_s": float(p99), "max_s": max(values),
                            "n": len(values)}  # fmt: skip
    result["runs"] = runs
    result["summary"] = summary
    s = summary
    say(f"  speedup after/before (median of {len(auto)} runs): "
        f"{s['speedup_after_over_before_median'] or 0:.2f}×; control runs' second half / "
        f"first: {s['control_second_half_over_first_median'] or 0:.2f}×")  # fmt: skip
    say(f"  steps/s: {s['steps_per_s_before_median'] or 0:.2f} before → "
        f"{s['steps_per_s_after_median'] or 0:.2f} after; the unchanged job "
        f"{s['steps_per_s_unchanged_job_median'] or 0:.2f} "
        f"({s['speedup_over_unchanged_job'] or 0:.2f}×)")  # fmt: skip
    for key in ("diagnosis_to_applied_s", "recommendation_to_applied_s", "command_to_applied_s"):
        q = s.get(key)
        if q:
            say(f"  {key.removesuffix('_s').replace('_', ' ')}: p50 {q['p50_s']:.3f} s, "
                f"p99 {q['p99_s']:.3f} s, max {q['max_s']:.3f} s (n {q['n']})")  # fmt: skip
    result["wall_s"] = time.perf_counter() - t0
    save_result("real_job", result, note=f" ({result['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
