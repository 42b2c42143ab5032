"""The job agent: runs inside the training process and applies commands at step boundaries.

A background thread consumes ``perfloop.control``, keeps the commands addressed to its job,
and checks each one — signature, expiry, sequence (no replays), knob not pinned by the user
(``pinned``: ``perfloop run --pin``), knob known and value within bounds — failing closed: a
command that does not pass changes nothing and is acked as rejected with its reason. Commands
that pass wait in a queue until the training loop calls `JobAgent.step_boundary`, which
applies them through the registered knob handlers and acks each on ``perfloop.actuations``.
Nothing here ever raises into the training loop.

Verification: the training loop reports each step (`JobAgent.observe_step`: its time, and its
loss when known). A change is applied alone, and the steps after it are compared with as many
steps just before it (`perfloop.actuators.verification.ChangeVerifier`); the next command
waits until the verdict.
A change that hurt (significantly slower steps) or broke training (a NaN loss) is rolled back
to the last value known good at the next step boundary, within ``settle_steps + verify_steps``
steps of being applied; one slower by the median but not yet significantly is judged on more
steps (up to ``max_verify_steps``) and rolled back if it stays slower than 3 %. A change of a
knob that is only there for speed (`perfloop.schemas.knobs.SPEED_KNOBS`: loader workers,
threads, …) is kept only when it helped; one with no measured gain by the last look is rolled
back. The verdict is acked too (``kept`` or ``rolled_back``, with the evidence). The verdict
is the agent's own, in the training process: a job whose actuator is gone keeps verifying,
and keeps its last-known-good values.

The control consumer is quiet on purpose (`CONTROL_CONSUMER`): a fetch waits up to half a
second at the end of the topic and the thread wakes four times a second, so an idle job pays
a few broker requests a second, not forty, for commands that arrive a few a minute and are
applied at a step boundary anyway.

With ``announce``, every change applied, kept, rolled back or rejected is also one line on
the process's stderr (`perfloop.actuators._notice`; ``PERFLOOP_QUIET=1`` turns it off in
`perfloop run`), e.g. ``perfloop[rank 0]: applied dataloader.num_workers 0 → 1 at step 41
(command 3f2a9c1d0b7e)``; a closed or broken stderr is ignored.

Live configuration: a `ConfigChange` with target "producers" whose ``applies_to`` is the
agent's job or "*" goes to the registered `ConfigHandler` (``on_config``, e.g.
`NodeSampler.configure`) at once, on the agent's thread — sampling changes need no step
boundary and are not signed (they change what is observed, not the job). A change the handler
refuses (unknown key, bad value) is logged as one warning line and changes nothing; it is never
acked and never raises. The change itself is recorded in the warehouse by the sink
(``config_changes``). `ConfigListener` does the same for a process with no job agent
(``perfloop sample``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from perfloop.actuators._notice import notice, say
from perfloop.actuators.config_patch import ConfigPatch
from perfloop.actuators.signing import check_signature
from perfloop.actuators.trust import Gate, refusal, roster_gate
from perfloop.actuators.verification import ChangeVerifier, Verdict
from perfloop.exceptions import ConfigError
from perfloop.identity import KeyringFile
from perfloop.kafka import consumer, follow, producer
from perfloop.schemas import (
    ActuationResult,
    Command,
    ConfigChange,
    KnobValue,
    SchemaError,
    decode_event,
    encode_event,
)
from perfloop.schemas.knobs import (
    ACTION_KNOBS,
    BOOL_KNOBS,
    KNOB_BOUNDS,
    SPEED_KNOBS,
    knob_problem,
)
from perfloop.schemas.topics import Topics
from perfloop.settings import BaseServiceSettings

__all__ = ["ConfigHandler", "ConfigListener", "JobAgent", "KnobHandler", "apply_config"]

log = logging.getLogger("perfloop.agent")

CONTROL_CONSUMER = {"auto.offset.reset": "latest", "fetch.wait.max.ms": 500}
"""How a job's control consumer fetches: new commands only, a long wait at the topic's end."""
POLL_S = 0.25
"""How long the consumer thread blocks in one poll (also how long `stop` may wait for it)."""

KnobHandler = Callable[[KnobValue], None]
ConfigHandler = Callable[[str, Any], tuple[Any, Any]]
"""``configure(key, value) -> (old, new)``; raises `ConfigError` for an unknown key or a bad
value (the shape of `NodeSampler.configure` and of the stream components' ``configure``)."""


APPLYING: contextvars.ContextVar[tuple[Command, bool] | None] = contextvars.ContextVar(
    "perfloop_applying", default=None
)
"""While a knob handler runs: the verified command it applies, and whether it undoes it (a
rollback). A handler that passes the change on to another process (the GPU power-limit
helper, `perfloop.producers.power_helper`) sends the command, which that process checks."""


@contextlib.contextmanager
def applying(cmd: Command, *, undo: bool = False) -> Iterator[None]:
    token = APPLYING.set((cmd, undo))
    try:
        yield
    finally:
        APPLYING.reset(token)


def keyring_for(settings: Any) -> KeyringFile | None:
    """The keyring a job's agent checks commands against: ``command_keyring``, else the
    embedded stack's keyring of its actuator's key where it exists
    (``BaseServiceSettings.command_keyring_path``); None: the shared ``signing_key``."""
    path = getattr(settings, "command_keyring_path", None)
    return KeyringFile(path) if path is not None else None


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


class Refused(str):
    """The reason a roster refused a change (``"refused: …"``), and ``by``: who it claimed to
    come from."""

    by: str = "unknown"


def apply_config(
    change: ConfigChange, job_id: str, handler: ConfigHandler | None, gate: Gate | None = None
) -> tuple[Any, Any] | str | None:
    """Apply ``change`` if it is for the producers of ``job_id``; never raises.

    Returns ``(old, new)`` when applied, the one-line reason when it was for this job and
    refused (also logged as a warning), and ``None`` when it is not for this job's producers.
    With a ``gate`` (a roster), a change not signed by a principal whose role covers it, or
    expired, or seen before, is refused: the reason then starts with ``"refused: "``.
    """
    if change.target != "producers" or change.applies_to not in ("*", job_id):
        return None
    what = f"config change {change.key}={change.value!r} for job {job_id}"
    who, why = gate.check(change, now_ns=time.time_ns()) if gate is not None else ("", "")
    if why:
        reason: str = Refused(f"refused: {why} (claimed by {who})")
        reason.by = who  # type: ignore[attr-defined]
    elif handler is None:
        reason = "no sampling control is registered in this process"
    else:
        try:
            old, new = handler(change.key, change.value)
        except ConfigError as e:
            reason = _one_line(str(e))
        except Exception as e:  # a failing handler must not break training
            reason = _one_line(f"handler failed: {e!r}")
        else:
            log.info("%s applied: %r -> %r (by %s)", what, old, new, change.author or "?")
            return old, new
    log.warning("%s not applied: %s", what, reason)
    return reason


def _for_job(key: bytes | None, job_id: str) -> bool:
    """Whether a control message keyed ``key`` may be for ``job_id`` (its own key or "*")."""
    return key is None or key == b"*" or key == job_id.encode()


class ConfigListener:
    """Applies live `ConfigChange` events for ``job_id``'s producers from ``perfloop.control``.

    For a process that runs samplers but no `JobAgent` (``perfloop sample``); commands are
    left to the job agent. A plain service: ``start()``, ``stop()``, ``run()``.

    >>> from perfloop.settings import BaseServiceSettings
    >>> seen = {}
    >>> def configure(key, value):
    ...     old, seen[key] = seen.get(key), value
    ...     return old, value
    >>> listener = ConfigListener(BaseServiceSettings(kafka_port=1), job_id="j1",
    ...                           on_config=configure)
    >>> change = ConfigChange(ts_ns=1, job_id="ops", node="cli", rank=-1, target="producers",
    ...                       key="sampling.host_interval_ms", value=250)
    >>> listener.receive(encode_event(change))
    (None, 250)
    >>> listener.close()
    """

    def __init__(
        self, settings: BaseServiceSettings, *, job_id: str, on_config: ConfigHandler
    ) -> None:
        self.job_id = job_id
        self.on_config = on_config
        self._consumer = consumer(
            settings,
            f"perfloop-config-{job_id}-{uuid.uuid4().hex[:8]}",
            **CONTROL_CONSUMER,
        )
        self.gate = roster_gate(settings.roster_path)  # who may change sampling, where signed
        self._stop = threading.Event()
        self._assigned = threading.Event()
        self._thread = threading.Thread(target=self.run, name="perfloop-config", daemon=True)

    def start(self, wait_assigned_s: float = 0.0) -> bool:
        """Start consuming; return True once the control topic is assigned (no wait by default)."""
        self._thread.start()
        return self._assigned.wait(wait_assigned_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def close(self) -> None:
        """Release the consumer of a listener that was never started."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._stop.set()
            self._consumer.close()

    def run(self) -> None:
        follow(
            self._consumer, [Topics.CONTROL], lambda msg: self.receive(msg.value() or b""),
            self._stop, self._assigned, key=lambda k: _for_job(k, self.job_id), poll_s=POLL_S,
            what="control consumer", log=log,
        )  # fmt: skip

    def receive(self, data: bytes) -> tuple[Any, Any] | str | None:
        """Apply one control message if it is a change for this job's producers (see
        `apply_config`); anything else (commands, unreadable messages) is left alone."""
        try:
            event = decode_event(data)
        except SchemaError:
            return None  # the job agent and the stream tier report bad control messages
        if not isinstance(event, ConfigChange):
            return None
        return apply_config(event, self.job_id, self.on_config, self.gate)


class JobAgent:
    """Applies verified commands for ``job_id`` through ``handlers`` (knob name → setter).

    ``handlers`` is kept, not copied: knobs a process registers later (a script's own
    tunables) become commandable. ``bounds`` narrows the allow-list's range of a knob by what
    this job's hardware allows (e.g. threads up to its CPUs); ``read`` gives a knob's current
    value (what a rollback restores; without it, the last value known good or the command's
    ``from_value``); ``patch`` records slow-loop commands for the job's next start (they are
    acked as applied at once, and not judged: the run they change has not started);
    ``rank`` names the process in its acks and lines; ``pinned`` knobs are refused ("pinned by
    the user"); ``announce`` prints each change, verdict and rejection as one line on stderr.
    """

    def __init__(
        self,
        settings: BaseServiceSettings,
        *,
        job_id: str,
        node: str,
        signing_key: bytes,
        handlers: Mapping[str, KnobHandler],
        keyring: KeyringFile | None = None,
        on_result: Callable[[ActuationResult], None] | None = None,
        on_config: ConfigHandler | None = None,
        bounds: Mapping[str, tuple[float, float]] | None = None,
        read: Callable[[str], KnobValue | None] | None = None,
        patch: ConfigPatch | None = None,
        rank: int = -1,
        verify_changes: bool = True,
        settle_steps: int = 2,
        verify_steps: int = 20,
        max_verify_steps: int | None = None,
        pinned: Collection[str] = (),
        announce: bool = False,
    ) -> None:
        self.job_id, self.node, self.rank = job_id, node, rank
        self.pinned = frozenset(pinned)
        """Knobs the user keeps out of reach (``perfloop run --pin``): commands are refused."""
        self.announce = announce
        self.bounds: Mapping[str, tuple[float, float]] = bounds if bounds is not None else {}
        self._read = read
        self.patch = patch
        """Where slow-loop commands go (`perfloop.actuators.config_patch`); None: refused."""
        self.verify_changes = verify_changes
        self.settle_steps, self.verify_steps = settle_steps, verify_steps
        self.max_verify_steps = 3 * verify_steps if max_verify_steps is None else max_verify_steps
        # The steps before a change, newest last: it is judged against as many of them as steps
        # after it, so the newest ``verify_steps`` first (a change usually answers a recent
        # slowdown, and the steps from before that slowdown are not what it is judged against),
        # more when its judgement is extended.
        self._recent: collections.deque[float] = collections.deque(maxlen=self.max_verify_steps)
        self._good: dict[str, KnobValue] = {}  # per knob: the value last known good
        # the change being verified: (command, value before it, verifier)
        self._trial: tuple[Command, KnobValue | None, ChangeVerifier] | None = None
        self._undo: tuple[Command, KnobValue, Verdict] | None = None  # at the next boundary
        self._key = signing_key
        self.keyring = keyring
        """The public keys commands must be signed with (`perfloop.identity`); with one, a
        command signed with the shared ``signing_key`` is refused."""
        self._handlers = handlers
        self._on_result = on_result
        self.on_config = on_config
        """Where live `ConfigChange` events for this job's producers go (see the module)."""
        self.gate = roster_gate(settings.roster_path)  # who may change sampling, where signed
        # Each agent reads every control partition from its start (`follow`: no group to join).
        self._consumer = consumer(
            settings,
            f"perfloop-agent-{job_id}-{uuid.uuid4().hex[:8]}",
            **CONTROL_CONSUMER,
        )
        self._producer: Any = producer(settings, **{"linger.ms": 0})
        # Commands that passed, with the monotonic time their expiry falls at.
        self._ready: queue.Queue[tuple[Command, float]] = queue.Queue()
        self._last_seq = 0
        self._stop = threading.Event()
        self._assigned = threading.Event()
        self._thread = threading.Thread(target=self.run, name="perfloop-agent", daemon=True)
        self.results: list[ActuationResult] = []

    # -- service -----------------------------------------------------------------------------
    def start(self, wait_assigned_s: float = 15.0) -> bool:
        """Start consuming; return True once the control topic is assigned."""
        self._thread.start()
        return self._assigned.wait(wait_assigned_s)

    def stop(self) -> None:
        """Stop consuming, deliver the acks still queued (5 s at most) and release the Kafka
        clients now: a client left to the garbage collector could be finalized in a forked
        child (a DataLoader worker), which crashes it. Acks the broker did not take in those
        5 s are dropped, said once in the log: closing a producer that still holds messages
        waits for them (9 s more, measured, with the broker gone), and a job ending must not
        wait on a broker that is not there."""
        started = self._thread.ident is not None
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._producer is None:
            return
        left = self._producer.flush(5)
        if left:
            self._producer.purge()
            self._producer.flush(0)
            log.warning("%d command results not delivered: the broker did not take them", left)
        self._producer.close()
        self._producer = None
        if not started:
            self._consumer.close()  # run() closes it otherwise

    def run(self) -> None:
        follow(
            self._consumer, [Topics.CONTROL], lambda msg: self.receive(msg.value() or b""),
            self._stop, self._assigned, key=lambda k: _for_job(k, self.job_id), poll_s=POLL_S,
            what="control consumer", log=log,
        )  # fmt: skip

    # -- checks and application --------------------------------------------------------------
    def receive(self, data: bytes, *, now_ns: int | None = None) -> str | None:
        """Check one control message; queue it, or ack it as rejected. Returns the reason.

        A `ConfigChange` for this job's producers is applied at once through ``on_config``;
        the reason is returned when it was refused.
        """
        try:
            cmd = decode_event(data)
        except SchemaError as e:
            log.warning("rejected unreadable control message: %s", e)
            return str(e)
        if isinstance(cmd, ConfigChange):
            outcome = apply_config(cmd, self.job_id, self.on_config, self.gate)
            if isinstance(outcome, Refused):
                self._refused(cmd, outcome)
            return outcome if isinstance(outcome, str) else None
        if not isinstance(cmd, Command) or cmd.job_id != self.job_id:
            return None
        now = time.time_ns() if now_ns is None else now_ns
        reason = self.check(cmd, now_ns=now)
        if reason:
            self._ack(cmd, "rejected", reason, step=0)
            return reason
        self._last_seq = cmd.seq
        if cmd.loop == "slow":  # for the next start: recorded now, nothing changes in the run
            assert self.patch is not None  # check() refused it otherwise
            try:
                self.patch.record(cmd)
            except ConfigError as e:
                self._ack(cmd, "rejected", str(e), step=0)
                return str(e)
            self._ack(cmd, "applied", f"slow loop: in {self.patch.path}, from the next start",
                      step=0)  # fmt: skip
            return None
        self._ready.put((cmd, time.monotonic() + (cmd.expires_ts_ns - now) / 1e9))
        return None

    def check(self, cmd: Command, *, now_ns: int) -> str:
        """Why the command must not be applied, or "" if it may."""
        ring = self.keyring.current() if self.keyring is not None else None
        why = check_signature(cmd, key=self._key, keyring=ring, now_ns=now_ns)
        if why:
            return why
        if cmd.expires_ts_ns <= now_ns:
            return f"expired {(now_ns - cmd.expires_ts_ns) / 1e9:.1f} s ago"
        if cmd.seq <= self._last_seq:
            return f"sequence {cmd.seq} already seen (last {self._last_seq})"
        if cmd.knob in self.pinned:
            return "pinned by the user (perfloop run --pin, PERFLOOP_PINNED_KNOBS)"
        if cmd.loop == "slow":
            if self.patch is None:
                return "this job takes no slow-loop changes (it has no config patch)"
            if cmd.knob not in KNOB_BOUNDS and cmd.knob not in BOOL_KNOBS:
                return f"knob {cmd.knob!r} is not on the allow-list for a config patch"
        elif cmd.knob not in self._handlers:
            return (
                f"knob {cmd.knob!r} is not handled by this job; handled: {sorted(self._handlers)}"
            )
        if cmd.knob in KNOB_BOUNDS or cmd.knob in BOOL_KNOBS:
            return knob_problem(cmd.knob, cmd.value, self.bounds.get(cmd.knob))
        # a knob of the job's own (not the actuator's allow-list): only its own bounds
        own = self.bounds.get(cmd.knob)
        if own is None:
            return ""
        lo, hi = own
        if isinstance(cmd.value, bool | str) or not lo <= cmd.value <= hi:
            return f"{cmd.knob}={cmd.value!r} is outside [{lo:g}, {hi:g}]"
        return ""

    def step_boundary(self, step: int) -> list[ActuationResult]:
        """Apply what is due now (call between two steps); never raises: a rollback the last
        verdict asked for, else the queued commands (one at a time while changes are verified:
        the next waits for the verdict on this one)."""
        done = []
        if self._undo is not None:
            done.append(self._roll_back(step))
        while self._trial is None:
            try:
                cmd, expires = self._ready.get_nowait()
            except queue.Empty:
                break
            late = time.monotonic() - expires
            if late >= 0:  # it waited for a verdict past its expiry
                why = f"expired {late:.1f} s ago, before its turn"
                done.append(self._ack(cmd, "rejected", why, step=step))
                continue
            before = self._before(cmd)
            try:
                with applying(cmd):
                    self._handlers[cmd.knob](cmd.value)
            except Exception as e:  # a failing handler must not break training
                done.append(self._ack(cmd, "rejected", f"handler failed: {e!r}", step=step))
                continue
            done.append(self._ack(cmd, "applied", "", step=step, was=before))
            if cmd.knob in ACTION_KNOBS:
                continue  # done once: nothing to judge or undo
            if not self.verify_changes:
                self._good[cmd.knob] = cmd.value
                continue
            verifier = ChangeVerifier(
                list(self._recent),
                settle_steps=self.settle_steps,
                verify_steps=self.verify_steps,
                max_verify_steps=self.max_verify_steps,
                must_help=cmd.knob in SPEED_KNOBS,
            )
            self._trial = (cmd, before, verifier)
        return done

    def _before(self, cmd: Command) -> KnobValue | None:
        """The knob's value before ``cmd``: as read from the job, else as last known good,
        else as the command says."""
        if self._read is not None:
            try:
                value = self._read(cmd.knob)
            except Exception as e:  # a failing reader: fall back
                log.warning("cannot read %s before changing it: %r", cmd.knob, e)
            else:
                if value is not None:
                    return value
        return self._good.get(cmd.knob, cmd.from_value)

    def observe_step(self, step: int, step_time_ms: float, loss: float | None = None) -> None:
        """Report one finished step (its time, and its loss when known); never raises."""
        try:
            trial = self._trial
            if trial is None:
                self._recent.append(float(step_time_ms))
                return
            cmd, before, verifier = trial
            verdict = verifier.observe(step_time_ms, loss)
            if verdict is None:
                return
            self._trial = None
            # The next change is judged against the regime it meets: the steps after this one
            # if it stays, the steps before it if it is rolled back.
            self._recent.clear()
            if verdict.rollback and before is not None:
                self._recent.extend(verifier.before)
                self._undo = (cmd, before, verdict)  # at the next step boundary
                return
            self._recent.extend(verifier.after)
            self._good[cmd.knob] = cmd.value
            reason = verdict.reason
            if verdict.rollback:
                reason = f"{reason}; not rolled back: the value before it is unknown"
            self._ack(cmd, "kept", reason, step=step, evidence=verdict.evidence)
        except Exception as e:  # never into the training loop
            log.warning("step %s not observed: %r", step, e)

    def _roll_back(self, step: int) -> ActuationResult:
        assert self._undo is not None
        cmd, before, verdict = self._undo
        self._undo = None
        try:
            with applying(cmd, undo=True):
                self._handlers[cmd.knob](before)
        except Exception as e:  # the change stays: say so
            return self._ack(
                cmd, "kept", f"{verdict.reason}; rolling back to {before!r} failed: {e!r}",
                step=step, evidence=verdict.evidence,
            )  # fmt: skip
        self._good[cmd.knob] = before
        return self._ack(
            cmd, "rolled_back", verdict.reason, step=step, evidence=verdict.evidence,
            value=before,
        )  # fmt: skip

    @property
    def verifying(self) -> bool:
        """Whether a change is being verified (or rolled back at the next boundary)."""
        return self._trial is not None or self._undo is not None

    def _refused(self, change: ConfigChange, reason: Refused) -> None:
        """A sampling change refused: on ``perfloop.actuations`` for ``audit``, one row per job
        (every rank's agent refuses it alike, under the same id)."""
        why = reason.removeprefix("refused: ").rpartition(" (claimed by ")[0]
        decision = refusal(change, tier="observe", actor=reason.by,
                           reason=f"by job {self.job_id}: {why}")  # fmt: skip
        ids = {"job_id": self.job_id, "event_id": f"{change.event_id}-{self.job_id}"[:64]}
        decision = decision.model_copy(update=ids)
        try:
            if self._producer is not None:
                self._producer.produce(
                    Topics.ACTUATIONS, key=self.job_id.encode(), value=encode_event(decision)
                )
        except Exception as e:  # never raise into training
            log.warning("cannot publish the refusal of %s: %s", change.event_id, e)

    def _ack(
        self,
        cmd: Command,
        status: str,
        reason: str,
        *,
        step: int,
        evidence: dict[str, float] | None = None,
        value: KnobValue | None = None,
        was: KnobValue | None = None,
    ) -> ActuationResult:
        result = ActuationResult(
            ts_ns=time.time_ns(),
            job_id=self.job_id,
            node=self.node,
            rank=self.rank,
            command_id=cmd.event_id,
            status=status,  # type: ignore[arg-type]
            reason=reason[:1000],
            knob=cmd.knob,
            value=cmd.value if value is None else value,
            step=step,
            evidence=evidence or {},
        )
        self.results.append(result)
        try:
            if self._producer is None:
                raise BufferError("the agent is stopped")
            self._producer.produce(
                Topics.ACTUATIONS, key=self.job_id.encode(), value=encode_event(result)
            )
            self._producer.poll(0)
        except Exception as e:  # BufferError/KafkaException: report, never raise into training
            log.warning("cannot publish actuation result: %s", e)
        if self.announce:
            say(notice(result, cmd, rank=self.rank, was=was))
        if self._on_result is not None:
            self._on_result(result)
        return result
