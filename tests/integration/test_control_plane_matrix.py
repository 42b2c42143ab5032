"""Acceptance (issue 25), on the real embedded stack as `perfloop up` makes it (the stream tier's
key and the owner's roster under its home, `perfloop.stack._keys`): for a recommendation, an
approval, an actuator setting and a command — unsigned, signed with the wrong key, replayed,
expired, out of its signer's role, tampered (and, but for the command, signed with a revoked
key) — nothing changes at the job or in the actuator's policy, and each refusal is on record:
the actuator's in ``audit`` with the principal it claimed, the job's (for a command) in
``actuations``.

Everything is sent at once, then the records are awaited together (one module fixture); each
cell of the matrix is then one parametrized test of what was recorded. The jobs:

- ``auto-…`` (the session actuator's default tier ``auto``): the bad recommendations go to it,
  where a good one would be issued at once;
- ``approve-…``, put in tier ``approve`` by a setting the owner signs here: the bad settings
  try to raise its tier, the bad approvals try to release its pending recommendations;
- ``cmd-…``: bad commands sent straight to its agent, which checks them against the stack's
  command keyring as a job on its machine does (the actuator's Ed25519 key,
  ``keys/commands.json``); the good ones are signed with the actuator's key.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from perfloop.actuators import JobAgent, sign
from perfloop.actuators.agent import keyring_for
from perfloop.identity import Keyring, PrivateKey, TrustedKey
from perfloop.roster import Principal, Role, Roster
from perfloop.schemas import Approval, Command, ConfigChange, Recommendation
from perfloop.schemas.topics import Topics
from perfloop.settings import DEV_SIGNING_KEY, StackSettings

from .conftest import audit_of, publish, query, wait_for
from .test_actuator_failover import _position

pytestmark = pytest.mark.integration

NS = 1_000_000_000
KNOB = "dataloader.num_workers"
CASES = ("unsigned", "wrong key", "replayed", "expired", "out of role", "tampered")
AUDITED = (*CASES, "revoked")
STREAM_CASES = tuple(c for c in AUDITED if c != "replayed")
"""What the stream tier is sent (a change of a detector's threshold for one job). A replay of
the change it took comes on the same partition and is dropped there as a repeat before any
check (its at-least-once dedup): nothing changes, and nothing is audited."""
STREAM_KEY = "detect.hang.floor_s"
"""What the actuator is sent: the cases above, and one signed with a key revoked since (a
command's keys are the job's: `test_signed_commands` revokes one)."""
MALLORY = PrivateKey.generate()  # a key nobody trusts
ANA = PrivateKey.generate()  # a principal whose role does not reach the jobs here
EVE = PrivateKey.generate()  # a principal and a recommender with every role, whose key is revoked


@dataclass
class Matrix:
    auto_job: str
    approve_job: str
    cmd_job: str
    refused: dict[tuple[str, str], list[tuple[Any, ...]]] = field(default_factory=dict)
    """(kind, case): the records of its refusal (audit rows, or the job's acks)."""
    applied: list[tuple[str, Any]] = field(default_factory=list)
    """What the jobs' agents applied."""
    last_decisions: list[str] = field(default_factory=list)
    """What the session's actuator and one started afresh (applying the stored settings again)
    decided about a good recommendation for the approve job sent after everything bad."""
    pending_ids: list[str] = field(default_factory=list)
    bad_rec_ids: list[str] = field(default_factory=list)
    stream_changes: list[str] = field(default_factory=list)
    """The lines of the stream worker's log that say it changed ``STREAM_KEY`` for the auto
    job (the owner's change, once)."""
    command_audit: dict[str, list[str]] = field(default_factory=dict)
    """case: the reasons of the ``refused`` rows in audit for its command (the actuator
    records each command a job refused, `perfloop.actuators.service.refused_at_job`)."""


def _revoked(key: PrivateKey, principal: str) -> TrustedKey:
    k = TrustedKey.of(key.public_bytes(), principal)
    return TrustedKey(k.key_id, k.principal, k.public, None, revoked=True)


@pytest.fixture(scope="module")
def matrix(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Any:
    run = uuid.uuid4().hex[:8]
    m = Matrix(f"it-matrix/auto-{run}", f"it-matrix/approve-{run}", f"it-matrix/cmd-{run}")
    keys = stack.home / "keys"
    streams, owner = PrivateKey.load(keys / "streams.key"), PrivateKey.load(keys / "owner.key")
    # ana: a principal of the roster, whose role covers other jobs and tiers up to recommend
    roster = Roster.load(keys / "roster.json")
    roster.principals["ana"] = Principal("ana", (Role(("team-b/*",), ("actuator.*",), "auto"),
                                                 Role(("it-matrix/*",), ("actuator.dry_run",),
                                                      "recommend")))  # fmt: skip
    roster.keyring.keys[ANA.key_id] = TrustedKey.of(ANA.public_bytes(), "ana")
    roster.principals["eve"] = Principal("eve", (Role(("*",), ("actuator.*",), "auto"),))
    roster.keyring.keys[EVE.key_id] = _revoked(EVE, "eve")
    roster.save(keys / "roster.json")  # read again by the actuator when it changes
    ring = Keyring.load(keys / "recommenders.json")
    ring.keys[EVE.key_id] = _revoked(EVE, "eve-streams")
    ring.save(keys / "recommenders.json")

    agents = {
        job: JobAgent(stack, job_id=job, node="n0", signing_key=DEV_SIGNING_KEY.encode(),
                      keyring=keyring_for(stack), verify_changes=False,
                      handlers={KNOB: lambda v, job=job: m.applied.append((job, v))})
        for job in (m.auto_job, m.approve_job, m.cmd_job)
    }  # fmt: skip
    now = time.time_ns()
    later, gone = now + 300 * NS, now - NS

    def rec(job: str, to: int = 6, **kw: Any) -> Recommendation:
        return Recommendation(**(dict(
            ts_ns=now, job_id=job, node="n0", rank=-1, knob=KNOB, from_value=2, to_value=to,
            loop="fast", expected_gain_pct=30.0, confidence=0.9, rationale="loader starves",
            expires_ts_ns=later) | kw))  # fmt: skip

    def approval(of: Recommendation, **kw: Any) -> Approval:
        return Approval(**(dict(
            ts_ns=now, job_id=of.job_id, node="cli", rank=-1, rec_id=of.event_id,
            verdict="approve", author="mallory@nowhere", knob=KNOB, from_value=2,
            to_value=of.to_value, rec_ts_ns=of.ts_ns, expires_ts_ns=later) | kw))  # fmt: skip

    def setting(value: str = "auto", **kw: Any) -> ConfigChange:
        return ConfigChange(**(dict(
            ts_ns=now, job_id=m.approve_job, node="cli", rank=-1, target="actuator",
            applies_to=m.approve_job, key="actuator.tier", value=value,
            author="mallory@nowhere", expires_ts_ns=later) | kw))  # fmt: skip

    def stream_setting(value: float = 1.0, **kw: Any) -> ConfigChange:
        return ConfigChange(**(dict(
            ts_ns=now, job_id=m.auto_job, node="cli", rank=-1, target="streams",
            applies_to=m.auto_job, key=STREAM_KEY, value=value, author="mallory@nowhere",
            expires_ts_ns=later) | kw))  # fmt: skip

    def command(seq: int, **kw: Any) -> Command:
        return Command(**(dict(
            ts_ns=now, job_id=m.cmd_job, node="n0", rank=-1, seq=seq, knob=KNOB, from_value=2,
            value=4, expires_ts_ns=later) | kw))  # fmt: skip

    try:
        for agent in agents.values():
            assert agent.start(wait_assigned_s=30), "the agent reads the control topic"
        # the approve job, by a setting the owner signed: taken (and, sent again, a replay)
        to_approve = sign(setting("approve", author="owner@it"), owner)
        publish(stack, Topics.CONTROL, to_approve)
        log = stack.home / "logs" / "actuator.log"
        wait_for(lambda: f"actuator.tier for job {m.approve_job}: 'auto' -> 'approve'"
                 in log.read_text(), 30, "the actuator to take the owner's setting")  # fmt: skip

        # the stream tier: a detector's threshold for the auto job, by a change the owner signed
        stream_good = sign(stream_setting(45.0, author="owner@it"), owner)
        publish(stack, Topics.CONTROL, stream_good)
        streams_log = stack.home / "logs" / "streams.log"
        changed = f"config {STREAM_KEY} for {m.auto_job}"
        wait_for(lambda: changed in streams_log.read_text(), 30, "the stream tier to take it")

        # recommendations, for the job in tier auto (a good one would be issued)
        good = sign(rec(m.approve_job, 7), streams)  # pending, then sent again
        bad_recs = {
            "unsigned": rec(m.auto_job),
            "wrong key": sign(rec(m.auto_job), MALLORY),
            "replayed": good,
            "expired": sign(rec(m.auto_job, expires_ts_ns=gone), streams),
            "out of role": sign(rec(m.auto_job), owner),  # a person's key, not a recommender's
            "tampered": sign(rec(m.auto_job), streams).model_copy(update={"to_value": 64}),
            "revoked": sign(rec(m.auto_job), EVE),
        }
        # approvals, each of a recommendation of its own pending for the approve job
        pending = {case: sign(rec(m.approve_job, 3 + i), streams)
                   for i, case in enumerate(AUDITED)}  # fmt: skip
        publish(stack, Topics.RECOMMENDATIONS, good, *pending.values())
        wait_for(lambda: all(audit_of(stack, r.event_id) for r in (good, *pending.values())), 30,
                 "the good recommendations pending")  # fmt: skip
        rejected = sign(approval(pending["replayed"], verdict="reject", author="owner@it"), owner)
        bad_approvals = {
            "unsigned": approval(pending["unsigned"]),
            "wrong key": sign(approval(pending["wrong key"]), MALLORY),
            "replayed": rejected,
            "expired": sign(approval(pending["expired"], expires_ts_ns=gone), owner),
            "out of role": sign(approval(pending["out of role"], author="ana@it"), ANA),
            "tampered": sign(approval(pending["tampered"]), owner).model_copy(
                update={"to_value": 64}
            ),
            "revoked": sign(approval(pending["revoked"], author="eve@it"), EVE),
        }
        # settings: each tries to raise the approve job's tier to auto
        bad_settings = {
            "unsigned": setting(),
            "wrong key": sign(setting(), MALLORY),
            "replayed": to_approve,
            "expired": sign(setting(expires_ts_ns=gone), owner),
            "out of role": sign(setting(author="ana@it"), ANA),
            "tampered": sign(setting("observe"), owner).model_copy(update={"value": "auto"}),
            "revoked": sign(setting(author="eve@it"), EVE),
        }
        bad_streams = {
            "unsigned": stream_setting(),
            "wrong key": sign(stream_setting(), MALLORY),
            "expired": sign(stream_setting(expires_ts_ns=gone), owner),
            "out of role": sign(stream_setting(author="ana@it"), ANA),
            "tampered": sign(stream_setting(2.0), owner).model_copy(update={"value": 1.0}),
            "revoked": sign(stream_setting(author="eve@it"), EVE),
        }
        # commands, straight to the job (signed with what the actuator signs with here)
        key = PrivateKey.load(keys / "actuator.key")  # what the stack's actuator signs with
        valid = sign(command(2**60), key)
        bad_commands = {
            "unsigned": command(2**60 + 1),
            "wrong key": sign(command(2**60 + 2), MALLORY),
            "replayed": valid,
            "expired": sign(command(2**60 + 3, expires_ts_ns=gone), key),
            "out of role": sign(command(2**60 + 4, value=10_000), key),  # out of its bounds
            "tampered": sign(command(2**60 + 5), key).model_copy(update={"value": 64}),
        }
        publish(stack, Topics.RECOMMENDATIONS, rejected)
        wait_for(lambda: any(o == "rejected" for o, *_ in audit_of(stack, rejected.rec_id)), 30,
                 "the owner's rejection")  # fmt: skip
        publish(stack, Topics.RECOMMENDATIONS, *bad_recs.values(), *bad_approvals.values())
        publish(stack, Topics.CONTROL, *bad_settings.values(), valid, *bad_commands.values(),
                 *bad_streams.values(), stream_good)  # fmt: skip

        def refusals() -> dict[tuple[str, str], list[tuple[Any, ...]]]:
            got: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
            sends = (("recommendation", bad_recs), ("approval", bad_approvals),
                     ("config", bad_settings), ("stream config", bad_streams))  # fmt: skip
            for kind, sent in sends:
                for case, ev in sent.items():
                    rec_id = ev.rec_id if isinstance(ev, Approval) else ev.event_id
                    rows = [r for r in audit_of(stack, rec_id) if r[0] == "refused"]
                    if rows:
                        got[(kind, case)] = rows
            return got

        every = 3 * len(AUDITED) + len(STREAM_CASES)
        m.refused = wait_for(lambda: len(got := refusals()) == every and got, 60,
                             "every refusal in audit")  # fmt: skip
        m.stream_changes = [ln for ln in streams_log.read_text().splitlines() if changed in ln]
        cmd_agent = agents[m.cmd_job]
        wait_for(lambda: len(cmd_agent.results) >= len(CASES), 30, "the job's acks")
        for agent in agents.values():
            agent.step_boundary(1)  # what was taken would be applied here
        ids = [c.event_id for c in bad_commands.values()]
        acks_sql = (
            "SELECT command_id, status, reason FROM actuations WHERE job_id = {j:String} "
            "AND command_id IN {c:Array(String)} ORDER BY ts LIMIT 1 BY event_id"
        )
        acks = wait_for(  # the job's acks, in the warehouse
            lambda: len(rows := query(stack, acks_sql, j=m.cmd_job, c=ids)) >= len(CASES) and rows,
            30,
            "the job's acks in actuations",
        )
        for case, c in bad_commands.items():
            m.refused[("command", case)] = [(s, r) for i, s, r in acks if i == c.event_id]
        audit_sql = (
            "SELECT command_id, reason FROM audit WHERE command_id IN {c:Array(String)} "
            "AND outcome = 'refused' LIMIT 1 BY event_id"
        )
        in_audit = wait_for(
            lambda: len(rows := query(stack, audit_sql, c=ids)) >= len(CASES) and rows,
            30,
            "the job's refusals in audit",
        )
        for case, c in bad_commands.items():
            m.command_audit[case] = [r for i, r in in_audit if i == c.event_id]

        # An actuator started now applies the stored settings again (the forged ones stored
        # too, by the sink): the approve job stays in tier approve for it as for the session's.
        group = f"it-matrix-actuator-{run}"
        _position(stack, group)
        log_path = tmp_path_factory.mktemp("matrix") / "actuator.log"
        with log_path.open("wb") as out:
            fresh = subprocess.Popen(
                [sys.executable, "-m", "perfloop.cli", "service", "actuator"],
                env=stack_env_vars | {
                    "PERFLOOP_GROUP_ID": group,
                    "PERFLOOP_RECOMMENDATION_KEYRING": str(keys / "recommenders.json"),
                    "PERFLOOP_ROSTER": str(keys / "roster.json"),
                },
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_for(lambda: "assigned" in log_path.read_text(), 60, "the fresh actuator")
            last = sign(rec(m.approve_job, 9), streams)
            publish(stack, Topics.RECOMMENDATIONS, last)
            decided = wait_for(lambda: len(d := audit_of(stack, last.event_id)) >= 2 and d, 30,
                               "both actuators' decisions")  # fmt: skip
            m.last_decisions = sorted(str(d[0]) for d in decided)
        finally:
            fresh.terminate()
            fresh.wait(30)
        m.pending_ids = [r.event_id for r in pending.values()]
        m.bad_rec_ids = [r.event_id for r in bad_recs.values()]
    finally:
        for agent in agents.values():
            agent.stop()
    return m


EXPECTED = {
    ("recommendation", "unsigned"): "unsigned: it carries no signature",
    ("recommendation", "wrong key"): "is not in the keyring",
    ("recommendation", "replayed"): "replayed: recommendation",
    ("recommendation", "expired"): "expired: its expiry passed",
    ("recommendation", "out of role"): "is not in the keyring",
    ("recommendation", "tampered"): "signature does not verify under key",
    ("approval", "unsigned"): "unsigned: it carries no signature",
    ("approval", "wrong key"): "is not in the keyring",
    ("approval", "replayed"): "replayed: approval",
    ("approval", "expired"): "expired: its expiry passed",
    ("approval", "out of role"): "principal 'ana' has no role that approves",
    ("approval", "tampered"): "signature does not verify under key",
    ("config", "unsigned"): "unsigned: it carries no signature",
    ("config", "wrong key"): "is not in the keyring",
    ("config", "replayed"): "replayed: config",
    ("config", "expired"): "expired: its expiry passed",
    ("config", "out of role"): "principal 'ana' has no role that sets actuator.tier",
    ("config", "tampered"): "signature does not verify under key",
    ("recommendation", "revoked"): "of 'eve-streams' is revoked",
    ("approval", "revoked"): "of 'eve' is revoked",
    ("config", "revoked"): "of 'eve' is revoked",
    ("stream config", "unsigned"): "by the stream tier: unsigned: it carries no signature",
    ("stream config", "wrong key"): "is not in the keyring",
    ("stream config", "expired"): "by the stream tier: expired: its expiry passed",
    ("stream config", "out of role"): f"principal 'ana' has no role that sets {STREAM_KEY}",
    ("stream config", "tampered"): "by the stream tier: signature does not verify under key",
    ("stream config", "revoked"): "of 'eve' is revoked",
    ("command", "unsigned"): "unsigned: it carries no signature",
    ("command", "wrong key"): "is not in the keyring",
    ("command", "replayed"): "already seen",
    ("command", "expired"): "expired",
    ("command", "out of role"): "is outside",
    ("command", "tampered"): "signature does not verify",
}
CLAIMED = {"unsigned": "mallory@nowhere", "wrong key": "mallory@nowhere", "replayed": "owner",
           "expired": "owner", "out of role": "ana", "tampered": "owner",
           "revoked": "eve"}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "case"),
    [(kind, case) for kind in ("recommendation", "approval", "config") for case in AUDITED]
    + [("stream config", case) for case in STREAM_CASES]
    + [("command", case) for case in CASES],
)
def test_a_bad_event_is_refused_and_on_record(matrix: Matrix, kind: str, case: str) -> None:
    rows = matrix.refused.get((kind, case))
    assert rows, f"no record of the {case} {kind}'s refusal"
    why = EXPECTED[(kind, case)]
    if kind == "command":  # the job's acks (a replay's original was applied, once)
        rejected = [reason for status, reason in rows if status == "rejected"]
        assert len(rejected) == 1 and why in rejected[0], rows
        audited = matrix.command_audit.get(case, [])
        assert len(audited) == 1 and why in audited[0], audited  # and in audit, once
        return
    outcome, actor, reason, command_id = rows[-1]
    assert (outcome, command_id) == ("refused", "") and why in reason, rows
    if kind != "recommendation":  # the principal it claimed: its key's, else its author
        assert actor == CLAIMED[case], rows
    elif case in ("expired", "tampered", "replayed"):
        assert actor == "streams", rows  # signed (or claiming to be) by the stream tier's key
    elif case == "revoked":
        assert actor == "eve-streams", rows


def test_nothing_changed_at_the_jobs_or_in_the_policy(matrix: Matrix, stack: StackSettings) -> None:
    # only the one valid command (the replayed one's original) reached a job's knob
    assert matrix.applied == [(matrix.cmd_job, 4)]
    assert matrix.last_decisions == ["pending", "pending"], "the approve job's tier was changed"
    ids = [*matrix.pending_ids, *matrix.bad_rec_ids]
    issued = query(stack, "SELECT count() FROM audit WHERE rec_id IN {r:Array(String)} "
                   "AND outcome = 'issued'", r=ids)  # fmt: skip
    assert issued == [(0,)]
    jobs = [matrix.auto_job, matrix.approve_job]
    sent = query(stack, "SELECT count() FROM commands WHERE job_id IN {j:Array(String)}", j=jobs)
    assert sent == [(0,)]
    # the stream tier changed the threshold once, to the owner's value, and for nothing else
    assert len(matrix.stream_changes) == 1 and "-> 45" in matrix.stream_changes[0], (
        matrix.stream_changes
    )
