"""The roster: the people (and processes) who may approve changes and set the actuator, with
their keys and their roles.

A JSON file naming each principal, the Ed25519 public keys that sign for them (keyring entries,
`perfloop.identity`: key ids, rotation with ``not_after``, revocation with ``revoked``) and
their roles: which jobs (an id, a prefix ending in ``*``, or ``*`` for every job), which
actuator settings (a key such as ``actuator.tier``, a prefix ending in ``*``), and the highest
automation tier they may set (``max_tier``; one whose ``max_tier`` is ``approve`` or ``auto``
may also approve the jobs' recommendations)::

    {"principals": [
      {"name": "ana",
       "keys": [{"key_id": "ed25519:3f0c…", "public_key": "<base64 of the 32 raw bytes>"}],
       "roles": [{"jobs": ["team-a/*"], "settings": ["actuator.tier", "actuator.dry_run"],
                  "max_tier": "approve"}]}]}

A change to every job (``applies_to`` ``*``) needs a role whose jobs include ``*``.

>>> from perfloop.identity import PrivateKey, TrustedKey
>>> key = PrivateKey.generate()
>>> ana = Principal("ana", (Role(("team-a/*",), ("actuator.tier",), "approve"),))
>>> roster = Roster([ana], [TrustedKey.of(key.public_bytes(), "ana")])
>>> roster.may_set("ana", "team-a/run-1", "actuator.tier", "approve")
''
>>> roster.may_set("ana", "team-a/run-1", "actuator.tier", "auto")
"principal 'ana' may set actuator.tier of job team-a/run-1 up to tier approve, not 'auto'"
>>> roster.may_approve("ana", "team-b/run-2")
"principal 'ana' has no role that approves for job team-b/run-2"
"""

from __future__ import annotations

import binascii
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, PrivateKey, TrustedKey, WatchedFile
from perfloop.schemas import AUTOMATION_TIERS

__all__ = ["Principal", "Role", "Roster", "RosterFile", "owner_roster"]

log = logging.getLogger(__name__)

APPROVING_TIERS = ("approve", "auto")
"""A role whose ``max_tier`` is one of these may approve its jobs' recommendations."""


def _matches(patterns: Iterable[str], name: str) -> bool:
    """``name`` is one of ``patterns``, or starts with one that ends in ``*``."""
    return any(p == name or (p.endswith("*") and name.startswith(p[:-1])) for p in patterns)


@dataclass(frozen=True)
class Role:
    """What a principal may do: for which jobs, which settings, up to which tier."""

    jobs: tuple[str, ...]
    settings: tuple[str, ...] = ()
    max_tier: str = "observe"

    def covers(self, job: str) -> bool:
        """A job id, or ``*`` (every job: only a role for every job covers it)."""
        return "*" in self.jobs if job == "*" else _matches(self.jobs, job)

    @classmethod
    def from_json(cls, doc: Any) -> Role:
        jobs, settings = doc.get("jobs", []), doc.get("settings", [])
        if not isinstance(jobs, list) or not all(isinstance(j, str) and j for j in jobs):
            raise ValueError('"jobs" must be a list of job ids or prefixes ending in *')
        if not isinstance(settings, list) or not all(isinstance(s, str) for s in settings):
            raise ValueError('"settings" must be a list of setting keys')
        tier = doc.get("max_tier", "observe")
        if tier not in AUTOMATION_TIERS:
            raise ValueError(f"max_tier {tier!r} is not one of {list(AUTOMATION_TIERS)}")
        return cls(tuple(jobs), tuple(settings), tier)

    def to_json(self) -> dict[str, Any]:
        return {"jobs": list(self.jobs), "settings": list(self.settings), "max_tier": self.max_tier}


@dataclass(frozen=True)
class Principal:
    name: str
    roles: tuple[Role, ...]


class Roster:
    """The principals, their roles, and the keyring of every principal's keys."""

    def __init__(self, principals: Iterable[Principal], keys: Iterable[TrustedKey]) -> None:
        self.principals = {p.name: p for p in principals}
        self.keyring = Keyring(keys)

    @classmethod
    def load(cls, path: Path) -> Roster:
        """Read a roster file (the module says its form); a problem is one `ConfigError` line
        naming the file and the principal."""
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read the roster {path}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"the roster {path} is not JSON: {e}") from None
        entries = doc.get("principals") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise ConfigError(f'the roster {path} has no "principals" list')
        principals, keys = [], []
        for i, entry in enumerate(entries):
            try:
                name = entry["name"]
                if not isinstance(name, str) or not name:
                    raise ValueError('"name" must be a non-empty string')
                roles = tuple(Role.from_json(r) for r in entry.get("roles", []))
                for k in entry.get("keys", []):
                    keys.append(TrustedKey.from_json({**k, "principal": name}))
            except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as e:
                why = f"missing {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
                raise ConfigError(f"the roster {path}, principal {i}: {why}") from None
            principals.append(Principal(name, roles))
        return cls(principals, keys)

    def save(self, path: Path) -> None:
        """Write it (atomically, like a keyring)."""
        docs = []
        for p in self.principals.values():
            keys = [k.to_json() for k in self.keyring.keys.values() if k.principal == p.name]
            for k in keys:
                k.pop("principal")
            docs.append({"name": p.name, "keys": keys, "roles": [r.to_json() for r in p.roles]})
        tmp = Path(path).with_name(f".{Path(path).name}.tmp")
        tmp.write_text(json.dumps({"principals": docs}, indent=2) + "\n")
        tmp.replace(path)

    def principal_of(self, key_id: str) -> str:
        """Whose key ``key_id`` is ("" if no principal's)."""
        key = self.keyring.keys.get(key_id)
        return key.principal if key is not None else ""

    def _roles(self, name: str) -> tuple[Role, ...]:
        p = self.principals.get(name)
        return p.roles if p is not None else ()

    def may_approve(self, name: str, job: str) -> str:
        """Why ``name`` may not approve recommendations for ``job`` ("" when they may)."""
        if any(r.covers(job) and r.max_tier in APPROVING_TIERS for r in self._roles(name)):
            return ""
        return f"principal {name!r} has no role that approves for job {job}"

    def may_set(self, name: str, job: str, key: str, value: Any) -> str:
        """Why ``name`` may not set actuator setting ``key`` to ``value`` for ``job`` (``*``:
        every job) ("" when they may)."""
        scope = "every job" if job == "*" else f"job {job}"
        roles = [r for r in self._roles(name) if r.covers(job) and _matches(r.settings, key)]
        if not roles:
            return f"principal {name!r} has no role that sets {key} of {scope}"
        if key != "actuator.tier" or value not in AUTOMATION_TIERS:
            return ""
        top = max(AUTOMATION_TIERS.index(r.max_tier) for r in roles)
        if AUTOMATION_TIERS.index(value) <= top:
            return ""
        return (
            f"principal {name!r} may set {key} of {scope} up to tier {AUTOMATION_TIERS[top]}, "
            f"not {value!r}"
        )


class RosterFile(WatchedFile[Roster]):
    """A roster file read again whenever it changes (a new principal, a rotated or revoked key
    takes effect at the next check: `perfloop.identity.WatchedFile`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, Roster.load, "roster")


def owner_roster(key: PrivateKey, name: str = "owner") -> Roster:
    """A roster of one principal with every role: every job, every setting (the actuator's
    and the stream tier's), every tier (the embedded stack's, `perfloop up`)."""
    role = Role(("*",), ("*",), AUTOMATION_TIERS[-1])
    return Roster([Principal(name, (role,))], [TrustedKey.of(key.public_bytes(), name)])
