"""The data-wait rule: only an unexplained, critical-path starvation diagnosis recommends more
loader workers, with the modelled target, not more often than the cooldown allows."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.exceptions import ConfigError
from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Diagnosis, Recommendation, decode_event, encode_event
from perfloop.streams.rules import KNOB_NUM_WORKERS, DataWaitRule

NS = 1_000_000_000


def _diag(
    share: float,
    *,
    t_s: float = 10.0,
    job: str = "j",
    bottleneck: str = "dataloader_starvation",
    critical: bool = True,
    explained_by: str = "",
    state: str = "open",
) -> Diagnosis:
    return Diagnosis(
        ts_ns=int(t_s * NS),
        job_id=job,
        node="n0",
        rank=-1,
        diagnosis_id=f"d-{job}-{t_s}",
        bottleneck=bottleneck,
        level="host",
        loop="training",
        state=state,
        onset_ns=int((t_s - 1) * NS),
        step_share=share,
        confidence=0.9,
        critical_path=critical,
        explained_by=explained_by,
        ranks=[0, 1],
        evidence={"data_wait_share": share, "step_time_ms": 200.0},
    )


def _rule(cooldown_s: float = 30, max_workers: int = 16) -> DataWaitRule:
    rule = DataWaitRule(threshold=0.3, cooldown_s=cooldown_s, max_workers=max_workers)
    rule.observe_workers("j", 2)
    rule.observe_workers("k", 2)
    return rule


def _eval(rule: DataWaitRule, *diags: Diagnosis) -> list[Recommendation]:
    return rule.evaluate(diags, now_ns=max(d.ts_ns for d in diags))


def test_share_below_threshold_recommends_nothing() -> None:
    assert _eval(_rule(), _diag(0.29)) == []


def test_starvation_recommends_the_modelled_target() -> None:
    (rec,) = _eval(_rule(), _diag(0.5))
    target = loader_workers_needed(0.5, 2, max_workers=16)
    assert (rec.job_id, rec.knob, rec.from_value, rec.to_value) == (
        "j",
        KNOB_NUM_WORKERS,
        2,
        target,
    )
    assert rec.expected_gain_pct == round(100 * expected_step_gain(0.5, 2, target), 2)
    assert (rec.loop, rec.rank, rec.ts_ns, rec.confidence) == ("fast", -1, 10 * NS, 0.9)
    assert rec.evidence["data_wait_share"] == 0.5 and rec.evidence["step_time_ms"] == 200.0
    assert "d-j-10.0" in rec.rationale
    assert decode_event(encode_event(rec)) == rec


@pytest.mark.parametrize(
    "diag",
    [
        _diag(0.6, critical=False),
        _diag(0.6, explained_by="hang"),
        _diag(0.6, state="resolved"),
        _diag(0.6, bottleneck="straggler"),
    ],
    ids=["off the critical path", "explained by a higher level", "resolved", "another kind"],
)
def test_only_an_actionable_starvation_acts(diag: Diagnosis) -> None:
    assert _eval(_rule(), diag) == []


def test_updates_act_like_opens() -> None:
    assert len(_eval(_rule(), _diag(0.5, state="update"))) == 1


def test_cooldown_holds_back_repeats_for_the_same_job() -> None:
    rule = _rule(cooldown_s=30)
    assert len(_eval(rule, _diag(0.5, t_s=10))) == 1
    assert _eval(rule, _diag(0.5, t_s=20)) == []
    assert len(_eval(rule, _diag(0.5, t_s=40))) == 1, "30 s after the last one"


def test_jobs_are_independent() -> None:
    rule = _rule(cooldown_s=30)
    recs = _eval(rule, _diag(0.5, job="j"), _diag(0.5, job="k"))
    assert sorted(r.job_id for r in recs) == ["j", "k"]


def test_no_recommendation_at_the_worker_cap_and_nothing_cools_down() -> None:
    rule = _rule(max_workers=2)
    assert _eval(rule, _diag(0.8)) == []
    rule.max_workers = 16
    assert len(_eval(rule, _diag(0.8, t_s=11))) == 1


@pytest.mark.parametrize("share", [0.95, 0.99, 1.0])
def test_saturated_share_still_yields_a_valid_recommendation(share: float) -> None:
    (rec,) = _eval(_rule(max_workers=64), _diag(share))
    assert rec.to_value == loader_workers_needed(0.95, 2, max_workers=64)


def test_new_worker_count_moves_the_next_target() -> None:
    rule = _rule(cooldown_s=0)
    (first,) = _eval(rule, _diag(0.5))
    rule.observe_workers("j", int(first.to_value))
    (second,) = _eval(rule, _diag(0.5, t_s=11))
    assert second.from_value == first.to_value and int(second.to_value) > int(first.to_value)


def test_configure_and_snapshot() -> None:
    rule = _rule()
    assert rule.configure("rules.data_wait_share_threshold", 0.6) == (0.3, 0.6)
    assert _eval(rule, _diag(0.5)) == []
    with pytest.raises(ConfigError, match="valid"):
        rule.configure("rules.data_wait_share_threshold", 1.5)
    with pytest.raises(ConfigError, match="valid"):
        rule.configure("rules.nope", 1)
    again = DataWaitRule(threshold=0.3, cooldown_s=0, max_workers=16)
    again.restore(rule.snapshot())
    assert again.snapshot() == rule.snapshot()


# -- per-job bounds and what was learned ------------------------------------------------------
def _info(job: str = "j", *, cpus: int = 2, threads: int | None = 8, gpus: int = 0) -> Any:
    from perfloop.schemas import JobInfo

    extra = {"cpu_affinity": str(cpus)}
    if threads is not None:
        extra["torch.num_threads"] = str(threads)
    return JobInfo(ts_ns=NS, job_id=job, node="n0", rank=0, cpu_count=64, gpu_count=gpus,
                   extra=extra)  # fmt: skip


def _verdict(status: str, before: float, after: float, command_id: str = "c1") -> Any:
    from perfloop.schemas import ActuationResult

    return ActuationResult(ts_ns=NS, job_id="other", node="n0", rank=0, command_id=command_id,
                           status=status, knob=KNOB_NUM_WORKERS, value=3,
                           evidence={"before_ms": before, "after_ms": after})  # fmt: skip


def test_a_jobs_workers_stay_within_its_cpus_less_one() -> None:
    rule = _rule(max_workers=64)
    rule.observe_info(_info(cpus=4))
    (rec,) = _eval(rule, _diag(0.8))
    assert rec.to_value == 3 and "at most 3" in rec.rationale


def test_no_workers_to_one_is_worth_the_whole_wait() -> None:
    rule = _rule()
    rule.observe_workers("j", 0)
    rule.observe_info(_info(cpus=2))
    (rec,) = _eval(rule, _diag(0.45))
    assert (rec.from_value, rec.to_value) == (0, 1)
    assert rec.expected_gain_pct == pytest.approx(45.0)


def test_outcomes_of_similar_changes_replace_the_prior_gain() -> None:
    from perfloop.streams.outcomes import Outcomes

    outcomes = Outcomes()
    outcomes.expect("c1", 2, 3)
    outcomes.observe(_verdict("kept", 100.0, 90.0))  # another job: 2 -> 3 workers, 10 % faster
    rule = DataWaitRule(threshold=0.3, cooldown_s=30, max_workers=16, outcomes=outcomes)
    rule.observe_workers("j", 2)
    (rec,) = _eval(rule, _diag(0.5))
    prior = 100 * expected_step_gain(0.5, 2, rec.to_value)
    assert rec.expected_gain_pct == pytest.approx((prior + 10.0) / 2, abs=0.01)
    assert "1 similar change kept of 1, measured gain 10%" in rec.rationale


def test_a_change_rolled_back_repeatedly_and_never_kept_is_not_recommended() -> None:
    from perfloop.streams.outcomes import Outcomes

    outcomes = Outcomes(min_failures=2)
    for i in range(2):
        outcomes.expect(f"c{i}", 2, 5)
        outcomes.observe(_verdict("rolled_back", 100.0, 130.0, command_id=f"c{i}"))
    rule = DataWaitRule(threshold=0.3, cooldown_s=0, max_workers=16, outcomes=outcomes)
    rule.observe_workers("j", 2)
    assert _eval(rule, _diag(0.5)) == []
    rule.observe_workers("j", 1)  # a different kind of change? no: still "up"
    assert _eval(rule, _diag(0.5, t_s=20)) == []
