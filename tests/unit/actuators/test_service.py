"""The actuator policy: which recommendations become commands, and with what guarantees."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from perfloop.actuators import KNOB_BOUNDS, ActuatorService, Policy, verify
from perfloop.schemas import Command, Recommendation, encode_event
from perfloop.settings import ActuatorSettings

KNOB = "dataloader.num_workers"
S = 1_000_000_000
T0 = 1_700_000_000 * S


def _rec(**kw: Any) -> Recommendation:
    fields: dict[str, Any] = dict(
        ts_ns=T0,
        job_id="job-1",
        node="n0",
        rank=-1,
        knob=KNOB,
        from_value=2,
        to_value=5,
        loop="fast",
        expected_gain_pct=40.0,
        confidence=0.9,
        rationale="waits for input",
    )
    return Recommendation(**(fields | kw))


def _policy(tier: str = "auto", cooldown_s: float = 30, ttl_s: float = 60) -> Policy:
    return Policy(tier=tier, cooldown_s=cooldown_s, ttl_s=ttl_s)


def test_auto_tier_issues_a_command_that_carries_the_recommendation() -> None:
    rec = _rec()
    cmd, why = _policy(ttl_s=60).decide(rec, now_ns=T0)
    assert why == "issued"
    assert isinstance(cmd, Command)
    assert (cmd.job_id, cmd.node, cmd.knob, cmd.from_value, cmd.value) == (
        "job-1",
        "n0",
        KNOB,
        2,
        5,
    )
    assert cmd.rec_id == rec.event_id
    assert cmd.loop == "fast"
    assert cmd.rank == -1
    assert cmd.ts_ns == T0
    assert cmd.expires_ts_ns == T0 + 60 * S
    assert cmd.seq >= 1
    assert cmd.signature == "", "the service signs; the policy only decides"


@pytest.mark.parametrize("tier", ["observe", "recommend", "approve"])
def test_non_auto_tiers_issue_nothing(tier: str) -> None:
    cmd, why = _policy(tier).decide(_rec(), now_ns=T0)
    assert cmd is None
    assert tier in why


@pytest.mark.parametrize("tier", ["Auto", "observe ", "manual"])
def test_unknown_tier_issues_nothing(tier: str) -> None:
    try:
        policy = _policy(tier)
    except ValueError:
        return
    cmd, _ = policy.decide(_rec(), now_ns=T0)
    assert cmd is None


def test_unknown_knob_is_refused_with_the_allowed_ones() -> None:
    cmd, why = _policy().decide(_rec(knob="optimizer.lr", to_value=0.1), now_ns=T0)
    assert cmd is None
    assert "'optimizer.lr'" in why and KNOB in why


@pytest.mark.parametrize("to_value", [KNOB_BOUNDS[KNOB][1] + 1, -1, 1e9])
def test_out_of_bounds_target_is_refused(to_value: float) -> None:
    cmd, why = _policy().decide(_rec(to_value=to_value), now_ns=T0)
    assert cmd is None
    assert "outside" in why


@pytest.mark.parametrize("to_value", list(KNOB_BOUNDS[KNOB]))
def test_bounds_are_inclusive(to_value: float) -> None:
    cmd, _ = _policy().decide(_rec(to_value=to_value), now_ns=T0)
    assert cmd is not None and cmd.value == to_value


@pytest.mark.parametrize("to_value", ["8", True, False])
def test_non_numeric_target_is_refused(to_value: Any) -> None:
    cmd, why = _policy().decide(_rec(to_value=to_value), now_ns=T0)
    assert cmd is None
    assert "not a number" in why


def test_cooldown_is_per_job_and_knob() -> None:
    policy = _policy(cooldown_s=30)
    assert policy.decide(_rec(), now_ns=T0)[0] is not None
    cmd, why = policy.decide(_rec(to_value=6), now_ns=T0 + 10 * S)
    assert cmd is None and why.startswith("cooldown")
    assert policy.decide(_rec(job_id="job-2"), now_ns=T0 + 10 * S)[0] is not None
    assert policy.decide(_rec(to_value=6), now_ns=T0 + 30 * S)[0] is not None


def test_refused_recommendation_does_not_start_a_cooldown() -> None:
    policy = _policy(cooldown_s=30)
    assert policy.decide(_rec(to_value=999), now_ns=T0)[0] is None
    assert policy.decide(_rec(), now_ns=T0 + S)[0] is not None


def test_sequence_increases_per_job() -> None:
    policy = _policy(cooldown_s=0)
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


@pytest.fixture
def unreachable_settings(monkeypatch: pytest.MonkeyPatch) -> ActuatorSettings:
    for name in ("PERFLOOP_TIER", "PERFLOOP_SIGNING_KEY", "PERFLOOP_COOLDOWN_S"):
        monkeypatch.delenv(name, raising=False)
    return ActuatorSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1", signing_key="k", tier="auto")


def test_service_signs_the_commands_it_issues(unreachable_settings: ActuatorSettings) -> None:
    service = ActuatorService(unreachable_settings)
    cmd = service.handle(encode_event(_rec()))
    assert cmd is not None
    assert verify(cmd, b"k")
    assert service.issued == 1


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        b"{}",
        orjson.dumps({"kind": "recommendation", "job_id": "j"}),
    ],
)
def test_service_ignores_unreadable_recommendations(
    unreachable_settings: ActuatorSettings, data: bytes
) -> None:
    service = ActuatorService(unreachable_settings)
    assert service.handle(data) is None
    assert service.issued == 0


def test_service_ignores_other_event_kinds(unreachable_settings: ActuatorSettings) -> None:
    service = ActuatorService(unreachable_settings)
    cmd = Command(
        ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob=KNOB, value=3, expires_ts_ns=2
    )
    assert service.handle(encode_event(cmd)) is None
    assert service.issued == 0
