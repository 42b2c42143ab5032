"""`perfloop.warehouse.wait_settled`: a reader that wants all of a job's rows waits until their
count has not moved for longer than a sink flush (the demo's before/after tables read the
job's last steps, which land up to `flush_interval_s` after it ended)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from perfloop.warehouse import wait_settled


class _Counts:
    """Answers each query with the count due at that moment (rows landing in flushes)."""

    def __init__(self, schedule: list[tuple[float, int]]) -> None:
        self.t0 = time.monotonic()
        self.schedule = schedule
        self.queries = 0

    def query(self, sql: str, parameters: dict[str, Any]) -> Any:
        self.queries += 1
        now = time.monotonic() - self.t0
        value = 0
        for at, n in self.schedule:
            if now >= at:
                value = n

        return SimpleNamespace(result_rows=[(value,)])


def test_it_waits_for_the_last_flush() -> None:
    ch = _Counts([(0.0, 0), (0.1, 40), (0.5, 55)])  # a first flush, then the job's last rows
    t0 = time.monotonic()
    n = wait_settled(ch, "q", {}, quiet_s=0.6, timeout_s=5.0, poll_s=0.05)  # type: ignore[arg-type]
    assert n == 55
    assert 1.1 <= time.monotonic() - t0 < 3.0  # 0.5 s, then quiet for 0.6 s


def test_nothing_landed_returns_at_the_timeout() -> None:
    ch = _Counts([(0.0, 0)])
    t0 = time.monotonic()
    assert wait_settled(ch, "q", {}, quiet_s=0.1, timeout_s=0.4, poll_s=0.05) == 0  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 0.4


def test_rows_still_landing_at_the_timeout_return_what_is_there() -> None:
    ch = _Counts([(i * 0.05, i) for i in range(100)])
    assert 0 < wait_settled(ch, "q", {}, quiet_s=1.0, timeout_s=0.3, poll_s=0.05) < 100  # type: ignore[arg-type]
