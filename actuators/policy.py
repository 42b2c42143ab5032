"""The actuator's decisions, pure: a recommendation or an approval in, a command (or none) and
the `Decision` that explains it out.

Per job (`JobRules`, changed live by ``ConfigChange`` events with target ``actuator``):

- the automation tier (`perfloop.schemas.AUTOMATION_TIERS`): ``observe`` records the
  recommendation, ``recommend`` shows it, ``approve`` keeps it pending until a person approves
  it (`Policy.approve`), ``auto`` issues the command itself;
- ``dry_run``: decide everything as in the tier, publish no command (outcome ``dry_run``);
- the knob allow-list and its bounds (`KNOB_BOUNDS`, `perfloop.schemas.knobs`), narrowed
  per job by the ranges its job agent reports in its job info (the CPUs it has, its GPU's
  power-limit range);
- hysteresis: a recommendation expecting less than ``min_gain_pct`` is refused (an approval is a
  person's call and skips it);
- a cooldown per knob (``cooldown_s`` since the knob last changed) and a rate limit
  (``max_commands_per_min`` commands a job in any 60 s);
- ``pinned``: knobs the user keeps out of reach (``perfloop run --pin``): refused.

A job that has ended (its launcher's lifecycle event, rank -1: finished, failed or killed) gets
nothing more: its recommendations and approvals are refused ("job ended"), and its state here is
freed ``ended_retention_s`` later (what it was told to keep, its settings, stays).

Knobs in `HOOK_KNOBS` are actions the actuator takes itself, through the operator's action
hook (`perfloop.actuators.hook`), and never send to the job: ``cluster.drain_node`` (the value is
the straggler's node). The tier governs them as any knob; "issued" means the hook is to run,
at most once per job and node and ``hook_max_per_hour`` times an hour over every job; with no
hook configured they are only recorded.

Commands carry a per-job monotonic sequence number (microseconds since the epoch, at least one
more than the last: monotonic across restarts without stored state) and an expiry; the service
signs them. An approval is acted on only if its signature verifies, the job's tier is
``approve``, the recommendation is younger than ``approval_ttl_s`` and was not acted on before.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, replace
from typing import Any

from perfloop.actuators.signing import verify
from perfloop.exceptions import ConfigError
from perfloop.schemas import (
    AUTOMATION_TIERS,
    ActuationResult,
    Approval,
    Command,
    ConfigChange,
    Decision,
    JobInfo,
    JobLifecycle,
    Recommendation,
)
from perfloop.schemas.knobs import (
    ACTION_KNOBS,
    BOOL_KNOBS,
    HOOK_KNOBS,
    HOST_NAME,
    INT_KNOBS,
    KNOB_BOUNDS,
    PINNABLE_KNOBS,
    knob_problem,
    pinned_knobs,
)

__all__ = [
    "ACTION_KNOBS",
    "BOOL_KNOBS",
    "ENDED_STATES",
    "HOOK_KNOBS",
    "INT_KNOBS",
    "KNOB_BOUNDS",
    "PINNABLE_KNOBS",
    "JobRules",
    "Policy",
    "knob_problem",
    "pinned_knobs",
]

ENDED_STATES = frozenset({"finished", "failed", "killed"})
"""A job's lifecycle states (rank -1) after which it gets nothing more."""
NS = 1_000_000_000
RATE_WINDOW_NS = 60 * NS
ACTED_MEMORY = 10_000
"""Recommendations remembered as acted on (an approval of one of them is refused as a repeat)."""


@dataclass(frozen=True)
class JobRules:
    """How the actuator treats one job (or every job: the defaults)."""

    tier: str = "auto"
    dry_run: bool = False
    min_gain_pct: float = 5.0
    cooldown_s: float = 30.0
    max_commands_per_min: int = 6
    pinned: tuple[str, ...] = ()

    def with_setting(self, key: str, value: Any) -> JobRules:
        """These rules with ``actuator.<name>`` set to ``value``; `ConfigError` if invalid."""
        name = key.removeprefix("actuator.")
        if not key.startswith("actuator.") or name not in _SETTINGS:
            raise ConfigError(
                f"unknown actuator setting {key!r}; valid: "
                + ", ".join(f"actuator.{n}" for n in _SETTINGS)
            )
        return replace(self, **{name: _SETTINGS[name](key, value)})


def _tier(key: str, value: Any) -> str:
    if value not in AUTOMATION_TIERS:
        raise ConfigError(f"{key} must be one of {list(AUTOMATION_TIERS)}, got {value!r}")
    return str(value)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _number(lo: float, hi: float, integer: bool = False) -> Any:
    def check(key: str, value: Any) -> float | int:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and lo <= value <= hi
        if ok and integer:
            ok = float(value).is_integer()
        if not ok:
            what = "an integer" if integer else "a number"
            raise ConfigError(f"{key} must be {what} in [{lo:g}, {hi:g}], got {value!r}")
        return int(value) if integer else float(value)

    return check


def _pins(key: str, value: Any) -> tuple[str, ...]:
    try:
        return pinned_knobs(value)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


_SETTINGS = {
    "tier": _tier,
    "dry_run": _flag,
    "min_gain_pct": _number(0, 1000),
    "cooldown_s": _number(0, 86400),
    "max_commands_per_min": _number(1, 600, integer=True),
    "pinned": _pins,
}


NO_HOOK = "no action hook configured (PERFLOOP_STRAGGLER_HOOK)"
"""Why a hook knob's recommendation is only recorded."""


def _pinned(knob: str, rules: JobRules) -> str:
    return f"{knob} is pinned by the user (actuator.pinned)" if knob in rules.pinned else ""


class Policy:
    """Decides, per job, what becomes of each recommendation and approval.

    >>> p = Policy(JobRules(tier="auto"), ttl_s=60)
    >>> rec = Recommendation(ts_ns=0, job_id="j", node="n", rank=-1, knob="dataloader.num_workers",
    ...     from_value=2, to_value=5, loop="fast", expected_gain_pct=40, confidence=0.9,
    ...     rationale="r")
    >>> cmd, d = p.decide(rec, now_ns=10**18)
    >>> cmd.value, cmd.rec_id == rec.event_id, d.outcome
    (5, True, 'issued')
    >>> again = rec.model_copy(update={"event_id": "another", "to_value": 6})
    >>> p.decide(again, now_ns=10**18 + 1)[1].reason
    'cooldown: dataloader.num_workers changed 0 s ago (minimum 30 s)'
    >>> p.decide(rec, now_ns=10**18 + 2)[1].reason == f"already issued as command {cmd.event_id}"
    True
    """

    def __init__(
        self,
        defaults: JobRules,
        *,
        ttl_s: float,
        approval_ttl_s: float = 900.0,
        keys: dict[str, bytes] | None = None,
        action_hook: bool = False,
        hook_max_per_hour: int = 6,
        ended_retention_s: float = 300.0,
    ) -> None:
        self.defaults = defaults
        self.overrides: dict[str, dict[str, Any]] = {}  # per job: its own settings
        self.ttl_ns = int(ttl_s * NS)
        self.approval_ttl_ns = int(approval_ttl_s * NS)
        self.keys = keys or {}
        self._seq: dict[str, int] = {}
        self._last_change: dict[tuple[str, str], int] = {}
        self._last_command: dict[tuple[str, str], str] = {}  # (job, knob): its last command id
        self._recent: dict[str, collections.deque[int]] = {}
        self._acted: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._commands: collections.OrderedDict[str, None] = collections.OrderedDict()  # known
        self.job_bounds: dict[str, dict[str, tuple[float, float]]] = {}
        """Per job: the knobs' ranges its own hardware allows (from its job info)."""
        self.action_hook = action_hook
        """Whether an action hook is configured (`HOOK_KNOBS`; without one: only recorded)."""
        self.hook_max_per_hour = hook_max_per_hour
        self._hook_done: dict[tuple[str, str], int] = {}  # (job, node): when its hook ran
        self._hook_runs: collections.deque[int] = collections.deque()  # every job's, last hour
        self.ended_retention_ns = int(ended_retention_s * NS)
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # job: why
        self._free_at: dict[str, int] = {}  # job: when its state is freed

    # -- jobs --------------------------------------------------------------------------------
    def observe_lifecycle(self, event: JobLifecycle, *, now_ns: int) -> None:
        """Take a job's end (or a new start under the same id) from its launcher's lifecycle
        event (rank -1); a rank's own events are left alone."""
        if event.rank != -1:
            return
        job = event.job_id
        if event.state in ENDED_STATES:
            code = "" if event.exit_code is None else f", exit code {event.exit_code}"
            self._ended[job] = f"job ended ({event.state}{code})"
            self._ended.move_to_end(job)
            while len(self._ended) > ACTED_MEMORY:
                self._ended.popitem(last=False)
            self._free_at[job] = now_ns + self.ended_retention_ns
        else:  # started again (the same job id): it takes recommendations again
            self._ended.pop(job, None)
            self._free_at.pop(job, None)

    def ended(self, job_id: str) -> str:
        """Why the job gets nothing more ("job ended (…)"), or "" while it runs."""
        return self._ended.get(job_id, "")

    def sweep(self, now_ns: int) -> list[str]:
        """Free the state of the jobs that ended more than ``ended_retention_s`` ago (their
        sequence numbers, cooldowns, rates, ranges and hook runs; their settings stay, and
        they stay ended); return their ids."""
        due = [job for job, at in self._free_at.items() if at <= now_ns]
        for job in due:
            del self._free_at[job]
            self._seq.pop(job, None)
            self._recent.pop(job, None)
            self.job_bounds.pop(job, None)
            for key in [k for k in self._last_change if k[0] == job]:
                del self._last_change[key]
            for key in [k for k in self._last_command if k[0] == job]:
                del self._last_command[key]
            for key in [k for k in self._hook_done if k[0] == job]:
                del self._hook_done[key]
        return due

    def observe_verdict(self, result: ActuationResult) -> bool:
        """A job's verdict on a command: once the knob's last command was judged ``kept``, its
        cooldown is over (the change was measured; the next step of a rule that grows a knob
        one verified step at a time need not wait ``cooldown_s``). A rollback keeps it.
        Returns whether a cooldown ended."""
        key = (result.job_id, result.knob)
        if result.status != "kept" or self._last_command.get(key) != result.command_id:
            return False
        del self._last_command[key]
        return self._last_change.pop(key, None) is not None

    def observe_command(self, cmd: Command) -> None:
        """A command issued for a job, by this policy or by an actuator before it (read back
        from ``perfloop.control``: after a restart, or when the job's partition moved here):
        its recommendation counts as acted on (a redelivered one is refused, not issued again),
        the job's sequence numbers continue above it, and the knob's cooldown runs from it."""
        self._remember(cmd.rec_id, f"issued as command {cmd.event_id}")
        self._seq[cmd.job_id] = max(self._seq.get(cmd.job_id, 0), cmd.seq)
        key = (cmd.job_id, cmd.knob)
        if cmd.event_id in self._commands:  # known: its own, come back, or read before
            return
        self._know(cmd.event_id)
        if cmd.ts_ns >= self._last_change.get(key, 0):
            self._last_change[key] = cmd.ts_ns
            self._last_command[key] = cmd.event_id

    def observe_decision(self, decision: Decision) -> None:
        """A decision published by this policy's service or one before it: a recommendation
        decided in dry run, rejected by a person or acted on by the action hook counts as acted
        on; a hook that ran for a node does not run for it again."""
        if (
            decision.outcome not in ("issued", "dry_run", "rejected")
            or decision.rec_id in self._acted
        ):
            return
        if decision.outcome == "issued" and decision.knob in HOOK_KNOBS:
            node = str(decision.to_value)
            self._hook_done.setdefault((decision.job_id, node), decision.ts_ns)
            self._remember(decision.rec_id, f"acted on: the action hook ran for node {node}")
        elif decision.outcome == "issued":
            self._remember(decision.rec_id, f"issued as command {decision.command_id}")
        else:
            self._remember(decision.rec_id, f"decided before ({decision.outcome})")

    def observe_info(self, info: JobInfo) -> None:
        """Take a job's own knob ranges from its job info (``extra["bounds.<knob>"]`` =
        ``"lo,hi"``, as its job agent publishes them); unreadable ones are ignored."""
        bounds = {}
        for key, text in info.extra.items():
            if not key.startswith("bounds."):
                continue
            try:
                lo, hi = (float(x) for x in text.split(","))
            except ValueError:
                continue
            if lo <= hi:
                bounds[key.removeprefix("bounds.")] = (lo, hi)
        if bounds:
            self.job_bounds[info.job_id] = bounds

    # -- rules -------------------------------------------------------------------------------
    def rules(self, job_id: str) -> JobRules:
        """The job's rules: the defaults, with the settings given for the job itself."""
        own = self.overrides.get(job_id)
        return replace(self.defaults, **own) if own else self.defaults

    def configure(self, change: ConfigChange) -> tuple[Any, Any]:
        """Apply a ``ConfigChange`` for the actuator; return ``(old, new)``. ``applies_to`` "*"
        changes the defaults (a job keeps the settings given for it alone)."""
        name = change.key.removeprefix("actuator.")
        if change.applies_to == "*":
            old = self.defaults
            self.defaults = old.with_setting(change.key, change.value)
            return getattr(old, name), getattr(self.defaults, name)
        old = self.rules(change.applies_to)
        new = old.with_setting(change.key, change.value)
        self.overrides.setdefault(change.applies_to, {})[name] = getattr(new, name)
        return getattr(old, name), getattr(new, name)

    def next_seq(self, job_id: str, now_ns: int) -> int:
        # Monotonic across restarts without stored state: microseconds since the epoch.
        seq = max(self._seq.get(job_id, 0) + 1, now_ns // 1000)
        self._seq[job_id] = seq
        return seq

    # -- decisions ---------------------------------------------------------------------------
    def decide(self, rec: Recommendation, *, now_ns: int) -> tuple[Command | None, Decision]:
        """What becomes of a recommendation, by the job's tier. One acted on before (by this
        policy, or by the actuator before a restart: `observe_command`) is refused."""
        rules = self.rules(rec.job_id)
        if rec.event_id in self._acted:
            return None, self._decision(
                rec, rules, now_ns, "refused", f"already {self._acted[rec.event_id]}"
            )
        why = self.ended(rec.job_id) or _pinned(rec.knob, rules)
        if why:
            return None, self._decision(rec, rules, now_ns, "refused", why)
        if rules.tier == "observe":
            return None, self._decision(rec, rules, now_ns, "observed", "tier observe: recorded")
        hook = rec.knob in HOOK_KNOBS
        if hook and not self.action_hook:
            return None, self._decision(rec, rules, now_ns, "recommended", NO_HOOK)
        if rules.tier == "recommend":
            return None, self._decision(
                rec, rules, now_ns, "recommended", "tier recommend: shown, not applied"
            )
        if rules.tier == "approve":
            then = "; then the action hook runs" if hook else ""
            return None, self._decision(
                rec,
                rules,
                now_ns,
                "pending",
                f"tier approve: waiting for `perfloop approve {rec.event_id}`{then}",
            )
        if rec.expected_gain_pct < rules.min_gain_pct:
            return None, self._decision(
                rec,
                rules,
                now_ns,
                "refused",
                f"expected gain {rec.expected_gain_pct:g}% is below the minimum "
                f"{rules.min_gain_pct:g}% (actuator.min_gain_pct)",
            )
        return self._issue(rec, rules, now_ns=now_ns, actor="actuator")

    def approve(
        self, appr: Approval, *, now_ns: int, verified_by: str = ""
    ) -> tuple[Command | None, Decision]:
        """What becomes of a person's approval or rejection. A signed approval of an action
        knob (`ACTION_KNOBS`: a profiler capture) is a person asking for it (``perfloop
        capture``): issued in every tier but observe, with no recommendation before it.
        ``verified_by``: the principal whose signature the service checked against its roster
        (`perfloop.actuators.trust`; the shared key is then not asked), named as the actor."""
        rules = self.rules(appr.job_id)
        key = self.keys.get(appr.key_id)
        who = appr.author or "unknown"
        if verified_by:
            who = f"{verified_by}: {who}"
        elif key is None or not verify(appr, key):
            known = sorted(self.keys)
            return None, self._decision(
                appr,
                rules,
                now_ns,
                "refused",
                f"approval signature does not verify under key {appr.key_id!r} "
                f"(keys known: {known})",
                actor=who,
            )
        if appr.rec_id in self._acted:
            return None, self._decision(
                appr, rules, now_ns, "refused", f"already {self._acted[appr.rec_id]}", actor=who
            )
        if appr.verdict == "reject":
            self._remember(appr.rec_id, f"rejected by {who}")
            return None, self._decision(
                appr, rules, now_ns, "rejected", appr.reason or f"rejected by {who}", actor=who
            )
        why = self.ended(appr.job_id) or _pinned(appr.knob, rules)
        if not why and appr.knob in HOOK_KNOBS and not self.action_hook:
            why = NO_HOOK
        if why:
            return None, self._decision(appr, rules, now_ns, "refused", why, actor=who)
        asked = appr.knob in ACTION_KNOBS  # a person asks the job for an action (a capture)
        if asked and rules.tier == "observe":
            return None, self._decision(
                appr,
                rules,
                now_ns,
                "refused",
                f"tier observe: perfloop sends the job nothing, {appr.knob} included "
                "(`perfloop config set actuator.tier recommend --job JOB` first)",
                actor=who,
            )
        if rules.tier != "approve" and not asked:
            return None, self._decision(
                appr,
                rules,
                now_ns,
                "refused",
                f"tier {rules.tier}: approvals are taken only in tier approve "
                "(`perfloop config set actuator.tier approve --job JOB`)",
                actor=who,
            )
        age = now_ns - appr.rec_ts_ns
        if age > self.approval_ttl_ns:
            return None, self._decision(
                appr,
                rules,
                now_ns,
                "refused",
                f"the recommendation is {age / NS:.0f} s old, past the "
                f"{self.approval_ttl_ns / NS:.0f} s an approval may act on",
                actor=who,
            )
        return self._issue(appr, rules, now_ns=now_ns, actor=who)

    # -- internals ---------------------------------------------------------------------------
    def _issue(
        self, src: Recommendation | Approval, rules: JobRules, *, now_ns: int, actor: str
    ) -> tuple[Command | None, Decision]:
        rec_id = src.event_id if isinstance(src, Recommendation) else src.rec_id
        value = src.to_value
        if src.knob in HOOK_KNOBS:
            return self._act(src, rules, now_ns=now_ns, actor=actor)
        own = self.job_bounds.get(src.job_id, {}).get(src.knob)
        why = knob_problem(src.knob, value, own)
        if why and own is not None:
            why += " (the job's own range, from its job info)"
        if why:
            return None, self._decision(src, rules, now_ns, "refused", why, actor=actor)
        key = (src.job_id, src.knob)
        last = self._last_change.get(key)
        cooldown_ns = int(rules.cooldown_s * NS)
        if last is not None and cooldown_ns and now_ns - last < cooldown_ns:
            why = (
                f"cooldown: {src.knob} changed {(now_ns - last) / NS:.0f} s ago "
                f"(minimum {rules.cooldown_s:.0f} s)"
            )
            return None, self._decision(src, rules, now_ns, "refused", why, actor=actor)
        recent = self._recent.setdefault(src.job_id, collections.deque())
        while recent and now_ns - recent[0] >= RATE_WINDOW_NS:
            recent.popleft()
        if len(recent) >= rules.max_commands_per_min:
            why = (
                f"rate limit: {len(recent)} commands for the job in the last 60 s "
                f"(actuator.max_commands_per_min {rules.max_commands_per_min})"
            )
            return None, self._decision(src, rules, now_ns, "refused", why, actor=actor)
        self._last_change[key] = now_ns
        recent.append(now_ns)
        cmd = Command(
            ts_ns=now_ns,
            job_id=src.job_id,
            node=src.node,
            rank=-1,
            rec_id=rec_id,
            seq=self.next_seq(src.job_id, now_ns),
            knob=src.knob,
            from_value=src.from_value,
            value=value,
            loop=src.loop,
            expires_ts_ns=now_ns + self.ttl_ns,
        )
        if rules.dry_run:
            self._remember(rec_id, f"decided in dry run (command {cmd.event_id} not sent)")
            why = f"dry run: would send {src.knob} = {value} (seq {cmd.seq})"
            return None, self._decision(src, rules, now_ns, "dry_run", why, actor=actor)
        self._remember(rec_id, f"issued as command {cmd.event_id}")
        self._last_command[key] = cmd.event_id
        self._know(cmd.event_id)
        return cmd, self._decision(
            src, rules, now_ns, "issued", f"{src.knob} = {value} (seq {cmd.seq})", actor=actor,
            command_id=cmd.event_id,
        )  # fmt: skip

    def _act(
        self, src: Recommendation | Approval, rules: JobRules, *, now_ns: int, actor: str
    ) -> tuple[Command | None, Decision]:
        """A hook knob: the command the service runs its action hook for (never sent)."""
        rec_id = src.event_id if isinstance(src, Recommendation) else src.rec_id
        node = src.to_value
        why = ""
        if not isinstance(node, str) or not HOST_NAME.fullmatch(node):
            why = f"{src.knob}: {node!r} is not a node name (letters, digits, '.', '_', '-')"
        elif (src.job_id, node) in self._hook_done:
            why = f"the action hook already ran for node {node} of this job"
        else:
            while self._hook_runs and now_ns - self._hook_runs[0] >= 3600 * NS:
                self._hook_runs.popleft()
            if len(self._hook_runs) >= self.hook_max_per_hour:
                why = (
                    f"rate limit: the action hook ran {len(self._hook_runs)} times in the last "
                    f"hour (PERFLOOP_STRAGGLER_HOOK_MAX_PER_HOUR {self.hook_max_per_hour})"
                )
        if why:
            return None, self._decision(src, rules, now_ns, "refused", why, actor=actor)
        cmd = Command(
            ts_ns=now_ns, job_id=src.job_id, node=src.node, rank=-1, rec_id=rec_id,
            seq=self.next_seq(src.job_id, now_ns), knob=src.knob, from_value=src.from_value,
            value=node, loop=src.loop, expires_ts_ns=now_ns + self.ttl_ns,
        )  # fmt: skip
        if rules.dry_run:
            self._remember(rec_id, "decided in dry run (the action hook did not run)")
            why = f"dry run: would run the action hook for {src.knob} = {node}"
            return None, self._decision(src, rules, now_ns, "dry_run", why, actor=actor)
        self._hook_done[(src.job_id, node)] = now_ns
        self._hook_runs.append(now_ns)
        self._remember(rec_id, f"acted on: the action hook ran for node {node}")
        return cmd, self._decision(
            src, rules, now_ns, "issued", f"action hook for {src.knob} = {node}", actor=actor
        )

    def _know(self, command_id: str) -> None:
        self._commands[command_id] = None
        while len(self._commands) > ACTED_MEMORY:
            self._commands.popitem(last=False)

    def _remember(self, rec_id: str, what: str) -> None:
        self._acted[rec_id] = what
        while len(self._acted) > ACTED_MEMORY:
            self._acted.popitem(last=False)

    @staticmethod
    def _decision(
        src: Recommendation | Approval,
        rules: JobRules,
        now_ns: int,
        outcome: str,
        reason: str,
        *,
        actor: str = "actuator",
        command_id: str = "",
    ) -> Decision:
        rec_id = src.event_id if isinstance(src, Recommendation) else src.rec_id
        return Decision(
            ts_ns=now_ns,
            job_id=src.job_id,
            node=src.node,
            rank=-1,
            rec_id=rec_id,
            command_id=command_id,
            knob=src.knob,
            from_value=src.from_value,
            to_value=src.to_value,
            loop=src.loop,
            tier=rules.tier,  # type: ignore[arg-type]
            outcome=outcome,  # type: ignore[arg-type]
            reason=reason[:1000],
            actor=actor[:256],
        )
