"""What a consumer does with a message it cannot handle: one policy for every service.

A service that reads a topic calls its policy, ``on_error(exc, message)``, with what went
wrong and the message (`Failed`: where it came from and its bytes), and the policy answers
with an `ErrorAction`:

- ``"dead_letter"``: publish the message as it came to ``perfloop.dlq``, with the reason and
  its source's topic, partition and offset in its headers (`perfloop.kafka.dlq_headers`), and
  go on with the next one;
- ``"skip"``: log it (one line) and go on; for a dead letter that cannot land (one is never
  dead-lettered again) and for a reader whose input another service reports;
- ``"raise"``: stop the service; for what is not the message's fault (the process is asked
  to stop).

Bad input never stops a service: `dead_letter_policy` (the stream workers', the sink's)
dead-letters whatever a message made go wrong, a bug in a component included, and
`skip_policy` (the actuator's: every topic it reads, the sink reads and reports too) skips it.
`decide` applies a policy and logs what it decided, in the same words for every service.

>>> m = Failed("perfloop.telemetry.step", 0, 7, b"job", b"{")
>>> dead_letter_policy(ValueError("bad"), m), skip_policy(ValueError("bad"), m)
('dead_letter', 'skip')
>>> dead_letter_policy(ValueError("bad"), Failed("perfloop.dlq", 0, 1, None, b""))
'skip'
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from perfloop.schemas.exceptions import SchemaError
from perfloop.schemas.topics import Topics

__all__ = [
    "BAD_INPUT",
    "ErrorAction",
    "Failed",
    "OnError",
    "Refused",
    "dead_letter_policy",
    "decide",
    "reason",
    "skip_policy",
]

ErrorAction = Literal["skip", "dead_letter", "raise"]


class Refused(Exception):
    """A message refused where it was going (a store took none of its rows): bad input, not
    a bug."""


BAD_INPUT: tuple[type[Exception], ...] = (SchemaError, Refused)
"""What says the message itself is bad; anything else a message raised is a component's bug
(logged with its traceback; the message is handled by the policy all the same)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The message a consumer could not handle: where it came from, and its bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes

    @property
    def place(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


OnError = Callable[[BaseException, Failed], ErrorAction]


def dead_letter_policy(exc: BaseException, message: Failed) -> ErrorAction:
    """Dead-letter it, unless it is a dead letter (skip) or the process is stopping (raise)."""
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not the message's
        return "raise"
    return "skip" if message.topic == Topics.DLQ else "dead_letter"


def skip_policy(exc: BaseException, message: Failed) -> ErrorAction:
    """Skip it (logged), unless the process is stopping (raise)."""
    return "raise" if not isinstance(exc, Exception) else "skip"


def reason(exc: BaseException) -> str:
    """One line on why: the error's own message for bad input (`BAD_INPUT`), else its type
    and first line (a component's bug: the message is kept to look at, the service goes on).

    >>> reason(SchemaError("step: field 'rank' must be >= 0")), reason(KeyError("x"))
    ("step: field 'rank' must be >= 0", "internal error: KeyError: 'x'")
    """
    if isinstance(exc, BAD_INPUT):
        return str(exc).splitlines()[0] if str(exc) else "unreadable"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"internal error: {type(exc).__name__}: {first}".rstrip(": ")


def decide(
    on_error: OnError, exc: BaseException, message: Failed, log: logging.Logger
) -> tuple[ErrorAction, str]:
    """Apply ``on_error`` to ``exc`` and ``message``, log the outcome (one line; the traceback
    too for what is not a schema error), and return the action with the reason. Re-raises
    ``exc`` where the policy says ``"raise"``."""
    action = on_error(exc, message)
    why = reason(exc)
    if action == "raise":
        raise exc
    if not isinstance(exc, BAD_INPUT):
        log.error("internal error on %s", message.place, exc_info=exc)
    if action == "dead_letter":
        log.warning("dead letter %s: %s", message.place, why)
    else:
        log.warning("skipped %s: %s", message.place, why)
    return action, why
