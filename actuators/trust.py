"""What the actuator trusts: the checks a recommendation, an approval or an actuator setting
passes before it can change anything, and the refusal recorded when it does not.

- A recommendation, with a keyring of recommender keys (``recommendation_keyring``: the stream
  tier's public keys), must be signed (Ed25519) by a key in it that is neither revoked nor past
  its ``not_after``, over its content as it came; not expired (``expires_ts_ns``, set by the
  stream tier); and not seen before (its event id).
- An approval, and a ``ConfigChange`` for the actuator, with a roster (``roster``,
  `perfloop.roster`), must be signed by a key of a principal in it, not expired, not seen
  before, and within the principal's role: the job (or every job), the setting, the tier.

Without a keyring recommendations are taken as they come, and without a roster settings are
taken unsigned and approvals are checked against the shared key (HMAC, `Policy.approve`): the
behaviour of a stack given no keys (docs/security.md).

Each refusal becomes a `Decision` with outcome ``refused``, the reason, and as ``actor`` the
principal the event claimed (its key's, else its author, else its key id); the service
publishes it on ``perfloop.actuations``, and the sink lands it in ``audit``. A refused setting
has no recommendation: its decision's ``rec_id`` is the change's event id and its ``knob`` the
setting's key.

>>> from perfloop.identity import PrivateKey, TrustedKey
>>> from perfloop.schemas import Recommendation
>>> from perfloop.actuators.signing import sign
>>> key = PrivateKey.generate()
>>> gate = Gate(recommenders=Keyring([TrustedKey.of(key.public_bytes(), "streams")]))
>>> rec = Recommendation(ts_ns=1, job_id="j", node="n", rank=-1, knob="k", from_value=1,
...     to_value=2, loop="fast", expected_gain_pct=10, confidence=0.5, rationale="r",
...     expires_ts_ns=100)
>>> gate.check(rec, now_ns=50)
('unknown', 'unsigned: it carries no signature')
>>> gate.check(sign(rec, key), now_ns=50)
('streams', '')
>>> gate.check(sign(rec, key), now_ns=60)[1]  # doctest: +ELLIPSIS
'replayed: recommendation ... was taken before'
>>> gate.check(sign(rec.model_copy(update={"event_id": "x"}), key), now_ns=200)[1]
'expired: its expiry passed 100 ns ago'
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import TypeVar

from perfloop.actuators.signing import SignedEvent, check_signature, sign
from perfloop.identity import ED25519, Keyring, KeyringFile, PrivateKey
from perfloop.roster import Roster, RosterFile
from perfloop.schemas import Approval, ConfigChange, Decision, Recommendation

__all__ = ["SIGNED_TTL_S", "Gate", "refusal", "roster_gate", "signed_by"]

SEEN_MEMORY = 50_000
"""Event ids remembered as taken (a replay of one is refused); past it, the expiry bounds how
long a replay could be taken."""
NS = 1_000_000_000
SIGNED_TTL_S = 300.0
"""How long an approval or a setting a person signs holds (`signed_by`)."""

Sent = TypeVar("Sent", Approval, ConfigChange)


def signed_by(
    event: Sent, key: PrivateKey | None, *, shared_key: bytes = b"", ttl_s: float = SIGNED_TTL_S
) -> Sent:
    """An approval or a setting as a person sends it: with their own ``key``, given an expiry
    ``ttl_s`` from now and signed (Ed25519); without one, an approval signed under the shared
    key (HMAC, for an actuator without a roster) and a setting as it is."""
    if key is not None:
        return sign(event.model_copy(update={"expires_ts_ns": time.time_ns() + int(ttl_s * NS)}),
                    key)  # fmt: skip
    if isinstance(event, Approval):
        return sign(event, shared_key)
    return event


class Gate:
    """The checks of `perfloop.actuators.trust`, with what it needs: the recommenders'
    keyring and the roster (each a file read again when it changes, or one given as it is),
    and the event ids already taken."""

    def __init__(
        self,
        *,
        recommenders: Keyring | KeyringFile | None = None,
        roster: Roster | RosterFile | None = None,
    ) -> None:
        self._recommenders = recommenders
        self._roster = roster
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def roster(self) -> Roster | None:
        r = self._roster
        return r.current() if isinstance(r, RosterFile) else r

    @property
    def recommenders(self) -> Keyring | None:
        r = self._recommenders
        return r.current() if isinstance(r, KeyringFile) else r

    def check(
        self, event: Recommendation | Approval | ConfigChange, *, now_ns: int, stored: bool = False
    ) -> tuple[str, str]:
        """``(who it claims to come from, why it is refused)``: "" when it may go on to the
        policy. ``stored``: a setting read back from the warehouse at a start, checked for its
        signature and role only (as its keys were trusted when it was signed), never as a
        replay or for its expiry, and not remembered."""
        if isinstance(event, Recommendation):
            ring = self.recommenders
            if ring is None:
                return "actuator", ""
            who = _owner(ring, event.key_id) or event.key_id or "unknown"
            return who, self._admit(event, ring, now_ns, stored)
        roster = self.roster
        if roster is None:  # approvals: the policy checks the shared key; settings: none
            return (event.author or "unknown"), ""
        claimed = roster.principal_of(event.key_id)
        who = claimed or event.author or event.key_id or "unknown"
        why = self._admit(event, roster.keyring, now_ns, stored, check_seen=False)
        if not why:
            if isinstance(event, Approval):
                why = roster.may_approve(claimed, event.job_id)
            else:
                why = roster.may_set(claimed, event.applies_to, event.key, event.value)
        if not why and not stored:
            why = self._remember(event)
        return who, why

    def _admit(
        self, event: SignedEvent, ring: Keyring, now_ns: int, stored: bool, check_seen: bool = True
    ) -> str:
        when = event.ts_ns if stored else now_ns  # a stored one: as its key was trusted then
        if event.signature and not event.signature.startswith(ED25519):
            return "signed with a shared key: only the Ed25519 keys trusted here count"
        why = check_signature(event, key=None, keyring=ring, now_ns=when)
        if why or stored:
            return why
        expires = getattr(event, "expires_ts_ns", 0)
        if not expires:
            return "no expiry: a signed event must say until when it holds (expires_ts_ns)"
        if now_ns > expires:
            return f"expired: its expiry passed {_ago(now_ns - expires)} ago"
        return self._remember(event) if check_seen else ""

    def _remember(self, event: SignedEvent) -> str:
        seen = f"{event.KIND}:{event.event_id}"
        if seen in self._seen:
            return f"replayed: {event.KIND} {event.event_id} was taken before"
        self._seen[seen] = None
        while len(self._seen) > SEEN_MEMORY:
            self._seen.popitem(last=False)
        return ""

    def taken(self, event: SignedEvent) -> None:
        """Count ``event`` as taken (a setting read back at a start: the same one sent again
        is a replay)."""
        self._remember(event)


_ROSTERS: dict[Path, RosterFile] = {}


def roster_gate(roster: Path | None) -> Gate | None:
    """A `Gate` that checks settings against the roster file ``roster`` (None without one).
    The gates of one process share one `RosterFile` per path: each keeps its own memory of
    the ids it took (a stream worker has one per partition, and a change for every job comes
    on every partition)."""
    if roster is None:
        return None
    shared = _ROSTERS.get(roster) or _ROSTERS.setdefault(roster, RosterFile(roster))
    return Gate(roster=shared)


def _owner(ring: Keyring, key_id: str) -> str:
    key = ring.keys.get(key_id)
    return key.principal if key is not None else ""


def _ago(ns: int) -> str:
    return f"{ns / NS:.0f} s" if ns >= NS else f"{ns} ns"


def refusal(
    event: Recommendation | Approval | ConfigChange,
    *,
    tier: str,
    reason: str,
    actor: str,
    now_ns: int | None = None,
) -> Decision:
    """The `Decision` that records ``event`` refused with ``reason``, by ``actor`` (who it
    claimed to come from), in the job's ``tier``."""
    what = f"{event.KIND} refused: {reason}"
    if getattr(event, "key_id", ""):
        what += f" (key {event.key_id})"
    common = dict(
        ts_ns=time.time_ns() if now_ns is None else now_ns, job_id=event.job_id, node=event.node,
        rank=-1, tier=tier, outcome="refused", reason=what[:1000], actor=actor[:256],
    )  # fmt: skip
    if isinstance(event, ConfigChange):
        value = event.value
        shown = value if isinstance(value, int | float | str | bool) else json.dumps(value)
        return Decision(**common, rec_id=event.event_id, knob=event.key, to_value=shown)
    rec_id = event.event_id if isinstance(event, Recommendation) else event.rec_id
    return Decision(
        **common, rec_id=rec_id, knob=event.knob, from_value=event.from_value,
        to_value=event.to_value, loop=event.loop,
    )  # fmt: skip
