"""How many samples/s the simulator produces from one process, against a per-sample baseline.

    python bench/simulator.py                       # 4 nodes x 8 ranks, 120 s simulated
    python bench/simulator.py --nodes 2 --ranks 8 --sim-s 30 --rate 200000

Three measurements, all in this process, with a publisher that drops what it is given (so
the figures are the producer's own cost: generating the samples and encoding the batches):

1. **Vectorised, flat out.** `SimulatedJob` (scenario ``mixed``) with no pacing: samples/s
   generated and encoded, and how many steps of all ranks each chunk holds.
2. **Per-sample baseline.** The same kinds and counts made one sample at a time with
   `Emitter.add` (what a naive simulator does), for a tenth of the simulated time; the ratio
   vectorised / per-sample.
3. **Paced by ``--rate``.** The simulator asked for ``--rate`` samples/s: the rate it
   achieved over its run (it sleeps when ahead; when it cannot keep up, it runs flat out).

Figures go to stdout, to ``bench/results/simulator-<time>.json`` and as one final JSON line.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/simulator.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import raise_on_sigterm, save_result, say


class Drop:
    """A publisher that keeps count and nothing else."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.messages += 1
        self.bytes += len(value)
        return True


def _config(args: argparse.Namespace, **kw: Any) -> Any:
    from perfloop.producers import scenario_config

    return scenario_config(
        "mixed",
        job_id="bench-sim",
        nodes=args.nodes,
        ranks_per_node=args.ranks,
        duration_s=args.sim_s,
        seed=1,
        t0_ns=1_700_000_000_000_000_000,
        **kw,
    )


def bench_vectorised(args: argparse.Namespace) -> dict[str, Any]:
    from perfloop.producers import SimulatedJob

    pub = Drop()
    job = SimulatedJob(_config(args, speed=1e9), pub)
    chunks = [0]
    t0 = time.perf_counter()
    job.run(args.sim_s, on_tick=lambda: chunks.__setitem__(0, chunks[0] + 1))
    wall = time.perf_counter() - t0
    out = {
        "samples": job.samples,
        "steps": job.step,
        "wall_s": wall,
        "samples_per_s": job.samples / wall,
        "steps_per_chunk": job.step / max(chunks[0], 1),
        "bytes_per_sample": pub.bytes / max(job.samples, 1),
    }
    say(
        f"[1] vectorised: {job.samples:,} samples ({job.step} steps x {job.world} ranks + GPU "
        f"and host) in {wall:.2f} s → {out['samples_per_s']:,.0f} samples/s; "
        f"{out['steps_per_chunk']:.1f} steps per chunk, {out['bytes_per_sample']:.0f} B/sample"
    )
    return out


def bench_per_sample(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """The baseline: one `Emitter.add` per sample, values from `random`, same kinds."""
    from perfloop.producers import Emitter
    from perfloop.producers.simulator import PHASES

    rng = random.Random(1)
    pub = Drop()
    g = args.ranks
    ems = [
        Emitter(pub, job_id="bench-naive", node=f"n{i}", producer_id="p", max_samples=5000)
        for i in range(args.nodes)
    ]
    world = args.nodes * g
    steps = max(1, steps // 10)
    t = 1_700_000_000_000_000_000
    n = 0
    t0 = time.perf_counter()
    for step in range(steps):
        for rank in range(world):
            em = ems[rank // g]
            ms = [rng.gauss(m, m * 0.02) for m in (0.5, 30.0, 58.0, 18.0, 8.0)]
            start = t
            for phase, d in zip(PHASES, ms, strict=True):
                em.add(
                    "span", ts_ns=start, rank=rank, step=step, phase=phase, name=phase,
                    duration_ms=d,
                )  # fmt: skip
                start += int(d * 1e6)
            em.add(
                "step", ts_ns=start, rank=rank, step=step, step_time_ms=sum(ms),
                data_wait_ms=ms[0], batch_size=32, num_workers=2,
            )  # fmt: skip
            em.add(
                "collective", ts_ns=t, rank=rank, step=step, op="all_reduce",
                size_bytes=1 << 30, group="dp", group_size=world, duration_ms=ms[3],
            )  # fmt: skip
            em.add(
                "gpu", ts_ns=t, rank=rank, device=rank % g, sm_util_pct=rng.uniform(80, 99),
                power_w=rng.uniform(400, 600), sm_clock_mhz=1980.0,
            )  # fmt: skip
            n += 8
        t += 115_000_000
        if step % 10 == 0:
            for em in ems:
                em.flush()
    for em in ems:
        em.flush()
    wall = time.perf_counter() - t0
    say(f"[2] per-sample baseline: {n:,} samples in {wall:.2f} s → {n / wall:,.0f} samples/s")
    return {"samples": n, "wall_s": wall, "samples_per_s": n / wall}


def bench_rate(args: argparse.Namespace) -> dict[str, Any]:
    from perfloop.producers import SimulatedJob

    job = SimulatedJob(_config(args, rate=args.rate), Drop())
    t0 = time.perf_counter()
    job.run(args.sim_s)
    wall = time.perf_counter() - t0
    achieved = job.samples / wall
    say(
        f"[3] paced: asked {args.rate:,.0f} samples/s, achieved {achieved:,.0f} "
        f"({100 * achieved / args.rate:.0f}%) over {wall:.2f} s; event time ran "
        f"{job.pace:.0f}x real time"
    )
    return {"target": args.rate, "achieved": achieved, "wall_s": wall, "pace": job.pace}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--sim-s", type=float, default=120.0, help="simulated seconds")
    p.add_argument("--rate", type=float, default=200_000.0, help="target samples/s for [3]")
    args = p.parse_args(argv)
    raise_on_sigterm()
    result: dict[str, Any] = {"bench": "simulator", "args": vars(args), "cpus": os.cpu_count()}
    result["vectorised"] = vec = bench_vectorised(args)
    result["per_sample"] = naive = bench_per_sample(args, vec["steps"])
    result["ratio"] = vec["samples_per_s"] / naive["samples_per_s"]
    say(f"    vectorised / per-sample: {result['ratio']:.1f}x")
    result["paced"] = bench_rate(args)
    save_result("simulator", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
