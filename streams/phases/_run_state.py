"""The run-level phase state machine of one job (private helper of `perfloop.streams.phases`).

States are `perfloop.schemas.analysis.RUN_PHASES`:

- ``warmup`` from the job's first step until its step times settle: the last ``cv_window``
  steps' mean times (across ranks) have a coefficient of variation ≤ ``warmup_cv`` and at least
  ``warmup_min_steps`` steps were seen;
- ``steady`` after that;
- ``eval`` / ``checkpoint`` from spans of those phases (any rank, any depth; overlapping spans
  are one episode), from a rank's progress report (`perfloop.schemas.RankProgress`) saying it
  is in one (while such reports keep coming, the episode does not stall), or from a pause
  in the steps — no step for ``max(gap_factor × median step,
  min_gap_s)`` — whose GPU samples show the signature: a busy GPU (mean SM ≥ ``eval_sm_pct`` and
  power ≥ ``eval_power_share`` of its limit) is an evaluation, an idle one (SM ≤ ``idle_sm_pct``)
  a checkpoint being written;
- ``stalled`` when no step came for ``max(stall_factor × median step, min_stall_s)`` (an eval
  found on the GPU stalls only once the GPU is no longer busy, a checkpoint only after three
  times its usual length);
- back to ``steady`` (or ``warmup``) when steps resume; ``finished`` when the job's lifecycle
  says it ended.

"Now" is event time: the newest GPU sample, or the last step's end plus the wall time since it
came when nothing else arrives. Each episode's start teaches the interval between episodes of
its kind and its end their length (exponential means), which predict the next transition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from perfloop.streams._batch_groups import unique_ints

__all__ = ["RunState"]

NS = 1_000_000_000
_EPISODES = ("eval", "checkpoint")
_KEEP_STEPS = 256
_AGG = 256  # GPU batch aggregates kept for pauses
_REPORTED_NS = 6 * NS  # a progress report of an episode holds it this long


class RunState:
    """Run-level state of one job; `changes` collects the transitions (dicts for PhaseChange)."""

    def __init__(self) -> None:
        self.phase = ""
        self.since_ns = 0
        self.source = ""
        self.reached_steady = False
        self.step_sum: dict[int, list[float]] = {}  # step → [sum ms, count, newest end ns]
        self._median: float | None = None
        self.last_step = -1
        self.last_end = 0
        self.last_wall = 0
        self.gpu_wm = 0
        self.gpu_wall = 0
        self.agg = np.zeros((_AGG, 3))  # per GPU batch: SM % sum, power share sum, samples
        self.agg_t = np.zeros((_AGG, 2), np.int64)  # its first and last sample time
        self.agg_i = 0
        self.episode: dict[str, Any] | None = None  # the open eval/checkpoint episode
        self.reported = 0  # the newest progress report of an eval or a checkpoint
        self.learned = {k: {"last": 0, "interval": 0.0, "dur": 0.0, "n": 0} for k in _EPISODES}
        self.changes: list[dict[str, Any]] = []

    # -- inputs ----------------------------------------------------------------------------------
    def add_steps(self, step: np.ndarray, end: np.ndarray, ms: np.ndarray, wall: int) -> None:
        """Fold a batch of step events in; leave a pause when steps resume."""
        uniq, inv = unique_ints(step)
        sums = np.bincount(inv, weights=ms)
        counts = np.bincount(inv)
        ends = np.zeros(len(uniq), np.int64)
        np.maximum.at(ends, inv, end)
        for s, t, c, e in zip(
            uniq.tolist(), sums.tolist(), counts.tolist(), ends.tolist(), strict=True
        ):
            cur = self.step_sum.get(s)
            if cur is None:
                self.step_sum[s] = [t, c, e]
            else:
                cur[0] += t
                cur[1] += c
                cur[2] = max(cur[2], e)
        if len(self.step_sum) > _KEEP_STEPS:
            for s in sorted(self.step_sum)[: len(self.step_sum) - _KEEP_STEPS]:
                del self.step_sum[s]
        self._median = None
        newest = int(end.max())
        starts = end - np.rint(ms * 1e6).astype(np.int64)
        if not self.phase:
            self._move("warmup", int(starts.min()), "steps", int(uniq[0]))
        elif self.phase in ("eval", "checkpoint", "stalled") and newest > self.since_ns:
            after = end > self.since_ns
            resume = int(starts[after].min()) if after.any() else newest
            if self.episode is not None and self.episode["end"]:
                resume = self.episode["end"]  # the episode's spans said when it ended
            resume = max(resume, self.since_ns)
            self._close_episode(resume)
            back = "steady" if self.reached_steady else "warmup"
            self._move(back, resume, "steps", int(step[after].min()) if after.any() else 0)
        if newest > self.last_end:
            self.last_end, self.last_wall = newest, wall
        self.last_step = max(self.last_step, int(uniq[-1]))

    def add_gpu(
        self, t_lo: int, t_hi: int, sm_sum: float, power_sum: float, n: int, wall: int
    ) -> None:
        """One batch of a job's GPU samples, summarised for pause detection."""
        i = self.agg_i % _AGG
        self.agg_t[i] = (t_lo, t_hi)
        self.agg[i] = (sm_sum, power_sum, n)
        self.agg_i += 1
        if t_hi > self.gpu_wm:
            self.gpu_wm, self.gpu_wall = t_hi, wall

    def add_episode(self, kind: str, start: int, end: int, step: int, tolerance_ns: int) -> None:
        """A span of an eval or a checkpoint (from any rank; one episode's spans count once)."""
        ep = self.episode
        if ep is not None and ep["kind"] == kind:
            ep["end"] = max(ep["end"], end)  # a span of the episode already open
            return
        last = self.learned[kind]["last"]
        if last and abs(start - last) <= tolerance_ns:
            return  # another rank's span of an episode already over
        if ep is not None:
            self._close_episode(start)
        back = "steady" if self.reached_steady else "warmup"
        self._open_episode(kind, start, "spans", step)
        self.episode["end"] = end  # type: ignore[index]
        if self.last_end > start:  # the steps went on already: the episode is over
            self._close_episode(end)
            self._move(back, end, "spans", step)

    def progress(self, kind: str, since: int, ts: int, step: int) -> None:
        """A rank reports where it is inside a long step: a checkpoint or an evaluation there
        is that episode, not a stall."""
        if kind not in _EPISODES or self.phase in ("", "finished") or since < self.last_end:
            return
        self.reported = max(self.__dict__.get("reported", 0), ts)
        ep = self.episode
        if ep is not None and ep["kind"] == kind:
            return
        if ep is not None:
            self._close_episode(since)
        self._open_episode(kind, since, "progress", step, 0.9)

    def end(self, ts_ns: int) -> None:
        """The job's lifecycle says it ended."""
        if self.phase != "finished":
            self._close_episode(ts_ns)
            self._move("finished", ts_ns, "lifecycle", max(self.last_step, 0))

    # -- evaluation --------------------------------------------------------------------------------
    def now(self, wall: int) -> int:
        """Event-time "now": the newest GPU sample, or the last step end plus the wall since."""
        t = self.gpu_wm + max(0, wall - self.gpu_wall) if self.gpu_wm else 0
        return max(t, self.last_end + max(0, wall - self.last_wall) if self.last_end else 0)

    def median_step_ms(self) -> float:
        """Median of the last 16 steps' mean times (0 before the first step)."""
        if self._median is None:
            keys = sorted(self.step_sum)[-16:]
            ms = [self.step_sum[k][0] / self.step_sum[k][1] for k in keys]
            self._median = float(np.median(ms)) if ms else 0.0
        return self._median

    def evaluate(self, wall: int, p: Callable[[str], float]) -> None:
        """Move on what time alone decides: warmup → steady, pauses, stalls."""
        if self.phase in ("", "finished"):
            return
        if self.phase == "warmup":
            keys = sorted(self.step_sum)
            w = int(p("cv_window"))
            if len(keys) >= max(int(p("warmup_min_steps")), w):
                last = keys[-w:]
                ms = np.array([self.step_sum[k][0] / self.step_sum[k][1] for k in last])
                if ms.std() <= p("warmup_cv") * ms.mean():
                    before = self.step_sum.get(last[0] - 1)
                    since = before[2] if before else int(self.step_sum[last[0]][2] - ms[0] * 1e6)
                    self.reached_steady = True
                    self._move("steady", since, "steps", last[0])
        med = self.median_step_ms()
        if not self.last_end or med <= 0:
            return
        now = self.now(wall)
        gap = now - self.last_end
        stall = max(p("stall_factor") * med * 1e6, p("min_stall_s") * NS)
        if self.phase in ("warmup", "steady"):
            if gap > max(p("gap_factor") * med * 1e6, p("min_gap_s") * NS):
                sm, power, n = self._gpu_since(self.last_end)
                if n >= 3 and sm >= p("eval_sm_pct") and power >= p("eval_power_share"):
                    self._open_episode("eval", self.last_end, "gpu", self.last_step, 0.7)
                elif n >= 3 and sm <= p("idle_sm_pct"):
                    self._open_episode("checkpoint", self.last_end, "gpu", self.last_step, 0.5)
            if self.phase in ("warmup", "steady") and gap > stall:
                self._move("stalled", self.last_end, "steps", self.last_step)
        elif self.phase == "eval" and self.source == "gpu" and gap > stall:
            sm, power, n = self._gpu_since(now - int(stall))
            if n >= 3 and not (sm >= p("eval_sm_pct") and power >= p("eval_power_share")):
                self._close_episode(now)
                self._move("stalled", self.last_end, "gpu", self.last_step)
        elif self.now(wall) - self.__dict__.get("reported", 0) <= _REPORTED_NS:
            return  # a rank says it is still in the episode
        elif self.phase == "checkpoint" and gap > max(stall, 3 * self._dur_ns("checkpoint")):
            self._close_episode(now)
            self._move("stalled", self.last_end, "steps", self.last_step)

    def prediction(self, now: int, p: Callable[[str], float]) -> tuple[str, int]:
        """The next run-level transition expected: (phase, event time), ("", 0) if unknown."""
        if self.phase == "warmup":
            med = self.median_step_ms()
            left = max(int(p("warmup_min_steps")), int(p("cv_window"))) - len(self.step_sum)
            return ("steady", now + int(max(left, 1) * med * 1e6)) if med > 0 else ("", 0)
        if self.phase in _EPISODES:
            d = self._dur_ns(self.phase)
            back = "steady" if self.reached_steady else "warmup"
            return (back, self.since_ns + d) if d else ("", 0)
        if self.phase == "steady":
            best = ("", 0)
            for kind, lrn in self.learned.items():
                if lrn["interval"] > 0 and lrn["last"]:
                    k = max(1, int(np.ceil((now - lrn["last"]) / lrn["interval"])))
                    t = int(lrn["last"] + k * lrn["interval"])
                    if not best[1] or t < best[1]:
                        best = (kind, t)
            return best
        return ("", 0)

    # -- internals ---------------------------------------------------------------------------------
    def _dur_ns(self, kind: str) -> int:
        return int(self.learned[kind]["dur"])

    def _gpu_since(self, t0: int) -> tuple[float, float, int]:
        """Mean SM % and power share of the GPU batches newer than ``t0``."""
        sel = self.agg_t[:, 1] > t0
        n = float(self.agg[sel, 2].sum())
        if n <= 0:
            return 0.0, 0.0, 0
        return (
            float(self.agg[sel, 0].sum()) / n,
            float(self.agg[sel, 1].sum()) / n,
            int(n),
        )

    def _open_episode(
        self, kind: str, start: int, source: str, step: int, confidence: float = 1.0
    ) -> None:
        lrn = self.learned[kind]
        if lrn["last"] and start > lrn["last"]:
            gap = start - lrn["last"]
            lrn["interval"] = gap if not lrn["interval"] else 0.7 * lrn["interval"] + 0.3 * gap
        lrn["last"] = start
        self.episode = {"kind": kind, "start": start, "end": 0}
        self._move(kind, start, source, step, confidence)

    def _close_episode(self, end: int) -> None:
        ep, self.episode = self.episode, None
        if ep is None:
            return
        lrn = self.learned[ep["kind"]]
        d = max(0, (ep["end"] or end) - ep["start"])
        lrn["dur"] = d if not lrn["n"] else 0.7 * lrn["dur"] + 0.3 * d
        lrn["n"] += 1

    def _move(
        self, phase: str, since: int, source: str, step: int, confidence: float = 1.0
    ) -> None:
        if phase == self.phase:
            return
        duration_ms = max(0.0, (since - self.since_ns) / 1e6) if self.phase else 0.0
        self.changes.append(
            {
                "phase": phase,
                "previous": self.phase,
                "since_ns": max(0, since),
                "source": source,
                "step": max(0, step),
                "confidence": confidence,
                "duration_ms": duration_ms,
            }
        )
        self.phase, self.since_ns, self.source = phase, max(0, since), source

    def state(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunState:
        rs = cls.__new__(cls)
        rs.__dict__.update(state)
        return rs
