"""``perfloop keys``: Ed25519 keys and the keyrings that trust them (`perfloop.identity`).

- ``perfloop keys new NAME [--dir DIR] [--principal P]``: a private key ``DIR/NAME.key``
  (owner-only, never over a file) and its keyring entry ``DIR/NAME.pub.json``; prints the
  key id.
- ``perfloop keys trust KEYRING NAME.pub.json [--until TIME]``: add (or replace) an entry in
  a keyring (made if missing), trusted until TIME (an ISO time, or 30s/10m/2h/1d from now).
- ``perfloop keys revoke KEYRING KEY_ID``: refuse that key from now on (KEYRING may be a
  roster: a person's key is revoked there).
- ``perfloop keys list KEYRING``: the entries, one a line (of a roster: every principal's).
- ``perfloop keys grant ROSTER NAME.pub.json --jobs J[,J…] [--settings S[,S…]]
  [--max-tier T]``: add the entry's principal (or another key of theirs) to a roster (made if
  missing, `perfloop.roster`) with a role: the jobs (ids, prefixes ending in ``*``, or ``*``),
  the actuator settings (keys, or prefixes ending in ``*``; default ``actuator.*``) and the
  highest tier (default ``approve``: they may approve these jobs' recommendations).
- ``perfloop keys client NAME [--out DIR] [--warehouse]``: for a stack that listens beyond
  loopback (`perfloop up --listen ADDR`), a client certificate ``NAME`` its CA signs, the CA,
  the stack's command keyring and ``DIR/perfloop.env`` (the settings a node sources to reach
  it); ``--warehouse`` adds the warehouse's password (a person's machine that queries it; a
  job's host needs none).

Rotating the actuator's key: ``keys new actuator-2``; ``keys trust`` it in every job's keyring;
point ``PERFLOOP_SIGNING_PRIVATE_KEY`` at the new key and restart the actuator; ``keys trust``
the old entry again ``--until 10m`` for the overlap (a command signed just before still
verifies), or ``keys revoke`` it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import time
from pathlib import Path
from typing import Any

from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, PrivateKey, TrustedKey
from perfloop.roster import Principal, Role, Roster
from perfloop.schemas import AUTOMATION_TIERS

__all__ = ["add_keys", "keys_command", "until_ns"]


def until_ns(text: str, now_ns: int | None = None) -> int:
    """``--until``: an ISO time with its zone, or a duration from now (30s, 10m, 2h, 1d).

    >>> until_ns("10m", now_ns=0)
    600000000000
    >>> until_ns("2026-12-08T00:00:00Z")
    1796688000000000000
    >>> until_ns("soon")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: --until 'soon': an ISO time with its zone, or 30s/10m/2h/1d
    """
    now = time.time_ns() if now_ns is None else now_ns
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return now + int(float(m.group(1)) * unit * 1e9)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"--until {text!r}: an ISO time with its zone, or 30s/10m/2h/1d"
        )
    return int(when.timestamp() * 1e9)


def add_keys(sub: Any) -> None:
    """Register ``keys`` on the CLI's subparsers."""
    k = sub.add_parser(
        "keys", help="Ed25519 keys and keyrings (new, trust, revoke, list, grant); client"
    )
    ks = k.add_subparsers(dest="keys_command", required=True)
    new = ks.add_parser("new", help="a private key and its keyring entry")
    new.add_argument("name", metavar="NAME")
    new.add_argument("--dir", type=Path, default=Path("."), help="where to write them (here)")
    new.add_argument("--principal", help="whose key it is (default: NAME)")
    tr = ks.add_parser("trust", help="add or replace a keyring entry")
    tr.add_argument("keyring", type=Path, metavar="KEYRING")
    tr.add_argument("entry", type=Path, metavar="NAME.pub.json")
    tr.add_argument("--until", type=until_ns, metavar="TIME", help="trusted until (ISO or 10m)")
    rv = ks.add_parser("revoke", help="refuse a key from now on (in a keyring or a roster)")
    rv.add_argument("keyring", type=Path, metavar="KEYRING")
    rv.add_argument("key_id", metavar="KEY_ID")
    ls = ks.add_parser("list", help="a keyring's entries")
    ls.add_argument("keyring", type=Path, metavar="KEYRING")
    cl = ks.add_parser("client", help="a node's certificate and settings for a listening stack")
    cl.add_argument("name", metavar="NAME")
    cl.add_argument("--out", type=Path, help="where to write them (default: ./NAME)")
    cl.add_argument("--warehouse", action="store_true",
                    help="add the warehouse's password (to query it from there)")  # fmt: skip
    gr = ks.add_parser("grant", help="add a principal's key and a role to a roster")
    gr.add_argument("roster", type=Path, metavar="ROSTER")
    gr.add_argument("entry", type=Path, metavar="NAME.pub.json")
    gr.add_argument("--jobs", required=True, type=_names, help="job ids or prefixes (a*,b)")
    gr.add_argument("--settings", type=_names, default=("actuator.*",),
                    help="actuator settings (default actuator.*)")  # fmt: skip
    gr.add_argument("--max-tier", default="approve", choices=AUTOMATION_TIERS,
                    help="the highest tier they may set (default approve)")  # fmt: skip


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more names, comma-separated")
    return names


def _entry(path: Path) -> TrustedKey:
    try:
        return TrustedKey.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a keyring entry: {e}") from None


def _grant(args: argparse.Namespace) -> int:
    """``keys grant``: the entry's principal in the roster, with its key and one role more."""
    roster = Roster.load(args.roster) if args.roster.exists() else Roster([], [])
    entry = _entry(args.entry)
    name = entry.principal
    old = roster.principals.get(name)
    role = Role(args.jobs, args.settings, args.max_tier)
    roles = old.roles if old is not None else ()
    roster.principals[name] = Principal(name, roles if role in roles else (*roles, role))
    roster.keyring.keys[entry.key_id] = entry
    roster.save(args.roster)
    print(f"{args.roster}: {name} ({entry.key_id}) may set {', '.join(role.settings)} of jobs "
          f"{', '.join(role.jobs)} up to tier {role.max_tier}")  # fmt: skip
    return 0


def _client(args: argparse.Namespace) -> int:
    """``keys client``: a node's bundle for the stack of ``PERFLOOP_HOME``."""
    from perfloop.settings import BaseServiceSettings, load_settings
    from perfloop.stack import client_bundle

    home = load_settings(BaseServiceSettings).home_dir
    out = args.out if args.out is not None else Path(args.name)
    env = client_bundle(home, args.name, out, warehouse=args.warehouse)
    print(f"{args.name}: certificate and settings in {out}; on the node: "
          f"set -a; . {env}; set +a")  # fmt: skip
    return 0


def keys_command(args: argparse.Namespace) -> int:
    if args.keys_command == "grant":
        return _grant(args)
    if args.keys_command == "client":
        return _client(args)
    if args.keys_command == "new":
        args.dir.mkdir(parents=True, exist_ok=True)
        path, pub = args.dir / f"{args.name}.key", args.dir / f"{args.name}.pub.json"
        if path.exists() or pub.exists():
            raise ConfigError(f"{path} or {pub} exists already: choose another name")
        key = PrivateKey.generate()
        key.save(path)
        entry = TrustedKey.of(key.public_bytes(), args.principal or args.name)
        pub.write_text(json.dumps(entry.to_json(), indent=2) + "\n")
        print(f"{key.key_id}  private key {path} (owner only), keyring entry {pub}")
        return 0
    roster = _roster(args.keyring) if args.keys_command in ("revoke", "list") else None
    ring = (
        roster.keyring if roster else _ring(args.keyring, missing_ok=args.keys_command == "trust")
    )
    if args.keys_command == "trust":
        entry = _entry(args.entry)
        if args.until is not None:
            entry = TrustedKey(entry.key_id, entry.principal, entry.public, args.until)
        ring.keys[entry.key_id] = entry
        ring.save(args.keyring)
        print(f"{args.keyring}: {_line(entry)}")
    elif args.keys_command == "revoke":
        old = ring.keys.get(args.key_id)
        if old is None:
            raise ConfigError(f"{args.keyring} has no key {args.key_id!r}")
        ring.keys[old.key_id] = TrustedKey(
            old.key_id, old.principal, old.public, old.not_after_ns, revoked=True
        )
        if roster is not None:  # a person's key, in the roster the actuator reads
            roster.save(args.keyring)
        else:
            ring.save(args.keyring)
        print(f"{args.keyring}: {_line(ring.keys[old.key_id])}")
    else:
        for entry in ring.keys.values():
            print(_line(entry))
    return 0


def _roster(path: Path) -> Roster | None:
    """The roster at ``path``, where the file is one (a ``"principals"`` list), else None."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the keyring's own reading says what is wrong
    return Roster.load(path) if isinstance(doc, dict) and "principals" in doc else None


def _ring(path: Path, *, missing_ok: bool) -> Keyring:
    if missing_ok and not path.exists():
        return Keyring()
    return Keyring.load(path)


def _line(k: TrustedKey) -> str:
    doc = k.to_json()
    state = "revoked" if k.revoked else f"until {doc['not_after']}" if k.not_after_ns else "trusted"
    return f"{k.key_id}  {k.principal}  {state}"
