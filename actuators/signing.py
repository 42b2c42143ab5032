"""Signatures of commands and approvals: HMAC-SHA256 over a canonical encoding of every field
but the signature itself."""

from __future__ import annotations

import hashlib
import hmac
from typing import TypeVar

import orjson

from perfloop.schemas import Approval, Command

__all__ = ["sign", "signature_of", "verify"]

Signed = TypeVar("Signed", Command, Approval)


def _canonical(event: Command | Approval) -> bytes:
    doc = event.model_dump(exclude={"signature"})
    doc["kind"] = event.KIND  # a command's signature never verifies an approval's fields
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)


def signature_of(event: Command | Approval, key: bytes) -> str:
    """Hex HMAC-SHA256 of the event's canonical encoding."""
    return hmac.new(key, _canonical(event), hashlib.sha256).hexdigest()


def sign(event: Signed, key: bytes) -> Signed:
    """The same command (or approval) carrying its signature.

    >>> c = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob="k", value=2,
    ...             expires_ts_ns=10)
    >>> verify(sign(c, b"secret"), b"secret"), verify(sign(c, b"secret"), b"other")
    (True, False)
    """
    return event.model_copy(update={"signature": signature_of(event, key)})


def verify(event: Command | Approval, key: bytes) -> bool:
    """True if the event's signature matches its content under ``key`` (constant time)."""
    return bool(event.signature) and hmac.compare_digest(event.signature, signature_of(event, key))
