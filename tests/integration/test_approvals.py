"""Approvals against the real embedded stack: a job put in tier ``approve`` (``perfloop config
set actuator.tier approve --job JOB``) keeps its recommendations pending; ``perfloop recs``
lists them; ``perfloop approve`` releases one as a signed command and ``perfloop reject``
drops one; a forged approval changes nothing. Every step is in the warehouse: the
recommendation, the approval or rejection (``approvals``), each decision with its reason and
who took it (``audit``), and the command (``commands``)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from perfloop.actuators import sign
from perfloop.kafka import producer
from perfloop.schemas import Approval, Recommendation, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings

from .conftest import perfloop_cli, stack_signed, wait_for
from .conftest import query as _query

pytestmark = pytest.mark.integration

KNOB = "dataloader.num_workers"


def _publish(settings: StackSettings, topic: str, event: Any) -> None:
    """Publish ``event``: a recommendation signed as the stack's stream tier signs them."""
    event = stack_signed(settings, event)
    p = producer(settings)
    p.produce(topic, key=event.job_id.encode(), value=encode_event(event))
    assert p.flush(10) == 0


def _rec(job: str, to_value: int) -> Recommendation:
    return Recommendation(
        ts_ns=time.time_ns(), job_id=job, node="n0", rank=-1, knob=KNOB, from_value=1,
        to_value=to_value, loop="fast", expected_gain_pct=30.0, confidence=0.8,
        rationale="the loader starves the step",
    )  # fmt: skip


def _decisions(settings: StackSettings, rec_id: str) -> list[tuple[Any, ...]]:
    return _query(
        settings,
        "SELECT outcome, actor, tier, command_id, reason FROM audit WHERE rec_id = {r:String} "
        "ORDER BY ts LIMIT 1 BY event_id",
        r=rec_id,
    )


def _decided(settings: StackSettings, rec_id: str, n: int) -> list[tuple[Any, ...]]:
    return wait_for(
        lambda: (d := _decisions(settings, rec_id)) and len(d) >= n and d,
        30,
        f"{n} decisions about {rec_id}",
    )


@pytest.fixture
def job_in_approve_tier(stack: StackSettings, stack_env_vars: dict[str, str]) -> str:
    job = f"it-approve-{uuid.uuid4().hex[:8]}"
    out = perfloop_cli("config", "set", "actuator.tier", "approve", "--job", job,
                       env=stack_env_vars)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "→ actuator of job" in out.stdout
    log = stack.home / "logs" / "actuator.log"
    wait_for(
        lambda: f"actuator.tier for job {job}: 'auto' -> 'approve'" in log.read_text(),
        30,
        "the actuator to take the job's tier",
    )
    return job


def test_approve_releases_a_pending_recommendation_as_a_signed_command(
    stack: StackSettings, stack_env_vars: dict[str, str], job_in_approve_tier: str
) -> None:
    job = job_in_approve_tier
    rec = _rec(job, 6)
    _publish(stack, Topics.RECOMMENDATIONS, rec)
    [(outcome, actor, tier, command_id, reason)] = _decided(stack, rec.event_id, 1)
    assert (outcome, actor, tier, command_id) == ("pending", "actuator", "approve", "")
    assert f"perfloop approve {rec.event_id}" in reason

    listed = perfloop_cli("recs", "--job", job, "--json", env=stack_env_vars)
    assert listed.returncode == 0, listed.stderr
    [shown] = json.loads(listed.stdout)
    assert (shown["rec_id"], shown["state"], shown["knob"], shown["to_value"]) == (
        rec.event_id,
        "pending",
        KNOB,
        "6",
    )

    out = perfloop_cli("approve", rec.event_id, "--reason", "go", env=stack_env_vars)
    assert out.returncode == 0, out.stderr
    assert "actuator: issued" in out.stdout
    decisions = _decided(stack, rec.event_id, 2)
    outcome, actor, _, command_id, _ = decisions[-1]
    assert outcome == "issued" and "@" in actor and command_id
    cmd = wait_for(
        lambda: _query(
            stack,
            "SELECT command_id, rec_id, knob, value, signature FROM commands "
            "WHERE command_id = {c:String}",
            c=command_id,
        ),
        30,
        "the command in the warehouse",
    )
    assert cmd[0][1:4] == (rec.event_id, KNOB, "6") and cmd[0][4].startswith("ed25519:")
    approvals = _query(
        stack,
        "SELECT verdict, author, reason, to_value FROM approvals WHERE rec_id = {r:String}",
        r=rec.event_id,
    )
    # the actor: the roster's principal that signed it (the stack's owner), and its author
    assert actor.startswith("owner: ")
    assert approvals == [("approve", actor.removeprefix("owner: "), "go", "6")]
    # Approved once: no longer pending, and a second approval is refused before it is sent.
    again = perfloop_cli("approve", rec.event_id, env=stack_env_vars)
    assert again.returncode == 1 and "is issued" in again.stderr
    pending = perfloop_cli("recs", "--job", job, env=stack_env_vars)
    assert pending.returncode == 0 and pending.stdout.startswith("no recommendations pending")


def test_reject_drops_a_recommendation_and_a_forged_approval_changes_nothing(
    stack: StackSettings, stack_env_vars: dict[str, str], job_in_approve_tier: str
) -> None:
    job = job_in_approve_tier
    dropped, forged_for = _rec(job, 3), _rec(job, 4)
    for rec in (dropped, forged_for):
        _publish(stack, Topics.RECOMMENDATIONS, rec)
        _decided(stack, rec.event_id, 1)

    out = perfloop_cli("reject", dropped.event_id, "--reason", "eval running", env=stack_env_vars)
    assert out.returncode == 0, out.stderr
    assert "actuator: rejected: eval running" in out.stdout
    late = perfloop_cli("approve", dropped.event_id, env=stack_env_vars)
    assert late.returncode == 1 and "is rejected (eval running)" in late.stderr

    forged = Approval(
        ts_ns=time.time_ns(), job_id=job, node="x", rank=-1, rec_id=forged_for.event_id,
        verdict="approve", author="mallory", knob=KNOB, from_value=1, to_value=64,
        rec_ts_ns=forged_for.ts_ns,
    )  # fmt: skip
    _publish(stack, Topics.RECOMMENDATIONS, sign(forged, b"not the actuator's key"))
    decisions = _decided(stack, forged_for.event_id, 2)
    assert decisions[-1][:2] == ("refused", "mallory")
    assert "signed with a shared key" in decisions[-1][4], decisions[-1][4]
    assert not _query(
        stack, "SELECT 1 FROM commands WHERE rec_id = {r:String}", r=forged_for.event_id
    )
    listed = perfloop_cli("recs", "--job", job, "--all", "--json", env=stack_env_vars)
    states = {d["rec_id"]: d["state"] for d in json.loads(listed.stdout)}
    assert states == {dropped.event_id: "rejected", forged_for.event_id: "refused"}


def test_bad_approvals_and_settings_are_one_line_errors(stack_env_vars: dict[str, str]) -> None:
    out = perfloop_cli("approve", "no-such-rec", env=stack_env_vars)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "perfloop: no recommendation 'no-such-rec' in the warehouse; see `perfloop recs`"
    ]
    bad = perfloop_cli("config", "set", "actuator.tier", "sometimes", "--job", "j",
                       env=stack_env_vars)  # fmt: skip
    assert bad.returncode != 0 and "observe" in bad.stderr and "auto" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_pending_recommendation_past_the_approval_horizon_expires(
    stack: StackSettings, stack_env_vars: dict[str, str], job_in_approve_tier: str
) -> None:
    """Pending for longer than approval_ttl_s (15 min): no longer listed as pending, shown as
    expired with --all, and an approval is refused before anything is sent."""
    job = job_in_approve_tier
    old = _rec(job, 6).model_copy(update={"ts_ns": time.time_ns() - 16 * 60 * 1_000_000_000})
    _publish(stack, Topics.RECOMMENDATIONS, old)
    [(outcome, *_)] = _decided(stack, old.event_id, 1)
    assert outcome == "pending"
    wait_for(
        lambda: _query(stack, "SELECT count() FROM recommendations WHERE rec_id = {r:String}",
                       r=old.event_id) == [(1,)],
        30,
        "the recommendation in the warehouse",
    )  # fmt: skip
    pending = perfloop_cli("recs", "--job", job, env=stack_env_vars)
    assert pending.stdout.startswith("no recommendations pending"), pending.stdout
    every = perfloop_cli("recs", "--job", job, "--all", "--json", env=stack_env_vars)
    [shown] = json.loads(every.stdout)
    assert (shown["rec_id"], shown["state"]) == (old.event_id, "expired")
    late = perfloop_cli("approve", old.event_id, env=stack_env_vars)
    assert late.returncode == 1 and "it expired" in late.stderr
    assert _query(stack, "SELECT count() FROM approvals WHERE rec_id = {r:String}",
                  r=old.event_id) == [(0,)]  # fmt: skip
