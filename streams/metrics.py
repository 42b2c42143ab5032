"""The stream tier's Prometheus metrics: what the engine produced in, series out (pure, no I/O).

`StreamMetrics` keeps, per job and rank, the latest of what the stream worker computes, and
turns it into metric families (`Family`, `CATALOG` lists them all) when a scrape asks
(`StreamMetrics.snapshot`); `prometheus_families` hands them to ``prometheus_client``. The
worker serves them on ``/metrics`` (`perfloop.streams.app`, ``metrics_port``); docs/alerts.md
lists every series and the alert rules built on them.

What it reads, all of it public output of the engine, so it costs per tick what the tick
produced and never a look at a sample:

- the **closed windows** of each tick (`Outputs.windows`): of the tumbling window closest to
  `RECENT_WINDOW_S` (10 s), a rank's median step time and steps a second (``step_time_ms``),
  its data-wait share, its phase shares, its GPUs' SM utilisation and memory, its RSS (where
  ``proc_rss_bytes`` is windowed: ``perfloop config set windows.metrics.host …``);
- the **diagnoses** (open until resolved), **run-level phase changes** (the job's state) and
  **time-to-OOM warnings** (predictions ``time_to_oom_s``, shown `OOM_WARNING_S` after each)
  of each tick;
- the job's **recent steps** (`StepAnalysis.recent`), when a snapshot is taken: each rank's
  straggler lateness (median over its last `LATENESS_STEPS` steps) and score;
- the **actuations** the worker reads (`observe_event`): a change rolled back (counted once
  per command, whichever ranks acked it) and recommendations pending approval (until a later
  decision on them, or ``approval_ttl_s``).

The cardinality budget: at most ``max_series`` series. Past it, the jobs with the most per-rank
series have them folded into one series per job (``rank="all"``, ``node="all"``: the worst
rank's value for step time, lateness, memory; the mean for shares and utilisation), then the
jobs seen least recently are left out whole; ``perfloop_metrics_series_dropped`` counts what
that kept out. A job's series, and a rank's, go ``grace_s`` after the last output that named it.

>>> m = StreamMetrics(max_series=1000)
>>> from perfloop.schemas import Diagnosis
>>> d = Diagnosis(ts_ns=1, job_id="j", node="n", rank=-1, diagnosis_id="d1", bottleneck="hang",
...               level="cluster_health", loop="product", state="open", onset_ns=1,
...               step_share=1.0, confidence=0.9, critical_path=True)
>>> m.observe(Outputs(diagnoses=[d]), now_ns=10**9)
>>> [f.samples for f in m.snapshot(10**9) if f.name == "perfloop_diagnosis_open"]
[((('j', 'hang', 'cluster_health'), 1.0),)]
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from perfloop.schemas import ActuationResult, Decision
from perfloop.streams._metrics_catalog import CATALOG, EXPORTED_NAMES, Kind
from perfloop.streams.engine import Outputs
from perfloop.streams.steps import StepRecord

__all__ = [
    "CATALOG",
    "EXPORTED_NAMES",
    "LATENESS_STEPS",
    "OOM_WARNING_S",
    "RECENT_WINDOW_S",
    "Family",
    "StreamMetrics",
    "prometheus_families",
    "recent_window",
]

NS = 1_000_000_000
RECENT_WINDOW_S = 10.0
"""The per-rank series come from the tumbling window closest to this (`recent_window`)."""
LATENESS_STEPS = 20
"""A rank's straggler lateness is its median over this many of its latest steps."""
OOM_WARNING_S = 60.0
"""A time-to-OOM warning is shown this long after it was made (the prediction host repeats
one every ``predict.oom_every_s``, 30 s, while it holds)."""
ROLLED_BACK_KEPT = 4096
"""Commands remembered per job to count a rollback once, whichever ranks ack it."""

_WORKER_SERIES = sum(1 for _, (_, labels, _) in CATALOG.items() if not labels) + 7
"""Series of the worker's own families, at most (dead letters: one per input topic)."""


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


# per-rank families: window metric → (family, column), how devices of a rank and ranks of a
# folded job combine
_FROM_WINDOWS: dict[str, tuple[tuple[str, str, float], ...]] = {
    "step_time_ms": (
        ("perfloop_step_time_seconds", "p50", 1e-3),
        ("perfloop_steps_per_second", "rate_per_s", 1.0),
    ),
    "data_wait_share": (("perfloop_data_wait_share", "mean", 1.0),),
    "sm_util_pct": (("perfloop_gpu_sm_utilization_ratio", "mean", 1e-2),),
    "mem_used_bytes": (("perfloop_gpu_mem_used_bytes", "max", 1.0),),
    "proc_rss_bytes": (("perfloop_rss_bytes", "max", 1.0),),
}
"""Window metric → the families it feeds: (family, window column, scale to base units)."""
_PHASE_PREFIX, _PHASE_SUFFIX = "phase.", "_share"
_DEVICES: dict[str, Callable[[list[float]], float]] = {"perfloop_gpu_sm_utilization_ratio": _mean}
_FOLD: dict[str, Callable[[list[float]], float]] = {
    "perfloop_steps_per_second": min,
    "perfloop_time_to_oom_seconds": min,
    "perfloop_phase_share": _mean,
    "perfloop_gpu_sm_utilization_ratio": _mean,
}  # the rest: the worst rank, max
_MAX_AGE_S = {"perfloop_time_to_oom_seconds": OOM_WARNING_S}


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family of a snapshot: its samples as (label values, value)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]


Key = tuple[str, str, str, str, int]
"""A per-rank series: (job, family, its extra label value (the phase, or ""), node, rank)."""


@dataclass(slots=True)
class _Job:
    seen_ns: int
    state: str = ""
    diagnoses: dict[str, tuple[str, str]] = field(default_factory=dict)  # id → bottleneck, level
    rollbacks: int = 0
    rolled_back: OrderedDict[str, None] = field(default_factory=OrderedDict)
    pending: dict[str, int] = field(default_factory=dict)  # rec id → when asked (ns)


def recent_window(specs: Iterable[Any]) -> float | None:
    """The size of the tumbling window closest to `RECENT_WINDOW_S` among ``specs``
    (`WindowSpec`s), the smaller one on a tie; None if none is tumbling.

    >>> from perfloop.streams.windows import parse_specs
    >>> recent_window(parse_specs("1,10,60,60/10")), recent_window(parse_specs("5,30"))
    (10.0, 5.0)
    """
    sizes = sorted({float(s.size_s) for s in specs if s.size_s == s.hop_s})
    if not sizes:
        return None
    return min(sizes, key=lambda s: (abs(math.log(s / RECENT_WINDOW_S)), s))


class StreamMetrics:
    """The state behind a stream worker's ``/metrics`` (see the module docstring). Not thread
    safe: feed it and take snapshots from one thread (the worker's event loop)."""

    def __init__(
        self,
        *,
        max_series: int = 10_000,
        grace_s: float = 300.0,
        window_s: float | None = RECENT_WINDOW_S,
        pending_ttl_s: float = 900.0,
    ) -> None:
        self.max_series = max_series
        self.grace_ns = int(grace_s * NS)
        self.window_s = window_s
        self.pending_ttl_ns = int(pending_ttl_s * NS)
        self._jobs: dict[str, _Job] = {}
        self._values: dict[Key, tuple[float, int]] = {}  # per-rank: value, when it came (ns)
        self._codes = _Codes()
        self._worker: dict[str, Any] = {}
        self._rate: tuple[int, float] | None = None  # (ns, samples) at the previous snapshot

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def _job(self, job_id: str, now_ns: int) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(now_ns)
        job.seen_ns = max(job.seen_ns, now_ns)
        return job

    # -- input -------------------------------------------------------------------------------
    def observe(self, out: Outputs, now_ns: int) -> None:
        """Take what one engine tick produced (``now_ns``: the wall clock of the tick)."""
        if out.windows is not None and self.window_s is not None:
            self._windows(out.windows, now_ns)
        for d in out.diagnoses:
            job = self._job(d.job_id, now_ns)
            if d.state == "resolved":
                job.diagnoses.pop(d.diagnosis_id, None)
            else:
                job.diagnoses[d.diagnosis_id] = (d.bottleneck, d.level)
        for p in out.phases:
            job = self._job(p.job_id, now_ns)
            if p.level == "run" and p.rank < 0:
                job.state = p.phase
        for pr in out.predictions:
            if pr.target == "time_to_oom_s" and pr.state == "predicted":
                self._job(pr.job_id, now_ns)
                self._put((pr.job_id, "perfloop_time_to_oom_seconds", "", pr.node, pr.rank),
                          pr.value, now_ns)  # fmt: skip

    def _put(self, key: Key, value: float, now_ns: int) -> None:
        self._values[key] = (value, now_ns)

    def _windows(self, w: dict[str, Any], now_ns: int) -> None:
        """The chosen window's closed rows, in bulk: rows are grouped by metric (a dict
        lookup a row), and each group's keys and values go into the state by C loops (zip,
        dict updates); only a key several rows share (a rank's GPUs) is combined one by one."""
        if not len(w["ts_ns"]):
            return
        pick = np.flatnonzero((w["window_s"] == self.window_s) & (w["hop_s"] == self.window_s))
        if not len(pick):
            return
        codes = self._codes
        code = np.array([codes[m] for m in w["metric"][pick].tolist()], dtype=np.int64)
        keep = code >= 0
        if not keep.any():
            return
        pick, code = pick[keep], code[keep]
        order = np.argsort(code, kind="stable")
        pick, code = pick[order], code[order]
        for j in _distinct(w["job_id"][pick]):
            self._job(j, now_ns)
        bounds = np.flatnonzero(np.diff(code)) + 1
        for part in np.split(np.arange(len(pick)), bounds):
            rows = pick[part]
            job, node = w["job_id"][rows].tolist(), w["node"][rows].tolist()
            rank = w["rank"][rows].tolist()
            gpus = bool((w["device"][rows] >= 0).any())
            for name, extra, col, scale in codes.targets[int(code[part[0]])]:
                keys = list(zip(job, repeat(name), repeat(extra), node, rank, strict=False))
                values = w[col][rows] if scale == 1.0 else w[col][rows] * scale
                if gpus and len(set(keys)) < len(keys):  # several devices of one rank
                    merged: dict[Key, list[float]] = {}
                    for k, v in zip(keys, values.tolist(), strict=True):
                        if v == v:
                            merged.setdefault(k, []).append(v)
                    combine = _DEVICES.get(name, max)
                    self._values.update((k, (combine(v), now_ns)) for k, v in merged.items())
                    continue
                known = ~np.isnan(values)
                if not known.all():  # NaN: nothing known
                    keys = [k for k, ok in zip(keys, known.tolist(), strict=True) if ok]
                    values = values[known]
                self._values.update(zip(keys, zip(values.tolist(), repeat(now_ns)), strict=True))

    def observe_event(self, event: Any, now_ns: int) -> None:
        """Take an event the worker read on ``perfloop.actuations``: a `Decision` (pending
        approval, or a later decision on one) or an `ActuationResult` (a rollback)."""
        if isinstance(event, ActuationResult):
            if event.status != "rolled_back":
                return
            job = self._job(event.job_id, now_ns)
            if event.command_id in job.rolled_back:
                return
            job.rolled_back[event.command_id] = None
            if len(job.rolled_back) > ROLLED_BACK_KEPT:
                job.rolled_back.popitem(last=False)
            job.rollbacks += 1
        elif isinstance(event, Decision) and event.rec_id:
            job = self._job(event.job_id, now_ns)
            if event.outcome == "pending":
                job.pending.setdefault(event.rec_id, min(event.ts_ns, now_ns))
            else:
                job.pending.pop(event.rec_id, None)

    def worker(self, **numbers: Any) -> None:
        """The worker's own figures for the next snapshot: ``samples``, ``messages``,
        ``late_samples``, ``lag_messages``, ``ingest_delay_s``, ``publish_failures`` (numbers)
        and ``dead_letters`` (by topic)."""
        self._worker.update(numbers)

    # -- output ------------------------------------------------------------------------------
    def snapshot(
        self, now_ns: int, recent: Callable[[str], Sequence[StepRecord]] | None = None
    ) -> list[Family]:
        """Every family, within the budget, as of ``now_ns``; ``recent`` gives a job's recent
        steps (`StepAnalysis.recent`) for the straggler series."""
        self._expire_jobs(now_ns)
        if recent is not None:
            for job_id in self._jobs:
                self._stragglers(job_id, recent(job_id)[-LATENESS_STEPS:], now_ns)
        ranks = self._by_job(now_ns)
        folded, dropped, kept_out = self._budget(ranks)
        series: dict[str, list[tuple[tuple[str, ...], float]]] = {n: [] for n in CATALOG}
        for job_id, job in self._jobs.items():
            if job_id in dropped:
                continue
            mine = ranks.get(job_id, {})
            self._job_series(series, job_id, job, mine, now_ns)
            for (name, extra), values in mine.items():
                tail = (extra,) if extra else ()
                if job_id in folded:
                    value = _FOLD.get(name, max)(list(values.values()))
                    series[name].append(((job_id, "all", "all", *tail), value))
                    continue
                for (node, rank), value in values.items():
                    series[name].append(((job_id, node, str(rank), *tail), value))
        self._worker_series(series, now_ns, len(self._jobs) - len(dropped))
        total = sum(len(s) for s in series.values()) + 4
        series["perfloop_metrics_series"].append(((), float(total)))
        series["perfloop_metrics_max_series"].append(((), float(self.max_series)))
        series["perfloop_metrics_series_dropped"].append(((), float(kept_out)))
        series["perfloop_metrics_jobs_folded"].append(((), float(len(folded))))
        out = []
        for name, (kind, labels, text) in CATALOG.items():
            if series[name] or not labels:
                out.append(Family(name, kind, text, labels, tuple(sorted(series[name]))))
        return out

    def _expire_jobs(self, now_ns: int) -> None:
        for job in self._jobs.values():
            for rec in [r for r, t in job.pending.items() if now_ns - t > self.pending_ttl_ns]:
                del job.pending[rec]
        for job_id, job in list(self._jobs.items()):  # (kept while an approval pends)
            if now_ns - job.seen_ns > self.grace_ns and not job.pending:
                del self._jobs[job_id]

    def _by_job(
        self, now_ns: int
    ) -> dict[str, dict[tuple[str, str], dict[tuple[str, int], float]]]:
        """The per-rank series by job and family; those of a job gone, or not refreshed within
        the grace (a time-to-OOM warning: `OOM_WARNING_S`), are forgotten."""
        out: dict[str, dict[tuple[str, str], dict[tuple[str, int], float]]] = {}
        stale = []
        oom = int(OOM_WARNING_S * NS)
        for key, (value, stamp) in self._values.items():
            job_id, name, extra, node, rank = key
            limit = oom if name == "perfloop_time_to_oom_seconds" else self.grace_ns
            if job_id not in self._jobs or now_ns - stamp > limit:
                stale.append(key)
                continue
            out.setdefault(job_id, {}).setdefault((name, extra), {})[(node, rank)] = value
        for key in stale:
            del self._values[key]
        return out

    def _job_series_count(self, job: _Job) -> int:
        groups = len(set(job.diagnoses.values()))
        return 3 + bool(job.state) + groups + bool(job.pending)

    def _budget(
        self, ranks: dict[str, dict[Any, dict[Any, float]]]
    ) -> tuple[set[str], set[str], int]:
        """Which jobs are folded and which left out to stay within ``max_series``; and how
        many series that keeps out."""
        room = self.max_series - _WORKER_SERIES
        per_job = {j: self._job_series_count(job) for j, job in self._jobs.items()}
        per_rank = {j: sum(len(r) for r in ranks.get(j, {}).values()) for j in self._jobs}
        flat = {j: len(ranks.get(j, {})) for j in self._jobs}
        total = sum(per_job.values()) + sum(per_rank.values())
        folded: set[str] = set()
        kept_out = 0
        for j in sorted(per_rank, key=lambda j: (-per_rank[j], j)):
            if total <= room or per_rank[j] <= flat[j]:
                break
            folded.add(j)
            total -= per_rank[j] - flat[j]
            kept_out += per_rank[j] - flat[j]
        dropped: set[str] = set()
        for j in sorted(self._jobs, key=lambda j: (self._jobs[j].seen_ns, j)):
            if total <= room:
                break
            own = per_job[j] + (flat[j] if j in folded else per_rank[j])
            dropped.add(j)
            total -= own
            kept_out += own
        return folded - dropped, dropped, kept_out

    def _job_series(
        self,
        series: dict[str, list[Any]],
        job_id: str,
        job: _Job,
        ranks: dict[tuple[str, str], dict[tuple[str, int], float]],
        now_ns: int,
    ) -> None:
        seen = {rank for by_rank in ranks.values() for _, rank in by_rank if rank >= 0}
        series["perfloop_job_ranks"].append(((job_id,), float(len(seen))))
        if job.state:
            series["perfloop_job_state"].append(((job_id, job.state), 1.0))
        groups: dict[tuple[str, str], int] = {}
        for key in job.diagnoses.values():
            groups[key] = groups.get(key, 0) + 1
        for (bottleneck, level), n in groups.items():
            series["perfloop_diagnosis_open"].append(((job_id, bottleneck, level), float(n)))
        series["perfloop_rollbacks"].append(((job_id,), float(job.rollbacks)))
        series["perfloop_pending_approvals"].append(((job_id,), float(len(job.pending))))
        if job.pending:
            age = max(0, now_ns - min(job.pending.values())) / NS
            series["perfloop_pending_approval_age_seconds"].append(((job_id,), age))

    def _worker_series(self, series: dict[str, list[Any]], now_ns: int, jobs: int) -> None:
        w = self._worker
        samples = float(w.get("samples", 0))
        rate = 0.0
        if self._rate is not None and now_ns > self._rate[0]:
            rate = max(0.0, samples - self._rate[1]) / ((now_ns - self._rate[0]) / NS)
        self._rate = (now_ns, samples)
        for name, key in (
            ("perfloop_worker_samples", "samples"),
            ("perfloop_worker_messages", "messages"),
            ("perfloop_worker_late_samples", "late_samples"),
            ("perfloop_worker_lag_messages", "lag_messages"),
            ("perfloop_worker_ingest_delay_seconds", "ingest_delay_s"),
            ("perfloop_worker_publish_failures", "publish_failures"),
        ):
            series[name].append(((), float(w.get(key, 0))))
        series["perfloop_worker_samples_per_second"].append(((), rate))
        series["perfloop_worker_jobs"].append(((), float(jobs)))
        for topic, n in sorted((w.get("dead_letters") or {}).items()):
            series["perfloop_worker_dead_letters"].append(((str(topic),), float(n)))

    def _stragglers(self, job_id: str, records: Sequence[StepRecord], now_ns: int) -> None:
        """Each rank's median lateness over ``records`` and its latest straggler score."""
        late: dict[tuple[str, int], list[float]] = {}
        score: dict[tuple[str, int], float] = {}
        for rec in records:
            for i, (rank, node) in enumerate(zip(rec.ranks.tolist(), rec.nodes, strict=False)):
                x, sc = float(rec.lateness_ms[i]) / 1000, float(rec.straggler_score[i])
                if math.isfinite(x):
                    late.setdefault((node, rank), []).append(x)
                if math.isfinite(sc):
                    score[(node, rank)] = sc
        for (node, rank), xs in late.items():
            key = (job_id, "perfloop_straggler_lateness_seconds", "", node, rank)
            self._put(key, statistics.median(xs), now_ns)
        for (node, rank), sc in score.items():
            self._put((job_id, "perfloop_straggler_score", "", node, rank), sc, now_ns)


class _Codes(dict[str, int]):
    """Window metric → index of what it feeds in ``targets`` (-1: nothing), filled as names
    are first met: (family, extra label value, the window column it is read from)."""

    MAX_NAMES = 10_000  # metric names are few; a flood of odd ones is not remembered

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[tuple[tuple[str, str, str, float], ...]] = []

    def __missing__(self, metric: str) -> int:
        got = tuple((name, "", col, scale) for name, col, scale in _FROM_WINDOWS.get(metric, ()))
        if metric.startswith(_PHASE_PREFIX) and metric.endswith(_PHASE_SUFFIX):
            phase = metric[len(_PHASE_PREFIX) : -len(_PHASE_SUFFIX)]
            got = (("perfloop_phase_share", phase, "mean", 1.0),)
        code = -1
        if got:
            code = len(self.targets)
            self.targets.append(got)
        if len(self) < self.MAX_NAMES:
            self[metric] = code
        return code


def _distinct(column: np.ndarray) -> list[Any]:
    """The distinct values of a column grouped by value (windows come sorted by job), in
    order; any column works, an unsorted one at some more cost."""
    if not len(column):
        return []
    starts = np.flatnonzero(column[1:] != column[:-1]) + 1
    return list(dict.fromkeys(column[np.concatenate(([0], starts))].tolist()))


def prometheus_families(families: Iterable[Family]) -> Iterator[Any]:
    """``prometheus_client`` metric families of a snapshot, for a collector's ``collect``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for f in families:
        cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
        metric = cls(f.name, f.help, labels=f.labels)
        for values, value in f.samples:
            metric.add_metric(values, value)
        yield metric
