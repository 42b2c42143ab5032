"""What the actuator trusts (`perfloop.actuators.trust`): recommendations signed by the stream
tier's key, approvals and settings signed by a roster principal within their role; unsigned,
wrong key, tampered, replayed, expired, revoked or out-of-role ones are refused with the reason
and the principal they claimed, and the service records each refusal as a `Decision` and
changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from perfloop.actuators import sign
from perfloop.actuators.service import ActuatorService
from perfloop.actuators.trust import Gate, refusal, signed_by
from perfloop.identity import Keyring, PrivateKey, TrustedKey
from perfloop.roster import Principal, Role, Roster
from perfloop.schemas import Approval, ConfigChange, Decision, Recommendation, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings

S = 1_000_000_000
NOW = 1_700_000_000 * S
KNOB = "dataloader.num_workers"
STREAMS, ANA, MALLORY = PrivateKey.generate(), PrivateKey.generate(), PrivateKey.generate()


def _rec(**kw: Any) -> Recommendation:
    fields: dict[str, Any] = dict(
        ts_ns=NOW, job_id="team-a/run-1", node="n0", rank=-1, knob=KNOB, from_value=2,
        to_value=5, loop="fast", expected_gain_pct=30, confidence=0.9, rationale="starved",
        expires_ts_ns=NOW + 60 * S,
    )  # fmt: skip
    return Recommendation(**(fields | kw))


def _approval(**kw: Any) -> Approval:
    fields: dict[str, Any] = dict(
        ts_ns=NOW, job_id="team-a/run-1", node="cli", rank=-1, rec_id="rec-1",
        verdict="approve", author="ana@laptop", knob=KNOB, from_value=2, to_value=5,
        rec_ts_ns=NOW, expires_ts_ns=NOW + 60 * S,
    )  # fmt: skip
    return Approval(**(fields | kw))


def _change(**kw: Any) -> ConfigChange:
    fields: dict[str, Any] = dict(
        ts_ns=NOW, job_id="team-a/run-1", node="cli", rank=-1, target="actuator",
        applies_to="team-a/run-1", key="actuator.tier", value="approve", author="ana@laptop",
        expires_ts_ns=NOW + 60 * S,
    )  # fmt: skip
    return ConfigChange(**(fields | kw))


def _roster(**key: Any) -> Roster:
    ana = Principal("ana", (Role(("team-a/*",), ("actuator.tier", "actuator.dry_run"), "approve"),))
    return Roster([ana], [TrustedKey.of(ANA.public_bytes(), "ana", **key)])


def _gate(**key: Any) -> Gate:
    return Gate(
        recommenders=Keyring([TrustedKey.of(STREAMS.public_bytes(), "streams", **key)]),
        roster=_roster(**key),
    )


def test_a_recommendation_signed_by_the_stream_tier_is_taken_once() -> None:
    gate = _gate()
    rec = sign(_rec(), STREAMS)
    assert gate.check(rec, now_ns=NOW) == ("streams", "")
    assert gate.check(rec, now_ns=NOW + 1) == (
        "streams", f"replayed: recommendation {rec.event_id} was taken before"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "claimed", "why"),
    [
        ("unsigned", "unknown", "unsigned: it carries no signature"),
        ("wrong key", "ed25519:", "is not in the keyring"),
        ("posing as the stream tier", "streams", "signature does not verify under key"),
        ("tampered", "streams", "signature does not verify under key"),
        ("expired", "streams", "expired: its expiry passed 1 s ago"),
        ("no expiry", "streams", "no expiry"),
        ("shared key", "unknown", "signed with a shared key"),
    ],
)
def test_a_bad_recommendation_is_refused_with_its_reason(case: str, claimed: str, why: str) -> None:
    rec = _rec()
    event = {
        "unsigned": rec,
        "wrong key": sign(rec, MALLORY),
        "posing as the stream tier": sign(rec, MALLORY).model_copy(
            update={"key_id": STREAMS.key_id}
        ),
        "tampered": sign(rec, STREAMS).model_copy(update={"to_value": 64}),
        "expired": sign(rec.model_copy(update={"expires_ts_ns": NOW - S}), STREAMS),
        "no expiry": sign(rec.model_copy(update={"expires_ts_ns": 0}), STREAMS),
        "shared key": sign(rec, b"the shared development key"),
    }[case]
    who, got = _gate().check(event, now_ns=NOW)
    assert who.startswith(claimed) and why in got, (who, got)


def test_a_revoked_or_retired_recommender_key_is_refused() -> None:
    revoked = Gate(recommenders=Keyring([TrustedKey(
        STREAMS.key_id, "streams", TrustedKey.of(STREAMS.public_bytes(), "s").public, None, True
    )]))  # fmt: skip
    assert revoked.check(sign(_rec(), STREAMS), now_ns=NOW)[1].endswith("is revoked")
    retired = _gate(not_after_ns=NOW - S)
    assert "is no longer trusted" in retired.check(sign(_rec(), STREAMS), now_ns=NOW)[1]


def test_a_principal_within_their_role_may_approve_and_set() -> None:
    gate = _gate()
    assert gate.check(sign(_approval(), ANA), now_ns=NOW) == ("ana", "")
    assert gate.check(sign(_change(), ANA), now_ns=NOW) == ("ana", "")
    lower = _change(value="observe", event_id="lower")
    assert gate.check(sign(lower, ANA), now_ns=NOW) == ("ana", "")


@pytest.mark.parametrize("kind", ["approval", "change"])
@pytest.mark.parametrize(
    ("case", "claimed", "why"),
    [
        ("unsigned", "ana@laptop", "unsigned: it carries no signature"),
        ("wrong key", "ana@laptop", "is not in the keyring"),
        ("shared key", "ana@laptop", "signed with a shared key"),
        ("tampered", "ana", "signature does not verify under key"),
        ("expired", "ana", "expired"),
        ("replayed", "ana", "replayed"),
        ("another job", "ana", "has no role that"),
    ],
)
def test_a_bad_approval_or_setting_is_refused_with_the_principal_it_claimed(
    kind: str, case: str, claimed: str, why: str
) -> None:
    gate = _gate()
    make = _approval if kind == "approval" else _change
    base = make()
    event = {
        "unsigned": base,
        "wrong key": sign(base, MALLORY),
        "shared key": sign(base, b"the shared development key"),
        "tampered": sign(base, ANA).model_copy(update={"job_id": "team-a/run-2"}),
        "expired": sign(base.model_copy(update={"expires_ts_ns": NOW - S}), ANA),
        "replayed": sign(base, ANA),
        "another job": sign(base.model_copy(update={"job_id": "team-b/run-9",
                                                    "applies_to": "team-b/run-9"}), ANA),
    }[case]  # fmt: skip
    if case == "replayed":
        assert gate.check(event, now_ns=NOW) == ("ana", "")
    who, got = gate.check(event, now_ns=NOW)
    assert (who, why in got) == (claimed, True), got


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (dict(value="auto"), "up to tier approve, not 'auto'"),
        (dict(key="actuator.min_gain_pct", value=0), "no role that sets actuator.min_gain_pct"),
        (dict(applies_to="*", job_id="ops"), "no role that sets actuator.tier of every job"),
    ],
)
def test_a_setting_out_of_role_is_refused(change: dict[str, Any], why: str) -> None:
    who, got = _gate().check(sign(_change(**change), ANA), now_ns=NOW)
    assert who == "ana" and why in got, got


def test_a_stored_setting_is_checked_for_its_signature_and_role_only() -> None:
    """At a start: long expired, seen before, still applied if its principal signed it within
    their role while their key was trusted; never when unsigned or revoked since."""
    gate = _gate()
    signed = sign(_change(), ANA)
    later = NOW + 3600 * S
    assert gate.check(signed, now_ns=later, stored=True) == ("ana", "")
    assert gate.check(signed, now_ns=later, stored=True) == ("ana", "")  # not a replay
    assert "unsigned" in gate.check(_change(), now_ns=later, stored=True)[1]
    retired = _gate(not_after_ns=NOW + S)  # retired after it signed: still counts
    assert retired.check(signed, now_ns=later, stored=True) == ("ana", "")
    revoked = Gate(roster=Roster(_roster().principals.values(), [TrustedKey(
        ANA.key_id, "ana", TrustedKey.of(ANA.public_bytes(), "ana").public, None, True
    )]))  # fmt: skip
    assert revoked.check(signed, now_ns=later, stored=True)[1].endswith("is revoked")


def test_without_keys_everything_goes_on_to_the_policy() -> None:
    gate = Gate()
    assert gate.check(_rec(), now_ns=NOW) == ("actuator", "")
    assert gate.check(_change(), now_ns=NOW) == ("ana@laptop", "")
    assert gate.check(_approval(), now_ns=NOW) == ("ana@laptop", "")  # the policy's HMAC


def test_a_refused_setting_is_a_decision_named_by_its_key() -> None:
    change = _change(value=[[1.0, 2.0]], key="actuator.curve")
    d = refusal(change, tier="auto", reason="no role", actor="mallory", now_ns=NOW)
    assert isinstance(d, Decision)
    assert (d.rec_id, d.knob, d.to_value, d.outcome, d.actor) == (
        change.event_id, "actuator.curve", "[[1.0, 2.0]]", "refused", "mallory"
    )  # fmt: skip
    assert d.reason == "config refused: no role"


def test_signed_by_gives_an_expiry_and_falls_back_to_the_shared_key() -> None:
    appr = signed_by(_approval(expires_ts_ns=0), ANA, ttl_s=60)
    assert appr.key_id == ANA.key_id and appr.expires_ts_ns > NOW
    assert _gate().check(appr, now_ns=appr.expires_ts_ns - S) == ("ana", "")
    shared = signed_by(_approval(), None, shared_key=b"k")
    assert shared.signature and not shared.signature.startswith("ed25519:")
    assert signed_by(_change(), None).signature == ""


# -- the service ------------------------------------------------------------------------------


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ActuatorService:
    for name in ("PERFLOOP_TIER", "PERFLOOP_SIGNING_KEY", "PERFLOOP_COOLDOWN_S"):
        monkeypatch.delenv(name, raising=False)
    ring, roster = tmp_path / "recommenders.json", tmp_path / "roster.json"
    Keyring([TrustedKey.of(STREAMS.public_bytes(), "streams")]).save(ring)
    _roster().save(roster)
    settings = ActuatorSettings(
        PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1", signing_key="k", tier="auto",
        recommendation_keyring=ring, roster=roster,
    )  # fmt: skip
    service = ActuatorService(settings)
    published: list[Any] = []
    monkeypatch.setattr(service, "_publish", lambda topic, ev: published.append(ev) or True)
    service.published = published  # type: ignore[attr-defined]
    return service


def _now(**kw: Any) -> dict[str, Any]:
    import time

    now = time.time_ns()
    return dict(ts_ns=now, expires_ts_ns=now + 60 * S) | kw


def test_the_service_refuses_and_records_what_it_does_not_trust(guarded: ActuatorService) -> None:
    published: list[Any] = guarded.published  # type: ignore[attr-defined]
    forged_tier = sign(_change(**_now(value="observe")), MALLORY)
    assert guarded.handle(encode_event(forged_tier), Topics.CONTROL) is None
    assert guarded.policy.rules("team-a/run-1").tier == "auto"
    assert guarded.handle(encode_event(_rec(**_now()))) is None  # unsigned: no command
    refused = [d for d in published if isinstance(d, Decision)]
    assert [(d.outcome, d.knob) for d in refused] == [("refused", "actuator.tier"),
                                                      ("refused", KNOB)]  # fmt: skip
    assert "is not in the keyring" in refused[0].reason and MALLORY.key_id in refused[0].reason
    assert refused[1].reason.startswith("recommendation refused: unsigned")

    # what a principal signed within role, and what the stream tier signed, go through
    tier = sign(_change(**_now(value="approve")), ANA)
    guarded.handle(encode_event(tier), Topics.CONTROL)
    assert guarded.policy.rules("team-a/run-1").tier == "approve"
    rec = sign(_rec(**_now()), STREAMS)
    guarded.handle(encode_event(rec))
    assert published[-1].outcome == "pending"
    appr = sign(_approval(**_now(rec_id=rec.event_id, rec_ts_ns=rec.ts_ns)), ANA)
    cmd = guarded.handle(encode_event(appr))
    assert cmd is not None and cmd.value == 5
    issued = published[-1]
    assert (issued.outcome, issued.actor) == ("issued", "ana: ana@laptop")
    # the same approval again: a replay, refused before the policy
    assert guarded.handle(encode_event(appr)) is None
    assert published[-1].outcome == "refused" and "replayed" in published[-1].reason


# -- the stored settings, applied again at a start -------------------------------------------


def _row(change: ConfigChange, text: str, inserted_ns: int) -> tuple[Any, ...]:
    """A ``config_changes`` row as `_stored`'s query returns it."""
    c = change
    return (c.ts_ns, c.event_id, c.job_id, c.node, c.applies_to, c.key, text, c.author,
            c.reason, c.expires_ts_ns, c.key_id, c.signature, inserted_ns)  # fmt: skip


def test_only_stored_settings_a_principal_signed_within_role_are_applied_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    import perfloop.warehouse
    from perfloop.actuators._stored import stored_settings

    good = sign(_change(), ANA)
    pins = sign(_change(key="actuator.dry_run", value="true", event_id="text"), ANA)
    forged = sign(_change(event_id="forged"), ANA).model_copy(update={"value": "auto"})
    rows = [
        _row(good, "approve", NOW),
        _row(pins, "true", NOW),  # signed as the text "true", read back as True
        _row(_change(value="auto", event_id="unsigned"), "auto", NOW),
        _row(sign(_change(value="auto", event_id="auto"), ANA), "auto", NOW),  # out of role
        _row(sign(_change(event_id="late"), ANA), "approve", NOW + 61 * S),  # after its expiry
        _row(forged, "auto", NOW),
    ]
    monkeypatch.setattr(perfloop.warehouse, "query",
                        lambda _s, _sql: SimpleNamespace(result_rows=rows))  # fmt: skip
    gate = _gate()
    kept = stored_settings(None, gate)
    assert [(c.event_id, c.value) for c in kept] == [(good.event_id, "approve"), ("text", "true")]
    # taken: the same change sent again is a replay
    assert "replayed" in gate.check(good.model_copy(update={"expires_ts_ns": NOW + 60 * S}),
                                    now_ns=NOW)[1]  # fmt: skip
    # without a roster, every stored setting goes to the policy (which checks its value)
    assert len(stored_settings(None, Gate())) == len(rows)
