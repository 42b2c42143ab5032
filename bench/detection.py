"""Detection quality of the bottleneck funnel on simulated faults with ground truth, and its cost.

    python bench/detection.py                      # 8 scenarios x 3 shapes x seeds 100-119 (~4 min)
    python bench/detection.py --seeds 0:10         # the seeds the thresholds were tuned on
    python bench/detection.py --json table.json    # also write the table as JSON
    python bench/detection.py --seeds 0:10 --check # the tuning matrix: exit 1 below a target

Every scenario (healthy, data-loader starvation, straggler, thermal throttle, memory leak → OOM,
comm degradation, hang, mixed) runs for each seed and job shape in process
(`perfloop.evaluation.run_scenario`): the simulator publishes like a live producer
(a message per node and kind every 0.25 s), each message reaches a fresh `Funnel` ``--delay``
after its newest sample, and ``tick`` runs every ``--tick`` of that simulated receive clock.
Root diagnoses are scored per fault kind against the simulator's ground truth with the rules in
`perfloop.evaluation` (kind and time window; precision over every run, healthy ones
included; latency = detection time − fault onset). The thresholds were tuned on seeds 0–9;
the default report uses seeds 100–119, never tuned on.

Cost, measured in the same run on one ``mixed`` run per shape (best of 5, or of 3 replays for
ticks): time in ``Funnel.observe`` per sample against the baseline of decoding the same
messages with ``decode_batch``, and in ``Funnel.tick`` per call for one job (also spread over
the samples a job sends between two ticks).

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


def bench_cost(nodes: int, per_node: int, args: argparse.Namespace) -> dict[str, Any]:
    """The funnel's cost on one ``mixed`` run of this shape, best of a few repetitions each:
    ``observe`` over every telemetry batch (no ticks), whole replays for ``tick``, and
    decoding the same messages as the baseline."""
    from perfloop.evaluation import REPORT_SEEDS, RunSpec, replay, simulate
    from perfloop.schemas.codec import decode_batch
    from perfloop.streams.funnel import Funnel

    spec = RunSpec("mixed", REPORT_SEEDS[0], nodes, per_node, args.duration)
    sent, world = simulate(spec)
    telemetry = [v for t, v in sent if not t.endswith(".job")]
    batches = [decode_batch(v) for v in telemetry]
    samples = sum(len(b) for b in batches)
    decode = observe = tick = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for v in telemetry:
            decode_batch(v)
        decode = min(decode, time.perf_counter() - t)
        f = Funnel()
        t = time.perf_counter()
        for b in batches:
            f.observe(b, int(b.columns["ts_ns"][-1]) + int(args.delay * 1e9))
        observe = min(observe, time.perf_counter() - t)
    for _ in range(3):
        res = replay(spec, sent, world, delay_s=args.delay, tick_s=args.tick)
        tick = min(tick, res.tick_s / res.ticks)
    rate = samples / args.duration
    per_tick = tick / (args.tick * rate)  # tick cost spread over the samples of one tick
    out = {
        "samples_per_job_s": rate,
        "observe_us_per_sample": observe / samples * 1e6,
        "tick_us_per_call": tick * 1e6,
        "tick_us_per_sample": per_tick * 1e6,
        "decode_us_per_sample": decode / samples * 1e6,
        "observe_over_decode": observe / decode,
    }
    say(
        f"cost {nodes}x{per_node} ({rate:,.0f} samples per second of job time): observe "
        f"{out['observe_us_per_sample']:.2f} µs/sample = {out['observe_over_decode']:.2f}x "
        f"decoding them ({out['decode_us_per_sample']:.2f} µs/sample); tick "
        f"{out['tick_us_per_call']:.0f} µs per call and job, {out['tick_us_per_sample']:.2f} "
        "µs/sample at one tick per 0.25 s"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    from perfloop.evaluation import (
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
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless every fault kind has precision and recall >= 0.9, median latency "
        "<= 2 s and no other diagnosis on the critical path (the simulator's targets)",
    )
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

    cost = {f"{n}x{g}": bench_cost(n, g, args) for n, g in shapes}
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
    if args.check:
        missed = missed_targets(kinds, others)
        for line in missed:
            say(f"MISSED {line}")
        return 1 if missed else 0
    return 0


def missed_targets(kinds: dict[str, Any], others: dict[str, dict[str, int]]) -> list[str]:
    """The simulator's targets a scored table misses, one line each (none: all met)."""
    from perfloop.schemas.job import FAULT_KINDS

    out = []
    for k in FAULT_KINDS:
        s = kinds[k]
        if s.faults == 0:
            out.append(f"{k}: no fault of this kind was run")
            continue
        if not s.precision >= 0.9:
            out.append(f"{k}: precision {s.precision:.3f} < 0.9 (false: {s.false_alarms})")
        if not s.recall >= 0.9:
            out.append(f"{k}: recall {s.recall:.3f} < 0.9 (missed: {s.misses})")
        if not s.latency(0.5) <= 2.0:
            out.append(f"{k}: median latency {s.latency(0.5):.2f} s > 2 s")
    out += [
        f"{k}: on the critical path {v['critical_path']}x"
        for k, v in others.items()
        if v["critical_path"]
    ]
    return out


if __name__ == "__main__":
    sys.exit(main())
