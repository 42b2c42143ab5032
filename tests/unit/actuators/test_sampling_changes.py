"""A job's sampling changes (`perfloop config set sampling.*`, `perfloop.actuators.agent`):
with a roster, only a change a principal signed within their role is applied; every other is
refused with who it claimed to come from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perfloop.actuators.agent import Refused, apply_config
from perfloop.actuators.signing import sign
from perfloop.actuators.trust import Gate, signed_by
from perfloop.identity import PrivateKey, TrustedKey
from perfloop.roster import Principal, Role, owner_roster
from perfloop.schemas import ConfigChange, encode_event
from perfloop.settings import ProducerSettings

OWNER, ANA, MALLORY = PrivateKey.generate(), PrivateKey.generate(), PrivateKey.generate()


def _gate() -> Gate:
    roster = owner_roster(OWNER)
    roster.principals["ana"] = Principal("ana", (Role(("*",), ("actuator.*",), "auto"),))
    roster.keyring.keys[ANA.key_id] = TrustedKey.of(ANA.public_bytes(), "ana")
    return Gate(roster=roster)


def _change(value: Any = 250, job: str = "j1", **kw: Any) -> ConfigChange:
    return ConfigChange(
        ts_ns=1, job_id="ops" if job == "*" else job, node="cli", rank=-1, target="producers",
        key="sampling.host_interval_ms", value=value, applies_to=job, author="someone@host", **kw,
    )  # fmt: skip


def test_with_a_roster_only_a_principals_signed_change_within_their_role_applies() -> None:
    gate, applied = _gate(), []

    def handler(key: str, value: Any) -> tuple[Any, Any]:
        applied.append((key, value))
        return None, value

    good = signed_by(_change(), OWNER)
    assert apply_config(good, "j1", handler, gate) == (None, 250)
    bad = {
        "unsigned": (_change(), "unsigned: it carries no signature", "someone@host"),
        "wrong key": (signed_by(_change(), MALLORY), "is not in the keyring", "someone@host"),
        "out of role": (signed_by(_change(), ANA), "no role that sets sampling", "ana"),
        "replayed": (good, "replayed", "owner"),
        "tampered": (
            signed_by(_change(), OWNER).model_copy(update={"value": 10}),
            "does not verify",
            "owner",
        ),
        "shared key": (sign(_change(), b"shared"), "shared key", "someone@host"),
    }
    for case, (change, why, who) in bad.items():
        out = apply_config(change, "j1", handler, gate)
        assert isinstance(out, Refused) and why in out, (case, out)
        assert out.by == who, case
    assert applied == [("sampling.host_interval_ms", 250)]
    assert apply_config(_change(job="j2"), "j1", handler, gate) is None  # not this job's


def test_without_a_roster_a_change_is_taken_unsigned() -> None:
    assert apply_config(_change(), "j1", lambda k, v: (None, v)) == (None, 250)


def test_a_job_on_the_stacks_machine_finds_the_stacks_roster(tmp_path: Path) -> None:
    assert ProducerSettings(home=tmp_path).roster_path is None
    (tmp_path / "keys").mkdir()
    owner_roster(OWNER).save(tmp_path / "keys" / "roster.json")
    assert (
        ProducerSettings(home=tmp_path).roster_path == tmp_path.resolve() / "keys" / "roster.json"
    )
    own = tmp_path / "mine.json"
    assert ProducerSettings(home=tmp_path, roster=own).roster_path == own


def test_the_job_agent_puts_a_refused_change_on_record_once_per_job(tmp_path: Path) -> None:
    from perfloop.actuators import JobAgent
    from perfloop.schemas import Decision, decode_event

    (tmp_path / "keys").mkdir()
    owner_roster(OWNER).save(tmp_path / "keys" / "roster.json")
    sent: list[tuple[str, bytes]] = []

    class Producer:
        def produce(self, topic: str, key: bytes, value: bytes) -> None:
            sent.append((topic, value))

        def poll(self, _: float) -> int:
            return 0

    applied: list[Any] = []
    settings = ProducerSettings(home=tmp_path, PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1")
    agents = [
        JobAgent(
            settings,
            job_id="j1",
            node="n0",
            signing_key=b"k",
            handlers={},
            rank=rank,
            on_config=lambda k, v: (applied.append(v), (None, v))[1],
        )
        for rank in (0, 1)
    ]
    forged = _change(5, job="*")
    for agent in agents:
        agent._producer = Producer()
        reason = agent.receive(encode_event(forged))
        assert reason is not None and "unsigned" in reason
    assert applied == []
    decisions = [decode_event(v) for _, v in sent]
    assert {t for t, _ in sent} == {"perfloop.actuations"}
    assert all(isinstance(d, Decision) for d in decisions)
    # both ranks refuse it under one id: the sink keeps one row for the job
    assert {d.event_id for d in decisions} == {f"{forged.event_id}-j1"}
    d = decisions[0]
    assert (d.job_id, d.outcome, d.actor, d.knob) == ("j1", "refused", "someone@host",
                                                      "sampling.host_interval_ms")  # fmt: skip
    assert d.reason.startswith("config refused: by job j1: unsigned")
    assert agents[0].receive(encode_event(signed_by(_change(7, job="*"), OWNER))) is None
    assert applied == [7]
