"""What past changes did: the recommender learns from the job agents' verdicts.

Every change a job agent applied ends in a verdict (`ActuationResult` ``kept`` or
``rolled_back``, with the step-time medians before and after). `Outcomes` keeps them by kind of
change — the knob, the direction (up or down) and the kind of job (CPU or GPU training) — so
the rules can prefer what worked for similar jobs:

- `Outcomes.adjust` blends a rule's prior expected gain with the gains measured for similar
  changes (each measured change counts as much as the prior), and raises or lowers the
  confidence with how many were kept;
- `Outcomes.discouraged` says why a kind of change should not be recommended again: at least
  ``min_failures`` similar changes were rolled back and none was kept.

A verdict is matched to its change by its command (read on ``perfloop.control``: the knob's
value before and after; every rank's verdict on one command finds it); a verdict whose command
this worker did not see is counted as a change of unknown direction ("set"). A rollback's
``value`` is the value the agent restored, so `Outcomes.last` names the change by the value
its command asked for.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from perfloop.schemas import ActuationResult, JobInfo, KnobValue

__all__ = ["Outcomes", "Record"]

MAX_GAINS = 50
"""Measured gains kept per kind of change (the newest)."""
MAX_PENDING = 10_000
"""Commands remembered while their verdict is awaited."""


@dataclass
class Record:
    """The verdicts on one kind of change."""

    kept: int = 0
    rolled_back: int = 0
    gains: list[float] = field(default_factory=list)  # 1 - after/before, of each verdict

    @property
    def n(self) -> int:
        return self.kept + self.rolled_back


def _direction(old: KnobValue | None, new: KnobValue | None) -> str:
    if isinstance(old, bool) or isinstance(new, bool):
        return "on" if new else "off"
    if not isinstance(old, int | float) or not isinstance(new, int | float):
        return "set"
    return "up" if new > old else "down" if new < old else "set"


class Outcomes:
    """Verdicts by kind of change.

    >>> o = Outcomes()
    >>> o.expect("c", 8, 2)
    >>> o.observe(ActuationResult(ts_ns=1, job_id="j1", node="n", rank=0, command_id="c",
    ...     status="kept", knob="torch.num_threads", value=2,
    ...     evidence={"before_ms": 100.0, "after_ms": 60.0}))
    True
    >>> gain, conf, note = o.adjust("j2", "torch.num_threads", 8, 1, prior_pct=10.0,
    ...                             confidence=0.5)
    >>> round(gain, 1), round(conf, 2), note
    (25.0, 0.75, '1 similar change kept of 1, measured gain 40%')
    """

    def __init__(self, *, min_failures: int = 2) -> None:
        self.min_failures = min_failures
        self.records: defaultdict[tuple[str, str, str], Record] = defaultdict(Record)
        self._device: dict[str, str] = {}  # job -> "cpu" | "gpu"
        # (job, knob) -> the verdict on the job's latest change of the knob (see `last`)
        self._last: dict[tuple[str, str], dict[str, Any]] = {}
        # command id -> the knob's value before and after (the newest MAX_PENDING commands)
        self._pending: dict[str, tuple[KnobValue | None, KnobValue]] = {}

    def observe_info(self, info: JobInfo) -> None:
        self._device[info.job_id] = "gpu" if info.gpu_count else "cpu"

    def forget(self, job: str) -> None:
        """The job ended: drop what is kept of it (the verdicts it taught stay, by kind)."""
        self._device.pop(job, None)
        for key in [k for k in self._last if k[0] == job]:
            del self._last[key]

    def expect(self, command_id: str, old: KnobValue | None, new: KnobValue) -> None:
        """A command went out: its verdict will say how ``old`` → ``new`` did."""
        self._pending[command_id] = (old, new)
        while len(self._pending) > MAX_PENDING:
            del self._pending[next(iter(self._pending))]

    def _key(
        self, job: str, knob: str, old: KnobValue | None, new: KnobValue | None
    ) -> tuple[str, str, str]:
        return (knob, _direction(old, new), self._device.get(job, "cpu"))

    def observe(self, result: ActuationResult) -> bool:
        """Count one verdict; False for anything else (applied, rejected acks)."""
        if result.status not in ("kept", "rolled_back"):
            return False
        old, new = self._pending.get(result.command_id, (None, None))
        if new is None:  # not seen: of unknown direction (a rollback's value is the one restored)
            old, new = None, result.value if result.status == "kept" else None
        rec = self.records[self._key(result.job_id, result.knob, old, new)]
        if result.status == "kept":
            rec.kept += 1
        else:
            rec.rolled_back += 1
        before, after = result.evidence.get("before_ms"), result.evidence.get("after_ms")
        gain = 1.0 - after / before if before and after and before > 0 else float("nan")
        if gain == gain:
            rec.gains = [*rec.gains[-(MAX_GAINS - 1) :], gain]
        self._verdict(result, old, new, gain)
        return True

    def _verdict(self, result: ActuationResult, old: Any, new: Any, gain: float) -> None:
        """Keep the job's latest verdict per knob; the ranks of one change (one command) agree
        on it: rolled back if any rank rolled it back, its gain the least any rank measured."""
        key = (result.job_id, result.knob)
        cur = self._last.get(key)
        if cur is None or cur.get("command") != result.command_id:
            cur = self._last[key] = {"command": result.command_id, "value": new, "from": old,
                                     "status": "kept", "restored": None, "gain": gain,
                                     "ts_ns": result.ts_ns, "ranks": 0}  # fmt: skip
        if result.status == "rolled_back":
            cur["status"], cur["restored"] = "rolled_back", result.value
        if gain == gain:
            cur["gain"] = gain if cur["gain"] != cur["gain"] else min(cur["gain"], gain)
        cur["ts_ns"] = max(cur["ts_ns"], result.ts_ns)
        cur["ranks"] += 1

    def last(self, job: str, knob: str) -> dict[str, Any] | None:
        """The verdict on the job's latest change of ``knob``: ``command`` (its id), ``value``
        (what its command asked for; None for a rollback whose command was not seen),
        ``from`` (None when its command was not seen), ``status`` (kept or rolled_back),
        ``restored`` (the value a rollback restored), ``gain`` (1 - after/before step time,
        NaN unknown), ``ts_ns`` (the newest verdict's, the job's clock), ``ranks`` (verdicts)."""
        return self._last.get((job, knob))

    def similar(self, job: str, knob: str, old: KnobValue | None, new: KnobValue) -> Record:
        return self.records.get(self._key(job, knob, old, new), Record())

    def adjust(
        self,
        job: str,
        knob: str,
        old: KnobValue | None,
        new: KnobValue,
        *,
        prior_pct: float,
        confidence: float,
    ) -> tuple[float, float, str]:
        """``(expected gain %, confidence, note)`` for a change, given what similar ones did."""
        rec = self.similar(job, knob, old, new)
        if not rec.n:
            return prior_pct, confidence, ""
        measured = [100.0 * g for g in rec.gains]
        gain = (prior_pct + sum(measured)) / (1 + len(measured))
        # Laplace's rule: the share kept, with the rule's confidence as one prior trial
        conf = (confidence + rec.kept) / (1 + rec.n)
        median = sorted(measured)[len(measured) // 2] if measured else None
        note = f"{rec.kept} similar change{'s' * (rec.kept != 1)} kept of {rec.n}"
        if median is not None:
            note += f", measured gain {median:.0f}%"
        return gain, min(1.0, max(0.0, conf)), note

    def discouraged(self, job: str, knob: str, old: KnobValue | None, new: KnobValue) -> str:
        """Why this kind of change should not be recommended ("" if it may be)."""
        rec = self.similar(job, knob, old, new)
        if rec.kept == 0 and rec.rolled_back >= self.min_failures:
            return f"{rec.rolled_back} similar changes were rolled back and none was kept"
        return ""

    # -- snapshot ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "records": {
                "|".join(k): [r.kept, r.rolled_back, list(r.gains)] for k, r in self.records.items()
            },
            "device": dict(self._device),
            "pending": {c: list(v) for c, v in self._pending.items()},
            "last": [[j, k, dict(v)] for (j, k), v in self._last.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.records = defaultdict(Record)
        for k, (kept, rolled, gains) in state.get("records", {}).items():
            knob, direction, device = k.split("|")
            self.records[(knob, direction, device)] = Record(kept, rolled, list(gains))
        self._device = dict(state.get("device", {}))
        self._pending = {c: (v[0], v[1]) for c, v in state.get("pending", {}).items()}
        self._last = {(j, k): dict(v) for j, k, v in state.get("last", [])}
