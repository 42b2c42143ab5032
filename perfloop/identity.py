"""Ed25519 identities: private keys, key ids, and the keyring of public keys a verifier trusts.

A signer holds a private key (a PEM file readable by its owner only); whoever checks its
signatures holds only the public key, in a keyring: a JSON file of entries, each a key id,
its principal, the public key and, for rotation and revocation, the moment it stops being
trusted (``not_after``) and whether it was ``revoked``::

    {"keys": [{"key_id": "ed25519:3f0c…", "principal": "actuator",
               "public_key": "<base64 of the 32 raw bytes>",
               "not_after": "2026-12-08T12:00:00Z", "revoked": false}]}

Rotation: add the new key's entry, switch the signer to the new key, and give the old entry a
``not_after`` an overlap later (what was signed with it just before still verifies until
then). Revocation: ``"revoked": true``, effective at once. `perfloop keys` makes keys and
edits keyrings.

>>> key = PrivateKey.generate()
>>> ring = Keyring([TrustedKey.of(key.public_bytes(), "actuator")])
>>> sig = key.sign(b"payload")
>>> ring.check(key.key_id, b"payload", sig, now_ns=0)
''
>>> ring.check(key.key_id, b"tampered", sig, now_ns=0)  # doctest: +ELLIPSIS
"signature does not verify under key ed25519:... of 'actuator'"
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from perfloop.exceptions import ConfigError

__all__ = [
    "ED25519",
    "Keyring",
    "KeyringFile",
    "PrivateKey",
    "TrustedKey",
    "WatchedFile",
    "key_id_of",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

ED25519 = "ed25519:"
"""The prefix of an Ed25519 key id and signature (an HMAC signature is bare hex)."""


def key_id_of(public_raw: bytes) -> str:
    """A public key's id: ``ed25519:`` and the first 16 hex digits of its SHA-256.

    >>> key_id_of(bytes(32))
    'ed25519:66687aadf862bd77'
    """
    return ED25519 + hashlib.sha256(public_raw).hexdigest()[:16]


class PrivateKey:
    """An Ed25519 private key: signs, and names itself by its public key's id."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.key_id = key_id_of(self.public_bytes())

    @classmethod
    def generate(cls) -> PrivateKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> PrivateKey:
        """Read a PEM (PKCS#8) Ed25519 private key; any problem is one `ConfigError` line."""
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except OSError as e:
            raise ConfigError(f"cannot read the private key {path}: {e.strerror}") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{path} is not a PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{path} is a {type(key).__name__}, not an Ed25519 private key")
        return cls(key)

    def save(self, path: Path) -> None:
        """Write it as PEM, readable and writable by its owner only; never over a file."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    def public_bytes(self) -> bytes:
        return self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def __repr__(self) -> str:  # never the key itself
        return f"PrivateKey({self.key_id})"


@dataclass(frozen=True)
class TrustedKey:
    """A keyring entry: whose key it is, and until when it is trusted."""

    key_id: str
    principal: str
    public: Ed25519PublicKey
    not_after_ns: int | None = None
    revoked: bool = False

    @classmethod
    def of(
        cls, public_raw: bytes, principal: str, *, not_after_ns: int | None = None
    ) -> TrustedKey:
        return cls(
            key_id_of(public_raw),
            principal,
            Ed25519PublicKey.from_public_bytes(public_raw),
            not_after_ns,
        )

    @classmethod
    def from_json(cls, doc: Any) -> TrustedKey:
        """A keyring entry as `to_json` writes it (KeyError, TypeError or ValueError if it is
        not one)."""
        raw = base64.b64decode(doc["public_key"], validate=True)
        if len(raw) != 32:
            raise ValueError(f"public_key is {len(raw)} bytes, an Ed25519 key is 32")
        key = cls.of(raw, str(doc["principal"]), not_after_ns=_ns(doc.get("not_after")))
        if doc.get("key_id", key.key_id) != key.key_id:
            raise ValueError(f"key_id {doc['key_id']!r} is not its public key's ({key.key_id})")
        if doc.get("revoked"):
            key = cls(key.key_id, key.principal, key.public, key.not_after_ns, True)
        return key

    def to_json(self) -> dict[str, Any]:
        raw = self.public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        doc: dict[str, Any] = {
            "key_id": self.key_id,
            "principal": self.principal,
            "public_key": base64.b64encode(raw).decode(),
        }
        if self.not_after_ns is not None:
            doc["not_after"] = _iso(self.not_after_ns)
        if self.revoked:
            doc["revoked"] = True
        return doc


class Keyring:
    """The public keys a verifier trusts, by key id."""

    def __init__(self, keys: Iterable[TrustedKey] = ()) -> None:
        self.keys: dict[str, TrustedKey] = {k.key_id: k for k in keys}

    @classmethod
    def load(cls, path: Path) -> Keyring:
        """Read a keyring file (the module says its form); a problem is one `ConfigError`
        line naming the file and the entry."""
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read the keyring {path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"the keyring {path} is not JSON: {e}") from None
        entries = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise ConfigError(f'the keyring {path} has no "keys" list')
        keys = []
        for i, entry in enumerate(entries):
            try:
                keys.append(TrustedKey.from_json(entry))
            except (KeyError, TypeError, ValueError, binascii.Error) as e:
                raise ConfigError(f"the keyring {path}, entry {i}: {_why(e)}") from None
        return cls(keys)

    def save(self, path: Path) -> None:
        """Write it (atomically: a verifier reading it meanwhile sees the old or the new)."""
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        doc = {"keys": [k.to_json() for k in self.keys.values()]}
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)

    def check(self, key_id: str, data: bytes, signature: bytes, *, now_ns: int) -> str:
        """Why ``signature`` over ``data`` is not to be trusted ("" when it is)."""
        key = self.keys.get(key_id)
        if key is None:
            return f"key {key_id!r} is not in the keyring"
        whose = f"key {key_id} of {key.principal!r}"
        if key.revoked:
            return f"{whose} is revoked"
        if key.not_after_ns is not None and now_ns > key.not_after_ns:
            return f"{whose} is no longer trusted (since {_iso(key.not_after_ns)})"
        try:
            key.public.verify(signature, data)
        except InvalidSignature:
            return f"signature does not verify under {whose}"
        return ""


class WatchedFile(Generic[T]):
    """A file read again whenever it changes (its modification time or size): a rotation, a
    revocation or a new entry takes effect at the next `current`, with no restart. A change
    that does not read leaves the last good content in force, with a warning; the file must
    read at the start (`ConfigError`). ``load`` reads it; ``what`` names it in the warning."""

    def __init__(self, path: Path, load: Callable[[Path], T], what: str) -> None:
        self.path = Path(path)
        self._load, self._what = load, what
        self._stamp = self._stat()
        self._content = load(self.path)

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def current(self) -> T:
        stamp = self._stat()
        if stamp is not None and stamp != self._stamp:
            self._stamp = stamp
            try:
                self._content = self._load(self.path)
            except ConfigError as e:
                log.warning("%s change not taken, the last one stays: %s", self._what, e)
        return self._content


class KeyringFile(WatchedFile[Keyring]):
    """A keyring file read again whenever it changes (`WatchedFile`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, Keyring.load, "keyring")


def _ns(value: Any) -> int | None:
    if value is None:
        return None
    when = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"not_after {value!r} has no time zone")
    return int(when.timestamp() * 1e9)


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).isoformat().replace("+00:00", "Z")


def _why(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"missing {e.args[0]!r}"
    return str(e) or type(e).__name__
