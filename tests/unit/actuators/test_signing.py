"""Command signatures: any change to a signed command, or the wrong key, fails verification."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.actuators import sign, signature_of, verify
from perfloop.schemas import Command, decode_event, encode_event

KEY = b"test-signing-key"


def _command(**kw: Any) -> Command:
    fields: dict[str, Any] = dict(
        ts_ns=1_000,
        job_id="job-1",
        node="n0",
        rank=-1,
        rec_id="rec-1",
        seq=17,
        knob="dataloader.num_workers",
        from_value=2,
        value=5,
        expires_ts_ns=61_000,
    )
    return Command(**(fields | kw))


def test_signed_command_verifies_with_its_key() -> None:
    signed = sign(_command(), KEY)
    assert len(signed.signature) == 64
    assert verify(signed, KEY)


def test_signature_survives_the_wire() -> None:
    for value in (5, 0.25, "zstd", True):
        signed = sign(_command(value=value), KEY)
        back = decode_event(encode_event(signed))
        assert isinstance(back, Command)
        assert verify(back, KEY)


def test_signing_does_not_change_the_command() -> None:
    cmd = _command()
    signed = sign(cmd, KEY)
    assert signed.model_dump(exclude={"signature"}) == cmd.model_dump(exclude={"signature"})
    assert cmd.signature == ""


def test_signature_ignores_a_previous_signature() -> None:
    once = sign(_command(), KEY)
    assert sign(once, KEY).signature == once.signature
    assert signature_of(once, KEY) == once.signature


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ts_ns", 1_001),
        ("job_id", "job-2"),
        ("node", "n1"),
        ("rank", 0),
        ("event_id", "0" * 32),
        ("rec_id", "rec-2"),
        ("seq", 18),
        ("knob", "dataloader.prefetch_factor"),
        ("from_value", 3),
        ("value", 64),
        ("value", 5.0),
        ("value", "5"),
        ("loop", "slow"),
        ("expires_ts_ns", 10**19),
        ("key_id", "other"),
    ],
)
def test_tampered_field_fails_verification(field: str, value: Any) -> None:
    signed = sign(_command(), KEY)
    tampered = signed.model_copy(update={field: value})
    assert getattr(tampered, field) == value
    assert not verify(tampered, KEY)


def test_wrong_key_fails_verification() -> None:
    signed = sign(_command(), KEY)
    assert not verify(signed, b"other-key")
    assert not verify(signed, KEY + b"x")
    assert not verify(signed, b"")


@pytest.mark.parametrize("signature", ["", "0" * 64, "not hex", "AB" * 32])
def test_missing_or_forged_signature_fails_verification(signature: str) -> None:
    assert not verify(_command(signature=signature), KEY)


def test_uppercase_copy_of_a_valid_signature_fails() -> None:
    signed = sign(_command(), KEY)
    assert not verify(signed.model_copy(update={"signature": signed.signature.upper()}), KEY)
