"""`perfloop demo --real`: the loop closed on a real, unmodified torch training job on CPU.

The job is `perfloop.examples.cpu_training` (it does not import perfloop): its DataLoader has
no workers while each sample costs a blur augmentation, and it sets four times as many torch
threads as it has CPUs. It runs under ``perfloop run --tier auto``, so its process has perfloop's
hooks and a job agent. While it trains, the demo shows what the stack does about it, live: the
stream tier's diagnoses and recommendations, the actuator's signed commands, and the job's acks
(applied at a step boundary, then kept or rolled back on the agent's own verdict). When the job
ends, it reads the job's steps from the warehouse and compares its speed before the first change
with its speed after the last verdict.

`run_real_job` is what the demo and ``bench/real_job.py`` share: it runs the job once and
returns what happened (`RealRun`).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from perfloop.kafka import consumer, follow
from perfloop.schemas import (
    ActuationResult,
    Command,
    Decision,
    Diagnosis,
    Recommendation,
    SchemaError,
    decode_event,
)
from perfloop.schemas.topics import Topics
from perfloop.settings import SinkSettings, StackSettings
from perfloop.warehouse import client, wait_settled

__all__ = ["RealRun", "run_real_job", "steps_per_s"]

NS = 1_000_000_000
MS = 1_000_000
SCRIPT = "perfloop.examples.cpu_training"


@dataclass
class RealRun:
    """One run of the real job: what was published about it (with the Kafka timestamp each
    event was published with, ns) and its speed before and after the changes."""

    job_id: str
    tier: str
    exit_code: int | None = None
    events: list[tuple[int, Any]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)  # the job's own lines
    before: dict[str, float] = field(default_factory=dict)  # steps, steps_per_s, p50_ms
    after: dict[str, float] = field(default_factory=dict)

    def of(self, kind: type[Any]) -> list[tuple[int, Any]]:
        return [(t, e) for t, e in self.events if isinstance(e, kind)]

    @property
    def acks(self) -> list[ActuationResult]:
        return [e for _, e in self.of(ActuationResult)]

    @property
    def kept(self) -> list[ActuationResult]:
        return [a for a in self.acks if a.status == "kept"]

    @property
    def speedup(self) -> float | None:
        """Steps/s after the last verdict over steps/s before the first change."""
        b, a = self.before.get("steps_per_s"), self.after.get("steps_per_s")
        return a / b if a and b else None

    @property
    def closed(self) -> bool:
        """A change was applied and kept, and the job got faster."""
        return bool(self.kept) and (self.speedup or 0.0) > 1.0

    def latencies(self) -> list[dict[str, float]]:
        """Per applied change: recommendation published → command published → applied (the
        agent's stamp), and from the job's first open diagnosis for the first change."""
        cmds = {c.event_id: (t, c) for t, c in self.of(Command)}
        recs = {r.event_id: t for t, r in self.of(Recommendation)}
        first_diag = min(
            (t for t, d in self.of(Diagnosis) if d.state == "open" and d.critical_path),
            default=None,
        )
        out = []
        for i, a in enumerate(x for x in self.acks if x.status == "applied"):
            sent = cmds.get(a.command_id)
            if sent is None:
                continue
            t_cmd, cmd = sent
            row = {"command_to_applied_s": (a.ts_ns - t_cmd) / NS}
            t_rec = recs.get(cmd.rec_id)
            if t_rec is not None:
                row["recommendation_to_applied_s"] = (a.ts_ns - t_rec) / NS
            if i == 0 and first_diag is not None:
                row["diagnosis_to_applied_s"] = (a.ts_ns - first_diag) / NS
            out.append(row)
        return out


def steps_per_s(step_ms: list[float]) -> dict[str, float]:
    """Throughput of consecutive steps: their count over their summed time.

    >>> steps_per_s([100.0, 100.0, 50.0])
    {'steps': 3.0, 'steps_per_s': 12.0, 'p50_ms': 100.0}
    """
    if not step_ms:
        return {}
    return {
        "steps": float(len(step_ms)),
        "steps_per_s": len(step_ms) / (sum(step_ms) / 1000),
        "p50_ms": statistics.median(step_ms),
    }


class _Follow:
    """Reads the job's events from the loop's topics as they are published."""

    TOPICS = (Topics.DIAGNOSES, Topics.RECOMMENDATIONS, Topics.CONTROL, Topics.ACTUATIONS)

    def __init__(self, settings: StackSettings, run: RealRun, show: Callable[[str], None]) -> None:
        self.run, self.show = run, show
        self._c = consumer(settings, f"perfloop-demo-real-{run.job_id}")
        self._stop, self._assigned = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._loop, name="perfloop-demo-follow", daemon=True)

    def start(self, timeout_s: float = 30.0) -> bool:
        self._t.start()
        return self._assigned.wait(timeout_s)

    def stop(self, linger_s: float = 0.0) -> None:
        time.sleep(linger_s)
        self._stop.set()
        self._t.join(10)

    def _loop(self) -> None:
        job = self.run.job_id.encode()
        follow(self._c, list(self.TOPICS), self._take, self._stop, self._assigned,
               key=lambda k: k == job, what="demo follower")  # fmt: skip

    def _take(self, msg: Any) -> None:
        try:
            ev = decode_event(msg.value() or b"")
        except SchemaError:
            return
        self.run.events.append((msg.timestamp()[1] * MS, ev))
        line = describe(ev)
        if line:
            self.show(line)


def describe(ev: Any) -> str:
    """One line for the terminal (empty for what the demo does not show)."""
    if isinstance(ev, Diagnosis) and ev.state == "open":
        return (
            f"  diagnosis   {ev.bottleneck}: {100 * ev.step_share:.0f}% of each step"
            f"{' (critical path)' if ev.critical_path else ''}"
        )
    if isinstance(ev, Recommendation):
        return (
            f"  recommend   {ev.knob} {ev.from_value} → {ev.to_value} (expected "
            f"{ev.expected_gain_pct:.0f}% faster, confidence {ev.confidence:.2f}): {ev.rationale}"
        )
    if isinstance(ev, Decision) and ev.outcome != "issued":
        return f"  actuator    {ev.outcome} {ev.knob} → {ev.to_value}: {ev.reason}"
    if isinstance(ev, Command):
        return f"  command     {ev.knob} = {ev.value} (seq {ev.seq}, signed {ev.signature[:12]}…)"
    if isinstance(ev, ActuationResult):
        what = {"applied": "APPLIED", "rejected": "REJECTED", "kept": "KEPT",
                "rolled_back": "ROLLED BACK"}.get(ev.status, ev.status)  # fmt: skip
        at = f" at step {ev.step}" if ev.status == "applied" else ""
        why = f": {ev.reason}" if ev.reason else ""
        return f"  job         {what} {ev.knob} = {ev.value}{at}{why}"
    return ""


def run_real_job(
    settings: StackSettings,
    *,
    job_id: str,
    seconds: float = 60.0,
    tier: str = "auto",
    show: Callable[[str], None] = print,
    script_args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
) -> RealRun:
    """Run the example job once under ``perfloop run --tier TIER``; follow and measure it.
    ``env``: the job's environment (default: this process's)."""
    run = RealRun(job_id=job_id, tier=tier)
    follow = _Follow(settings, run, show)
    follow.start()
    cmd = [
        sys.executable, "-m", "perfloop.cli", "run", "--job-id", job_id, "--tier", tier,
        "--no-gpu", "--", sys.executable, "-m", SCRIPT, "--seconds", f"{seconds:g}",
        *script_args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=None if env is None else dict(env),
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        run.output.append(line)
        show(f"  job │ {line}")
    run.exit_code = proc.wait()
    follow.stop(linger_s=2.0)
    measure(settings, run)
    return run


RANK0_STEPS = (
    "SELECT step, toUnixTimestamp64Nano(ts) AS t, step_time_ms FROM steps "
    "WHERE job_id = {job:String} AND rank = 0 ORDER BY step"
)


def measure(settings: StackSettings, run: RealRun, *, timeout_s: float = 30.0) -> None:
    """Read the job's rank-0 steps from the warehouse: ``before`` the first applied change
    (without the first 5 steps: start-up) and ``after`` the last verdict (without the
    verifier's 2 settling steps). With no change, the first and second half of the run."""
    ch = client(settings)
    try:
        deadline = time.monotonic() + timeout_s
        rows: list[tuple[int, int, float]] = []
        while time.monotonic() < deadline:
            rows = ch.query(RANK0_STEPS, parameters={"job": run.job_id}).result_rows
            done = [a for a in run.acks if a.status in ("kept", "rolled_back")]
            last = max((a.step for a in done), default=-1)
            if rows and rows[-1][0] > last + 10:
                break
            time.sleep(1.0)
        # the job's last steps land with the sink's next telemetry flush
        flush_s = SinkSettings().flush_interval_s
        n = wait_settled(
            ch,
            "SELECT count() FROM steps WHERE job_id = {job:String} AND rank = 0",
            {"job": run.job_id},
            quiet_s=flush_s + 1.0,
            timeout_s=max(0.0, deadline - time.monotonic()) + flush_s,
        )
        if n != len(rows):
            rows = ch.query(RANK0_STEPS, parameters={"job": run.job_id}).result_rows
    finally:
        ch.close()
    if not rows:
        return
    applied = [a.step for a in run.acks if a.status == "applied"]
    verdicts = [a.step for a in run.acks if a.status in ("kept", "rolled_back")]
    if applied and verdicts:
        first, last = min(applied), max(verdicts) + 2
    else:
        first = last = rows[len(rows) // 2][0]
    run.before = steps_per_s([ms for s, _, ms in rows if 5 <= s < first])
    run.after = steps_per_s([ms for s, _, ms in rows if s > last])


def real_demo(settings: StackSettings, *, seconds: float = 60.0) -> int:
    """``perfloop demo --real``: run the job, show the loop, print the warehouse's record;
    0 if the loop closed (a change applied, kept, and the job faster after it)."""
    from perfloop.demo import QUERIES, format_table
    from perfloop.producers.launch import new_job_id

    job_id = "demo-real-" + new_job_id().removeprefix("run-")
    print(
        f"job {job_id}: python -m {SCRIPT} --seconds {seconds:g}, unmodified, under "
        "`perfloop run --tier auto`\n(no DataLoader workers for a costly augmentation, and 4× "
        "more torch threads than CPUs)\n",
        flush=True,
    )
    run = run_real_job(
        settings, job_id=job_id, seconds=seconds, show=lambda s: print(s, flush=True)
    )
    print("\nwhat the warehouse holds (perfloop sql …):")
    ch = client(settings)
    try:
        for title, sql in QUERIES[:4]:
            r = ch.query(sql, parameters={"job": job_id})
            print(f"\n» {title}: {sql}\n{format_table(list(r.column_names), r.result_rows)}")
    finally:
        ch.close()
    b, a = run.before, run.after
    if b and a:
        print(
            f"\nsteps/s: {b['steps_per_s']:.2f} before the first change ({b['steps']:.0f} steps, "
            f"p50 {b['p50_ms']:.0f} ms) → {a['steps_per_s']:.2f} after the last verdict "
            f"({a['steps']:.0f} steps, p50 {a['p50_ms']:.0f} ms): {run.speedup:.2f}×"
        )
    for lat in run.latencies():
        parts = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f} s"
                          for k, v in lat.items())  # fmt: skip
        print(f"  latency: {parts}")
    if run.closed:
        print(
            "\nloop closed on a real job: detected → recommended → commanded → applied → "
            "verified → kept → faster"
        )
        return 0
    print(
        f"\nloop NOT closed (job exit code {run.exit_code}): see `perfloop status` and the logs "
        "under $PERFLOOP_HOME/logs",
        file=sys.stderr,
    )
    return 1
