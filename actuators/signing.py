"""Signatures of commands, approvals, recommendations and actuator settings, over a canonical
encoding of every field but the signature itself: HMAC-SHA256 with a shared key (bare hex),
or Ed25519 with a private key whose public half the verifier holds in a `Keyring`
(``ed25519:`` and base64; the key id is the public key's, `perfloop.identity`).

With Ed25519 a verifier cannot sign: a job that holds only the actuator's public key cannot
forge a command, for itself or any other job. With HMAC whoever verifies can also sign.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import TypeVar

import orjson

from perfloop.identity import ED25519, Keyring, PrivateKey
from perfloop.schemas import Approval, Command, ConfigChange, Recommendation

__all__ = ["SignedEvent", "check_signature", "sign", "signature_of", "verify"]

SignedEvent = Command | Approval | Recommendation | ConfigChange
"""The events that carry a signature (``key_id``, ``signature``)."""
Signed = TypeVar("Signed", Command, Approval, Recommendation, ConfigChange)


def _canonical(event: SignedEvent) -> bytes:
    doc = event.model_dump(exclude={"signature"})
    doc["kind"] = event.KIND  # a command's signature never verifies an approval's fields
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)


def signature_of(event: SignedEvent, key: bytes) -> str:
    """Hex HMAC-SHA256 of the event's canonical encoding."""
    return hmac.new(key, _canonical(event), hashlib.sha256).hexdigest()


def sign(event: Signed, key: bytes | PrivateKey) -> Signed:
    """The same command (approval, recommendation, setting) carrying its signature: an HMAC
    under a shared ``key`` (its ``key_id`` as it is), or an Ed25519 signature under a
    `PrivateKey` (``key_id`` set to the key's, and signed over).

    >>> c = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob="k", value=2,
    ...             expires_ts_ns=10)
    >>> verify(sign(c, b"secret"), b"secret"), verify(sign(c, b"secret"), b"other")
    (True, False)
    >>> key = PrivateKey.generate()
    >>> signed = sign(c, key)
    >>> signed.key_id == key.key_id, signed.signature.startswith("ed25519:")
    (True, True)
    """
    if isinstance(key, PrivateKey):
        event = event.model_copy(update={"key_id": key.key_id})
        sig = ED25519 + base64.b64encode(key.sign(_canonical(event))).decode()
        return event.model_copy(update={"signature": sig})
    return event.model_copy(update={"signature": signature_of(event, key)})


def verify(event: SignedEvent, key: bytes) -> bool:
    """True if the event's HMAC signature matches its content under ``key`` (constant
    time); an Ed25519 signature never matches a shared key."""
    if not event.signature or event.signature.startswith(ED25519):
        return False
    return hmac.compare_digest(event.signature, signature_of(event, key))


def check_signature(
    event: SignedEvent, *, key: bytes | None, keyring: Keyring | None, now_ns: int
) -> str:
    """Why the event's signature is not to be trusted ("" when it is). With a ``keyring``
    only an Ed25519 signature by one of its keys is; without one, only an HMAC under
    ``key``.

    >>> c = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob="k", value=2,
    ...             expires_ts_ns=10)
    >>> from perfloop.identity import TrustedKey
    >>> key = PrivateKey.generate()
    >>> ring = Keyring([TrustedKey.of(key.public_bytes(), "actuator")])
    >>> check_signature(sign(c, key), key=None, keyring=ring, now_ns=5)
    ''
    >>> check_signature(sign(c, b"job-host-key"), key=b"job-host-key", keyring=ring, now_ns=5)
    'signed with a shared key: this job trusts only the public keys in its keyring'
    >>> why = check_signature(sign(c, key), key=b"job-host-key", keyring=None, now_ns=5)
    >>> why.startswith(f"signed with Ed25519 key {key.key_id}"), "PERFLOOP_COMMAND_KEYRING" in why
    (True, True)
    """
    if not event.signature:
        return "unsigned: it carries no signature"
    if keyring is None:
        if key is not None and verify(event, key):
            return ""
        if event.signature.startswith(ED25519):  # an actuator with its own key: say how to trust it
            return (
                f"signed with Ed25519 key {event.key_id}, and this job has no keyring to check "
                "it with: set PERFLOOP_COMMAND_KEYRING (the stack's keys/commands.json)"
            )
        return "signature does not verify"
    if not event.signature.startswith(ED25519):
        return "signed with a shared key: this job trusts only the public keys in its keyring"
    try:
        raw = base64.b64decode(event.signature[len(ED25519) :], validate=True)
    except (binascii.Error, ValueError):
        return "the signature is not base64"
    return keyring.check(event.key_id, _canonical(event), raw, now_ns=now_ns)
