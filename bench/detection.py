"""Detection quality of the bottleneck funnel on simulated faults with ground truth, and its cost.

    python bench/detection.py                      # 8 scenarios x 3 shapes x seeds 100-119 (~4 min)
    python bench/detection.py --seeds 0:10         # the seeds the thresholds were tuned on
    python bench/detection.py --json table.json    # also write the table as JSON

Every scenario (healthy, data-loader starvation, straggler, thermal throttle, memory leak → OOM,
comm degradation, hang, mixed) runs for each seed and job shape in process
(`perfloop.streams.evaluation.run_scenario`): the simulator publishes like a live producer
(a message per node and kind every 0.25 s), each message reaches a fresh `Funnel` ``--delay``
after its newest sample, and ``tick`` runs every ``--tick`` of that simulated receive clock.
Root diagnoses are scored per fault kind against the simulator's ground truth with the rules in
`perfloop.streams.evaluation` (kind and time window; precision over every run, healthy ones
included; latency = detection time − fault onset). The thresholds were tuned on seeds 0–9;
the default report uses seeds 100–119, never tuned on.

Cost, measured in the same run: time in ``Funnel.observe`` per sample and in ``Funnel.tick``
per call (one job per funnel), against the baseline of decoding the same messages
(``decode_batch`` / ``decode_event``) per sample.

Figures go to stdout, to ``bench/results/detection-<time>.json`` and as one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/detection.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import raise_on_sigterm, save_result, say


def _seeds(text: str) -> list[int]:
    if ":" in text:
        lo, hi = text.split(":")
        return list(range(int(lo), int(hi)))
    return [int(s) for s in text.split(",")]


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.split("x") for s in text.split(","))]


def main(argv: list[str] | None = None) -> int:
    from perfloop.streams.evaluation import (
        REPORT_SEEDS,
        SCENARIOS,
        TUNE_SEEDS,
        RunSpec,
        format_table,
        run_scenario,
        score,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default=f"{REPORT_SEEDS[0]}:{REPORT_SEEDS[-1] + 1}")
    p.add_argument(
        "--shapes", default="1x4,2x4,2x8", help="nodes x ranks per node, comma-separated"
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--duration", type=float, default=40.0, help="simulated seconds per run")
    p.add_argument("--delay", type=float, default=0.3, help="transport delay, s")
    p.add_argument("--tick", type=float, default=0.25, help="tick period, s")
    p.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = p.parse_args(argv)
    raise_on_sigterm()
    seeds, shapes = _seeds(args.seeds), _shapes(args.shapes)
    scenarios = args.scenarios.split(",")
    tuned = sorted(set(seeds) & set(TUNE_SEEDS))
    say(
        f"{len(scenarios)} scenarios x {len(shapes)} shapes x {len(seeds)} seeds "
        f"({args.seeds}), {args.duration:g} s each; delay {args.delay:g} s, tick {args.tick:g} s"
    )
    say(
        "thresholds tuned on seeds 0-9; "
        + (f"WARNING: this report includes tuning seeds {tuned}" if tuned else "none of them here")
    )
    t0 = time.perf_counter()
    results = []
    for sc in scenarios:
        for n, g in shapes:
            for seed in seeds:
                spec = RunSpec(sc, seed, n, g, args.duration)
                results.append(run_scenario(spec, delay_s=args.delay, tick_s=args.tick))
        say(f"  {sc}: done ({time.perf_counter() - t0:.0f} s)")
    kinds, others = score(results)
    say("")
    say(format_table(kinds, others))
    say("  prec/recall: root diagnoses per fault kind; lat: detection time - fault onset;")
    say("  ranks∩ / ranks=: matched diagnoses naming a faulty rank / exactly the faulty ranks")

    cost: dict[str, Any] = {}
    for n, g in shapes:
        mine = [r for r in results if (r.spec.nodes, r.spec.ranks_per_node) == (n, g)]
        samples = sum(r.samples for r in mine)
        ticks = sum(r.ticks for r in mine)
        observe = sum(r.observe_s for r in mine) / samples * 1e6
        decode = sum(r.decode_s for r in mine) / samples * 1e6
        tick = sum(r.tick_s for r in mine) / ticks * 1e6
        total = sum(r.funnel_s for r in mine) / samples * 1e6
        rate = samples / sum(r.spec.duration_s for r in mine)
        cost[f"{n}x{g}"] = {
            "samples_per_sim_s": rate,
            "observe_us_per_sample": observe,
            "tick_us_per_call": tick,
            "funnel_us_per_sample": total,
            "decode_us_per_sample": decode,
            "funnel_over_decode": total / decode,
        }
        say(
            f"cost {n}x{g} ({rate:,.0f} samples/s of job time): observe {observe:.2f} µs/sample, "
            f"tick {tick:.0f} µs/call; all funnel work {total:.2f} µs/sample = "
            f"{total / decode:.2f}x decoding the same messages ({decode:.2f} µs/sample)"
        )
    table = [kinds[k].as_dict() for k in kinds]
    doc = {
        "bench": "detection",
        "args": {k: str(v) for k, v in vars(args).items()},
        "seeds": seeds,
        "tuned_on": list(TUNE_SEEDS),
        "runs": len(results),
        "cpus": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
        "table": table,
        "others": others,
        "cost": cost,
    }
    if args.json:
        args.json.write_text(json.dumps({"table": table, "others": others}, indent=2) + "\n")
        say(f"table → {args.json}")
    save_result("detection", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
