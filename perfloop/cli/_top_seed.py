"""The warehouse's seed of `perfloop top`: a job's recent state, so that a job already running
shows its numbers at once, before the topics bring more.

`load_seed` reads (in the view's worker thread) the job's steps and phase spans of its last
`perfloop.cli._top_state.RECENT_S` seconds of steps, its latest GPU and host readings, its
lifecycle, what it is, its run phase, and its recent recommendations and commands with their
acks; `JobSeed.apply` hands them to the view's `TopState` (in the view's thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perfloop.cli._top_lines import ChangeLine, RecLine
from perfloop.cli._top_state import MAX_STEPS, RECENT_S, TopState
from perfloop.settings import BaseServiceSettings

__all__ = ["JobSeed", "load_seed"]

_LIMIT = 200_000  # rows of one query at most (a job of thousands of ranks)
_LAST_STEPS = (
    "ts >= (SELECT max(ts) FROM steps WHERE job_id = {job:String})"
    " - toIntervalSecond({recent:UInt32})"
)
_STEPS = f"""
SELECT node, rank, toUnixTimestamp64Nano(ts), step, step_time_ms, data_wait_ms FROM steps
WHERE job_id = {{job:String}} AND {_LAST_STEPS}
ORDER BY rank, ts DESC LIMIT {MAX_STEPS} BY rank LIMIT {_LIMIT}
"""
_SPANS = f"""
SELECT node, rank, step, phase, sum(duration_ms) FROM spans
WHERE job_id = {{job:String}} AND depth = 0 AND phase != 'user' AND {_LAST_STEPS}
GROUP BY node, rank, step, phase LIMIT {_LIMIT}
"""
_LATEST = "ts >= (SELECT max(ts) FROM {table} WHERE job_id = {{job:String}}) - toIntervalSecond(60)"
_GPU = f"""
SELECT node, rank, device, toUnixTimestamp64Nano(max(ts)), argMax(sm_util_pct, ts),
       argMax(mem_used_bytes, ts), argMax(mem_total_bytes, ts), argMax(power_w, ts)
FROM gpu_samples WHERE job_id = {{job:String}} AND {_LATEST.format(table="gpu_samples")}
GROUP BY node, rank, device LIMIT {_LIMIT}
"""
_HOST = f"""
SELECT node, rank, toUnixTimestamp64Nano(max(ts)), argMax(proc_cpu_pct, ts),
       argMax(loader_cpu_pct, ts)
FROM host_samples WHERE job_id = {{job:String}} AND {_LATEST.format(table="host_samples")}
GROUP BY node, rank LIMIT {_LIMIT}
"""
_LIFECYCLE = """
SELECT rank, argMax(state, (ts, state IN ('finished', 'failed', 'killed'))),
       argMax(exit_code, (ts, state IN ('finished', 'failed', 'killed'))),
       toUnixTimestamp64Nano(max(ts))
FROM job_lifecycle WHERE job_id = {job:String} GROUP BY rank
"""
_INFO = """
SELECT count(), max(world_size), argMax(model_name, ts), groupUniqArray(node)
FROM job_info WHERE job_id = {job:String}
"""
_RUN_PHASE = """
SELECT count(), argMax(phase, ts) FROM phases
WHERE job_id = {job:String} AND level = 'run' AND rank = -1
"""
_RECS = """
SELECT toUnixTimestamp64Nano(r.ts), r.rec_id, r.knob, r.from_value, r.to_value,
       r.expected_gain_pct, r.confidence, r.rationale, a.outcome
FROM (
    SELECT * FROM recommendations WHERE job_id = {job:String}
    ORDER BY ts DESC LIMIT 1 BY rec_id LIMIT 20
) AS r
LEFT JOIN (
    SELECT rec_id, argMax(outcome, ts) AS outcome FROM audit WHERE job_id = {job:String}
    GROUP BY rec_id
) AS a ON a.rec_id = r.rec_id
"""
_COMMANDS = """
SELECT toUnixTimestamp64Nano(ts), command_id, seq, knob, from_value, value FROM commands
WHERE job_id = {job:String} ORDER BY ts DESC LIMIT 1 BY command_id LIMIT 20
"""
_ACKS = """
SELECT command_id, status, reason, step, evidence, toUnixTimestamp64Nano(ts), knob, value
FROM actuations WHERE job_id = {job:String} AND command_id IN {ids:Array(String)} ORDER BY ts
"""


@dataclass
class JobSeed:
    """One job's recent state as the warehouse holds it (rows of each query)."""

    job_id: str
    steps: list[tuple[Any, ...]] = field(default_factory=list)
    spans: list[tuple[Any, ...]] = field(default_factory=list)
    gpu: list[tuple[Any, ...]] = field(default_factory=list)
    host: list[tuple[Any, ...]] = field(default_factory=list)
    lifecycle: list[tuple[Any, ...]] = field(default_factory=list)
    info: tuple[Any, ...] | None = None
    run_phase: str = ""
    recs: list[tuple[Any, ...]] = field(default_factory=list)
    commands: list[tuple[Any, ...]] = field(default_factory=list)
    acks: list[tuple[Any, ...]] = field(default_factory=list)

    def apply(self, state: TopState) -> None:
        """Hand the rows to ``state`` the way the live events come (a step or span the feed
        brought already counts once)."""
        job = self.job_id
        j = state.job(job)
        for node, rank, ts, step, ms, wait in sorted(self.steps, key=lambda r: r[2]):
            state.add_step(job, node, rank, ts, step, ms, wait)
        for node, rank, step, phase, ms in self.spans:
            state.add_span(job, node, rank, step, phase, ms, seeded=True)
        for node, rank, device, ts, util, used, total, power in self.gpu:
            state.add_gpu(job, node, rank, device, ts, util, used, total, power)
        for node, rank, ts, cpu, loader in self.host:
            state.add_host(job, node, rank, ts, cpu, loader)
        for rank, st, code, ts in self.lifecycle:
            j.lifecycle.setdefault(int(rank), (str(st), code))
            j.last_ns = max(j.last_ns, int(ts))
        if self.info is not None and self.info[0]:
            _, world, model, nodes = self.info
            j.world_size = max(j.world_size, int(world))
            j.model = j.model or str(model)
            j.nodes.update(str(n) for n in nodes)
        j.run_phase = j.run_phase or self.run_phase
        for ts, rec_id, knob, before, after, gain, conf, why, outcome in reversed(self.recs):
            state.add_rec(job, RecLine(int(ts), rec_id, knob, before, after, float(gain),
                                       float(conf), why, outcome or ""))  # fmt: skip
        for ts, cid, seq, knob, before, after in reversed(self.commands):
            state.add_command(job, ChangeLine(int(ts), cid, int(seq), knob, before, after))
        for cid, status, reason, step, evidence, ts, knob, value in self.acks:
            state.ack(job, cid, status, ts_ns=int(ts), reason=reason, step=int(step),
                      evidence=dict(evidence), knob=knob, value=value)  # fmt: skip


def load_seed(settings: BaseServiceSettings, job_id: str, *, recent_s: float = RECENT_S) -> JobSeed:
    """Read one job's recent state; raises `WarehouseError` (one line) if the warehouse
    cannot answer."""
    from perfloop.warehouse import query

    p: dict[str, Any] = {"job": job_id, "recent": int(recent_s)}

    def rows(sql: str, **extra: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in query(settings, sql, p | extra).result_rows]

    seed = JobSeed(job_id)
    seed.steps = rows(_STEPS)
    seed.spans = rows(_SPANS)
    seed.gpu = rows(_GPU)
    seed.host = rows(_HOST)
    seed.lifecycle = rows(_LIFECYCLE)
    seed.info = next(iter(rows(_INFO)), None)
    phase = rows(_RUN_PHASE)
    seed.run_phase = str(phase[0][1]) if phase and phase[0][0] else ""
    seed.recs = rows(_RECS)
    seed.commands = rows(_COMMANDS)
    if seed.commands:
        seed.acks = rows(_ACKS, ids=[c[1] for c in seed.commands])
    return seed
