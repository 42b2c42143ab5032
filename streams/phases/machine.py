"""Phase detection: a hierarchical state machine per job, from spans or from GPU signals alone
(public through `perfloop.streams.phases`).

`PhaseMachine` is a stream-tier component (no I/O, picklable state) that reads decoded step,
span and GPU batches and job lifecycle events, and emits `PhaseChange` events (rank -1, the job):

- **run level** (``level="run"``, every change): ``warmup`` → ``steady`` once step times settle,
  ``eval`` / ``checkpoint`` from spans of those phases or from a pause in the steps with the GPU
  signature of one, ``stalled`` when no step comes, back when steps resume, ``finished`` at the
  end (rules in `perfloop.streams.phases._run_state`). ``next_phase`` / ``next_ts_ns``
  predict the next transition from what the job taught: the interval between its evaluations
  and checkpoints and their length, or the steps left before warmup can end;
- **step level** (``level="step"``), as a *summary per job*: per-rank phase changes happen five
  times a step (50 per second per rank at 10 steps/s) and are not emitted. Instead the machine
  keeps each job's phase mix (the share of step time in each of data_wait, forward, backward,
  comm, optimizer over the last ``mix_steps`` steps) and emits a change when the dominant phase
  changes (by at least ``dominance_margin`` of share), at most once per ``step_emit_s``
  (default 5 s) per job. Run-level changes are a few per evaluation or checkpoint and at most
  one stall/resume pair per ``min_stall_s``, so a job's event rate is bounded by about
  ``1 / step_emit_s + 2 / min_gap_s`` events per second whatever its size.

Step-level phases come from depth-0 spans when a job publishes them (``source="spans"``). For a
job that publishes only GPU samples (``source="gpu"``) — and samples them at least four times a
step: NVML averages over the sampling interval, so at 10 Hz a 100-ms step's phases blur into one
reading and no step-level change is emitted from them — each sample is classified by a per-job
signature library learned online (`perfloop.streams.phases._signatures`): labelled by the
job's own spans when it has both (the library then also measures its accuracy, `accuracy`),
otherwise by clustering the samples and naming the clusters by the physics of each phase.
`predict` says, for a rank, which step phase it is in at a time and when the next one starts,
from the learned mean offset and length of each phase within a step (jobs with spans).

>>> from perfloop.schemas.codec import decode_batch, encode_batch
>>> pm = PhaseMachine(warmup_min_steps=3, cv_window=3)
>>> steps = {"ts_ns": [(i + 1) * 10**8 for i in range(5)], "rank": [0] * 5,
...          "step": list(range(5)), "step_time_ms": [100.0] * 5}
>>> pm.observe(decode_batch(encode_batch("step", steps, job_id="j", node="n")), 6 * 10**8)
>>> [(c.phase, c.previous, c.step) for c in pm.tick(6 * 10**8)]
[('warmup', '', 0), ('steady', 'warmup', 2)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import numpy as np

from perfloop.exceptions import ConfigError
from perfloop.schemas.analysis import PhaseChange
from perfloop.schemas.base import Event
from perfloop.schemas.codec import Batch
from perfloop.schemas.job import JobLifecycle, RankProgress
from perfloop.streams._batch_groups import group_batches, unique_ints
from perfloop.streams.phases._run_state import RunState
from perfloop.streams.phases._signatures import STEP_PHASES, SignatureLibrary, gpu_features

__all__ = ["STEP_PHASES", "PhaseMachine"]

NS = 1_000_000_000
_CODE = {p: i for i, p in enumerate(STEP_PHASES)}
_P = len(STEP_PHASES)
_COLUMNS = {
    "step": ("rank", "step", "ts_ns", "step_time_ms"),
    "span": ("rank", "step", "ts_ns", "phase", "duration_ms", "depth"),
    "gpu": (
        "rank", "ts_ns", "sm_util_pct", "mem_util_pct", "power_w", "power_limit_w",
        "nvlink_rx_bytes_per_s", "nvlink_tx_bytes_per_s",
    ),
}  # fmt: skip
_KINDS = frozenset(_COLUMNS)
_ENDED = frozenset({"finished", "failed", "killed"})
_SPANS_FRESH_NS = 30 * NS  # a job whose last spans are older is read from its GPU samples
_KEEP_NS = 30 * NS  # GPU samples wait this long at most for the spans that label them
_SKEW_NS = 2 * NS  # spans kept this long for GPU samples of their time that come later
_IDLE_EVAL_NS = NS  # a job that sent nothing is re-evaluated (pauses, stalls) this often

_PARAMS: dict[str, tuple[type, float, float]] = {
    "warmup_min_steps": (int, 1, 100000),
    "cv_window": (int, 2, 1000),
    "warmup_cv": (float, 0.0, 10.0),
    "gap_factor": (float, 1.0, 1e4),
    "min_gap_s": (float, 0.0, 86400.0),
    "stall_factor": (float, 1.0, 1e5),
    "min_stall_s": (float, 0.0, 86400.0),
    "eval_sm_pct": (float, 0.0, 100.0),
    "eval_power_share": (float, 0.0, 1.0),
    "idle_sm_pct": (float, 0.0, 100.0),
    "step_emit_s": (float, 0.0, 86400.0),
    "dominance_margin": (float, 0.0, 1.0),
    "mix_steps": (int, 1, 100000),
    "forget_s": (float, 1.0, 86400.0),
}


class _Job:
    """One job's state besides its run level: spans timeline, library, phase mix, offsets."""

    def __init__(self, job_id: str, node: str) -> None:
        self.job_id, self.node = job_id, node
        self.run = RunState()
        self.lib = SignatureLibrary()
        self.col: dict[int, int] = {}
        self.lut = np.zeros(0, np.int64)  # rank → column, -1 for ranks not seen
        self.tl = np.zeros((0, 4), np.int64)  # span timeline: col, start, end, phase code
        self.tl_max = np.zeros(0, np.int64)  # newest span end per col
        self.pend_t = np.zeros((0, 2), np.int64)  # GPU samples to label: col, mid time
        self.pend_x = np.zeros((0, 4))
        self.pend_y = np.zeros(0, np.int64)  # what was predicted for them
        self.dt_ns = NS // 10
        self.spans_wall = 0
        self.mix = {"spans": np.zeros(_P), "gpu": np.zeros(_P)}  # exponential means of shares
        self.mix_w = {"spans": 0.0, "gpu": 0.0}  # their weight: 1 = a full window of evidence
        self.gpu_conf = 0.0
        self.dominant = ""
        self.dom_since = 0
        self.step_emit_wall = 0
        self.off = np.zeros(_P)  # mean start offset of each phase in its step (ns)
        self.dur = np.zeros(_P)  # mean length (ns)
        self.ph_n = np.zeros(_P)
        self.rank_end: dict[int, int] = {}
        self.last_wall = 0
        self.ended_wall = 0
        self.dirty = False  # data came since the last evaluation
        self.eval_wall = 0

    def cols(self, ranks: np.ndarray) -> np.ndarray:
        """Column of each rank (their order of first appearance), adding new ranks."""
        top = int(ranks.max())
        if top >= len(self.lut):
            self.lut = np.concatenate([self.lut, np.full(top + 1 - len(self.lut), -1)])
        cols = self.lut[ranks]
        if (cols < 0).any():
            for r in np.unique(ranks[cols < 0]).tolist():
                self.lut[r] = self.col[r] = len(self.col)
                self.tl_max = np.append(self.tl_max, 0)
            cols = self.lut[ranks]
        return cols


class PhaseMachine:
    """Run-level and step-level phases of every job; see the module docstring.

    Parameters are constructor arguments of the same names, changed live with
    ``configure("phases.<name>", value)``.
    """

    def __init__(
        self,
        *,
        warmup_min_steps: int = 10,
        cv_window: int = 8,
        warmup_cv: float = 0.1,
        gap_factor: float = 5.0,
        min_gap_s: float = 2.0,
        stall_factor: float = 20.0,
        min_stall_s: float = 10.0,
        eval_sm_pct: float = 50.0,
        eval_power_share: float = 0.35,
        idle_sm_pct: float = 10.0,
        step_emit_s: float = 5.0,
        dominance_margin: float = 0.05,
        mix_steps: int = 10,
        forget_s: float = 600.0,
    ) -> None:
        values = dict(locals())
        for name in _PARAMS:
            setattr(self, name, self._check(name, values[name]))
        self._jobs: dict[str, _Job] = {}
        self._pending: list[tuple[Batch, int]] = []
        self._out: list[PhaseChange] = []

    # -- the component interface -----------------------------------------------------------------
    def observe(self, batch: Batch, wall_ns: int) -> None:
        """Take a decoded batch (kinds other than gpu, step and span are ignored)."""
        if batch.kind in _KINDS and len(batch):
            self._pending.append((batch, wall_ns))

    def observe_event(self, event: Event, wall_ns: int) -> None:
        """A job's lifecycle (rank -1): its end finishes the run; a new start resets it. A
        rank's progress report of a checkpoint or an evaluation is that episode."""
        if isinstance(event, RankProgress):
            self._apply()
            job = self._jobs.get(event.job_id)
            if job is not None and not job.ended_wall:
                job.run.progress(event.phase, event.since_ns, event.ts_ns, event.step)
                job.dirty = True
            return
        if not isinstance(event, JobLifecycle) or event.rank != -1:
            return
        self._apply()
        job = self._jobs.get(event.job_id)
        if event.state in _ENDED:
            job = job or self._job(event.job_id, event.node, wall_ns)
            self._label(job)
            job.run.evaluate(wall_ns, self._param)  # what the last steps decided, first
            job.run.end(event.ts_ns)
            job.ended_wall = max(wall_ns, 1)
            self._flush(job, event.ts_ns)
        elif event.state == "started" and job is not None and job.ended_wall:
            del self._jobs[event.job_id]  # the job runs again: start afresh

    def tick(self, wall_ns: int, jobs: Iterable[str] | None = None) -> list[PhaseChange]:
        """Apply what was observed; return the phase changes that became due.

        ``jobs``: only these jobs are evaluated (the engine ticks each job at its own event
        time); None: every job.
        """
        self._apply()
        p = self._param
        for job_id in list(self._jobs) if jobs is None else [j for j in jobs if j in self._jobs]:
            job = self._jobs[job_id]
            if job.dirty or wall_ns - job.eval_wall >= _IDLE_EVAL_NS:
                self._label(job)
                job.run.evaluate(wall_ns, p)
                now = job.run.now(wall_ns)
                self._flush(job, now)
                self._step_level(job, now, wall_ns)
                job.dirty, job.eval_wall = False, wall_ns
            if wall_ns - max(job.last_wall, job.ended_wall) > self.forget_s * NS:
                del self._jobs[job_id]
        out, self._out = self._out, []
        return out

    def forget(self, job_id: str) -> None:
        """Drop the job (it ended and its changes were returned)."""
        self._apply()
        self._jobs.pop(job_id, None)

    def configure(self, key: str, value: Any) -> tuple[Any, Any]:
        """Change one parameter live (``phases.<name>``); return ``(old, new)``."""
        name = key.removeprefix("phases.")
        if not key.startswith("phases.") or name not in _PARAMS:
            raise ConfigError(
                f"unknown phase machine setting {key!r}; valid: "
                + ", ".join(f"phases.{n}" for n in _PARAMS)
            )
        new = self._check(name, value)
        old = getattr(self, name)
        setattr(self, name, new)
        return old, new

    def snapshot(self) -> dict[str, Any]:
        """Durable state: builtins and numpy arrays (observed batches are applied first)."""
        self._apply()
        jobs = {}
        for job_id, job in self._jobs.items():
            d = {k: v for k, v in vars(job).items() if k not in ("run", "lib")}
            d["run"], d["lib"] = job.run.state(), job.lib.state()
            jobs[job_id] = d
        return {
            "version": 1,
            "params": {n: getattr(self, n) for n in _PARAMS},
            "jobs": jobs,
            "out": [c.model_dump() for c in self._out],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Replace this component's state with a `snapshot`."""
        if state.get("version") != 1:
            raise ConfigError(f"phase machine snapshot version {state.get('version')!r}; valid: 1")
        for n, v in state["params"].items():
            setattr(self, n, v)
        self._jobs = {}
        for job_id, d in state["jobs"].items():
            job = _Job.__new__(_Job)
            job.__dict__.update({k: v for k, v in d.items() if k not in ("run", "lib")})
            job.run = RunState.from_state(d["run"])
            job.lib = SignatureLibrary.from_state(d["lib"])
            self._jobs[job_id] = job
        self._out = [PhaseChange(**c) for c in state["out"]]
        self._pending = []

    # -- queries ---------------------------------------------------------------------------------
    def run_phase(self, job_id: str) -> str:
        """The job's run-level phase ("" when unknown)."""
        job = self._jobs.get(job_id)
        return job.run.phase if job else ""

    def accuracy(self, job_id: str) -> float:
        """How often the job's GPU classification matched its spans (NaN without both)."""
        job = self._jobs.get(job_id)
        return job.lib.accuracy if job else float("nan")

    def classify(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Step phase (names) and confidence of each sample of a GPU batch, by its job's library.

        Learns nothing (use `observe` for that); a job not seen yet is classified by priors.
        """
        job = self._jobs.get(batch.job_id)
        lib = job.lib if job else SignatureLibrary()
        raw = gpu_features(batch.columns)
        x = raw.copy()
        x[:, 3] = raw[:, 3] / lib.link_scale if lib.link_scale > 0 else 0.0
        codes, conf = lib.classify(x)
        return np.asarray(STEP_PHASES, dtype=object)[codes], conf

    def predict(self, job_id: str, rank: int, ts_ns: int) -> tuple[str, str, int] | None:
        """``(phase, next_phase, next_ts_ns)`` of a rank at ``ts_ns`` (None: not learned).

        From the rank's last step end and the job's mean offset and length of each phase in a
        step, the steps repeating at the job's median step time.
        """
        job = self._jobs.get(job_id)
        if job is None or rank not in job.rank_end or not (job.ph_n > 0).any():
            return None
        step_ns = job.run.median_step_ms() * 1e6
        if step_ns <= 0:
            return None
        order = [int(i) for i in np.argsort(job.off) if job.ph_n[i] > 0]
        end = job.rank_end[rank]
        k = max(0, math.floor((ts_ns - end) / step_ns))
        base = end + k * step_ns
        u = ts_ns - base
        i = max([j for j, c in enumerate(order) if job.off[c] <= u], default=len(order) - 1)
        cur = order[i]
        if i + 1 < len(order):
            nxt, t = order[i + 1], base + job.off[order[i + 1]]
        else:
            nxt, t = order[0], base + step_ns + job.off[order[0]]
        return STEP_PHASES[cur], STEP_PHASES[nxt], int(t)

    # -- internals -------------------------------------------------------------------------------
    def _param(self, name: str) -> float:
        return float(getattr(self, name))

    def _check(self, name: str, value: Any) -> Any:
        kind, lo, hi = _PARAMS[name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and kind is int:
            ok = float(value).is_integer()
        if not ok or not math.isfinite(value) or not (lo <= value <= hi):
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"phases.{name} must be {what} in [{lo:g}, {hi:g}], got {value!r}")
        return kind(value)

    def _job(self, job_id: str, node: str, wall_ns: int) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(job_id, node)
        job.last_wall = max(job.last_wall, wall_ns)
        job.dirty = True
        return job

    def _apply(self) -> None:
        pending, self._pending = self._pending, []
        for job_id, node, kind, cols, wall in group_batches(pending, _COLUMNS):
            job = self._jobs.get(job_id)
            if job is not None and job.ended_wall:
                continue  # late data of a job that ended
            job = self._job(job_id, node, wall)
            if kind == "step":
                self._on_steps(job, cols, wall)
            elif kind == "span":
                self._on_spans(job, cols, wall)
            else:
                self._on_gpu(job, cols, wall)

    def _on_steps(self, job: _Job, c: dict[str, np.ndarray], wall: int) -> None:
        job.run.add_steps(c["step"], c["ts_ns"], c["step_time_ms"], wall)
        ranks, ends = c["rank"], c["ts_ns"]
        uniq, inv = unique_ints(ranks)
        newest = np.zeros(len(uniq), np.int64)
        np.maximum.at(newest, inv, ends)
        for r, e in zip(uniq.tolist(), newest.tolist(), strict=True):
            if e > job.rank_end.get(r, 0):
                job.rank_end[r] = e

    def _on_spans(self, job: _Job, c: dict[str, np.ndarray], wall: int) -> None:
        phase = c["phase"]
        start = c["ts_ns"]
        dur = np.rint(c["duration_ms"] * 1e6).astype(np.int64)
        episodic = (phase == "eval") | (phase == "checkpoint")
        if episodic.any():
            tol = max(NS, int(2e6 * job.run.median_step_ms()))
            for i in np.flatnonzero(episodic).tolist():
                s = int(start[i])
                job.run.add_episode(str(phase[i]), s, s + int(dur[i]), int(c["step"][i]), tol)
        top = c["depth"] == 0
        if not top.any():
            return
        job.spans_wall = wall
        codes = np.fromiter(map(_CODE.get, phase[top], repeat(-1)), np.int64, int(top.sum()))
        cols = job.cols(c["rank"][top])
        s, d, steps = start[top], dur[top], c["step"][top]
        known = codes >= 0
        if known.any():
            rows = np.stack([cols[known], s[known], s[known] + d[known], codes[known]], axis=1)
            job.tl = np.concatenate([job.tl, rows])
            np.maximum.at(job.tl_max, cols[known], rows[:, 2])
        key = (steps - steps.min()) * len(job.col) + cols  # one per (step, rank)
        uniq, inv = unique_ints(key)
        if known.any():
            ms = np.bincount(codes[known], weights=d[known], minlength=_P)
            pairs = len(uniq)
            alpha = min(1.0, pairs / (self.mix_steps * max(1, len(job.col))))
            mix = job.mix["spans"]
            mix += alpha * (ms / max(ms.sum(), 1.0) - mix)
            job.mix_w["spans"] += alpha
        # where each phase sits in its step: offsets from the step's first span
        first = np.full(len(uniq), np.iinfo(np.int64).max)
        np.minimum.at(first, inv, s)
        off = (s - first[inv])[known]
        n = np.bincount(codes[known], minlength=_P).astype(float)
        if n.any():
            mean_off = np.bincount(codes[known], weights=off, minlength=_P) / np.maximum(n, 1)
            mean_dur = np.bincount(codes[known], weights=d[known], minlength=_P) / np.maximum(n, 1)
            w = np.where(n > 0, np.maximum(0.05, n / (job.ph_n + n)), 0.0)
            job.off += w * (mean_off - job.off)
            job.dur += w * (mean_dur - job.dur)
            job.ph_n += n

    def _on_gpu(self, job: _Job, c: dict[str, np.ndarray], wall: int) -> None:
        lib = job.lib
        raw = gpu_features(c)
        x = lib.features(raw)
        pred, conf, near = lib.classify_full(x)
        ts = c["ts_ns"]
        job.run.add_gpu(
            int(ts.min()), int(ts.max()), float(c["sm_util_pct"].sum()), float(x[:, 2].sum()),
            len(ts), wall,
        )  # fmt: skip
        cols = job.cols(c["rank"])
        if len(ts) > 1:  # the sampling interval, from one rank's consecutive samples
            mine = np.sort(ts[cols == cols[0]])
            if len(mine) > 1:
                job.dt_ns = int(np.median(np.diff(mine))) or job.dt_ns
        step_ns = job.run.median_step_ms() * 1e6
        if step_ns and job.dt_ns > step_ns / 4:
            return  # samples that average a whole step teach no phase signature
        if job.spans_wall:
            mid = ts - job.dt_ns // 2  # NVML averages over the interval before the sample
            job.pend_t = np.concatenate([job.pend_t, np.stack([cols, mid], axis=1)])
            job.pend_x = np.concatenate([job.pend_x, x])
            job.pend_y = np.concatenate([job.pend_y, pred])
        else:
            lib.add_unlabelled(raw, near, ts)
            if lib.source == "prior":
                return  # generic signatures only: not enough to say what the job does
            hist = np.bincount(pred, minlength=_P).astype(float)
            alpha = min(1.0, len(ts) / (3.0 * self.mix_steps * max(1, len(job.col))))
            mix = job.mix["gpu"]
            mix += alpha * (hist / hist.sum() - mix)
            job.mix_w["gpu"] += alpha
            job.gpu_conf += alpha * (float(conf.mean()) - job.gpu_conf)

    def _label(self, job: _Job) -> None:
        """Label buffered GPU samples with the span covering them once their rank's spans
        reach them; learn from the labelled; forget what is too old."""
        if not len(job.pend_t):  # nothing to label: keep only the spans late samples may need
            if len(job.tl):
                job.tl = job.tl[job.tl[:, 2] >= int(job.tl_max.max()) - _SKEW_NS]
            return
        tl = job.tl[np.lexsort((job.tl[:, 1], job.tl[:, 0]))]
        base = int(min(tl[:, 1].min(), job.pend_t[:, 1].min())) if len(tl) else 0
        key = tl[:, 0] * (1 << 42) + (tl[:, 1] - base)
        col, t = job.pend_t[:, 0], job.pend_t[:, 1]
        decided = t <= job.tl_max[col]
        i = np.searchsorted(key, col * (1 << 42) + (t - base), side="right") - 1
        ok = decided & (i >= 0)
        j = np.maximum(i, 0)
        ok &= (tl[j, 0] == col) & (t < tl[j, 2]) if len(tl) else False
        if ok.any():
            job.lib.add_labelled(job.pend_x[ok], tl[j[ok], 3], job.pend_y[ok])
        newest = int(job.tl_max.max()) if len(job.tl_max) else 0
        keep = ~decided & (t > newest - _KEEP_NS)
        job.pend_t, job.pend_x, job.pend_y = job.pend_t[keep], job.pend_x[keep], job.pend_y[keep]
        # spans older than every sample still waiting (less a margin for GPU batches that
        # arrive after the spans of their time) can label nothing more
        oldest = int(job.pend_t[:, 1].min()) if keep.any() else newest
        job.tl = job.tl[job.tl[:, 2] >= min(oldest, newest - _SKEW_NS)]

    def _flush(self, job: _Job, now: int) -> None:
        """Turn the run level's pending transitions into events."""
        changes, job.run.changes = job.run.changes, []
        if not changes:
            return
        nxt, nxt_ts = job.run.prediction(now, self._param)
        for i, ch in enumerate(changes):
            last = i == len(changes) - 1
            self._out.append(
                PhaseChange(
                    ts_ns=max(now, ch["since_ns"]),
                    job_id=job.job_id,
                    node=job.node,
                    rank=-1,
                    level="run",
                    next_phase=nxt if last else "",
                    next_ts_ns=max(0, nxt_ts) if last else 0,
                    **ch,
                )
            )

    def _step_level(self, job: _Job, now: int, wall: int) -> None:
        """Emit the job's dominant step phase when it changes (rate-limited)."""
        if job.run.phase not in ("warmup", "steady"):
            return
        fresh = job.spans_wall and wall - job.spans_wall <= _SPANS_FRESH_NS
        source = "spans" if fresh else "gpu"
        step_ns = job.run.median_step_ms() * 1e6
        if not fresh and step_ns and job.dt_ns > step_ns / 4:
            return  # each GPU sample averages most of a step: its phases are not resolved
        mix = job.mix[source]
        if job.mix_w[source] < 1.0 or mix.sum() <= 0:
            return
        dom = int(np.argmax(mix))
        name = STEP_PHASES[dom]
        if name == job.dominant or wall - job.step_emit_wall < self.step_emit_s * NS:
            return
        if job.dominant and mix[dom] - mix[_CODE[job.dominant]] < self.dominance_margin:
            return
        low = min(job.rank_end) if job.rank_end else None
        guess = self.predict(job.job_id, low, now) if low is not None and fresh else None
        conf = 1.0 if fresh else job.gpu_conf
        if not fresh and job.lib.scored:
            conf = job.lib.accuracy
        self._out.append(
            PhaseChange(
                ts_ns=now,
                job_id=job.job_id,
                node=job.node,
                rank=-1,
                level="step",
                phase=name,
                previous=job.dominant,
                since_ns=now,
                step=max(0, job.run.last_step),
                source=source,
                confidence=min(1.0, max(0.0, conf)),
                duration_ms=max(0.0, (now - job.dom_since) / 1e6) if job.dominant else 0.0,
                next_phase=guess[1] if guess else "",
                next_ts_ns=max(0, guess[2]) if guess else 0,
            )
        )
        job.dominant, job.dom_since, job.step_emit_wall = name, now, wall
