"""The embedded stack's keys: made under ``$PERFLOOP_HOME/keys`` at its first start, so that
`perfloop up` (and the demo) signs and checks its control plane with no setup.

- ``streams.key``: the stream tier's Ed25519 key; ``recommenders.json``, the keyring the
  actuator checks recommendations against, trusts its public key.
- ``actuator.key``: the actuator's Ed25519 key, which signs every command; ``commands.json``,
  the keyring of its public key, which the jobs of this machine check commands against
  (`ProducerSettings.command_keyring_path`): a job's host then holds no key that signs a
  command.
- ``owner.key``: the local owner's key; ``roster.json`` names the owner with every role (every
  job, every actuator setting, every tier). The CLI signs approvals and settings with it by
  default (`BaseServiceSettings.principal_key_path`).

Existing files are kept as they are (a rotated key, principals added to the roster), but for
a roster of the owner alone with the one role earlier stacks gave them (every actuator
setting): the owner then gets every setting, as a new stack's owner has. The
supervisor gives its services the settings naming them (`stack_key_settings`), unless the
environment names others.
"""

from __future__ import annotations

from pathlib import Path

from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, PrivateKey, TrustedKey
from perfloop.roster import Principal, Role, Roster, owner_roster

__all__ = ["stack_key_settings"]


def _key(path: Path) -> PrivateKey:
    if path.exists():
        return PrivateKey.load(path)
    key = PrivateKey.generate()
    key.save(path)
    return key


_FIRST_OWNER_ROLE = Role(("*",), ("actuator.*",), "auto")
"""The owner's one role in the rosters the stack made before the stream tier and the jobs
checked settings (they then covered the actuator's only)."""


def _widen_owner(path: Path) -> None:
    """A roster the stack made with `_FIRST_OWNER_ROLE`, unchanged since: its owner gets every
    setting, as a new stack's owner has. A roster someone edited is left as it is."""
    try:
        roster = Roster.load(path)
    except ConfigError:
        return  # the actuator says what is wrong with it
    owner = roster.principals.get("owner")
    if owner is None or owner.roles != (_FIRST_OWNER_ROLE,) or len(roster.principals) != 1:
        return
    roster.principals["owner"] = Principal("owner", (Role(("*",), ("*",), "auto"),))
    roster.save(path)


def stack_key_settings(home: Path) -> dict[str, str]:
    """Make what is missing of the stack's keys under ``home/keys``; return the environment
    that names them (``PERFLOOP_RECOMMENDATION_PRIVATE_KEY``, ``_KEYRING``, ``PERFLOOP_ROSTER``,
    ``PERFLOOP_SIGNING_PRIVATE_KEY``, ``PERFLOOP_COMMAND_KEYRING``).
    """
    keys = home / "keys"
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    streams, ring = keys / "streams.key", keys / "recommenders.json"
    key = _key(streams)
    if not ring.exists():
        Keyring([TrustedKey.of(key.public_bytes(), "streams")]).save(ring)
    actuator, commands = keys / "actuator.key", keys / "commands.json"
    key = _key(actuator)
    if not commands.exists():
        Keyring([TrustedKey.of(key.public_bytes(), "actuator")]).save(commands)
    owner, roster = keys / "owner.key", keys / "roster.json"
    key = _key(owner)
    if not roster.exists():
        owner_roster(key).save(roster)
    else:
        _widen_owner(roster)
    return {
        "PERFLOOP_RECOMMENDATION_PRIVATE_KEY": str(streams),
        "PERFLOOP_RECOMMENDATION_KEYRING": str(ring),
        "PERFLOOP_ROSTER": str(roster),
        "PERFLOOP_SIGNING_PRIVATE_KEY": str(actuator),
        "PERFLOOP_COMMAND_KEYRING": str(commands),
    }
