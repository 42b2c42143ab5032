"""``perfloop simulate --scenario NAME …``: run a simulated multi-node job with a chosen fault
on the stack (`perfloop.producers.simulator`) and write its ground truth."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

from perfloop.exceptions import ConfigError
from perfloop.producers.scenarios import SCENARIOS, scenario_config
from perfloop.schemas.base import JOB_ID_PATTERN
from perfloop.settings import ActuatorSettings, ProducerSettings, load_settings

if TYPE_CHECKING:
    from perfloop.producers.simulator import SimConfig
    from perfloop.schemas import GroundTruth

__all__ = ["simulate_command"]


def _config_from_args(args: argparse.Namespace, settings: Any) -> SimConfig:
    if args.scenario not in SCENARIOS:
        raise ConfigError(f"unknown scenario {args.scenario!r}; valid: {', '.join(SCENARIOS)}")
    for name, value in (("--nodes", args.nodes), ("--ranks-per-node", args.ranks_per_node)):
        if value < 1:
            raise ConfigError(f"{name} must be ≥ 1, got {value}")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise ConfigError(f"--duration must be > 0 s, got {args.duration:g}")
    if not (math.isfinite(args.speed) and args.speed > 0):
        raise ConfigError(f"--speed must be > 0, got {args.speed:g}")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ConfigError(f"--rate must be > 0 samples/s, got {args.rate:g}")
    job_id = args.job_id or getattr(settings, "job_id", None)
    if job_id is None:
        job_id = f"sim-{args.scenario.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-"
        job_id += uuid.uuid4().hex[:4]
    import re

    if not re.match(JOB_ID_PATTERN, job_id):
        raise ConfigError(f"--job-id {job_id!r} must match {JOB_ID_PATTERN}")
    return scenario_config(
        args.scenario,
        job_id=job_id,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        duration_s=args.duration,
        seed=args.seed,
        speed=args.speed,
        rate=args.rate,
        gpu_interval_ms=getattr(settings, "gpu_interval_ms", 100.0),
        host_interval_ms=getattr(settings, "host_interval_ms", 1000.0),
        publish_interval_ms=getattr(settings, "publish_interval_ms", 250.0),
    )


@contextlib.contextmanager
def _stop_on_signals(flag: list[str]) -> Iterator[None]:
    """SIGINT/SIGTERM end the run at the next step boundary (and say so) instead of killing it."""

    def handler(signum: int, _frame: object) -> None:
        flag.append(signal.Signals(signum).name)

    saved = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _fmt_fault(gt: GroundTruth, t0_ns: int) -> str:
    end = f"{(gt.end_ns - t0_ns) / 1e9:.2f}s" if gt.end_ns else "end"
    where = f"ranks {gt.ranks}" if len(gt.ranks) <= 8 else f"{len(gt.ranks)} ranks"
    return f"{gt.fault}@{(gt.onset_ns - t0_ns) / 1e9:.2f}s–{end} {where}"


def simulate_command(
    args: argparse.Namespace,
    settings: Any = None,
    *,
    signing_key: bytes | None = None,
    out: TextIO | None = None,
) -> int:
    """``perfloop simulate``: run a scenario against the stack; 0 on success, 2 on bad input.

    ``settings`` are the producer settings (`perfloop.settings.ProducerSettings`; from the
    environment when not given). A job agent
    beside the job applies signed commands at step boundaries (``dataloader.num_workers``,
    ``dataloader.prefetch_factor``, ``gpu.power_limit_w``); ``signing_key`` defaults to the
    actuator's (``PERFLOOP_SIGNING_KEY``), read here because this is the command's entry point.
    """
    out = out or sys.stdout
    if settings is None:
        settings = load_settings(ProducerSettings)
    gt_file: IO[str] | None = None
    try:
        cfg = _config_from_args(args, settings)
        if args.ground_truth:
            try:
                gt_file = Path(args.ground_truth).open("w", encoding="utf-8")  # noqa: SIM115
            except OSError as e:
                raise ConfigError(
                    f"cannot write --ground-truth {args.ground_truth}: {e.strerror or e}"
                ) from e
    except ConfigError as e:
        print(f"perfloop: error: {e}", file=sys.stderr)
        return 2
    try:
        return _simulate(cfg, args, settings, signing_key, gt_file, out)
    finally:
        if gt_file is not None:
            gt_file.close()


def _simulate(
    cfg: SimConfig,
    args: argparse.Namespace,
    settings: Any,
    signing_key: bytes | None,
    gt_file: IO[str] | None,
    out: TextIO,
) -> int:
    from perfloop.actuators.agent import JobAgent, keyring_for
    from perfloop.kafka import ping
    from perfloop.producers.publisher import Publisher
    from perfloop.producers.simulator import SimulatedJob

    if signing_key is None:
        signing_key = load_settings(ActuatorSettings).signing_key.get_secret_value().encode()

    def on_ground_truth(gt: GroundTruth) -> None:
        if gt_file is not None:
            gt_file.write(gt.model_dump_json() + "\n")
            gt_file.flush()

    ping(settings)  # a broker that is not there is one line now, not undelivered data later
    publisher = Publisher(settings)
    job = SimulatedJob(cfg, publisher, on_ground_truth=on_ground_truth)
    pace = f"rate {cfg.rate:,.0f} samples/s" if cfg.rate else f"speed {cfg.speed:g}x"
    print(
        f"simulating job {cfg.job_id}: scenario {cfg.scenario}, {cfg.nodes} node(s) x "
        f"{cfg.ranks_per_node} rank(s), {args.duration:g} s simulated at {pace}, seed {cfg.seed}"
        f" → kafka {settings.kafka_bootstrap}",
        file=out,
        flush=True,
    )
    agent = JobAgent(
        settings,
        job_id=cfg.job_id,
        node=cfg.node,
        signing_key=signing_key,
        keyring=keyring_for(settings),
        handlers=job.knob_handlers(),
        read=job.knob_value,
    )
    agent.start(wait_assigned_s=0.0)  # commands count from when the control topic is assigned
    stop: list[str] = []
    wall0 = time.monotonic()
    last = [wall0]

    def progress() -> None:
        now = time.monotonic()
        if now - last[0] < 2.0:
            return
        last[0] = now
        active = ", ".join(sorted({f.kind for f in job.active_faults()})) or "none"
        print(
            f"  t={job.clock_s:7.1f}s  step {job.step:6d}  samples {job.samples:>11,}  "
            f"({job.samples / (now - wall0):,.0f}/s)  faults: {active}",
            file=out,
            flush=True,
        )

    try:
        with _stop_on_signals(stop):
            job.run(
                args.duration,
                step_boundary=agent.step_boundary,
                on_step=lambda rep: agent.observe_step(rep.step, rep.step_time_ms),
                stop=lambda: bool(stop),
                on_tick=progress,
            )
    finally:
        agent.stop()
        undelivered = publisher.flush(30.0)
    wall = time.monotonic() - wall0
    faults = "; ".join(_fmt_fault(g, job.t0_ns) for g in job.ground_truth) or "none"
    print(
        f"done: {job.state}, {job.clock_s:.1f} s simulated in {wall:.1f} s, {job.step} steps, "
        f"{job.samples:,} samples ({job.samples / max(wall, 1e-9):,.0f}/s), faults: {faults}"
        + (f"; ground truth → {args.ground_truth}" if args.ground_truth else ""),
        file=out,
        flush=True,
    )
    if undelivered:
        print(
            f"perfloop: {undelivered} messages were not delivered to {settings.kafka_bootstrap}"
            " (is the stack up?)",
            file=sys.stderr,
        )
        return 1
    return 130 if stop else 0
