"""Command signatures: HMAC-SHA256 over a canonical encoding of every field but the signature."""

from __future__ import annotations

import hashlib
import hmac

import orjson

from perfloop.schemas import Command

__all__ = ["sign", "signature_of", "verify"]


def _canonical(command: Command) -> bytes:
    doc = command.model_dump(exclude={"signature"})
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)


def signature_of(command: Command, key: bytes) -> str:
    """Hex HMAC-SHA256 of the command's canonical encoding."""
    return hmac.new(key, _canonical(command), hashlib.sha256).hexdigest()


def sign(command: Command, key: bytes) -> Command:
    """The same command carrying its signature.

    >>> c = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob="k", value=2,
    ...             expires_ts_ns=10)
    >>> verify(sign(c, b"secret"), b"secret"), verify(sign(c, b"secret"), b"other")
    (True, False)
    """
    return command.model_copy(update={"signature": signature_of(command, key)})


def verify(command: Command, key: bytes) -> bool:
    """True if the command's signature matches its content under ``key`` (constant time)."""
    return bool(command.signature) and hmac.compare_digest(
        command.signature, signature_of(command, key)
    )
