"""The actuator's decisions about jobs that ended, about the straggler's node (a hook knob the
actuator acts on itself) and about what a user pinned: refused with the reason, governed by the
tier, at most once per job and node, and rate-limited over every job."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.actuators import JobRules, Policy, sign
from perfloop.actuators.policy import NO_HOOK
from perfloop.exceptions import ConfigError
from perfloop.schemas import Approval, ConfigChange, JobInfo, JobLifecycle, Recommendation
from tests.helpers import recommendation

S = 1_000_000_000
T0 = 1_700_000_000 * S
KEY = b"k"
DRAIN = "cluster.drain_node"


def _policy(hook: bool = True, **rules: Any) -> Policy:
    return Policy(JobRules(**rules), ttl_s=60, approval_ttl_s=900, keys={"default": KEY},
                  action_hook=hook, hook_max_per_hour=3, ended_retention_s=300)  # fmt: skip


def _straggler(job: str = "job-1", node: str = "n3", **kw: Any) -> Recommendation:
    fields: dict[str, Any] = dict(
        job_id=job, knob=DRAIN, from_value="", to_value=node, loop="slow",
        rationale=f"rank 1 on host {node} is 40 ms late to every all-reduce",
        evidence={"rank": 1.0, "lateness_ms": 40.0, "score": 6.2, "steps": 120.0},
    )  # fmt: skip
    return recommendation(**(fields | kw))


def _approve(rec: Recommendation, verdict: str = "approve") -> Approval:
    appr = Approval(
        ts_ns=T0 + S, job_id=rec.job_id, node="cli", rank=-1, rec_id=rec.event_id,
        verdict=verdict, author="ana@host", knob=rec.knob, from_value=None,
        to_value=rec.to_value, loop=rec.loop, rec_ts_ns=rec.ts_ns,
    )  # fmt: skip
    return sign(appr, KEY)


def _change(key: str, value: Any, job: str = "job-1") -> ConfigChange:
    return ConfigChange(ts_ns=T0, job_id=job, node="cli", rank=-1, target="actuator",
                        applies_to=job, key=key, value=value)  # fmt: skip


def _end(job: str = "job-1", state: str = "finished", rank: int = -1) -> JobLifecycle:
    return JobLifecycle(ts_ns=T0, job_id=job, node="n0", rank=rank, state=state, exit_code=0)


# -- jobs that ended ------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["finished", "failed", "killed"])
def test_a_job_that_ended_gets_nothing_more(state: str) -> None:
    p = _policy(tier="auto")
    p.observe_lifecycle(_end(state=state), now_ns=T0)
    cmd, d = p.decide(recommendation(), now_ns=T0 + S)
    assert cmd is None and d.outcome == "refused"
    assert d.reason == f"job ended ({state}, exit code 0)"
    assert p.decide(recommendation(job_id="job-2"), now_ns=T0 + S)[0] is not None


def test_an_approval_for_a_job_that_ended_is_refused() -> None:
    p = _policy(tier="approve")
    rec = recommendation()
    p.decide(rec, now_ns=T0)
    p.observe_lifecycle(_end(), now_ns=T0 + S)
    cmd, d = p.approve(_approve(rec), now_ns=T0 + 2 * S)
    assert cmd is None and d.outcome == "refused" and d.reason.startswith("job ended")


def test_a_rank_finishing_is_not_the_job_ending_and_a_restart_takes_recommendations() -> None:
    p = _policy(tier="auto")
    p.observe_lifecycle(_end(rank=0), now_ns=T0)
    assert p.ended("job-1") == ""
    p.observe_lifecycle(_end(), now_ns=T0)
    assert p.ended("job-1").startswith("job ended")
    restart = JobLifecycle(ts_ns=T0 + S, job_id="job-1", node="n0", rank=-1, state="started")
    p.observe_lifecycle(restart, now_ns=T0 + S)
    assert p.ended("job-1") == ""
    assert p.decide(recommendation(), now_ns=T0 + 2 * S)[1].outcome == "issued"


def test_an_ended_jobs_state_is_freed_after_the_retention_and_it_stays_ended() -> None:
    p = _policy(tier="auto", cooldown_s=3600)
    p.configure(_change("actuator.tier", "auto"))
    p.observe_info(JobInfo(ts_ns=T0, job_id="job-1", node="n0", rank=0,
                           extra={"bounds.dataloader.num_workers": "0,8"}))  # fmt: skip
    assert p.decide(recommendation(), now_ns=T0)[1].outcome == "issued"
    assert p.decide(_straggler(), now_ns=T0)[1].outcome == "issued"
    p.observe_lifecycle(_end(), now_ns=T0 + S)
    assert p.sweep(T0 + 100 * S) == [], "not yet"
    assert p.sweep(T0 + 302 * S) == ["job-1"]
    assert "job-1" not in p.job_bounds and "job-1" not in p._seq
    assert not any(k[0] == "job-1" for k in [*p._last_change, *p._hook_done])
    assert p.sweep(T0 + 400 * S) == []
    assert p.decide(recommendation(), now_ns=T0 + 400 * S)[1].reason.startswith("job ended")
    assert p.rules("job-1").tier == "auto", "what the user set for the job stays"


# -- the straggler's node: the action hook --------------------------------------------------


@pytest.mark.parametrize(
    ("tier", "outcome", "said"),
    [
        ("observe", "observed", "tier observe: recorded"),
        ("recommend", "recommended", "tier recommend: shown, not applied"),
        ("approve", "pending", "then the action hook runs"),
        ("auto", "issued", "action hook for cluster.drain_node = n3"),
    ],
)
def test_the_tier_governs_the_hook(tier: str, outcome: str, said: str) -> None:
    cmd, d = _policy(tier=tier).decide(_straggler(), now_ns=T0)
    assert (d.outcome, d.knob, d.to_value, d.loop) == (outcome, DRAIN, "n3", "slow")
    assert said in d.reason
    assert (cmd is not None) == (tier == "auto")
    if cmd is not None:
        assert (cmd.knob, cmd.value, cmd.rec_id) == (DRAIN, "n3", d.rec_id)


@pytest.mark.parametrize("tier", ["recommend", "approve", "auto"])
def test_without_a_hook_the_recommendation_is_recorded_with_the_reason(tier: str) -> None:
    cmd, d = _policy(hook=False, tier=tier).decide(_straggler(), now_ns=T0)
    assert cmd is None and (d.outcome, d.reason) == ("recommended", NO_HOOK)
    assert NO_HOOK == "no action hook configured (PERFLOOP_STRAGGLER_HOOK)"


def test_an_approved_straggler_runs_the_hook_once() -> None:
    p = _policy(tier="approve")
    rec = _straggler()
    p.decide(rec, now_ns=T0)
    cmd, d = p.approve(_approve(rec), now_ns=T0 + S)
    assert cmd is not None and (d.outcome, d.actor) == ("issued", "ana@host")
    assert p.approve(_approve(rec), now_ns=T0 + 2 * S)[1].reason.startswith("already")


def test_the_hook_runs_at_most_once_per_job_and_node() -> None:
    p = _policy(tier="auto")
    assert p.decide(_straggler(), now_ns=T0)[0] is not None
    cmd, d = p.decide(_straggler(), now_ns=T0 + 3600 * S)
    assert cmd is None and d.reason == "the action hook already ran for node n3 of this job"
    assert p.decide(_straggler(node="n4"), now_ns=T0 + S)[0] is not None
    assert p.decide(_straggler(job="job-2"), now_ns=T0 + S)[0] is not None


def test_the_hook_is_rate_limited_over_every_job() -> None:
    p = _policy(tier="auto")  # 3 an hour
    for i in range(3):
        assert p.decide(_straggler(job=f"job-{i}"), now_ns=T0 + i * S)[0] is not None
    cmd, d = p.decide(_straggler(job="job-9"), now_ns=T0 + 10 * S)
    assert cmd is None and d.reason.startswith("rate limit: the action hook ran 3 times")
    assert p.decide(_straggler(job="job-9"), now_ns=T0 + 3601 * S)[0] is not None


def test_in_dry_run_the_hook_does_not_run_and_may_run_later() -> None:
    p = _policy(tier="auto", dry_run=True)
    cmd, d = p.decide(_straggler(), now_ns=T0)
    assert cmd is None and d.outcome == "dry_run" and "would run the action hook" in d.reason
    p.configure(_change("actuator.dry_run", False))
    assert p.decide(_straggler(), now_ns=T0 + S)[0] is not None


@pytest.mark.parametrize("node", ["--all", "n3 n4", "", "a" * 300, 5])
def test_a_node_that_is_not_a_host_name_is_refused(node: Any) -> None:
    cmd, d = _policy(tier="auto").decide(_straggler(node=node), now_ns=T0)
    assert cmd is None and d.outcome == "refused" and "is not a node name" in d.reason


def test_the_hook_cannot_be_configured_live() -> None:
    with pytest.raises(ConfigError, match="unknown actuator setting"):
        JobRules().with_setting("actuator.straggler_hook", "rm -rf {node}")


# -- pinned knobs ---------------------------------------------------------------------------


def test_a_pinned_knob_is_refused_in_every_tier_and_others_are_not() -> None:
    for tier in ("observe", "recommend", "approve", "auto"):
        p = _policy(tier=tier)
        p.configure(_change("actuator.pinned", '["torch.num_threads"]'))
        cmd, d = p.decide(recommendation(knob="torch.num_threads", to_value=2), now_ns=T0)
        assert cmd is None and d.outcome == "refused"
        assert d.reason == "torch.num_threads is pinned by the user (actuator.pinned)"
        assert p.decide(recommendation(), now_ns=T0)[1].outcome != "refused"


def test_a_pin_set_after_a_recommendation_refuses_its_approval() -> None:
    p = _policy(tier="approve")
    rec = recommendation()
    assert p.decide(rec, now_ns=T0)[1].outcome == "pending"
    p.configure(_change("actuator.pinned", "dataloader.num_workers"))
    cmd, d = p.approve(_approve(rec), now_ns=T0 + S)
    assert cmd is None and d.outcome == "refused" and "pinned by the user" in d.reason


@pytest.mark.parametrize(
    ("value", "pinned"),
    [
        ('["torch.num_threads", "dataloader.num_workers"]',
         ("dataloader.num_workers", "torch.num_threads")),
        (["torch.num_threads"], ("torch.num_threads",)),  # as the warehouse gives it back
        ("torch.num_threads,torch.num_threads", ("torch.num_threads",)),
        ("[]", ()),
        ("", ()),
    ],
)  # fmt: skip
def test_pins_are_read_from_json_or_commas(value: Any, pinned: tuple[str, ...]) -> None:
    assert JobRules().with_setting("actuator.pinned", value).pinned == pinned


@pytest.mark.parametrize("value", ['["threads"]', "torch.threads", '["a"', "[1]", 3])
def test_a_bad_pin_is_refused_naming_the_valid_knobs(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^actuator.pinned: ") as e:
        JobRules().with_setting("actuator.pinned", value)
    if "unknown knob" in str(e.value):
        assert "valid: cluster.drain_node, dataloader.num_workers" in str(e.value)
