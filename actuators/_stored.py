"""The actuator settings changed live before a start, read back from the warehouse
(``config_changes``) for `ActuatorService.load_settings`, and which of them may be applied again.

Every stored setting but those the actuator refused when they came (their refusal is in
``audit``; a replay's refusal names the same event and is not counted against it). With a roster
(`perfloop.actuators.trust`), also only those a principal signed within their role, as their
key was trusted when they signed, and that reached the warehouse before their expiry: a change
refused live, or held back and sent after it expired, is not applied at the next start either.
The table keeps a value as text; the one signed may have been that text, or what it reads as (a
number, a list): both are tried.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from perfloop.actuators.trust import Gate
from perfloop.schemas import ConfigChange

__all__ = ["stored_settings"]

log = logging.getLogger("perfloop.actuator")

_SQL = (
    "SELECT toUnixTimestamp64Nano(ts), event_id, job_id, node, applies_to, key, value, author, "
    "reason, expires_ts_ns, key_id, signature, toUnixTimestamp64Nano(inserted) "
    "FROM config_changes WHERE target = 'actuator' AND event_id NOT IN (SELECT rec_id FROM "
    "audit WHERE outcome = 'refused' AND NOT startsWith(reason, 'config refused: replayed')) "
    "ORDER BY ts, event_id LIMIT 1 BY event_id"
)


def stored_settings(settings: Any, gate: Gate) -> list[ConfigChange]:
    """The stored settings to apply again, oldest first (see the module); what is left out is
    one line each in the log. A warehouse that cannot be read raises (the caller says so)."""
    from perfloop.warehouse import query

    out = []
    for *fields, inserted_ns in query(settings, _SQL).result_rows:
        change = _change(*fields)
        if gate.roster is not None:  # only what a principal signed within their role
            change, who, why = _checked(gate, change, fields[6])
            if not why and change.expires_ts_ns and inserted_ns > change.expires_ts_ns:
                why = "it reached the warehouse after its expiry"
            if why:
                log.warning("not applying stored actuator setting %s (%s = %s, claimed by %s): "
                            "%s", change.event_id, change.key, fields[6], who, why)  # fmt: skip
                continue
            gate.taken(change)  # the same change sent again is a replay
        out.append(change)
    return out


def _checked(gate: Gate, change: ConfigChange, text: str) -> tuple[ConfigChange, str, str]:
    who, why = gate.check(change, now_ns=change.ts_ns, stored=True)
    if why and not isinstance(change.value, str):
        as_text = change.model_copy(update={"value": text})
        if not gate.check(as_text, now_ns=change.ts_ns, stored=True)[1]:
            return as_text, who, ""
    return change, who, why


def _change(ts_ns: int, event_id: str, job_id: str, node: str, applies_to: str, key: str,
            value: str, author: str = "", reason: str = "", expires_ts_ns: int = 0,
            key_id: str = "", signature: str = "") -> ConfigChange:  # fmt: skip
    """A ``config_changes`` row back as the `ConfigChange` it was."""
    return ConfigChange(
        ts_ns=ts_ns, event_id=event_id, job_id=job_id, node=node, rank=-1, target="actuator",
        applies_to=applies_to, key=key, value=stored_value(value), author=author, reason=reason,
        expires_ts_ns=expires_ts_ns, key_id=key_id, signature=signature,
    )  # fmt: skip


def stored_value(value: str) -> Any:
    """A value as ``config_changes`` keeps it (strings as they are, the rest as JSON)."""
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
