"""What the notifier tells: the loop's events in, `Notice`s out (pure, no I/O).

`Notices.notice` takes one event read from the topics and says whether it is news, as a
`Notice` (firing or resolved) or None:

- a `Diagnosis` that **opens** (firing) or **resolves** (resolved), of a bottleneck named in
  the kinds (updates are not news);
- an `ActuationResult` ``rolled_back`` (kind ``rollback``): once per command, whichever ranks
  ack it;
- a `Decision` ``pending`` (kind ``approval``): firing until a later decision on the same
  recommendation (issued, refused, rejected, …) resolves it;
- a `Prediction` of ``time_to_oom_s`` (kind ``oom_warning``): the prediction host makes one
  while a rank's time to OOM is under its horizon, every 30 s; it is news once per rank and
  `REPEAT_S`.

The same event read twice (a restarted stream worker emits again what it emitted after its
last snapshot; the notifier itself reads at least once) gives one notice: the latest
`REMEMBERED` are remembered. Each notice's ``alertname`` is the Prometheus rule's for the same
condition (docker/prometheus/rules/perfloop.yml), so a receiver can treat both alike.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from perfloop.schemas import ActuationResult, Decision, Diagnosis, Prediction

__all__ = ["EVENT_S", "REMEMBERED", "REPEAT_S", "SEVERITY", "Notice", "Notices", "alertname"]

NS = 1_000_000_000
REPEAT_S = 600.0
"""A time-to-OOM warning for a rank is news again only this long after the last one."""
EVENT_S = 900.0
"""A one-off event (a rollback) ends, as an alert, this long after it happened."""
REMEMBERED = 10_000
"""Events remembered to say each once (and pending approvals, to resolve them)."""
SEVERITY = {
    "hang": "critical",
    "oom": "critical",
    "gpu_error": "critical",
    "rollback": "info",
    "approval": "info",
}
"""A notice's ``severity`` label; every other kind is a ``warning``."""


def alertname(kind: str) -> str:
    """The alert's name for a kind, as the Prometheus rules name it.

    >>> alertname("memory_leak"), alertname("oom_warning"), alertname("approval")
    ('PerfloopMemoryLeak', 'PerfloopOomWarning', 'PerfloopPendingApproval')
    """
    if kind == "approval":
        return "PerfloopPendingApproval"
    return "Perfloop" + "".join(part.capitalize() for part in kind.split("_"))


@dataclass(frozen=True)
class Notice:
    """One thing to tell: a condition that started (firing) or ended (resolved)."""

    kind: str
    status: Literal["firing", "resolved"]
    job_id: str
    title: str  # one line
    text: str  # what the event says, a few lines at most
    starts_ns: int
    ends_ns: int = 0  # 0: on until a resolved notice; a firing one's: when it is expected to end
    key: str = ""  # the condition's own id (diagnosis, command, recommendation, rank)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def severity(self) -> str:
        return SEVERITY.get(self.kind, "warning")

    def all_labels(self) -> dict[str, str]:
        """The labels an Alertmanager receiver groups and routes by."""
        return {
            "alertname": alertname(self.kind),
            "job_id": self.job_id,
            "kind": self.kind,
            "severity": self.severity,
            **self.labels,
        }


class Notices:
    """Events to notices for the given kinds (see the module docstring)."""

    def __init__(self, kinds: Iterable[str]) -> None:
        self.kinds = frozenset(kinds)
        self._said: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._pending: OrderedDict[str, Decision] = OrderedDict()  # rec id → its pending decision
        self._warned: OrderedDict[tuple[str, int], int] = OrderedDict()  # (job, rank) → ns

    def notice(self, event: Any, now_ns: int | None = None) -> Notice | None:
        """The notice ``event`` makes, or None when it is no news or not of the kinds."""
        now = time.time_ns() if now_ns is None else now_ns
        if isinstance(event, Diagnosis):
            return self._diagnosis(event)
        if isinstance(event, ActuationResult):
            return self._rollback(event)
        if isinstance(event, Decision):
            return self._decision(event, now)
        if isinstance(event, Prediction):
            return self._oom(event, now)
        return None

    def _once(self, key: tuple[str, str]) -> bool:
        """True the first time ``key`` is met (of the latest `REMEMBERED`)."""
        if key in self._said:
            return False
        self._said[key] = None
        if len(self._said) > REMEMBERED:
            self._said.popitem(last=False)
        return True

    def _diagnosis(self, d: Diagnosis) -> Notice | None:
        if d.bottleneck not in self.kinds or d.state == "update":
            return None
        if not self._once((d.diagnosis_id, d.state)):
            return None
        where = f"rank {d.rank}" if d.rank >= 0 else "the job"
        if d.ranks and d.rank < 0:
            where = "ranks " + ", ".join(str(r) for r in d.ranks[:8])
        nodes = f" on {', '.join(d.nodes[:4])}" if d.nodes else ""
        name = d.bottleneck.replace("_", " ")
        lines = [d.summary] if d.summary else []
        if d.state == "resolved":
            title = f"resolved: {name} in job {d.job_id}"
            took = max(0, d.ts_ns - d.onset_ns) / NS
            lines.insert(0, f"{where}{nodes}; it lasted {_duration(took)}")
        else:
            title = f"{name} in job {d.job_id}: {where}{nodes}"
            share = f", {d.step_share:.0%} of the step" if d.step_share > 0 else ""
            path = "on the critical path" if d.critical_path else "off the critical path"
            why = f", explained by {d.explained_by}" if d.explained_by else ""
            level = d.level.replace("_", " ")
            lines.insert(0, f"{level} level, {path}{share}{why}; confidence {d.confidence:.0%}")
        labels = {"bottleneck": d.bottleneck, "level": d.level, "diagnosis_id": d.diagnosis_id}
        if d.rank >= 0:
            labels["rank"] = str(d.rank)
        if d.nodes:
            labels["node"] = d.nodes[0]
        return Notice(
            kind=d.bottleneck,
            status="resolved" if d.state == "resolved" else "firing",
            job_id=d.job_id,
            title=title,
            text="\n".join(lines)[:1500],
            starts_ns=d.onset_ns or d.ts_ns,
            ends_ns=d.ts_ns if d.state == "resolved" else 0,
            key=d.diagnosis_id,
            labels=labels,
        )

    def _rollback(self, r: ActuationResult) -> Notice | None:
        if r.status != "rolled_back" or "rollback" not in self.kinds:
            return None
        if not self._once((r.command_id, "rolled_back")):
            return None
        ev = r.evidence
        detail = ""
        if "before_ms" in ev and "after_ms" in ev:
            detail = f"; step time p50 {ev['before_ms']:.1f} → {ev['after_ms']:.1f} ms"
        return Notice(
            kind="rollback",
            status="firing",
            job_id=r.job_id,
            title=f"rolled back {r.knob or 'a change'} in job {r.job_id} (to {r.value!r})",
            text=f"{r.reason or 'the change did not help'}{detail} (command {r.command_id})",
            starts_ns=r.ts_ns,
            ends_ns=r.ts_ns + int(EVENT_S * NS),
            key=r.command_id,
            labels={"knob": r.knob, "command_id": r.command_id},
        )

    def _decision(self, d: Decision, now_ns: int) -> Notice | None:
        if "approval" not in self.kinds or not d.rec_id:
            return None
        if d.outcome == "pending":
            if d.rec_id in self._pending:
                return None
            self._pending[d.rec_id] = d
            if len(self._pending) > REMEMBERED:
                self._pending.popitem(last=False)
            change = f"{d.knob} {d.from_value!r} → {d.to_value!r}"
            return Notice(
                kind="approval",
                status="firing",
                job_id=d.job_id,
                title=f"job {d.job_id} awaits approval: {change}",
                text=f"perfloop approve {d.rec_id}  (or: perfloop reject {d.rec_id})"
                + (f"\n{d.reason}" if d.reason else ""),
                starts_ns=d.ts_ns,
                key=d.rec_id,
                labels={"knob": d.knob, "rec_id": d.rec_id},
            )
        asked = self._pending.pop(d.rec_id, None)
        if asked is None:  # not one this notifier said was pending
            return None
        return Notice(
            kind="approval",
            status="resolved",
            job_id=d.job_id,
            title=f"resolved: approval of {d.knob} in job {d.job_id}: {d.outcome}",
            text=f"{d.outcome} by {d.actor}" + (f": {d.reason}" if d.reason else ""),
            starts_ns=asked.ts_ns,
            ends_ns=max(d.ts_ns, asked.ts_ns),
            key=d.rec_id,
            labels={"knob": asked.knob, "rec_id": d.rec_id},
        )

    def _oom(self, p: Prediction, now_ns: int) -> Notice | None:
        if p.target != "time_to_oom_s" or p.state != "predicted":
            return None
        if "oom_warning" not in self.kinds:
            return None
        key = (p.job_id, p.rank)
        last = self._warned.get(key)
        if last is not None and p.ts_ns - last < REPEAT_S * NS:
            return None
        self._warned[key] = p.ts_ns
        self._warned.move_to_end(key)
        if len(self._warned) > REMEMBERED:
            self._warned.popitem(last=False)
        where = f"rank {p.rank}" if p.rank >= 0 else "the job"
        return Notice(
            kind="oom_warning",
            status="firing",
            job_id=p.job_id,
            title=f"job {p.job_id} {where} on {p.node}: out of memory in ~{_duration(p.value)}",
            text=p.summary or f"{p.model} predicts {p.value:.0f} s to OOM",
            starts_ns=p.ts_ns,
            ends_ns=p.ts_ns + int(max(p.value, 0.0) * NS),
            key=f"{p.job_id}:{p.rank}",
            labels={"rank": str(p.rank), "node": p.node},
        )


def _duration(seconds: float) -> str:
    """
    >>> _duration(42.4), _duration(130), _duration(7300)
    ('42 s', '2 min 10 s', '2 h 1 min')
    """
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
