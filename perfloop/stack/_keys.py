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

Existing files are kept as they are (a rotated key, principals added to the roster). The
supervisor gives its services the settings naming them (`stack_key_settings`), unless the
environment names others.
"""

from __future__ import annotations

from pathlib import Path

from perfloop.identity import Keyring, PrivateKey, TrustedKey
from perfloop.roster import owner_roster

__all__ = ["stack_key_settings"]


def _key(path: Path) -> PrivateKey:
    if path.exists():
        return PrivateKey.load(path)
    key = PrivateKey.generate()
    key.save(path)
    return key


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
    return {
        "PERFLOOP_RECOMMENDATION_PRIVATE_KEY": str(streams),
        "PERFLOOP_RECOMMENDATION_KEYRING": str(ring),
        "PERFLOOP_ROSTER": str(roster),
        "PERFLOOP_SIGNING_PRIVATE_KEY": str(actuator),
        "PERFLOOP_COMMAND_KEYRING": str(commands),
    }
