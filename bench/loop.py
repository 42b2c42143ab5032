"""Fast-loop latency: from the diagnosis to the change applied in the job, over many loops.

    python bench/loop.py                   # 12 simulated jobs at once, fault at 6 s, 2 rounds
    python bench/loop.py --jobs 4 --rounds 1

A private embedded stack (as in bench/e2e.py). Each round starts ``--jobs`` simulated jobs
together (4 ranks each, event time at wall speed, their data loader starving from
``--fault-at-s``), each with its own job agent in this process applying commands at its step
boundaries and verifying them, exactly as `perfloop demo` does for one. A job runs until the
agent's verdict on its change (or ``--max-s``). The stack's actuator runs in tier auto.

Per loop, from the topics (the Kafka timestamp each event was published with) and the agent:
the stream tier's first open diagnosis of the job's data-loader starvation, its
recommendation, the actuator's command, and the job's applied ack (stamped by the agent when
it applied the change at a step boundary); reported as p50/p99/max over the loops of
**diagnosis published → applied at the job** (the fast loop; target p99 ≤ 1 s) and its parts,
and how many changes were kept.
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

if __package__ in (None, ""):  # run as `python bench/loop.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench._common import embedded_stack, raise_on_sigterm, save_result, say

NS = 1_000_000_000
MS = 1_000_000
KNOB = "dataloader.num_workers"


def _run_round(settings: Any, args: argparse.Namespace, key: bytes, tag: str) -> list[Any]:
    from perfloop.actuators import JobAgent
    from perfloop.actuators.agent import keyring_for
    from perfloop.producers.publisher import Publisher
    from perfloop.producers.scenarios import Fault
    from perfloop.producers.simulator import SimConfig, SimulatedJob

    publisher = Publisher(settings)
    loops = []
    for j in range(args.jobs):
        cfg = SimConfig(
            job_id=f"loop-{tag}-{j}",
            ranks_per_node=4,
            scenario="dataloader_starvation",
            faults=(Fault("dataloader_starvation", onset_s=args.fault_at_s),),
            seed=j,
        )
        job = SimulatedJob(cfg, publisher)
        agent = JobAgent(settings, job_id=cfg.job_id, node=cfg.node, signing_key=key,
                         keyring=keyring_for(settings),
                         handlers={KNOB: job.set_num_workers}, read=job.knob_value)  # fmt: skip
        loops.append((job, agent))
    for _, agent in loops:
        if not agent.start(20.0):
            raise RuntimeError("the control topic was not assigned within 20 s")

    def drive(job: Any, agent: Any) -> None:
        def verdict() -> bool:
            return any(r.status in ("kept", "rolled_back") for r in agent.results)

        job.run(
            args.max_s,
            step_boundary=agent.step_boundary,
            on_step=lambda rep: agent.observe_step(rep.step, rep.step_time_ms),
            stop=verdict,
        )

    threads = [threading.Thread(target=drive, args=pair, daemon=True) for pair in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.max_s + 30)
    publisher.flush(10)
    for _, agent in loops:
        agent.stop()
    publisher.close()
    return loops


def _published(settings: Any, topics: list[str], jobs: set[str]) -> dict[str, list[Any]]:
    """Every event of ``jobs`` on ``topics`` with the Kafka timestamp it was published with."""
    from perfloop.kafka import consumer
    from perfloop.schemas import SchemaError, decode_event

    c = consumer(settings, f"bench-loop-{uuid.uuid4().hex[:8]}")
    c.subscribe(topics)
    out: dict[str, list[Any]] = {j: [] for j in jobs}
    idle_until = time.monotonic() + 10
    try:
        while time.monotonic() < idle_until:
            msg = c.poll(0.5)
            if msg is None or msg.error():
                continue
            idle_until = time.monotonic() + 3  # until the topics are read to their end
            if (msg.key() or b"").decode() not in jobs:
                continue
            try:
                ev = decode_event(msg.value() or b"")
            except SchemaError:
                continue
            out[ev.job_id].append((msg.timestamp()[1] * MS, ev))
    finally:
        c.close()
    return out


def _loop_times(job_id: str, events: list[Any], agent: Any) -> dict[str, Any]:
    from perfloop.schemas import Command, Diagnosis, Recommendation

    diag = min((t for t, e in events if isinstance(e, Diagnosis) and e.state == "open"
                and e.bottleneck == "dataloader_starvation"), default=None)  # fmt: skip
    rec = min((t for t, e in events if isinstance(e, Recommendation)), default=None)
    cmd = min((t for t, e in events if isinstance(e, Command)), default=None)
    applied = next((r for r in agent.results if r.status == "applied"), None)
    verdict = next((r for r in agent.results if r.status in ("kept", "rolled_back")), None)
    out: dict[str, Any] = {"job_id": job_id, "verdict": verdict.status if verdict else None}
    if diag is not None and applied is not None:
        out["diagnosis_to_applied_s"] = (applied.ts_ns - diag) / NS
    if diag is not None and rec is not None:
        out["diagnosis_to_recommendation_s"] = (rec - diag) / NS
    if rec is not None and cmd is not None:
        out["recommendation_to_command_s"] = (cmd - rec) / NS
    if cmd is not None and applied is not None:
        out["command_to_applied_s"] = (applied.ts_ns - cmd) / NS
    return out


def _q(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50_s": float(p50), "p99_s": float(p99), "max_s": float(max(values)), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    from perfloop.schemas.topics import Topics
    from perfloop.settings import ActuatorSettings, StackSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=12, help="simulated jobs per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fault-at-s", type=float, default=6.0)
    p.add_argument("--max-s", type=float, default=60.0, help="simulated seconds at most per job")
    args = p.parse_args(argv)
    raise_on_sigterm()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"bench": "loop", "args": vars(args), "cpus": os.cpu_count()}
    loops: list[dict[str, Any]] = []
    with embedded_stack(say) as _home:
        settings = StackSettings()
        key = ActuatorSettings().signing_key.get_secret_value().encode()
        for r in range(args.rounds):
            tag = f"{uuid.uuid4().hex[:6]}-{r}"
            say(f"round {r + 1}: {args.jobs} jobs, data-loader starvation at {args.fault_at_s:g} s")
            ran = _run_round(settings, args, key, tag)
            jobs = {job.cfg.job_id for job, _ in ran}
            events = _published(settings, [Topics.DIAGNOSES, Topics.RECOMMENDATIONS,
                                           Topics.CONTROL], jobs)  # fmt: skip
            for job, agent in ran:
                loops.append(_loop_times(job.cfg.job_id, events[job.cfg.job_id], agent))
    parts = ("diagnosis_to_applied_s", "diagnosis_to_recommendation_s",
             "recommendation_to_command_s", "command_to_applied_s")  # fmt: skip
    result["loops"] = loops
    result["latency"] = {k: _q([lp[k] for lp in loops if k in lp]) for k in parts}
    result["kept"] = sum(lp["verdict"] == "kept" for lp in loops)
    result["closed"] = sum("diagnosis_to_applied_s" in lp for lp in loops)
    for k in parts:
        q = result["latency"][k]
        if q:
            say(f"  {k.removesuffix('_s').replace('_', ' ')}: p50 {q['p50_s']:.3f} s, "
                f"p99 {q['p99_s']:.3f} s, max {q['max_s']:.3f} s (n {q['n']})")  # fmt: skip
    say(f"  loops closed (applied): {result['closed']} of {len(loops)}; changes kept: "
        f"{result['kept']}")  # fmt: skip
    result["wall_s"] = time.perf_counter() - t0
    save_result("loop", result, note=f" ({result['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
