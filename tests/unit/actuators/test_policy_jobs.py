"""The actuator's decisions about jobs that ended: refused with the reason, their state freed a
while later, a new start under the same id taken again."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.actuators import JobRules, Policy, sign
from perfloop.schemas import Approval, ConfigChange, JobInfo, JobLifecycle, Recommendation
from tests.helpers import recommendation

S = 1_000_000_000
T0 = 1_700_000_000 * S
KEY = b"k"


def _policy(**rules: Any) -> Policy:
    return Policy(JobRules(**rules), ttl_s=60, approval_ttl_s=900, keys={"default": KEY},
                  ended_retention_s=300)  # fmt: skip


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
    p.observe_lifecycle(_end(), now_ns=T0 + S)
    assert p.sweep(T0 + 100 * S) == [], "not yet"
    assert p.sweep(T0 + 302 * S) == ["job-1"]
    assert "job-1" not in p.job_bounds and "job-1" not in p._seq
    assert not any(k[0] == "job-1" for k in p._last_change)
    assert p.sweep(T0 + 400 * S) == []
    assert p.decide(recommendation(), now_ns=T0 + 400 * S)[1].reason.startswith("job ended")
    assert p.rules("job-1").tier == "auto", "what the user set for the job stays"
