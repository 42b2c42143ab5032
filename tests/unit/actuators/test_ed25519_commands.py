"""Commands signed with the actuator's Ed25519 key, checked by jobs that hold only its public
key (`perfloop.identity`, `perfloop.actuators.signing`): any change to a signed command, a key
not in the keyring, a revoked key or one past its overlap is refused; and a job's host, holding
only what a job holds, can sign nothing a job accepts."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.actuators import JobAgent, sign
from perfloop.actuators.signing import check_signature
from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, KeyringFile, PrivateKey, TrustedKey
from perfloop.schemas import Command, decode_event, encode_event
from perfloop.settings import BaseServiceSettings, ProducerSettings

S = 1_000_000_000
NOW = 1_700_000_000 * S
KNOB = "dataloader.num_workers"
ACTUATOR = PrivateKey.generate()


def _command(**kw: Any) -> Command:
    fields: dict[str, Any] = dict(
        ts_ns=NOW, job_id="job-1", node="n0", rank=-1, rec_id="rec-1", seq=17, knob=KNOB,
        from_value=2, value=5, expires_ts_ns=NOW + 60 * S,
    )  # fmt: skip
    return Command(**(fields | kw))


def _ring(*keys: PrivateKey, **kw: Any) -> Keyring:
    return Keyring([TrustedKey.of(k.public_bytes(), "actuator", **kw) for k in keys])


def test_a_signed_command_verifies_after_the_wire_and_names_its_key() -> None:
    signed = decode_event(encode_event(sign(_command(), ACTUATOR)))
    assert isinstance(signed, Command)
    assert signed.key_id == ACTUATOR.key_id and signed.signature.startswith("ed25519:")
    assert check_signature(signed, key=None, keyring=_ring(ACTUATOR), now_ns=NOW) == ""


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(
        ["ts_ns", "job_id", "node", "rec_id", "seq", "knob", "value", "expires_ts_ns", "key_id"]
    ),
    salt=st.integers(1, 10**6),
)
def test_any_change_to_a_signed_command_is_refused(field: str, salt: int) -> None:
    signed = sign(_command(), ACTUATOR)
    old = getattr(signed, field)
    new = old + salt if isinstance(old, int) else f"{old}-{salt}"
    tampered = signed.model_copy(update={field: new})
    why = check_signature(tampered, key=None, keyring=_ring(ACTUATOR), now_ns=NOW)
    assert why, f"{field} changed and still trusted"


def test_what_a_job_host_can_sign_is_refused_by_every_job() -> None:
    """A job's host holds its settings (the shared signing key among them) and the actuator's
    public key. Whatever it signs with them, or with a key it makes, no job with the keyring
    accepts — for itself or another job."""
    host = ProducerSettings()
    shared = host.signing_key.get_secret_value().encode()
    ring = _ring(ACTUATOR)
    own = PrivateKey.generate()
    forged = {
        "shared key": sign(_command(), shared),
        "its own key": sign(_command(), own),
        "its own key, the actuator's key id": sign(_command(), own).model_copy(
            update={"key_id": ACTUATOR.key_id}
        ),
        "unsigned": _command(),
        "another job's command, re-addressed": sign(_command(job_id="job-2"), ACTUATOR)
        .model_copy(update={"job_id": "job-1"}),
    }  # fmt: skip
    for what, cmd in forged.items():
        why = check_signature(cmd, key=shared, keyring=ring, now_ns=NOW)
        assert why, what
    # the shared key still verifies where no keyring is given: the keyring is what closes it
    assert check_signature(forged["shared key"], key=shared, keyring=None, now_ns=NOW) == ""


def test_rotation_overlap_then_refusal_and_revocation() -> None:
    new = PrivateKey.generate()
    ring = Keyring(
        [
            TrustedKey.of(ACTUATOR.public_bytes(), "actuator", not_after_ns=NOW + 60 * S),
            TrustedKey.of(new.public_bytes(), "actuator"),
        ]
    )
    old_cmd, new_cmd = sign(_command(), ACTUATOR), sign(_command(seq=18), new)
    assert check_signature(old_cmd, key=None, keyring=ring, now_ns=NOW + 59 * S) == ""
    late = check_signature(old_cmd, key=None, keyring=ring, now_ns=NOW + 61 * S)
    assert "no longer trusted" in late
    assert check_signature(new_cmd, key=None, keyring=ring, now_ns=NOW + 61 * S) == ""
    gone = TrustedKey(new.key_id, "actuator", ring.keys[new.key_id].public, revoked=True)
    ring.keys[new.key_id] = gone
    assert "revoked" in check_signature(new_cmd, key=None, keyring=ring, now_ns=NOW)
    unknown = check_signature(sign(_command(), PrivateKey.generate()), key=None, keyring=ring,
                              now_ns=NOW)  # fmt: skip
    assert "is not in the keyring" in unknown


def test_the_agent_with_a_keyring_applies_the_actuators_commands_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PERFLOOP_KAFKA_BOOTSTRAP", raising=False)
    path = tmp_path / "ring.json"
    _ring(ACTUATOR).save(path)
    applied: list[Any] = []
    agent = JobAgent(
        BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1"),
        job_id="job-1", node="n0", signing_key=b"dev-key", keyring=KeyringFile(path),
        handlers={KNOB: applied.append},
    )  # fmt: skip
    refused = agent.receive(encode_event(sign(_command(seq=1), b"dev-key")), now_ns=NOW)
    assert refused is not None and "shared key" in refused
    assert agent.receive(encode_event(sign(_command(seq=2), ACTUATOR)), now_ns=NOW) is None
    agent.step_boundary(1)
    assert applied == [5]

    # revoked in the file, taken at the next command with no restart
    ring = Keyring.load(path)
    k = ring.keys[ACTUATOR.key_id]
    ring.keys[k.key_id] = TrustedKey(k.key_id, k.principal, k.public, revoked=True)
    ring.save(path)
    os.utime(path, ns=(NOW, NOW))  # a change the stat sees even within a second
    refused = agent.receive(encode_event(sign(_command(seq=3, value=6), ACTUATOR)), now_ns=NOW)
    assert refused is not None and "revoked" in refused


def test_keys_and_keyrings_on_disk(tmp_path: Path) -> None:
    key = PrivateKey.generate()
    key.save(tmp_path / "a.key")
    assert stat.S_IMODE((tmp_path / "a.key").stat().st_mode) == 0o600
    assert PrivateKey.load(tmp_path / "a.key").key_id == key.key_id
    assert repr(key) == f"PrivateKey({key.key_id})"  # never the key material
    with pytest.raises(FileExistsError):
        key.save(tmp_path / "a.key")  # never over a file

    bad = {
        "not json": "{",
        "no keys": "{}",
        "short key": json.dumps({"keys": [{"principal": "a", "public_key": "AAAA"}]}),
        "missing principal": json.dumps({"keys": [{"public_key": "A" * 43 + "="}]}),
        "wrong key id": json.dumps(
            {"keys": [TrustedKey.of(key.public_bytes(), "a").to_json() | {"key_id": "x"}]}
        ),
        "naive time": json.dumps(
            {"keys": [TrustedKey.of(key.public_bytes(), "a").to_json()
                      | {"not_after": "2026-01-01T00:00:00"}]}
        ),
    }  # fmt: skip
    for what, text in bad.items():
        (tmp_path / "r.json").write_text(text)
        with pytest.raises(ConfigError) as e:
            Keyring.load(tmp_path / "r.json")
        assert "\n" not in str(e.value) and "r.json" in str(e.value), what
    (tmp_path / "k.pem").write_text("not a key")
    with pytest.raises(ConfigError, match="is not a PEM private key"):
        PrivateKey.load(tmp_path / "k.pem")

    # a keyring change that does not read keeps the last good one
    good = tmp_path / "good.json"
    _ring(key).save(good)
    live = KeyringFile(good)
    good.write_text("{")
    os.utime(good, ns=(NOW, NOW))
    assert key.key_id in live.current().keys
