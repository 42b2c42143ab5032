"""`perfloop demo`: the whole loop, live, on a simulated job with data-loader starvation.

The simulated job runs in this process with a job agent beside it. The demo prints the job's
step time as it goes, the recommendation the stream tier makes, the command the actuator
signs, the moment the job applies it and the ack, and the agent's verdict on the change once
it has compared the steps after it with those before (kept, or rolled back); then it queries
the warehouse and prints each SQL statement with its result. It exits 0 only if the loop
closed: the command was applied, the agent kept it, and steps got faster.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from perfloop.actuators.agent import JobAgent, keyring_for
from perfloop.exceptions import PerfloopError
from perfloop.kafka import consumer, follow
from perfloop.producers.publisher import Publisher
from perfloop.producers.scenarios import Fault
from perfloop.producers.simulator import SimConfig, SimulatedJob, StepReport
from perfloop.schemas import ActuationResult, Command, Recommendation, SchemaError, decode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import SinkSettings, StackSettings
from perfloop.warehouse import client, wait_settled

__all__ = ["DemoResult", "run_demo", "verify_in_warehouse"]

KNOB = "dataloader.num_workers"


@dataclass
class DemoResult:
    job_id: str
    recommendation: Recommendation | None = None
    command: Command | None = None
    result: ActuationResult | None = None
    verdict: ActuationResult | None = None  # kept or rolled back, with the evidence
    applied_step: int | None = None
    before_ms: list[float] = field(default_factory=list)
    after_ms: list[float] = field(default_factory=list)
    queries: list[tuple[str, list[str], list[tuple[Any, ...]]]] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        return (
            self.result is not None
            and self.result.status == "applied"
            and self.verdict is not None
            and self.verdict.status == "kept"
            and bool(self.before_ms and self.after_ms)
            and statistics.median(self.after_ms) < statistics.median(self.before_ms)
        )


class _Watcher:
    """Follows recommendations and commands for one job (what the terminal shows)."""

    def __init__(self, settings: StackSettings, job_id: str, emit: Callable[[str], None]) -> None:
        self.job_id, self.emit = job_id, emit
        self.rec: Recommendation | None = None
        self.cmd: Command | None = None
        self._shown_rec = self._shown_cmd = False
        self._c = consumer(settings, f"perfloop-demo-{job_id}", **{"auto.offset.reset": "latest"})
        self._stop = threading.Event()
        self._assigned = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self, timeout_s: float) -> bool:
        self._t.start()
        return self._assigned.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def _show(self) -> None:
        # The two topics arrive in any order; show them in the loop's order.
        rec, cmd = self.rec, self.cmd
        if rec is not None and not self._shown_rec:
            self._shown_rec = True
            self.emit(
                f"  ► recommendation  {rec.knob}: {rec.from_value} → {rec.to_value} "
                f"(expected gain {rec.expected_gain_pct:.0f}%, "
                f"confidence {rec.confidence:.2f})\n      {rec.rationale}"
            )
        if cmd is not None and self._shown_rec and not self._shown_cmd:
            self._shown_cmd = True
            self.emit(
                f"  ► command         seq {cmd.seq}, {cmd.knob} = {cmd.value}, "
                f"signed {cmd.signature[:12]}…, expires in "
                f"{(cmd.expires_ts_ns - time.time_ns()) / 1e9:.0f} s"
            )

    def _run(self) -> None:
        job = self.job_id.encode()
        follow(self._c, [Topics.RECOMMENDATIONS, Topics.CONTROL], self._take, self._stop,
               self._assigned, key=lambda k: k == job, poll_s=0.1, what="demo watcher")  # fmt: skip

    def _take(self, msg: Any) -> None:
        try:
            ev = decode_event(msg.value() or b"")
        except SchemaError:
            return
        if isinstance(ev, Recommendation) and self.rec is None:
            self.rec = ev
        elif isinstance(ev, Command) and self.cmd is None:
            self.cmd = ev
        self._show()


def run_demo(
    settings: StackSettings,
    *,
    signing_key: bytes,
    ranks: int = 4,
    fault_at_s: float = 12.0,
    max_s: float = 75.0,
    after_s: float = 12.0,
    out: TextIO = sys.stdout,
) -> DemoResult:
    """Run the simulated job with the fault until the loop closes (or ``max_s``)."""
    job_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    res = DemoResult(job_id)
    lock = threading.Lock()

    def emit(line: str) -> None:
        with lock:
            out.write(line + "\n")
            out.flush()

    emit(
        f"perfloop demo — job {job_id}: {ranks} ranks, data-loader starvation at "
        f"{fault_at_s:g} s\n  kafka {settings.kafka_bootstrap}   warehouse "
        f"{settings.clickhouse_url}"
    )
    publisher = Publisher(settings)
    cfg = SimConfig(
        job_id=job_id,
        ranks_per_node=ranks,
        scenario="dataloader_starvation",
        faults=(Fault("dataloader_starvation", onset_s=fault_at_s),),
    )
    job = SimulatedJob(cfg, publisher)

    def on_result(r: ActuationResult) -> None:
        if r.status in ("kept", "rolled_back"):
            res.verdict = r
        else:
            res.result = r
        if r.status == "applied":
            res.applied_step = r.step
        label = "verdict" if r.status in ("kept", "rolled_back") else "ack"
        emit(
            f"  ► {label:<15} command {r.command_id[:12]}… {r.status.upper()} at step "
            f"{r.step}{': ' + r.reason if r.reason else ''}"
        )

    agent = JobAgent(
        settings,
        job_id=job_id,
        node=job.cfg.node,
        signing_key=signing_key,
        keyring=keyring_for(settings),
        handlers={KNOB: job.set_num_workers},
        read=job.knob_value,
        on_result=on_result,
    )
    watcher = _Watcher(settings, job_id, emit)
    if not (agent.start(20.0) and watcher.start(20.0)):
        raise PerfloopError("the control topic was not assigned within 20 s; is the stack up?")

    window: list[StepReport] = []
    last_print = [0.0]
    done_at: list[float] = []
    now_s = [0.0]

    def on_step(rep: StepReport) -> None:
        agent.observe_step(rep.step, rep.step_time_ms)
        now_s[0] = rep.elapsed_s
        window.append(rep)
        if res.applied_step is None:
            if rep.fault_active:
                res.before_ms.append(rep.step_time_ms)
        elif rep.step > res.applied_step:
            res.after_ms.append(rep.step_time_ms)
            if not done_at:
                done_at.append(rep.elapsed_s)
        if rep.elapsed_s - last_print[0] >= 2.0:
            last_print[0] = rep.elapsed_s
            mean = statistics.fmean(r.step_time_ms for r in window)
            share = statistics.fmean(r.data_wait_share for r in window)
            emit(
                f"  t={rep.elapsed_s:5.1f}s  step {rep.step:4d}  step time {mean:6.1f} ms  "
                f"data wait {100 * share:4.0f}%  workers {rep.num_workers}"
                f"{'  [fault]' if rep.fault_active else ''}"
            )
            window.clear()

    def stop() -> bool:
        return bool(done_at) and now_s[0] - done_at[0] >= after_s and not agent.verifying

    try:
        job.run(max_s, on_step=on_step, step_boundary=agent.step_boundary, stop=stop)
    finally:
        publisher.flush(10)
        agent.stop()
        watcher.stop()
    res.recommendation, res.command = watcher.rec, watcher.cmd
    if res.before_ms and res.after_ms:
        emit(
            f"  step time: {statistics.median(res.before_ms):.1f} ms with the fault → "
            f"{statistics.median(res.after_ms):.1f} ms after the change (medians)"
        )
    return res


QUERIES: tuple[tuple[str, str], ...] = (
    (
        "recommendation",
        "SELECT ts, knob, from_value, to_value, expected_gain_pct, rationale FROM recommendations "
        "WHERE job_id = {job:String} ORDER BY ts",
    ),
    (
        "command",
        "SELECT ts, seq, knob, from_value, value, substring(signature, 1, 16) AS signature "
        "FROM commands WHERE job_id = {job:String} ORDER BY ts",
    ),
    (
        "ack and verdict",
        "SELECT ts, status, knob, value, step, round(evidence['ratio'], 2) AS after_over_before, "
        "round(evidence['p_value'], 4) AS p_value FROM actuations "
        "WHERE job_id = {job:String} ORDER BY ts",
    ),
    (
        "the actuator's decisions",
        "SELECT ts, outcome, actor, tier, reason FROM audit WHERE job_id = {job:String} "
        "ORDER BY ts",
    ),
    (
        "step time before/after",
        "SELECT if(step < {applied:UInt64}, 'before', 'after') AS phase, "
        "count() AS steps, round(quantileExact(0.5)(step_time_ms), 1) AS p50_step_ms, "
        "round(avg(data_wait_ms / step_time_ms), 3) AS data_wait_share FROM steps "
        "WHERE job_id = {job:String} AND rank = 0 AND step >= {since:UInt64} "
        "GROUP BY phase ORDER BY phase DESC",
    ),
    (
        "windows",
        "SELECT ts, count() AS ranks, round(avg(mean), 3) AS data_wait_share FROM windows "
        "WHERE job_id = {job:String} AND metric = 'data_wait_share' GROUP BY ts ORDER BY ts",
    ),
)


def verify_in_warehouse(
    settings: StackSettings, res: DemoResult, *, timeout_s: float = 30.0
) -> None:
    """Wait for the sink to land the loop's rows, then run `QUERIES` into ``res.queries``."""
    ch = client(settings)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = ch.query(
                "SELECT count() FROM actuations WHERE job_id = {job:String}",
                parameters={"job": res.job_id},
            ).result_rows[0][0]
            if n:
                break
            time.sleep(0.5)
        # the job's last steps land with the sink's next telemetry flush
        flush_s = SinkSettings().flush_interval_s
        wait_settled(
            ch,
            "SELECT count() FROM steps WHERE job_id = {job:String}",
            {"job": res.job_id},
            quiet_s=flush_s + 1.0,
            timeout_s=max(0.0, deadline - time.monotonic()) + flush_s,
        )
        applied = res.applied_step or 0
        # "before" means steps under the fault, so start the comparison at the fault.
        fault_step = ch.query(
            "SELECT min(step) FROM steps WHERE job_id = {job:String} AND rank = 0 "
            "AND data_wait_ms > step_time_ms * 0.25",
            parameters={"job": res.job_id},
        ).result_rows[0][0]
        params = {"job": res.job_id, "applied": applied, "since": fault_step or 0}
        for title, sql in QUERIES:
            r = ch.query(sql, parameters=params)
            res.queries.append((f"{title}: {sql}", list(r.column_names), r.result_rows))
    finally:
        ch.close()


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """A plain text table."""
    cells = [[str(c) for c in columns]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 60 else s[:57] + "…"
