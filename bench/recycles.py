"""Recycle the embedded broker again and again under load: does any service crash or restart?

The embedded stack with ``PERFLOOP_BROKER_RECYCLE_MB`` small (a recycle every ~15 s) and six
simulated jobs (8 ranks each, five healthy, one with a starving loader) publishing through
the producers' `Publisher`, for ``--minutes``. Every 10 s it reads the stack's state: how
many recycles, and which services the supervisor restarted. At the end: recycles, restarts,
the services' logs' crash reports (``Fatal Python error``: `perfloop service` turns on
faulthandler) and the step samples sent against the step rows that landed (distinct and all),
so a crash that made rows land twice shows.

    python bench/recycles.py --minutes 30

A service crashed by librdkafka at a recycle (SIGSEGV, docs/guarantees.md) shows as a
restart and a crash report.
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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import embedded_stack, raise_on_sigterm, save_result, say, wait_for

SCENARIOS = ("healthy",) * 5 + ("dataloader_starvation",)


def run(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from perfloop.producers import Publisher
    from perfloop.producers.scenarios import scenario_config
    from perfloop.producers.simulator import SimulatedJob
    from perfloop.stack import read_state
    from perfloop.warehouse import client

    run_s = args.minutes * 60
    tag = uuid.uuid4().hex[:6]
    pub = Publisher(settings, producer_id=f"bench-recycles-{tag}")
    jobs = [
        SimulatedJob(
            scenario_config(sc, job_id=f"rc-{tag}-{i}-{sc}", nodes=1, ranks_per_node=8,
                            duration_s=run_s, seed=i),
            pub,
        )
        for i, sc in enumerate(SCENARIOS)
    ]  # fmt: skip
    threads = [threading.Thread(target=j.run, args=(run_s,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    state: dict[str, Any] = {}
    while any(t.is_alive() for t in threads):
        time.sleep(10)
        state = read_state(settings) or state
        restarts = {n: s["restarts"] for n, s in state["services"].items() if s.get("restarts")}
        recycles = (state.get("broker_recycling") or {}).get("recycles", 0)
        say(f"{time.monotonic() - t0:6.0f} s: {recycles} recycles, restarts {restarts}")
    pub.flush(60)
    pub.close()
    sent = sum(j.step * j.world for j in jobs)
    ch = client(settings)
    ids = [j.cfg.job_id for j in jobs]

    def landed() -> tuple[int, int]:
        n, uniq = ch.query(
            "SELECT count(), uniqExact(job_id, rank, step) FROM steps "
            "WHERE job_id IN {j:Array(String)}",
            parameters={"j": ids},
        ).result_rows[0]
        return int(n), int(uniq)

    wait_for(lambda: landed()[1] >= sent, 120)
    time.sleep(5)
    rows, distinct = landed()
    logs = Path(settings.home_dir) / "logs"
    crashes = {
        f.stem: f.read_text(errors="replace").count("Fatal Python error")
        for f in sorted(logs.glob("*.log"))
    }
    state = read_state(settings) or state
    return {
        "minutes": args.minutes,
        "recycles": (state.get("broker_recycling") or {}).get("recycles", 0),
        "restarts": {n: s["restarts"] for n, s in state["services"].items() if s.get("restarts")},
        "crash_reports": {k: v for k, v in crashes.items() if v},
        "step_samples_sent": sent,
        "step_rows": rows,
        "step_rows_distinct": distinct,
        "publisher": {"broker_losses": pub.stats.broker_losses, "resent": pub.stats.resent},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--recycle-mb", type=float, default=4.0, help="PERFLOOP_BROKER_RECYCLE_MB")
    args = p.parse_args(argv)
    raise_on_sigterm()
    result: dict[str, Any] = {"bench": "recycles", "args": vars(args), "cpus": os.cpu_count()}
    extra = {
        "PERFLOOP_BROKER_RECYCLE_MB": str(args.recycle_mb),
        "PERFLOOP_BROKER_RECYCLE_RETRY_S": "5",
    }
    with embedded_stack(say, extra):
        from perfloop.settings import StackSettings

        result.update(run(args, StackSettings()))
    path = save_result("recycles", result)
    say(
        f"{result['recycles']} recycles, restarts {result['restarts']}, crash reports "
        f"{result['crash_reports']}; step rows {result['step_rows']} ("
        f"{result['step_rows_distinct']} distinct) of {result['step_samples_sent']} sent; {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
