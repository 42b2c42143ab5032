"""The one policy for a message a consumer cannot handle: what each kind of failure becomes
(dead letter, skip, raise), the reason written with it, and what the log says."""

from __future__ import annotations

import logging

import pytest

from perfloop.bad_input import (
    Failed,
    Refused,
    dead_letter_policy,
    decide,
    reason,
    skip_policy,
)
from perfloop.schemas import SchemaError
from perfloop.schemas.topics import Topics

STEP = Failed(Topics.STEP, 2, 41, b"job-1", b"\x00junk")
LETTER = Failed(Topics.DLQ, 0, 9, None, b"\x00junk")
log = logging.getLogger("test.bad_input")


@pytest.mark.parametrize(
    ("exc", "message", "expected"),
    [
        (SchemaError("step: not valid JSON"), STEP, "dead_letter"),
        (Refused("warehouse refused steps rows"), STEP, "dead_letter"),
        (KeyError("x"), STEP, "dead_letter"),  # a component's bug: the message is kept
        (SchemaError("dead letter unreadable"), LETTER, "skip"),  # never dead-lettered again
        (KeyboardInterrupt(), STEP, "raise"),
        (SystemExit(0), LETTER, "raise"),
    ],
)
def test_the_dead_letter_policy(exc: BaseException, message: Failed, expected: str) -> None:
    assert dead_letter_policy(exc, message) == expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [(SchemaError("x"), "skip"), (ValueError("x"), "skip"), (KeyboardInterrupt(), "raise")],
)
def test_the_skip_policy(exc: BaseException, expected: str) -> None:
    assert skip_policy(exc, STEP) == expected


def test_the_reason_is_one_line() -> None:
    assert reason(SchemaError("step: field 'rank' < 0\nmore")) == "step: field 'rank' < 0"
    assert reason(Refused("warehouse refused steps rows: Code: 27")) == (
        "warehouse refused steps rows: Code: 27"
    )
    assert reason(ZeroDivisionError("division by zero\n  at ...")) == (
        "internal error: ZeroDivisionError: division by zero"
    )
    assert reason(RuntimeError()) == "internal error: RuntimeError"


def test_decide_logs_bad_input_in_one_line_and_a_bug_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=log.name)
    assert decide(dead_letter_policy, SchemaError("bad"), STEP, log) == ("dead_letter", "bad")
    (line,) = caplog.records
    assert line.getMessage() == f"dead letter {Topics.STEP}[2]@41: bad" and not line.exc_info
    caplog.clear()
    try:
        {}["x"]
    except KeyError as e:
        assert decide(skip_policy, e, STEP, log) == ("skip", "internal error: KeyError: 'x'")
    bug, skipped = caplog.records
    assert bug.exc_info is not None and bug.levelno == logging.ERROR
    assert skipped.getMessage().startswith(f"skipped {Topics.STEP}[2]@41: internal error")


def test_decide_raises_what_the_policy_says_to_raise() -> None:
    with pytest.raises(KeyboardInterrupt):
        decide(dead_letter_policy, KeyboardInterrupt(), STEP, log)
