"""`PredictionHost`: the online models of the stream worker, fed per job on its event-time
clock (public through `perfloop.streams.predict`, whose docstring says what each model
forecasts and when a forecast is realised).

Per job it keeps the models and what they forecast until it is realised (`_Job`); with the
two cross-run models, that is its `snapshot`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.models.anomaly import ALARM_SCORE, WindowAnomaly
from perfloop.models.crossrun import CrossRunPredictor
from perfloop.models.drift import RegimeDetector
from perfloop.models.oom import TimeToOOM
from perfloop.models.phase import PhaseTransitionForecaster
from perfloop.models.steptime import Ewma, StepTimeForecaster
from perfloop.schemas.analysis import RUN_PHASES, PhaseChange, Prediction
from perfloop.schemas.base import Event
from perfloop.schemas.codec import Batch
from perfloop.schemas.job import JobInfo, JobLifecycle
from perfloop.streams.predict.features import SHARES, job_features, window_features
from perfloop.streams.steps import StepRecord

__all__ = ["STEP_TARGETS", "PredictionHost"]

NS = 1_000_000_000
STEP_TARGETS = (
    "step_time_ms",
    "data_wait_ms",
    "forward_ms",
    "backward_ms",
    "comm_ms",
    "optimizer_ms",
)
"""What is forecast for a job's next step (the median over its ranks)."""
_RUN_CODE = {p: i for i, p in enumerate(RUN_PHASES)}
_OOM = re.compile(r"out of memory|outofmemory|\boom\b", re.IGNORECASE)  # as the funnel reads it
_PARAMS: dict[str, tuple[type, float, float]] = {
    "enabled": (bool, 0, 1),
    "oom_horizon_s": (float, 1, 86_400),
    "every_s": (float, 0, 3_600),
    "oom_every_s": (float, 0, 3_600),
    "anomaly_threshold": (float, 0.5, 1),
    "anomaly_every_s": (float, 0, 3_600),
}
_MAX_OPEN_WARNINGS = 64
_RING_STEPS = 2048
_WARMUP_WINDOWS = 10  # windows a job's forecasters learn from before their forecasts go out
_WINDOW_WAIT_S = 2  # a second's steps are closed this long after it on the job's clock
_ENDED = frozenset({"finished", "failed", "killed"})


@dataclass
class _Job:
    node: str
    last_step: int = -1
    win_sec: int = -1  # the second of event time whose completed steps are being gathered
    win: list[StepRecord] = field(default_factory=list)
    emitted_sec: int = -(1 << 62)  # when the last step forecasts went out
    forecasters: dict[str, StepTimeForecaster] = field(default_factory=dict)
    baselines: dict[str, Ewma] = field(default_factory=dict)
    pending: dict[str, Prediction] = field(default_factory=dict)  # target → for the next window
    regime: RegimeDetector = field(default_factory=RegimeDetector)
    oom: dict[int, TimeToOOM] = field(default_factory=dict)
    mem_total: dict[int, float] = field(default_factory=dict)
    oom_last: dict[int, float] = field(default_factory=dict)  # rank → event time of last warning
    warnings: list[Prediction] = field(default_factory=list)
    anomaly: WindowAnomaly = field(default_factory=WindowAnomaly)
    sec: int = -1  # the second being gathered for the anomaly scorer
    sums: dict[str, list[float]] = field(default_factory=dict)  # feature → [sum, n]
    anomaly_last: float = -math.inf
    phase: PhaseTransitionForecaster = field(default_factory=PhaseTransitionForecaster)
    phase_pending: Prediction | None = None
    features: dict[str, float] | None = None  # from JobInfo, for the cross-run models
    step_ring: list[float] = field(default_factory=list)  # job-level step times, newest last
    peak: float = 0.0  # highest per-step memory peak of any rank
    cross_pending: list[Prediction] = field(default_factory=list)


class PredictionHost:
    """Feeds the online models per job; `tick` returns the `Prediction` events due."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        every_s: float = 5.0,
        oom_horizon_s: float = 120.0,
        oom_every_s: float = 30.0,
        anomaly_threshold: float = ALARM_SCORE,
        anomaly_every_s: float = 10.0,
    ) -> None:
        self.enabled = enabled
        self.every_s = every_s
        self.oom_horizon_s = oom_horizon_s
        self.oom_every_s = oom_every_s
        self.anomaly_threshold = anomaly_threshold
        self.anomaly_every_s = anomaly_every_s
        self._jobs: dict[str, _Job] = {}
        self._out: list[Prediction] = []
        self.cross_step = CrossRunPredictor(target="step_time_ms")
        self.cross_mem = CrossRunPredictor(target="mem_peak_bytes")
        self.stats = {"predictions": 0, "realised": 0}

    # -- input -------------------------------------------------------------------------------
    def observe(self, batch: Batch, now_ns: int) -> None:
        """Step batches (memory per rank) and GPU batches (device memory, utilisation)."""
        if not self.enabled or batch.kind not in ("step", "gpu"):
            return
        job = self._job(batch.job_id, batch.node)
        c = batch.columns
        ranks = np.asarray(c["rank"], dtype=np.int64)
        ts = np.asarray(c["ts_ns"], dtype=np.int64)
        if batch.kind == "gpu":
            total = np.asarray(c["mem_total_bytes"], dtype=np.float64)
            known, first = np.unique(ranks, return_index=True)  # a device's memory is fixed
            for r, t in zip(known.tolist(), total[first].tolist(), strict=True):
                if t > 0:
                    job.mem_total[r] = t
            self._gather(job, ts, {"sm_util_pct": c["sm_util_pct"], "power_w": c["power_w"]})
            return
        peak = np.asarray(c["mem_peak_bytes"], dtype=np.float64)
        alloc = np.asarray(c["mem_allocated_bytes"], dtype=np.float64)
        used = np.where(peak > 0, peak, alloc)
        if not len(used):
            return
        job.peak = max(job.peak, float(used.max()))
        # one reading per rank and batch (a batch spans ~0.25 s): its highest peak, at its end
        order = np.lexsort((ts, ranks))
        ranks, ts, used = ranks[order], ts[order], used[order]
        starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])
        ends = np.r_[starts[1:], len(ranks)] - 1
        used = np.maximum.reduceat(used, starts)
        ranks, ts = ranks[starts], ts[ends]
        for r, t, u in zip(ranks.tolist(), ts.tolist(), used.tolist(), strict=True):
            total = job.mem_total.get(r, 0.0)
            if u <= 0 or total <= 0:
                continue
            model = job.oom.get(r)
            if model is None:
                model = job.oom[r] = TimeToOOM()
            x = {"ts_s": t / NS, "mem_peak_bytes": u, "mem_total_bytes": total}
            model.learn_one(x)
            if t / NS - job.oom_last.get(r, -math.inf) < self.oom_every_s:
                continue
            if model.warning(x, self.oom_horizon_s):
                job.oom_last[r] = t / NS
                left = model.predict_one(x)
                self._warn(batch.job_id, job, r, t, left, u, total)

    def observe_event(self, event: Event, now_ns: int) -> None:
        """A job's info asks the cross-run models; its end teaches them, and a failure out of
        memory realises its time-to-OOM warnings."""
        if not self.enabled:
            return
        if isinstance(event, JobInfo):
            self._job_info(event)
            return
        if not (isinstance(event, JobLifecycle) and event.state in _ENDED):
            return
        job = self._jobs.get(event.job_id)
        if job is None:
            return
        if event.state == "failed" and _OOM.search(event.message or ""):
            for p in job.warnings:  # a rank (or the job) ran out of memory
                had = max(0.0, (event.ts_ns - p.ts_ns) / NS)
                self._emit(_realised(p, had), realised=True)
            job.warnings = []
        if event.rank == -1:
            self._finish(job)

    def learn_history(self, jobs: Iterable[tuple[dict[str, float], float, float]]) -> int:
        """Teach the cross-run models finished jobs: ``(features, median step ms, peak
        bytes)`` each (NaN where unknown). Returns how many were learned from."""
        n = 0
        for x, step_ms, peak in jobs:
            self.cross_step.learn_one(x, step_ms)
            self.cross_mem.learn_one(x, peak)
            n += 1
        return n

    def steps(self, records: Iterable[StepRecord]) -> None:
        """Steps just completed (`StepAnalysis.last_done`), in completion order; a step at or
        before the last one seen for its job is skipped."""
        if not self.enabled:
            return
        for r in records:
            job = self._job(r.job_id, r.nodes[0] if r.nodes else "?")
            if r.step <= job.last_step or not len(r.end_ns):
                continue
            job.last_step = r.step
            sec = int(r.end_ns.max()) // NS
            if job.win and sec > job.win_sec:
                self._window(r.job_id, job)
            if not job.win:
                job.win_sec = sec
            job.win.append(r)

    def phases(self, changes: Iterable[PhaseChange]) -> None:
        """Run-level phase changes teach the job's transition forecaster."""
        if not self.enabled:
            return
        for ch in changes:
            if ch.level != "run" or ch.phase not in _RUN_CODE:
                continue
            job = self._job(ch.job_id, ch.node)
            t = ch.since_ns / NS
            if job.phase_pending is not None:
                p = job.phase_pending
                had = max(0.0, (ch.since_ns - p.ts_ns) / NS)
                self._emit(_realised(p, had), True)
                job.phase_pending = None
            job.phase.learn_one({"ts_s": t, "phase": float(_RUN_CODE[ch.phase])})
            left = job.phase.predict_one({"ts_s": ch.ts_ns / NS})
            if math.isfinite(left):
                p = _new(
                    ts_ns=ch.ts_ns,
                    job_id=ch.job_id,
                    node=ch.node,
                    rank=-1,
                    prediction_id=f"{ch.job_id}:next_phase_s:{ch.node}:{ch.phase}:{ch.since_ns}",
                    model="PhaseTransitionForecaster",
                    target="next_phase_s",
                    value=left,
                    for_ts_ns=ch.ts_ns + int(left * NS),
                    summary=f"{ch.phase} expected to end in {left:.0f} s",
                )
                job.phase_pending = p
                self._emit(p)

    def tick(self, now_ns: int, jobs: Iterable[str] | None = None) -> list[Prediction]:
        """Close the anomaly seconds the clock passed; return the predictions due."""
        for job_id in self._jobs if jobs is None else jobs:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if job.win and now_ns // NS > job.win_sec + _WINDOW_WAIT_S:
                self._window(job_id, job)
            if job.sec >= 0 and now_ns // NS > job.sec:
                self._score(job_id, job)
        out, self._out = self._out, []
        return out

    def forget(self, job_id: str) -> None:
        """The job is gone: the cross-run models learn what it realised (if it did not say it
        ended); what that realises comes out of the next `drain` or `tick`."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self._finish(job)

    def drain(self) -> list[Prediction]:
        """The predictions made since the last `tick` or `drain`."""
        out, self._out = self._out, []
        return out

    # -- settings and state --------------------------------------------------------------------
    def configure(self, key: str, value: Any) -> tuple[Any, Any]:
        name = key.removeprefix("predict.")
        if name not in _PARAMS:
            raise ConfigError(
                f"unknown setting {key!r}; valid: predict.{', predict.'.join(_PARAMS)}"
            )
        kind, lo, hi = _PARAMS[name]
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
        elif (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not lo <= value <= hi
        ):
            raise ConfigError(f"{key} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        old = getattr(self, name)
        setattr(self, name, kind(value))
        return old, kind(value)

    def snapshot(self) -> dict[str, Any]:
        return {
            "params": {k: getattr(self, k) for k in _PARAMS},
            "jobs": self._jobs,
            "cross": (self.cross_step, self.cross_mem),
            "stats": dict(self.stats),
        }

    def restore(self, state: dict[str, Any]) -> None:
        for k, v in state.get("params", {}).items():
            if k in _PARAMS:
                setattr(self, k, v)
        self._jobs = state.get("jobs", {})
        if "cross" in state:
            self.cross_step, self.cross_mem = state["cross"]
        self.stats.update(state.get("stats", {}))

    # -- internals -------------------------------------------------------------------------------
    def _job(self, job_id: str, node: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(node=node)
        return job

    def _emit(self, p: Prediction, realised: bool = False) -> None:
        self._out.append(p)
        self.stats["realised" if realised else "predictions"] += 1

    def _job_info(self, info: JobInfo) -> None:
        job = self._job(info.job_id, info.node)
        if job.features is not None:
            return  # a job's info is sent more than once; the first one counts
        job.features = job_features(info)
        for model, target in (
            (self.cross_step, "job_step_time_ms"),
            (self.cross_mem, "job_mem_peak_bytes"),
        ):
            if model.n_seen == 0 or not job.features:
                continue
            value = model.predict_one(job.features)
            if not value > 0:
                continue
            p = _new(
                ts_ns=info.ts_ns,
                job_id=info.job_id,
                node=info.node,
                rank=-1,
                prediction_id=f"{info.job_id}:{target}",
                model="CrossRunPredictor",
                target=target,
                value=value,
                evidence=dict(job.features),
                summary=f"{target} from the {min(model.k, model.n_seen)} most similar past jobs",
            )
            job.cross_pending.append(p)
            self._emit(p)

    def _finish(self, job: _Job) -> None:
        """The job ended: realise its cross-run predictions and teach the models (once)."""
        if job.features is None:
            return
        step_ms = float(np.median(job.step_ring)) if job.step_ring else math.nan
        peak = job.peak if job.peak > 0 else math.nan
        for p in job.cross_pending:
            came = step_ms if p.target == "job_step_time_ms" else peak
            if math.isfinite(came):
                self._emit(_realised(p, came), realised=True)
        job.cross_pending = []
        if job.features:
            self.cross_step.learn_one(job.features, step_ms)
            self.cross_mem.learn_one(job.features, peak)
        job.features = None

    def _window(self, job_id: str, job: _Job) -> None:
        """The job's steps that ended in one second of event time: its window features teach
        the forecasters, the regime detector and the anomaly scorer; forecasts of the next
        window go out at most every ``every_s``; the previous ones are realised."""
        records, job.win = job.win, []
        sec = job.win_sec
        end_ns = max(int(r.end_ns.max()) for r in records)
        x = window_features(records)
        if "step_time_ms" in x:
            job.step_ring.append(x["step_time_ms"])
            if len(job.step_ring) > _RING_STEPS:
                del job.step_ring[: len(job.step_ring) - _RING_STEPS]
        for target, p in job.pending.items():
            if target in x:
                self._emit(_realised(p, x[target]), True)
        job.pending.clear()
        emit = sec - job.emitted_sec >= self.every_s
        first = min(r.step for r in records)
        last = max(r.step for r in records)
        for target in STEP_TARGETS:
            if target not in x:
                continue
            f = job.forecasters.get(target)
            if f is None:
                f = job.forecasters[target] = StepTimeForecaster(target=target)
                job.baselines[target] = Ewma(target=target)
            f.learn_one(x)
            job.baselines[target].learn_one(x)
            if not emit or f.n_seen < _WARMUP_WINDOWS:
                continue
            value = f.predict_one(x)
            if not value > 0:
                continue
            p = _new(
                ts_ns=end_ns,
                job_id=job_id,
                node=job.node,
                rank=-1,
                prediction_id=f"{job_id}:{target}:{sec + 1}",
                model="StepTimeForecaster",
                target=target,
                value=value,
                baseline=job.baselines[target].predict_one(x),
                step=last + 1,
                for_ts_ns=(sec + 2) * NS,
                summary=f"median {target} of the steps ending in the next second",
            )
            job.pending[target] = p
            self._emit(p)
        if job.pending:
            job.emitted_sec = sec
        job.regime.learn_one(x)
        if job.regime.changed:
            moved = {k: round(x[k], 4) for k in job.regime.changed if k in x}
            self._emit(
                _new(
                    ts_ns=end_ns,
                    job_id=job_id,
                    node=job.node,
                    rank=-1,
                    prediction_id=f"{job_id}:regime_change:{first}",
                    model="RegimeDetector",
                    target="regime_change",
                    value=1.0,
                    step=first,
                    evidence=moved,
                    summary=f"regime change by step {last}: {', '.join(job.regime.changed)}",
                )
            )
        keep = ("step_time_ms", "idle_share", *(f"{p}_share" for p in SHARES))
        for k in keep:
            if k in x:
                acc = job.sums.setdefault(k, [0.0, 0.0])
                acc[0] += x[k]
                acc[1] += 1.0
        if job.sec < 0:
            job.sec = sec

    def _gather(self, job: _Job, ts: np.ndarray, cols: dict[str, Any]) -> None:
        """Add samples to the job's per-second sums (the seconds before the newest are closed
        at the next tick)."""
        if not len(ts):
            return
        sec = int(np.max(ts)) // NS
        if job.sec < 0:
            job.sec = sec
        for name, values in cols.items():
            v = np.asarray(values, dtype=np.float64)
            ok = np.isfinite(v)
            if ok.any():
                s = job.sums.setdefault(name, [0.0, 0.0])
                s[0] += float(v[ok].sum())
                s[1] += float(ok.sum())

    def _score(self, job_id: str, job: _Job) -> None:
        x = {k: s[0] / s[1] for k, s in job.sums.items() if s[1] > 0}
        job.sums = {}
        sec, job.sec = job.sec, -1
        if not x:
            return
        score = job.anomaly.score_one(x)
        job.anomaly.learn_one(x)
        if score < self.anomaly_threshold or sec - job.anomaly_last < self.anomaly_every_s:
            return
        job.anomaly_last = sec
        self._emit(
            _new(
                ts_ns=(sec + 1) * NS,
                job_id=job_id,
                node=job.node,
                rank=-1,
                prediction_id=f"{job_id}:anomaly_score:{sec}",
                model="WindowAnomaly",
                target="anomaly_score",
                value=round(score, 6),
                evidence={k: round(v, 4) for k, v in x.items()},
                summary=f"unusual second for this job (score {score:.3f})",
            )
        )

    def _warn(
        self, job_id: str, job: _Job, rank: int, ts_ns: int, left: float, used: float, total: float
    ) -> None:
        left = min(left, 1e9)
        p = _new(
            ts_ns=ts_ns,
            job_id=job_id,
            node=job.node,
            rank=rank,
            prediction_id=f"{job_id}:time_to_oom_s:{rank}:{ts_ns}",
            model="TimeToOOM",
            target="time_to_oom_s",
            value=round(left, 3),
            for_ts_ns=ts_ns + int(left * NS),
            evidence={"mem_peak_bytes": used, "mem_total_bytes": total},
            summary=f"rank {rank} runs out of memory in ~{left:.0f} s at its current trend",
        )
        job.warnings = [*job.warnings[-(_MAX_OPEN_WARNINGS - 1) :], p]
        self._emit(p)


def _event_id(prediction_id: str, state: str) -> str:
    """A prediction's event id, from its id and state: the same prediction emitted again
    (after a worker restart) is the same event, which the sink stores once."""
    return hashlib.blake2b(f"{prediction_id}|{state}".encode(), digest_size=16).hexdigest()


def _new(**fields: Any) -> Prediction:
    return Prediction(event_id=_event_id(fields["prediction_id"], "predicted"), **fields)


def _realised(p: Prediction, value: float) -> Prediction:
    """``p`` again, realised: the same ``prediction_id``, its own ``event_id``."""
    eid = _event_id(p.prediction_id, "realised")
    return p.model_copy(update={"state": "realised", "realised": value, "event_id": eid})
