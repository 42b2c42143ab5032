"""The actuator's decisions (`Policy`): which recommendations and approvals become commands,
what every one of them is recorded as, and with what guarantees."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from perfloop.actuators import KNOB_BOUNDS, JobRules, Policy, sign
from perfloop.exceptions import ConfigError
from perfloop.schemas import ActuationResult, Approval, Command, ConfigChange, Recommendation
from tests.helpers import recommendation

KNOB = "dataloader.num_workers"
S = 1_000_000_000
T0 = 1_700_000_000 * S
KEY = b"k"


_rec = recommendation


def _policy(**rules: Any) -> Policy:
    return Policy(JobRules(**rules), ttl_s=60, approval_ttl_s=900, keys={"default": KEY})


def _approval(
    rec: Recommendation, verdict: str = "approve", key: bytes = KEY, **kw: Any
) -> Approval:
    appr = Approval(
        ts_ns=T0 + S,
        job_id=rec.job_id,
        node="cli",
        rank=-1,
        rec_id=rec.event_id,
        verdict=verdict,
        author="ana@host",
        knob=rec.knob,
        from_value=rec.from_value,
        to_value=rec.to_value,
        loop=rec.loop,
        rec_ts_ns=rec.ts_ns,
        **kw,
    )
    return sign(appr, key)


def _change(key: str, value: Any, job: str = "*") -> ConfigChange:
    return ConfigChange(
        ts_ns=T0, job_id="ops" if job == "*" else job, node="cli", rank=-1, target="actuator",
        applies_to=job, key=key, value=value,
    )  # fmt: skip


# -- tiers ----------------------------------------------------------------------------------


def test_auto_tier_issues_a_command_that_carries_the_recommendation() -> None:
    rec = _rec()
    cmd, d = _policy().decide(rec, now_ns=T0)
    assert isinstance(cmd, Command)
    assert (cmd.job_id, cmd.node, cmd.knob, cmd.from_value, cmd.value) == (
        "job-1",
        "n0",
        KNOB,
        2,
        5,
    )
    assert (cmd.rec_id, cmd.loop, cmd.rank, cmd.ts_ns) == (rec.event_id, "fast", -1, T0)
    assert cmd.expires_ts_ns == T0 + 60 * S
    assert cmd.signature == "", "the service signs; the policy only decides"
    assert (d.outcome, d.rec_id, d.command_id, d.tier, d.actor) == (
        "issued",
        rec.event_id,
        cmd.event_id,
        "auto",
        "actuator",
    )
    assert (d.knob, d.from_value, d.to_value, d.job_id, d.ts_ns) == (KNOB, 2, 5, "job-1", T0)


@pytest.mark.parametrize(
    ("tier", "outcome"),
    [("observe", "observed"), ("recommend", "recommended"), ("approve", "pending")],
)
def test_other_tiers_issue_nothing_and_say_so(tier: str, outcome: str) -> None:
    rec = _rec()
    cmd, d = _policy(tier=tier).decide(rec, now_ns=T0)
    assert cmd is None
    assert (d.outcome, d.tier) == (outcome, tier)
    if tier == "approve":
        assert f"perfloop approve {rec.event_id}" in d.reason


@pytest.mark.parametrize("tier", ["Auto", "observe ", "manual", 1])
def test_an_unknown_tier_is_refused_naming_the_valid_ones(tier: Any) -> None:
    with pytest.raises(ConfigError, match=r"observe.*recommend.*approve.*auto"):
        JobRules().with_setting("actuator.tier", tier)


# -- what is refused --------------------------------------------------------------------------


def test_unknown_knob_is_refused_with_the_allowed_ones() -> None:
    cmd, d = _policy().decide(_rec(knob="optimizer.lr", to_value=0.1), now_ns=T0)
    assert cmd is None and d.outcome == "refused"
    assert "'optimizer.lr'" in d.reason and KNOB in d.reason


@pytest.mark.parametrize("to_value", [KNOB_BOUNDS[KNOB][1] + 1, -1, 1e9])
def test_out_of_bounds_target_is_refused(to_value: float) -> None:
    cmd, d = _policy().decide(_rec(to_value=to_value), now_ns=T0)
    assert cmd is None and d.outcome == "refused" and "outside" in d.reason


@pytest.mark.parametrize("to_value", list(KNOB_BOUNDS[KNOB]))
def test_bounds_are_inclusive(to_value: float) -> None:
    cmd, _ = _policy().decide(_rec(to_value=to_value), now_ns=T0)
    assert cmd is not None and cmd.value == to_value


@pytest.mark.parametrize("to_value", ["8", True, False])
def test_non_numeric_target_is_refused(to_value: Any) -> None:
    cmd, d = _policy().decide(_rec(to_value=to_value), now_ns=T0)
    assert cmd is None and "not a number" in d.reason


def test_a_gain_below_the_minimum_is_refused() -> None:
    policy = _policy(min_gain_pct=10)
    cmd, d = policy.decide(_rec(expected_gain_pct=9.9), now_ns=T0)
    assert cmd is None and d.outcome == "refused" and "below the minimum 10%" in d.reason
    assert policy.decide(_rec(expected_gain_pct=10), now_ns=T0)[0] is not None


def test_cooldown_is_per_job_and_knob() -> None:
    policy = _policy(cooldown_s=30)
    assert policy.decide(_rec(), now_ns=T0)[0] is not None
    cmd, d = policy.decide(_rec(to_value=6), now_ns=T0 + 10 * S)
    assert cmd is None and d.reason.startswith("cooldown")
    assert policy.decide(_rec(job_id="job-2"), now_ns=T0 + 10 * S)[0] is not None
    assert policy.decide(_rec(knob="dataloader.prefetch_factor"), now_ns=T0 + 10 * S)[0]
    assert policy.decide(_rec(to_value=6), now_ns=T0 + 30 * S)[0] is not None


def _verdict(cmd: Command, status: str, command_id: str | None = None) -> ActuationResult:
    return ActuationResult(
        ts_ns=cmd.ts_ns + 5 * S, job_id=cmd.job_id, node="n0", rank=0,
        command_id=command_id or cmd.event_id, status=status, knob=cmd.knob, value=cmd.value,
    )  # fmt: skip


def test_a_kept_verdict_on_the_knobs_last_command_ends_its_cooldown() -> None:
    """A rule that grows a knob one verified step at a time (loader workers waiting on
    storage) takes its next step once the job kept the last one, not cooldown_s later."""
    policy = _policy(cooldown_s=30)
    cmd, _ = policy.decide(_rec(to_value=2), now_ns=T0)
    assert cmd is not None
    assert not policy.observe_verdict(_verdict(cmd, "applied"))  # applied: not judged yet
    assert not policy.observe_verdict(_verdict(cmd, "kept", command_id="another"))
    assert policy.decide(_rec(to_value=3), now_ns=T0 + 5 * S)[0] is None  # still cooling
    assert policy.observe_verdict(_verdict(cmd, "kept"))
    nxt, d = policy.decide(_rec(to_value=3), now_ns=T0 + 6 * S)
    assert nxt is not None, d.reason
    # a rollback keeps the cooldown: the job just went back
    assert not policy.observe_verdict(_verdict(nxt, "rolled_back"))
    cmd3, d3 = policy.decide(_rec(to_value=4), now_ns=T0 + 8 * S)
    assert cmd3 is None and d3.reason.startswith("cooldown")


def test_refused_recommendation_does_not_start_a_cooldown() -> None:
    policy = _policy(cooldown_s=30)
    assert policy.decide(_rec(to_value=999), now_ns=T0)[0] is None
    assert policy.decide(_rec(), now_ns=T0 + S)[0] is not None


def test_rate_limit_counts_a_jobs_commands_over_the_last_minute() -> None:
    policy = _policy(cooldown_s=0, max_commands_per_min=2)
    assert policy.decide(_rec(), now_ns=T0)[0] is not None
    assert policy.decide(_rec(), now_ns=T0 + 10 * S)[0] is not None
    cmd, d = policy.decide(_rec(), now_ns=T0 + 20 * S)
    assert cmd is None and d.reason.startswith("rate limit: 2 commands")
    assert policy.decide(_rec(job_id="job-2"), now_ns=T0 + 20 * S)[0] is not None
    assert policy.decide(_rec(), now_ns=T0 + 60 * S)[0] is not None  # the first left the minute


def test_dry_run_decides_and_sends_nothing_yet_holds_the_cooldown() -> None:
    policy = _policy(dry_run=True, cooldown_s=30)
    cmd, d = policy.decide(_rec(), now_ns=T0)
    assert cmd is None and d.outcome == "dry_run" and "would send" in d.reason
    cmd, d = policy.decide(_rec(), now_ns=T0 + S)
    assert cmd is None and d.reason.startswith("cooldown"), "as if the first had been sent"


# -- live settings ----------------------------------------------------------------------------


def test_a_jobs_own_settings_override_the_defaults_and_outlive_their_changes() -> None:
    policy = _policy()
    assert policy.configure(_change("actuator.tier", "approve", job="job-1")) == ("auto", "approve")
    assert policy.decide(_rec(), now_ns=T0)[1].outcome == "pending"
    assert policy.decide(_rec(job_id="job-2"), now_ns=T0)[1].outcome == "issued"
    assert policy.configure(_change("actuator.tier", "observe")) == ("auto", "observe")
    assert policy.rules("job-2").tier == "observe"
    assert policy.rules("job-1").tier == "approve", "its own tier stays"
    policy.configure(_change("actuator.dry_run", True))
    assert policy.rules("job-1") == JobRules(tier="approve", dry_run=True)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("actuator.tiers", "auto", "valid: actuator.tier, actuator.dry_run"),
        ("actuator.dry_run", "yes", "true or false"),
        ("actuator.min_gain_pct", -1, r"in \[0, 1000\]"),
        ("actuator.max_commands_per_min", 2.5, "an integer"),
        ("actuator.cooldown_s", float("nan"), "a number"),
    ],
)
def test_a_bad_setting_is_refused_with_what_is_valid(key: str, value: Any, message: str) -> None:
    policy = _policy()
    with pytest.raises(ConfigError, match=message):
        policy.configure(_change(key, value, job="job-1"))
    assert policy.rules("job-1") == JobRules(), "nothing changed"


# -- approvals --------------------------------------------------------------------------------


def test_an_approval_releases_a_pending_recommendation() -> None:
    policy = _policy(tier="approve", min_gain_pct=50)
    rec = _rec(expected_gain_pct=10)  # below the minimum: a person's approval decides
    assert policy.decide(rec, now_ns=T0)[1].outcome == "pending"
    cmd, d = policy.approve(_approval(rec), now_ns=T0 + 2 * S)
    assert cmd is not None and (cmd.rec_id, cmd.knob, cmd.value) == (rec.event_id, KNOB, 5)
    assert (d.outcome, d.actor, d.command_id, d.rec_id) == (
        "issued",
        "ana@host",
        cmd.event_id,
        rec.event_id,
    )
    again, d = policy.approve(_approval(rec), now_ns=T0 + 3 * S)
    assert again is None and d.outcome == "refused" and "already issued" in d.reason


@pytest.mark.parametrize(
    "tamper",
    [
        lambda a: a.model_copy(update={"signature": ""}),
        lambda a: a.model_copy(update={"to_value": 64}),  # signed for 5
        lambda a: a.model_copy(update={"key_id": "other"}),
        lambda a: sign(a, b"wrong key"),
    ],
    ids=["unsigned", "tampered", "unknown key", "wrong key"],
)
def test_an_approval_that_does_not_verify_is_refused(tamper: Any) -> None:
    policy = _policy(tier="approve")
    rec = _rec()
    cmd, d = policy.approve(tamper(_approval(rec)), now_ns=T0 + S)
    assert cmd is None and d.outcome == "refused" and "does not verify" in d.reason
    assert policy.approve(_approval(rec), now_ns=T0 + S)[0] is not None, "the real one still can"


def test_a_rejection_is_recorded_and_ends_the_recommendation() -> None:
    policy = _policy(tier="approve")
    rec = _rec()
    cmd, d = policy.approve(_approval(rec, "reject", reason="not during the eval"), now_ns=T0)
    assert cmd is None and (d.outcome, d.reason, d.actor) == (
        "rejected",
        "not during the eval",
        "ana@host",
    )
    cmd, d = policy.approve(_approval(rec), now_ns=T0 + S)
    assert cmd is None and "already rejected by ana@host" in d.reason


@pytest.mark.parametrize("tier", ["observe", "recommend", "auto"])
def test_approvals_are_taken_only_in_tier_approve(tier: str) -> None:
    cmd, d = _policy(tier=tier).approve(_approval(_rec()), now_ns=T0 + S)
    assert cmd is None and d.outcome == "refused" and f"tier {tier}" in d.reason


def test_an_approval_of_an_old_recommendation_is_refused() -> None:
    policy = _policy(tier="approve")
    cmd, d = policy.approve(_approval(_rec()), now_ns=T0 + 901 * S)
    assert cmd is None and "901 s old" in d.reason


def test_an_approval_still_obeys_bounds_cooldown_and_dry_run() -> None:
    policy = _policy(tier="approve", cooldown_s=30)
    assert policy.approve(_approval(_rec(to_value=999)), now_ns=T0)[1].outcome == "refused"
    assert policy.approve(_approval(_rec()), now_ns=T0)[0] is not None
    cmd, d = policy.approve(_approval(_rec(to_value=7)), now_ns=T0 + S)
    assert cmd is None and d.reason.startswith("cooldown")
    dry = _policy(tier="approve", dry_run=True)
    cmd, d = dry.approve(_approval(_rec()), now_ns=T0)
    assert cmd is None and d.outcome == "dry_run"


# -- sequence numbers -------------------------------------------------------------------------


def test_sequence_increases_per_job() -> None:
    policy = _policy(cooldown_s=0, max_commands_per_min=100)
    seqs = []
    for now in (T0, T0, T0 + 1, T0 + 2 * S):
        cmd, _ = policy.decide(_rec(), now_ns=now)
        assert cmd is not None
        seqs.append(cmd.seq)
    assert all(b > a for a, b in itertools.pairwise(seqs))
    other, _ = policy.decide(_rec(job_id="job-2"), now_ns=T0)
    assert other is not None and other.seq >= 1


def test_sequence_increases_even_when_the_clock_goes_back() -> None:
    policy = _policy()
    seqs = [policy.next_seq("job-1", now) for now in (T0, T0 - 3600 * S, 0, T0)]
    assert all(b > a for a, b in itertools.pairwise(seqs))


def test_sequence_survives_a_restart() -> None:
    first, _ = _policy().decide(_rec(), now_ns=T0)
    later, _ = _policy().decide(_rec(), now_ns=T0 + 1_000_000)  # a new process, 1 ms later
    assert first is not None and later is not None
    assert later.seq > first.seq


def test_a_jobs_own_range_from_its_job_info_narrows_the_allow_list() -> None:
    """A 2-CPU job's agent reports threads in [1, 2]: 8 threads is refused before any command
    is issued, and the reason says whose range it is."""
    from perfloop.schemas import JobInfo

    p = Policy(JobRules(tier="auto", min_gain_pct=0), ttl_s=60)
    info = JobInfo(ts_ns=1, job_id="j", node="n", rank=0,
                   extra={"bounds.torch.num_threads": "1,2", "bounds.bad": "x"})  # fmt: skip
    p.observe_info(info)
    rec = Recommendation(ts_ns=0, job_id="j", node="n", rank=-1, knob="torch.num_threads",
                         from_value=1, to_value=8, loop="fast", expected_gain_pct=10,
                         confidence=0.5, rationale="r")  # fmt: skip
    cmd, d = p.decide(rec, now_ns=10**18)
    assert cmd is None and d.outcome == "refused"
    assert (
        d.reason == "torch.num_threads=8 is outside [1, 2] (the job's own range, from its job info)"
    )
    cmd, d = p.decide(rec.model_copy(update={"to_value": 2, "event_id": "r2"}), now_ns=10**18)
    assert cmd is not None and cmd.value == 2
    other, _ = p.decide(rec.model_copy(update={"job_id": "k", "event_id": "r3"}), now_ns=10**18)
    assert other is not None, "another job keeps the allow-list's range"


# -- a person asking for an action (perfloop capture) ---------------------------------------


def _capture(steps: Any = 3, key: bytes = KEY, rec_id: str = "capture-1") -> Approval:
    ask = Approval(
        ts_ns=T0, job_id="j1", node="cli", rank=-1, rec_id=rec_id, verdict="approve",
        author="ana@host", knob="profiler.capture_steps", from_value=0, to_value=steps,
        loop="fast", rec_ts_ns=T0,
    )  # fmt: skip
    return sign(ask, key)


@pytest.mark.parametrize("tier", ["recommend", "approve", "auto"])
def test_a_signed_capture_request_is_issued_in_every_tier_but_observe(tier: str) -> None:
    policy = _policy(tier=tier)
    cmd, d = policy.approve(_capture(), now_ns=T0 + S)
    assert cmd is not None and (cmd.knob, cmd.value) == ("profiler.capture_steps", 3)
    assert (d.outcome, d.actor, d.rec_id) == ("issued", "ana@host", "capture-1")
    again, d = policy.approve(_capture(), now_ns=T0 + 2 * S)  # the same request replayed
    assert again is None and d.outcome == "refused" and "already" in d.reason


def test_a_capture_request_is_refused_in_observe_unsigned_or_out_of_bounds() -> None:
    cmd, d = _policy(tier="observe").approve(_capture(), now_ns=T0 + S)
    assert cmd is None and d.outcome == "refused" and "tier observe" in d.reason
    cmd, d = _policy(tier="auto").approve(_capture(key=b"not the key"), now_ns=T0 + S)
    assert cmd is None and "does not verify" in d.reason
    cmd, d = _policy(tier="auto").approve(_capture(steps=500, rec_id="c2"), now_ns=T0 + S)
    assert cmd is None and d.outcome == "refused" and "profiler.capture_steps" in d.reason


# -- what was acted on before (a restart, a failover) -----------------------------------------


def test_a_recommendation_delivered_again_is_refused_not_issued_again() -> None:
    policy = _policy(cooldown_s=0)
    rec = _rec()
    cmd, _ = policy.decide(rec, now_ns=T0)
    assert cmd is not None
    again, d = policy.decide(rec, now_ns=T0 + S)
    assert again is None and d.outcome == "refused"
    assert d.reason == f"already issued as command {cmd.event_id}"


def test_a_successor_reads_back_its_predecessors_commands() -> None:
    """Another policy issued the command (the actuator before a restart): the recommendation
    is not acted on again, the sequence goes on above it and the knob's cooldown holds."""
    before = _policy(cooldown_s=30)
    rec = _rec(to_value=2)
    cmd, _ = before.decide(rec, now_ns=T0)
    assert cmd is not None
    after = _policy(cooldown_s=30)
    after.observe_command(cmd)
    after.observe_command(cmd)  # read twice (the recall, then the live stream): no harm
    refused, d = after.decide(rec, now_ns=T0 + S)
    assert refused is None and d.reason == f"already issued as command {cmd.event_id}"
    cooled, d = after.decide(_rec(to_value=3), now_ns=T0 + 5 * S)
    assert cooled is None and d.reason.startswith("cooldown")
    other, _ = after.decide(_rec(knob="dataloader.prefetch_factor", to_value=4), now_ns=T0)
    assert other is not None and other.seq > cmd.seq
    # a kept verdict read back after the command ends the cooldown, as it would have
    assert after.observe_verdict(_verdict(cmd, "kept"))
    assert after.decide(_rec(to_value=3), now_ns=T0 + 6 * S)[0] is not None


@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_an_approval_replayed_after_a_restart_is_refused_by_what_was_decided(
    verdict: str,
) -> None:
    """The actuator's memory of the approvals it took is gone after a restart, but its recall
    reads back the decisions (`observe_decision`): an approval sent again is refused."""
    before = _policy(tier="approve", min_gain_pct=50)
    rec = _rec(expected_gain_pct=10)
    assert before.decide(rec, now_ns=T0)[1].outcome == "pending"
    taken = _approval(rec, verdict)
    _, decided = before.approve(taken, now_ns=T0 + S)
    assert decided.outcome == ("issued" if verdict == "approve" else "rejected")
    after = _policy(tier="approve", min_gain_pct=50)
    after.observe_decision(decided)  # read back by the recall
    cmd, d = after.approve(taken, now_ns=T0 + 2 * S)
    assert cmd is None and d.outcome == "refused" and d.reason.startswith("already ")


def test_its_own_command_read_back_after_a_kept_verdict_starts_no_cooldown() -> None:
    policy = _policy(cooldown_s=30)
    cmd, _ = policy.decide(_rec(to_value=2), now_ns=T0)
    assert cmd is not None
    policy.observe_command(cmd)  # its own, back from the control topic
    assert policy.observe_verdict(_verdict(cmd, "kept"))
    policy.observe_command(cmd)  # read once more (a recall): the verdict still stands
    assert policy.decide(_rec(to_value=3), now_ns=T0 + 6 * S)[0] is not None


def test_decisions_read_back_hold_dry_runs_rejections_and_hook_runs() -> None:
    from perfloop.schemas import Decision

    def decision(rec: Recommendation, outcome: str, **kw: Any) -> Decision:
        return Decision(
            ts_ns=T0, job_id=rec.job_id, node="n0", rank=-1, rec_id=rec.event_id,
            knob=rec.knob, from_value=rec.from_value, to_value=rec.to_value, tier="auto",
            outcome=outcome, reason="before", actor="actuator", **kw,
        )  # fmt: skip

    policy = Policy(JobRules(tier="auto", min_gain_pct=0), ttl_s=60, action_hook=True)
    dry, hooked = _rec(), _rec(knob="cluster.drain_node", from_value="", to_value="node-7")
    policy.observe_decision(decision(dry, "dry_run"))
    policy.observe_decision(decision(hooked, "issued"))
    policy.observe_decision(decision(_rec(), "refused"))  # not acted on: nothing to hold
    assert policy.decide(dry, now_ns=T0 + S)[1].reason == "already decided before (dry_run)"
    assert policy.decide(hooked, now_ns=T0 + S)[1].reason.startswith("already acted on")
    again = _rec(knob="cluster.drain_node", from_value="", to_value="node-7")
    cmd, d = policy.decide(again, now_ns=T0 + S)
    assert cmd is None and d.reason == "the action hook already ran for node node-7 of this job"
