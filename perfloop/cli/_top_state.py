"""What `perfloop top` shows, and how it follows the events: pure state, no I/O, no widgets.

`TopState` takes what the feed decodes (telemetry `Batch`es, events, and `Seen` marks for
jobs whose telemetry is not decoded) and the warehouse's seed (`seed_jobs`, and the same
`add_step` / `add_span` / `add_gpu` / `add_host` calls the batches make) and answers what the
view draws: the jobs seen (`job_lines`), one job's summary (`summary`), its ranks with their
step time, phase shares and GPU/CPU use (`rank_lines`), its open diagnoses, its
recommendations and its changes with their acks and verdicts.

Step times and phase shares are over a rank's last `RECENT_S` seconds of steps (event time).
A step or span seen twice (in the seed and live) counts once.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from perfloop.cli._jobs_rows import DiagnosisSummary, JobRow, job_state
from perfloop.cli._top_lines import ChangeLine, JobLine, RankLine, RecLine, Seen, Summary
from perfloop.schemas import (
    ActuationResult,
    Batch,
    Command,
    Decision,
    Diagnosis,
    JobInfo,
    JobLifecycle,
    PhaseChange,
    Recommendation,
    StepEvent,
)

__all__ = ["MAX_STEPS", "PHASE_COLUMNS", "RECENT_S", "TopState"]

NS = 1_000_000_000
RECENT_S = 30.0
PHASE_COLUMNS = ("data_wait", "forward", "backward", "comm", "optimizer")
"""The phases `perfloop top` gives a column each; the rest of a step is ``other``."""
MAX_STEPS = 256
"""Steps kept per rank (and as many steps' phase spans; twice that while they wait)."""
_MAX_ITEMS = 20  # recommendations and changes kept per job
# How far a command got: a later ack of a lower rank (another rank's "applied" after the
# verdict) does not take it back.
_PROGRESS = {"sent": 0, "applied": 1, "rejected": 2, "kept": 2, "rolled_back": 2}


@dataclass
class _Rank:
    node: str = ""
    steps: OrderedDict[int, tuple[int, float, float]] = field(default_factory=OrderedDict)
    phases: dict[int, dict[str, float]] = field(default_factory=dict)
    seeded_spans: set[int] = field(default_factory=set)
    gpu: dict[int, tuple[float, int, int, float]] = field(default_factory=dict)
    cpu_pct: float | None = None
    loader_cpu_pct: float | None = None


@dataclass
class _Job:
    job_id: str
    last_ns: int = 0
    lifecycle: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    world_size: int = 0
    nodes: set[str] = field(default_factory=set)
    model: str = ""
    run_phase: str = ""
    seed_step_ms: float | None = None
    seed_steps_per_s: float | None = None
    seed_change: str = ""
    ranks: dict[int, _Rank] = field(default_factory=dict)
    node_gpu: dict[tuple[str, int], tuple[float, int, int, float]] = field(default_factory=dict)
    node_cpu: dict[str, tuple[float, float]] = field(default_factory=dict)
    diagnoses: dict[str, DiagnosisSummary] = field(default_factory=dict)
    recs: OrderedDict[str, RecLine] = field(default_factory=OrderedDict)
    changes: OrderedDict[str, ChangeLine] = field(default_factory=OrderedDict)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _rate(steps: Sequence[tuple[int, int]]) -> float | None:
    """Steps per second from ``(step, ts_ns)`` pairs."""
    if len(steps) < 2:
        return None
    (s0, t0), (s1, t1) = min(steps), max(steps)
    return (s1 - s0) / ((t1 - t0) / NS) if t1 > t0 and s1 > s0 else None


class TopState:
    """Every job `perfloop top` has heard of, and the detail of the one it shows.

    >>> from perfloop.schemas import StepEvent
    >>> s = TopState()
    >>> for i in range(3):
    ...     s.apply(StepEvent(ts_ns=(i + 1) * NS, job_id="j", node="n", rank=0, step=i,
    ...                       step_time_ms=100.0 + i))
    >>> s.summary("j").step_ms, s.rank_lines("j")[0].steps_per_s
    (101.0, 1.0)
    """

    def __init__(self, *, recent_s: float = RECENT_S) -> None:
        self.recent_ns = int(recent_s * NS)
        self.jobs: dict[str, _Job] = {}

    def job(self, job_id: str) -> _Job:
        j = self.jobs.get(job_id)
        if j is None:
            j = self.jobs[job_id] = _Job(job_id)
        return j

    def _saw(self, job_id: str, ts_ns: int) -> _Job:
        j = self.job(job_id)
        j.last_ns = max(j.last_ns, ts_ns)
        return j

    # -- the seed --------------------------------------------------------------------------

    def seed_jobs(self, rows: Iterable[JobRow]) -> None:
        """What the warehouse knows of recent jobs (`perfloop jobs`' rows)."""
        for r in rows:
            j = self._saw(r.job_id, r.last_seen_ns)
            if r.state in ("finished", "failed", "killed") and -1 not in j.lifecycle:
                j.lifecycle[-1] = (r.state, r.exit_code)
            j.world_size = j.world_size or (r.ranks or 0)
            j.seed_step_ms, j.seed_steps_per_s = r.step_time_ms, r.steps_per_s
            j.seed_change = r.last_change.text() if r.last_change else ""
            for d in r.diagnoses:
                j.diagnoses.setdefault(d.diagnosis_id or d.bottleneck, d)

    # -- telemetry ---------------------------------------------------------------------------

    def _rank(self, j: _Job, node: str, rank: int) -> _Rank:
        r = j.ranks.get(rank)
        if r is None:
            r = j.ranks[rank] = _Rank(node=node)
        r.node = node or r.node
        if node:
            j.nodes.add(node)
        return r

    def add_step(self, job_id: str, node: str, rank: int, ts_ns: int, step: int,
                 step_ms: float, data_wait_ms: float = 0.0) -> None:  # fmt: skip
        """One finished step of one rank."""
        j = self._saw(job_id, ts_ns)
        r = self._rank(j, node, rank)
        if step in r.steps:
            return
        r.steps[step] = (ts_ns, step_ms, data_wait_ms)
        if len(r.steps) > 1 and step < next(reversed(r.steps)):
            r.steps = OrderedDict(sorted(r.steps.items()))
        while len(r.steps) > MAX_STEPS:
            old, _ = r.steps.popitem(last=False)
            r.phases.pop(old, None)
            r.seeded_spans.discard(old)

    def add_span(self, job_id: str, node: str, rank: int, step: int, phase: str,
                 duration_ms: float, *, depth: int = 0, seeded: bool = False) -> None:  # fmt: skip
        """A phase span of a step (nested spans, depth > 0, are inside one at depth 0 and
        do not count again). ``seeded``: a sum over the step from the warehouse."""
        if depth > 0 or phase == "user":
            return
        r = self._rank(self.job(job_id), node, rank)
        if seeded:
            r.seeded_spans.add(step)
        elif step in r.seeded_spans:
            return
        if r.steps and step < next(iter(r.steps)) and len(r.steps) >= MAX_STEPS:
            return
        phases = r.phases.setdefault(step, {})
        phases[phase] = phases.get(phase, 0.0) + duration_ms
        if len(r.phases) > 2 * MAX_STEPS:  # spans of steps never reported: keep the last
            for old in sorted(r.phases)[:-MAX_STEPS]:
                del r.phases[old]
                r.seeded_spans.discard(old)

    def add_gpu(self, job_id: str, node: str, rank: int, device: int, ts_ns: int,
                util_pct: float, mem_used: int, mem_total: int,
                power_w: float) -> None:  # fmt: skip
        """A GPU reading; a rank's own when ``rank`` ≥ 0, else its node's."""
        j = self._saw(job_id, ts_ns)
        reading = (util_pct, mem_used, mem_total, power_w)
        if rank >= 0:
            self._rank(j, node, rank).gpu[device] = reading
        else:
            j.node_gpu[(node, device)] = reading
            j.nodes.add(node)

    def add_host(self, job_id: str, node: str, rank: int, ts_ns: int, cpu_pct: float,
                 loader_cpu_pct: float = 0.0) -> None:  # fmt: skip
        """A host reading of the training process (``rank`` ≥ 0) or of the node."""
        j = self._saw(job_id, ts_ns)
        if rank >= 0:
            r = self._rank(j, node, rank)
            r.cpu_pct, r.loader_cpu_pct = cpu_pct, loader_cpu_pct
        else:
            j.node_cpu[node] = (cpu_pct, loader_cpu_pct)
            j.nodes.add(node)

    def apply_batch(self, b: Batch) -> None:
        """A telemetry batch, row by row (only the kinds `perfloop top` shows)."""
        c = {k: v.tolist() for k, v in b.columns.items()}
        n = len(c["ts_ns"])
        job, node = b.job_id, b.node
        if b.kind == "step":
            wait = c.get("data_wait_ms") or [0.0] * n
            for i in range(n):
                self.add_step(job, node, c["rank"][i], c["ts_ns"][i], c["step"][i],
                              c["step_time_ms"][i], wait[i])  # fmt: skip
        elif b.kind == "span":
            depth = c.get("depth") or [0] * n
            for i in range(n):
                self.add_span(job, node, c["rank"][i], c["step"][i], c["phase"][i],
                              c["duration_ms"][i], depth=depth[i])  # fmt: skip
            if n:
                self._saw(job, max(c["ts_ns"]))
        elif b.kind == "gpu":
            z = [0] * n
            for i in range(n):
                self.add_gpu(job, node, c["rank"][i], c["device"][i], c["ts_ns"][i],
                             c.get("sm_util_pct", z)[i], c.get("mem_used_bytes", z)[i],
                             c.get("mem_total_bytes", z)[i], c.get("power_w", z)[i])  # fmt: skip
        elif b.kind == "host":
            z = [0.0] * n
            cpu, loader = c.get("proc_cpu_pct", z), c.get("loader_cpu_pct", z)
            for i in range(n):
                self.add_host(job, node, c["rank"][i], c["ts_ns"][i], cpu[i], loader[i])
        elif n:
            self._saw(job, max(c["ts_ns"]))

    # -- events ------------------------------------------------------------------------------

    def apply(self, item: Any) -> None:
        """Whatever the feed hands over: a `Batch`, an event, or a `Seen` mark."""
        if isinstance(item, Batch):
            self.apply_batch(item)
        elif isinstance(item, Seen):
            self._saw(item.job_id, item.ts_ns)
        else:
            self.apply_event(item)

    def apply_event(self, ev: Any) -> None:
        """One event about a job's run or its loop; the kinds `perfloop top` does not show
        (a live setting's `ConfigChange` names who issued it, not a job) are skipped."""
        if isinstance(ev, StepEvent):
            self.add_step(ev.job_id, ev.node, ev.rank, ev.ts_ns, ev.step, ev.step_time_ms,
                          ev.data_wait_ms)  # fmt: skip
        elif isinstance(ev, JobLifecycle):
            self._saw(ev.job_id, ev.ts_ns).lifecycle[ev.rank] = (ev.state, ev.exit_code)
        elif isinstance(ev, JobInfo):
            j = self._saw(ev.job_id, ev.ts_ns)
            j.world_size = max(j.world_size, ev.world_size)
            j.model = ev.model_name or j.model
            j.nodes.add(ev.node)
        elif isinstance(ev, PhaseChange):
            if ev.level == "run" and ev.rank == -1:
                self.job(ev.job_id).run_phase = ev.phase
        elif isinstance(ev, Diagnosis):
            self._diagnosis(self.job(ev.job_id), ev)
        elif isinstance(ev, Recommendation):
            self.add_rec(ev.job_id, RecLine(
                ev.ts_ns, ev.event_id, ev.knob, _text(ev.from_value), _text(ev.to_value),
                ev.expected_gain_pct, ev.confidence, ev.rationale,
            ))  # fmt: skip
        elif isinstance(ev, Decision):
            self.decide(ev.job_id, ev.rec_id, ev.outcome)
        elif isinstance(ev, Command):
            self.add_command(ev.job_id, ChangeLine(
                ev.ts_ns, ev.event_id, ev.seq, ev.knob, _text(ev.from_value), _text(ev.value)
            ))  # fmt: skip
        elif isinstance(ev, ActuationResult):
            self.ack(ev.job_id, ev.command_id, ev.status, ts_ns=ev.ts_ns, reason=ev.reason,
                     step=ev.step, evidence=ev.evidence, knob=ev.knob,
                     value=_text(ev.value))  # fmt: skip

    def _diagnosis(self, j: _Job, d: Diagnosis) -> None:
        if d.state == "resolved":
            j.diagnoses.pop(d.diagnosis_id, None)
            return
        j.diagnoses[d.diagnosis_id] = DiagnosisSummary(
            d.bottleneck, d.level, tuple(d.ranks), d.step_share, d.critical_path,
            d.explained_by, diagnosis_id=d.diagnosis_id, summary=d.summary, onset_ns=d.onset_ns,
        )  # fmt: skip

    def add_rec(self, job_id: str, rec: RecLine) -> None:
        """A recommendation (one seen before keeps the actuator's decision about it)."""
        j = self.job(job_id)
        old = j.recs.get(rec.rec_id)
        j.recs[rec.rec_id] = replace(rec, outcome=rec.outcome or (old.outcome if old else ""))
        _trim(j.recs)

    def decide(self, job_id: str, rec_id: str, outcome: str) -> None:
        """The actuator's (or a person's) decision about a recommendation shown."""
        j = self.jobs.get(job_id)
        rec = j.recs.get(rec_id) if j is not None else None
        if j is not None and rec is not None:
            j.recs[rec_id] = replace(rec, outcome=outcome)

    def add_command(self, job_id: str, cmd: ChangeLine) -> None:
        """A command sent to the job (one acked before keeps how far it got)."""
        j = self.job(job_id)
        old = j.changes.get(cmd.command_id)
        if old is not None:
            cmd = replace(cmd, status=old.status, reason=old.reason, step=old.step,
                           before_ms=old.before_ms, after_ms=old.after_ms)  # fmt: skip
        j.changes[cmd.command_id] = cmd
        _trim(j.changes)

    def ack(self, job_id: str, command_id: str, status: str, *, ts_ns: int, reason: str = "",
            step: int = 0, evidence: dict[str, float] | None = None, knob: str = "",
            value: str = "") -> None:  # fmt: skip
        """A rank's ack of a command: applied or rejected, then kept or rolled back."""
        j = self.job(job_id)
        old = j.changes.get(command_id)
        if old is None:  # sent before we looked: show what the ack says
            old = ChangeLine(ts_ns, command_id, 0, knob, "", value)
            j.changes[command_id] = old
            _trim(j.changes)
        if _PROGRESS.get(status, 0) < _PROGRESS.get(old.status, 0):
            return
        ev = evidence or {}
        j.changes[command_id] = replace(
            old,
            status=status,
            reason=reason or old.reason,
            step=step if status == "applied" else old.step or step,
            before_ms=ev.get("before_ms", old.before_ms),
            after_ms=ev.get("after_ms", old.after_ms),
        )

    # -- what the view shows -----------------------------------------------------------------

    def _state(self, j: _Job, now_ns: int) -> tuple[str, int | None]:
        """`perfloop jobs`' state; ``waiting`` for a job asked for and not heard from yet."""
        if not j.last_ns and not j.lifecycle:
            return "waiting", None
        return job_state([(r, s, c) for r, (s, c) in j.lifecycle.items()], j.last_ns, now_ns)

    def _recent(self, r: _Rank) -> list[tuple[int, int, float, float]]:
        """The rank's steps (step, ts, ms, wait) in its last RECENT_S seconds."""
        if not r.steps:
            return []
        last = max(t for t, _, _ in r.steps.values())
        return [(s, t, ms, w) for s, (t, ms, w) in r.steps.items() if t >= last - self.recent_ns]

    def job_lines(self, now_ns: int) -> list[JobLine]:
        """The jobs seen, running ones first (then one asked for and not heard from yet), the
        most recently seen first."""
        out = []
        for j in self.jobs.values():
            s = self.summary(j.job_id, now_ns)
            changes = self.changes(j.job_id)
            change = changes[0].text() if changes else j.seed_change
            out.append(JobLine(j.job_id, s.state, s.exit_code, s.ranks, s.step_ms, s.steps_per_s,
                               tuple(self.diagnoses(j.job_id)), change, j.last_ns))  # fmt: skip
        live = ("running", "silent", "waiting")
        out.sort(key=lambda x: (x.state not in live, x.state == "waiting", -x.last_ns, x.job_id))
        return out

    def summary(self, job_id: str, now_ns: int | None = None) -> Summary:
        """The job at a glance (``now_ns``: for running or silent; default its last event)."""
        j = self.job(job_id)
        state, code = self._state(j, j.last_ns if now_ns is None else now_ns)
        recent = {k: self._recent(r) for k, r in j.ranks.items()}
        times = [ms for rs in recent.values() for _, _, ms, _ in rs]
        rates = [x for rs in recent.values() if (x := _rate([(s, t) for s, t, _, _ in rs]))]
        return Summary(
            job_id=job_id,
            state=state,
            exit_code=code,
            ranks=j.world_size or len(j.ranks),
            nodes=len(j.nodes),
            model=j.model,
            run_phase=j.run_phase,
            step_ms=_median(times) if times else j.seed_step_ms,
            steps_per_s=_median(rates) if rates else (None if times else j.seed_steps_per_s),
            last_ns=j.last_ns,
        )

    def rank_lines(self, job_id: str) -> list[RankLine]:
        """Each rank of the job, in rank order."""
        j = self.job(job_id)
        out = []
        for k in sorted(j.ranks):
            r = j.ranks[k]
            recent = self._recent(r)
            gpu = list(r.gpu.values()) or [v for (n, _), v in j.node_gpu.items() if n == r.node]
            mem = [u / t for _, u, t, _ in gpu if t > 0]
            own = (r.cpu_pct, r.loader_cpu_pct or 0.0) if r.cpu_pct is not None else None
            cpu = own or j.node_cpu.get(r.node)
            out.append(
                RankLine(
                    rank=k,
                    node=r.node,
                    step=max(r.steps) if r.steps else 0,
                    step_ms=_median([ms for _, _, ms, _ in recent]),
                    last_ms=recent[-1][2] if recent else None,
                    steps_per_s=_rate([(s, t) for s, t, _, _ in recent]),
                    shares=self._shares(r, recent),
                    gpu_util_pct=statistics.fmean(g[0] for g in gpu) if gpu else None,
                    gpu_mem_pct=100 * statistics.fmean(mem) if mem else None,
                    cpu_pct=cpu[0] if cpu else None,
                    loader_cpu_pct=cpu[1] if cpu else None,
                )
            )
        return out

    def _shares(self, r: _Rank, recent: list[tuple[int, int, float, float]]) -> dict[str, float]:
        """Each phase's share of the recent steps' time (``other``: the rest); empty when no
        recent step has spans or a data wait."""
        total, sums = 0.0, dict.fromkeys((*PHASE_COLUMNS, "other"), 0.0)
        seen = False
        for step, _, ms, wait in recent:
            phases = r.phases.get(step, {})
            if not phases and not wait:
                continue
            seen = True
            total += ms
            if "data_wait" not in phases:
                phases = {**phases, "data_wait": wait}
            shown = 0.0
            for p, v in phases.items():
                key = p if p in sums else "other"
                sums[key] += v
                shown += v
            sums["other"] += max(0.0, ms - shown)
        if not seen or total <= 0:
            return {}
        return {p: min(1.0, v / total) for p, v in sums.items()}

    def diagnoses(self, job_id: str) -> list[DiagnosisSummary]:
        """The job's open diagnoses, those on the critical path and costliest first."""
        ds = self.job(job_id).diagnoses.values()
        return sorted(ds, key=lambda d: (not d.critical_path, -d.step_share, d.bottleneck))

    def recommendations(self, job_id: str) -> list[RecLine]:
        """The job's recent recommendations, newest first."""
        return sorted(self.job(job_id).recs.values(), key=lambda x: -x.ts_ns)

    def changes(self, job_id: str) -> list[ChangeLine]:
        """The job's recent commands and what became of each, newest first."""
        return sorted(self.job(job_id).changes.values(), key=lambda x: (-x.ts_ns, -x.seq))


def _text(v: Any) -> str:
    """A knob value as the tables keep it."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _trim(d: OrderedDict[str, Any]) -> None:
    while len(d) > _MAX_ITEMS:
        d.popitem(last=False)
