"""The example approver's judgement and its approvals: what it approves unasked, and that
an approval it signs is one the actuator verifies, for the very change recommended."""

from __future__ import annotations

import pytest

from perfloop.actuators import verify
from perfloop.examples.approver import approval_for, worth
from perfloop.schemas import Recommendation, decode_event, encode_event


def _rec(gain: float, confidence: float) -> Recommendation:
    return Recommendation(
        ts_ns=1_800_000_000 * 10**9, job_id="j1", node="n0", rank=-1,
        knob="dataloader.num_workers", from_value=0, to_value=4, loop="fast",
        expected_gain_pct=gain, confidence=confidence, rationale="the loader starves the step",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("gain", "confidence", "why"),
    [
        (31.0, 0.82, ""),
        (10.0, 0.7, ""),
        (9.5, 0.99, "expected gain 10% < 10%"),
        (50.0, 0.5, "confidence 0.50 < 0.7"),
    ],
)
def test_only_a_large_enough_sure_enough_gain_is_approved_unasked(
    gain: float, confidence: float, why: str
) -> None:
    assert worth(_rec(gain, confidence), min_gain_pct=10, min_confidence=0.7) == why


def test_an_approval_carries_the_recommended_change_signed() -> None:
    rec = _rec(31.0, 0.82)
    appr = approval_for(rec, key=b"k1", key_id="default", author="approver@box", reason="r")
    assert (appr.rec_id, appr.job_id, appr.verdict) == (rec.event_id, "j1", "approve")
    assert (appr.knob, appr.from_value, appr.to_value, appr.loop, appr.rec_ts_ns) == (
        rec.knob, rec.from_value, rec.to_value, rec.loop, rec.ts_ns,
    )  # fmt: skip
    assert verify(appr, b"k1") and not verify(appr, b"other")
    assert verify(decode_event(encode_event(appr)), b"k1")  # as the actuator reads it
