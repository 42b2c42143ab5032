"""The data-wait rule: recommend more loader workers when input waits dominate, not too often."""

from __future__ import annotations

import pytest

from perfloop.models import expected_step_gain, loader_workers_needed
from perfloop.schemas import Recommendation, decode_event, encode_event
from perfloop.streams.rules import KNOB_NUM_WORKERS, DataWaitRule
from perfloop.streams.windows import NS, WindowRow

WINDOW_S = 10


def _row(
    share: float,
    *,
    window: int = 0,
    job: str = "j",
    rank: int = 0,
    metric: str = "data_wait_share",
) -> WindowRow:
    start = window * WINDOW_S * NS
    return WindowRow(
        job_id=job,
        node="n0",
        rank=rank,
        metric=metric,
        ts_ns=start,
        window_end_ns=start + WINDOW_S * NS,
        window_s=float(WINDOW_S),
        count=50,
        mean=share,
        min=share,
        max=share,
        p50=share,
        p95=share,
        p99=share,
        rate_per_s=5.0,
        slope_per_s=0.0,
    )


def _rule(cooldown_s: float = 30, max_workers: int = 16) -> DataWaitRule:
    rule = DataWaitRule(threshold=0.3, cooldown_s=cooldown_s, max_workers=max_workers)
    rule.observe_workers("j", 2)
    rule.observe_workers("k", 2)
    return rule


def test_share_below_threshold_recommends_nothing() -> None:
    assert _rule().evaluate([_row(0.29), _row(0.1, rank=1)]) == []


def test_share_above_threshold_recommends_the_modelled_target() -> None:
    (rec,) = _rule().evaluate([_row(0.5)])
    target = loader_workers_needed(0.5, 2, max_workers=16)
    assert isinstance(rec, Recommendation)
    assert (rec.job_id, rec.knob, rec.from_value, rec.to_value) == (
        "j",
        KNOB_NUM_WORKERS,
        2,
        target,
    )
    assert rec.expected_gain_pct == round(100 * expected_step_gain(0.5, 2, target), 2)
    assert rec.loop == "fast"
    assert rec.rank == -1
    assert rec.ts_ns == WINDOW_S * NS, "stamped with the window's end (event time)"
    assert 0 <= rec.confidence <= 1
    assert rec.evidence["data_wait_share"] == 0.5
    assert decode_event(encode_event(rec)) == rec


def test_share_is_the_job_wide_mean_across_ranks() -> None:
    # Mean 0.25: one starved rank alone does not trigger the rule.
    assert _rule().evaluate([_row(0.45, rank=0), _row(0.05, rank=1)]) == []
    (rec,) = _rule().evaluate([_row(0.6, rank=0), _row(0.2, rank=1)])
    assert rec.evidence["data_wait_share"] == 0.4
    assert rec.evidence["ranks"] == 2.0
    assert rec.to_value == loader_workers_needed(0.4, 2, max_workers=16)


def test_other_metrics_are_ignored() -> None:
    assert _rule().evaluate([_row(0.9, metric="step_time_ms")]) == []


def test_cooldown_holds_back_repeats_for_the_same_job() -> None:
    rule = _rule(cooldown_s=30)
    assert len(rule.evaluate([_row(0.5, window=0)])) == 1
    assert rule.evaluate([_row(0.5, window=1)]) == []
    assert rule.evaluate([_row(0.5, window=2)]) == []
    assert len(rule.evaluate([_row(0.5, window=3)])) == 1, "30 s after the last one"


def test_cooldown_applies_within_one_evaluation() -> None:
    rule = _rule(cooldown_s=30)
    recs = rule.evaluate([_row(0.5, window=w) for w in (2, 0, 1)])
    assert [r.ts_ns for r in recs] == [WINDOW_S * NS]


def test_jobs_are_independent() -> None:
    rule = _rule(cooldown_s=30)
    recs = rule.evaluate([_row(0.5, job="j"), _row(0.5, job="k")])
    assert sorted(r.job_id for r in recs) == ["j", "k"]
    rule.observe_workers("k", 4)
    # j is cooling down; k is not held back by j's cooldown once its own has passed.
    assert rule.evaluate([_row(0.5, window=1, job="j")]) == []
    assert [r.job_id for r in rule.evaluate([_row(0.6, window=3, job="k")])] == ["k"]


def test_no_recommendation_when_already_at_the_worker_cap() -> None:
    rule = _rule(max_workers=2)
    assert rule.evaluate([_row(0.8)]) == []
    # Nothing was issued, so nothing cools down: a raised cap acts on the next window.
    rule.max_workers = 16
    assert len(rule.evaluate([_row(0.8, window=1)])) == 1


def test_target_respects_the_worker_cap() -> None:
    (rec,) = _rule(max_workers=4).evaluate([_row(0.9)])
    assert rec.to_value == 4


@pytest.mark.parametrize("share", [0.95, 0.99, 1.0])
def test_saturated_share_still_yields_a_valid_recommendation(share: float) -> None:
    (rec,) = _rule(max_workers=64).evaluate([_row(share)])
    assert rec.to_value == loader_workers_needed(0.95, 2, max_workers=64)


def test_unknown_worker_count_counts_as_zero() -> None:
    rule = DataWaitRule(threshold=0.3, cooldown_s=0, max_workers=16)
    (rec,) = rule.evaluate([_row(0.5)])
    assert rec.from_value == 0
    assert rec.to_value == loader_workers_needed(0.5, 0, max_workers=16)


def test_new_worker_count_moves_the_next_target() -> None:
    rule = _rule(cooldown_s=0)
    (first,) = rule.evaluate([_row(0.5)])
    rule.observe_workers("j", int(first.to_value))
    (second,) = rule.evaluate([_row(0.5, window=1)])
    assert second.from_value == first.to_value
    assert int(second.to_value) > int(first.to_value)
