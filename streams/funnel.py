"""The top-down bottleneck funnel: detectors over a job's telemetry → `Diagnosis` events.

`Funnel` is a stream-engine component (no I/O, picklable state): ``observe`` folds decoded
telemetry batches into compact per-job state (`JobState`, `perfloop.streams.detection`),
``observe_event`` reads `JobInfo` (world size, GPU memory) and `JobLifecycle` (a job's end; a
failure whose message says out of memory is an ``oom``). `GroundTruth` and every other event
are ignored: ground truth is the answer key of evaluations, never an input.

``tick(wall_ns)`` runs the detectors on the freshest data (step detectors when new steps
completed, device and host detectors, the hang watchdog) and orders what they hold active
top-down (`FUNNEL_LEVELS`: cluster health → network → host → memory → kernel). A condition
whose cause is also active is a symptom: it gets ``explained_by`` (the cause's bottleneck,
`EXPLAINS`) and is off the critical path. A root condition is on the critical path when it
costs at least ``funnel.min_step_share`` of the step, or threatens the job itself (loop
"product": hang, OOM, memory leak, GPU errors); kernel-level roofline classes are context and
never are. A new symptom whose cause is still pending (a throttle episode not yet long enough)
is held up to ``funnel.hold_s``, so it opens already explained.

Each condition becomes one diagnosis with a stable ``diagnosis_id``: "open" when first held,
"update" at most every ``funnel.update_s`` (and at once when ``explained_by`` or
``critical_path`` changes, a rule's note on it (`Funnel.annotate`) changes, or the detector
marks a change worth saying at once, such as a starved rank's loader workers), "resolved"
when it clears or the job ends. `actionable` picks what
may lead to a recommendation: open or updated, root, on the critical path.

Time: every duration the funnel measures (holds, update cadence, hang stalls) and every
diagnosis's ``ts_ns`` is in the job's **event time**: its clock is the newest event time of its
telemetry, moved on by the receive clock (``wall_ns``) less the job's usual transport lag while
nothing arrives (`JobState.now`); ``onset_ns`` is the estimated event-time start. So
``ts_ns - onset_ns`` is the detection latency in event time, and the same messages give the
same diagnoses however fast they are read, as long as the receive clock the funnel is given
follows them (the stream engine gives each job its event time, see
`perfloop.streams.engine`). Only "the job went quiet" (``funnel.idle_job_s``) and forgetting
ended jobs are measured on the receive clock itself. ``tick(wall_ns, jobs)`` evaluates only the
named jobs (the engine ticks each job at its own event time).

Settings are `DetectConfig` fields, changed live with ``configure("detect.<detector>.<param>",
value)`` for every job, or with ``job=<job id>`` for one job: a job's own values override the
shared ones (a later change for every job leaves them as they are) and are kept until the job
has ended and is forgotten.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.schemas.analysis import BOTTLENECKS, FUNNEL_LEVELS, Diagnosis
from perfloop.schemas.base import Event
from perfloop.schemas.codec import Batch
from perfloop.schemas.job import JobInfo, JobLifecycle, RankProgress
from perfloop.streams.detection import (
    NS,
    DetectConfig,
    Finding,
    JobState,
    device_detectors,
    hang_detector,
    step_detectors,
)

__all__ = ["EXPLAINS", "LEVELS", "LOOPS", "DetectConfig", "Funnel", "actionable"]

LOOPS: dict[str, str] = {
    "hang": "product",
    "gpu_error": "product",
    "oom": "product",
    "memory_leak": "product",
    "low_memory_headroom": "product",
    "straggler": "training",
    "comm_degradation": "training",
    "exposed_comm": "training",
    "load_imbalance": "training",
}
"""Each bottleneck's loop; the rest are "inner" (within a step on one rank or GPU)."""

_ALL_BUT_HARDWARE = (
    "straggler",
    "comm_degradation",
    "exposed_comm",
    "load_imbalance",
    "dataloader_starvation",
    "cpu_saturation",
    "launch_overhead",
    "memory_bound",
    "compute_bound",
    "overhead_bound",
)
EXPLAINS: dict[str, dict[str, str]] = {
    "hang": dict.fromkeys(_ALL_BUT_HARDWARE, "job"),
    "gpu_error": {"hang": "ranks", "straggler": "ranks", "load_imbalance": "ranks"},
    "thermal_throttle": {"straggler": "ranks", "load_imbalance": "ranks"},
    "power_throttle": {"straggler": "ranks", "load_imbalance": "ranks"},
    "comm_degradation": {"exposed_comm": "job"},
    "cpu_saturation": {"dataloader_starvation": "nodes", "straggler": "whole_nodes"},
    "memory_leak": {"low_memory_headroom": "ranks"},
}
"""cause → {symptom: scope}: the cause explains the symptom when both are active in the same
job and their ranks ("ranks") or nodes ("nodes") overlap, or anywhere in the job ("job").
A side that names no ranks is compared by nodes; one that names neither spans the job.
"whole_nodes": the nodes overlap and every rank the cause names has the symptom (a saturated
node slows all its ranks alike; one rank straggling behind the others of its node is slowed
by something of its own, such as another process on its CPUs)."""

LEVELS: dict[str, str] = BOTTLENECKS
"""Each bottleneck's funnel level (`perfloop.schemas.analysis.BOTTLENECKS`)."""

_MARK_NS = 2 * NS  # a detector's marked change updates a diagnosis at most this often

_OOM = re.compile(
    r"out of memory|outofmemory|\boom\b|cannot allocate memory|can't allocate memory|"
    r"memoryerror|bad_alloc",
    re.IGNORECASE,
)
_BATCH_KINDS = frozenset({"step", "span", "collective", "kernel", "gpu", "host"})


def actionable(diagnoses: Iterable[Diagnosis]) -> list[Diagnosis]:
    """The diagnoses that may lead to a recommendation: not resolved, root, critical path.

    >>> d = Diagnosis(ts_ns=2, job_id="j", node="n", rank=3, diagnosis_id="d1",
    ...               bottleneck="straggler", level="network", loop="training",
    ...               state="open", onset_ns=1, step_share=0.3, confidence=0.9,
    ...               critical_path=True, ranks=[3])
    >>> [x.diagnosis_id for x in actionable([d, d.model_copy(update={"explained_by": "hang"})])]
    ['d1']
    """
    return [
        d for d in diagnoses if d.state != "resolved" and d.critical_path and not d.explained_by
    ]


class _Open:
    """What the funnel remembers of one open diagnosis (and its latest finding)."""

    __slots__ = ("critical", "explained_by", "finding", "id", "last_emit_ns", "mark", "note")

    def __init__(
        self,
        id: str,
        explained_by: str,
        critical: bool,
        last_emit_ns: int,
        finding: Finding,
        note: str = "",
    ) -> None:
        self.id, self.explained_by = id, explained_by
        self.critical, self.last_emit_ns, self.finding = critical, last_emit_ns, finding
        self.note = note  # what the rules said about it (`Funnel.annotate`), as last emitted
        self.mark = finding.mark  # the detector's mark, as last emitted


class Funnel:
    """Cross-rank and per-device detectors ordered top-down (see the module docstring).

    >>> from perfloop.schemas import JobLifecycle
    >>> f = Funnel()
    >>> ev = JobLifecycle(ts_ns=5, job_id="j", node="n0", rank=2, state="failed",
    ...                   message="torch.OutOfMemoryError: CUDA out of memory")
    >>> f.observe_event(ev, wall_ns=10)
    >>> [(d.bottleneck, d.state, d.ranks, d.loop, d.critical_path) for d in f.tick(20)]
    [('oom', 'open', [2], 'product', True)]
    >>> f.configure("detect.straggler.score_threshold", 0.2)
    (0.12, 0.2)
    """

    def __init__(self, config: DetectConfig | None = None) -> None:
        self.config = config or DetectConfig()
        self._overrides: dict[str, dict[str, Any]] = {}  # job → its own values, by key
        self._job_config: dict[str, DetectConfig] = {}  # job → config with them applied
        self._jobs: dict[str, JobState] = {}
        self._open: dict[str, dict[str, _Open]] = {}
        self._held: dict[str, dict[str, int]] = {}
        self._ended: dict[str, int] = {}  # job → wall time it ended (late data is ignored)

    # -- input -------------------------------------------------------------------------------
    def _job(self, job_id: str) -> JobState | None:
        if job_id in self._ended:
            return None
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = JobState(job_id)
            self._apply_thresholds(job)
        return job

    def annotate(self, job_id: str, bottleneck: str, note: str, evidence: dict[str, float]) -> None:
        """What a rule says about the job's ``bottleneck`` (why perfloop stops acting on it):
        its diagnoses carry it in their evidence and summary, in an update at the next tick.
        An empty note withdraws it (perfloop acts on it again)."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        notes = job.det.setdefault("notes", {})
        if note:
            notes[bottleneck] = {"note": note, "evidence": evidence}
        else:
            notes.pop(bottleneck, None)

    def has_ended(self, job_id: str) -> bool:
        """Whether the job has ended: its lifecycle said so (rank -1, or every rank)."""
        job = self._jobs.get(job_id)
        return job_id in self._ended or (job is not None and job.ended)

    def config_for(self, job_id: str) -> DetectConfig:
        """The settings the job's detectors use: the shared ones with the job's own applied."""
        return self._job_config.get(job_id, self.config)

    def _apply_thresholds(self, job: JobState) -> None:
        cfg = self.config_for(job.job_id)
        job.det["clock_drop"] = cfg.throttle.min_clock_drop
        job.det["cpu_threshold"] = cfg.cpu.threshold_pct
        job.det["straggler_threshold"] = cfg.straggler.score_threshold

    def observe(self, batch: Batch, wall_ns: int) -> None:
        """Fold one decoded telemetry batch in (kinds this component does not read are skipped)."""
        if batch.kind not in _BATCH_KINDS or not len(batch):
            return
        job = self._job(batch.job_id)
        if job is not None:
            job.ingest(batch.kind, batch.node, batch.columns, wall_ns)

    def observe_event(self, event: Event, wall_ns: int) -> None:
        """Read job info and lifecycle events; ignore everything else (ground truth included)."""
        if isinstance(event, JobInfo):
            job = self._job(event.job_id)
            if job is not None:
                job.last_wall_ns = max(job.last_wall_ns, wall_ns)
                job.version += 1
                job.declared_world = max(job.declared_world, event.world_size)
                job.gpu_mem_bytes = float(event.gpu_mem_bytes or job.gpu_mem_bytes)
                job.gpus = max(job.gpus, event.gpu_count)
                job.node_index(event.node)
                job.info(event)
        elif isinstance(event, RankProgress):
            job = self._job(event.job_id)
            if job is not None:
                job.last_wall_ns = max(job.last_wall_ns, wall_ns)
                job.version += 1
                job.progress(event)
        elif isinstance(event, JobLifecycle):
            if event.state == "started" and event.job_id in self._ended:
                del self._ended[event.job_id]  # the job runs again: start afresh
            job = self._job(event.job_id)
            if job is None:
                return
            job.last_wall_ns = max(job.last_wall_ns, wall_ns)
            job.version += 1
            if event.state == "failed" and _OOM.search(event.message or ""):
                self._oom(job, event)
            job.lifecycle(event)

    def _oom(self, job: JobState, event: JobLifecycle) -> None:
        old = job.findings.get("oom")
        ranks = sorted({*(old.ranks if old else []), *([event.rank] if event.rank >= 0 else [])})
        job.findings["oom"] = Finding(
            key="oom",
            bottleneck="oom",
            onset_ns=old.onset_ns if old else event.ts_ns,
            step_share=1.0,
            confidence=1.0,
            ranks=ranks,
            nodes=sorted({*(old.nodes if old else []), event.node}),
            rank=ranks[0] if len(ranks) == 1 else -1,
            step=job.newest_step if job.newest_step > 0 else 0,
            evidence={"exit_code": float(event.exit_code or 0)},
            summary=(event.message or "out of memory")[:500],
        )

    # -- detection ---------------------------------------------------------------------------
    def tick(self, wall_ns: int, jobs: Iterable[str] | None = None) -> list[Diagnosis]:
        """Run the detectors and return the diagnoses that opened, updated or resolved.

        ``jobs``: only these jobs are evaluated; None: every job.
        """
        out: list[Diagnosis] = []
        names = list(self._jobs) if jobs is None else [j for j in jobs if j in self._jobs]
        for job_id in names:
            job = self._jobs[job_id]
            cfg = self.config_for(job_id)
            idle_ns = int(cfg.funnel.idle_job_s * NS)
            ended = job.ended or (job.last_wall_ns and wall_ns - job.last_wall_ns > idle_ns)
            now = job.now(wall_ns)
            seen = job.evaluated
            if not ended and (seen is None or seen[0] != job.version or seen[1] is not cfg):
                # Functions of the job's input and the settings: nothing new, same result.
                step_detectors(job, cfg)
                device_detectors(job, cfg)
                job.evaluated = (job.version, cfg)
            hang_detector(job, cfg, now)
            out.extend(self._reconcile(job, now, final=bool(ended)))
            if ended:
                del self._jobs[job_id]
                self._open.pop(job_id, None)
                self._held.pop(job_id, None)
                self._ended[job_id] = wall_ns
        for job_id, t in list(self._ended.items()):
            if wall_ns - t > int(self.config_for(job_id).funnel.idle_job_s * NS):
                del self._ended[job_id]
                self._overrides.pop(job_id, None)  # the job is forgotten, and its settings
                self._job_config.pop(job_id, None)
        return out

    def _cause(self, f: Finding, active: list[Finding]) -> str:
        best, best_level = "", len(FUNNEL_LEVELS)
        for c in active:
            scope = EXPLAINS.get(c.bottleneck, {}).get(f.bottleneck)
            if scope is None or c is f or not _overlap(scope, c, f):
                continue
            if scope == "whole_nodes":
                alike = {r for x in active if x.bottleneck == f.bottleneck for r in x.ranks}
                if not set(c.ranks) <= alike:
                    continue
            level = FUNNEL_LEVELS.index(LEVELS[c.bottleneck])
            if level < best_level:
                best, best_level = c.bottleneck, level
        return best

    def _reconcile(self, job: JobState, now_ns: int, *, final: bool) -> list[Diagnosis]:
        cfg = self.config_for(job.job_id).funnel
        opened = self._open.setdefault(job.job_id, {})
        held = self._held.setdefault(job.job_id, {})
        active = list(job.findings.values())
        active.sort(key=lambda f: (FUNNEL_LEVELS.index(LEVELS[f.bottleneck]), f.key))
        pending = job.det.get("pending", [])
        notes = job.det.get("notes", {})
        out = []
        for f in active:
            cause = self._cause(f, active)
            rec = opened.get(f.key)
            if rec is None and not cause and self._waits_for_cause(f, pending):
                first = held.setdefault(f.key, now_ns)
                if now_ns - first < cfg.hold_s * NS:
                    continue
            held.pop(f.key, None)
            level = LEVELS[f.bottleneck]
            loop = LOOPS.get(f.bottleneck, "inner")
            critical = (
                not cause
                and level != "kernel"
                and (loop == "product" or f.step_share >= cfg.min_step_share)
            )
            if rec is None:
                rec = opened[f.key] = _Open(_diag_id(job.job_id, f), cause, critical, now_ns, f)
                out.append(self._diagnosis(job, f, rec, "open", now_ns))
                continue
            rec.finding = f
            if final:  # the job ended: everything resolves below, no last updates
                continue
            note = notes.get(f.bottleneck, {}).get("note", "")
            if (
                cause != rec.explained_by
                or critical != rec.critical
                or note != rec.note
                or (f.mark != rec.mark and now_ns - rec.last_emit_ns >= _MARK_NS)
                or now_ns - rec.last_emit_ns >= cfg.update_s * NS
            ):
                rec.explained_by, rec.critical, rec.last_emit_ns = cause, critical, now_ns
                rec.note, rec.mark = note, f.mark
                out.append(self._diagnosis(job, f, rec, "update", now_ns))
        live = set() if final else {f.key for f in active}
        for key in [k for k in opened if k not in live]:
            rec = opened.pop(key)
            out.append(self._diagnosis(job, rec.finding, rec, "resolved", now_ns))
        for key in [k for k in held if k not in live]:
            del held[key]
        return out

    @staticmethod
    def _waits_for_cause(f: Finding, pending: list[tuple[str, list[int], list[str]]]) -> bool:
        for bottleneck, ranks, nodes in pending:
            scope = EXPLAINS.get(bottleneck, {}).get(f.bottleneck)
            cause = Finding("", bottleneck, 0, 0.0, 0.0, ranks=ranks, nodes=nodes)
            if scope is not None and _overlap(scope, cause, f):
                return True
        return False

    def _diagnosis(
        self, job: JobState, f: Finding, rec: _Open, state: str, now_ns: int
    ) -> Diagnosis:
        node = f.nodes[0] if f.nodes else (job.nodes[0] if job.nodes else "unknown")
        evidence, summary = f.evidence, f.summary
        said = job.det.get("notes", {}).get(f.bottleneck)
        if said is not None and state != "resolved":
            evidence = {**evidence, **said["evidence"]}
            summary = f"{summary}; perfloop stops here: {said['note']}"
        return Diagnosis(
            ts_ns=now_ns,
            job_id=job.job_id,
            node=node,
            rank=f.rank,
            diagnosis_id=rec.id,
            bottleneck=f.bottleneck,
            level=LEVELS[f.bottleneck],  # type: ignore[arg-type]
            loop=LOOPS.get(f.bottleneck, "inner"),  # type: ignore[arg-type]
            state=state,  # type: ignore[arg-type]
            onset_ns=max(0, int(f.onset_ns)),
            step_share=round(min(1.0, max(0.0, f.step_share)), 4),
            confidence=round(min(1.0, max(0.0, f.confidence)), 4),
            critical_path=rec.critical and state != "resolved",
            explained_by=rec.explained_by,
            ranks=list(f.ranks),
            nodes=list(f.nodes),
            step=max(0, int(f.step)),
            evidence={k: float(v) for k, v in evidence.items() if v == v},
            summary=summary[:2000],
        )

    # -- live settings and snapshots ---------------------------------------------------------
    def configure(self, key: str, value: Any, job: str = "*") -> tuple[Any, Any]:
        """Change ``detect.<detector>.<param>`` live, for every job ("*") or for ``job``
        alone; return (old, new) as that job (or every job without its own) sees it."""
        if not key.startswith("detect."):
            raise ConfigError(f"unknown setting {key}; the funnel's settings start with detect.")
        sub = key[len("detect.") :]
        if job == "*":
            old = self.config.get_key(sub)
            self.config = self.config.replace_key(sub, value)
            for j in list(self._overrides):
                self._rebuild(j)
            for state in self._jobs.values():
                self._apply_thresholds(state)
            return old, self.config.get_key(sub)
        old = self.config_for(job).get_key(sub)
        self.config_for(job).replace_key(sub, value)  # refused here, before anything changes
        self._overrides.setdefault(job, {})[sub] = value
        self._rebuild(job)
        if job in self._jobs:
            self._apply_thresholds(self._jobs[job])
        return old, self.config_for(job).get_key(sub)

    def _rebuild(self, job: str) -> None:
        cfg = self.config
        for sub, value in self._overrides.get(job, {}).items():
            cfg = cfg.replace_key(sub, value)
        self._job_config[job] = cfg

    def snapshot(self) -> dict[str, Any]:
        """Durable state: settings, every job's state, open diagnoses (builtins + numpy)."""
        return {
            "version": 1,
            "config": self.config.to_dict(),
            "jobs": {k: j.to_state() for k, j in self._jobs.items()},
            "open": {
                j: {
                    k: [
                        o.id,
                        o.explained_by,
                        o.critical,
                        o.last_emit_ns,
                        o.finding.to_dict(),
                        o.note,
                    ]
                    for k, o in recs.items()
                }
                for j, recs in self._open.items()
            },
            "held": {j: dict(h) for j, h in self._held.items()},
            "ended": dict(self._ended),
            "overrides": {j: dict(o) for j, o in self._overrides.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace this funnel's state with a `snapshot`."""
        if state.get("version") != 1:
            raise ConfigError(f"funnel snapshot version {state.get('version')!r}; supported: 1")
        self.config = DetectConfig.from_dict(state["config"])
        self._jobs = {k: JobState.from_state(v) for k, v in state["jobs"].items()}
        self._open = {
            j: {k: _Open(*v[:4], Finding(**v[4]), *v[5:]) for k, v in recs.items()}
            for j, recs in state["open"].items()
        }
        self._held = {j: dict(h) for j, h in state["held"].items()}
        self._ended = dict(state["ended"])
        self._overrides = {j: dict(o) for j, o in state.get("overrides", {}).items()}
        self._job_config = {}
        for j in self._overrides:
            self._rebuild(j)


def _overlap(scope: str, cause: Finding, symptom: Finding) -> bool:
    """Whether ``cause`` and ``symptom`` meet in ``scope``; a rank scope falls back to the
    nodes when one side does not know its ranks (a GPU no rank claims)."""
    if scope == "job":
        return True
    if scope == "ranks" and cause.ranks and symptom.ranks:
        return bool(set(cause.ranks) & set(symptom.ranks))
    a, b = cause.nodes, symptom.nodes
    return not a or not b or bool(set(a) & set(b))


def _diag_id(job_id: str, f: Finding) -> str:
    h = hashlib.blake2b(f"{job_id}|{f.key}|{f.onset_ns}".encode(), digest_size=12).hexdigest()
    return f"{f.bottleneck[:32]}-{h}"
