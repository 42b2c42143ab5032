"""One real embedded stack (Tansu broker, chDB warehouse, perfloop services) per test session."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from perfloop.settings import StackSettings
from perfloop.stack import read_state

NS = 1_000_000_000
SETTLE_MARGIN_S = 3.0
"""What `stream_settled` leaves, past its evidence, for the rows of the same stream output on the
other topics and for the actuator's commands (each ~0.2-0.5 s on an idle stack)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def perfloop_cli(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the installed CLI as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "perfloop.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def stack_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    env.update(
        PERFLOOP_HOME=str(home),
        PERFLOOP_KAFKA_PORT=str(free_port()),
        PERFLOOP_CLICKHOUSE_PORT=str(free_port()),
        PERFLOOP_METRICS_PORT=str(free_port()),  # the stream worker's /metrics
    )
    return env


def settings_for(env: dict[str, str]) -> StackSettings:
    return StackSettings(
        home=Path(env["PERFLOOP_HOME"]),
        kafka_port=int(env["PERFLOOP_KAFKA_PORT"]),
        clickhouse_port=int(env["PERFLOOP_CLICKHOUSE_PORT"]),
    )


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def query(settings: StackSettings, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """The rows of one warehouse query, as tuples."""
    from perfloop.warehouse import client

    ch = client(settings)
    try:
        return [tuple(r) for r in ch.query(sql, parameters=params).result_rows]
    finally:
        ch.close()


def short_seconds(settings: StackSettings, job_ids: list[str]) -> list[tuple[Any, ...]]:
    """(job, second, step samples, samples its 1 s windows count, each window once) for
    every second of the jobs whose windows count another number than the steps table holds:
    what a failing window-coverage check shows."""
    return query(
        settings,
        "SELECT s.job_id, s.sec, s.n, w.c FROM (SELECT job_id, toUnixTimestamp(ts) AS sec, "
        "count() AS n FROM steps WHERE job_id IN {j:Array(String)} GROUP BY job_id, sec) s "
        "LEFT JOIN (SELECT job_id, sec, sum(c) AS c FROM (SELECT job_id, "
        "toUnixTimestamp(ts) AS sec, any(count) AS c FROM windows WHERE job_id IN "
        "{j:Array(String)} AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1 "
        "GROUP BY job_id, node, rank, device, ts) GROUP BY job_id, sec) w "
        "ON s.job_id = w.job_id AND s.sec = w.sec WHERE w.c != s.n ORDER BY s.sec",
        j=job_ids,
    )


def stack_signed(settings: StackSettings, event: Any) -> Any:
    """A recommendation signed as the stack's stream tier signs its own (the key `perfloop up`
    made under its home), and expiring in 5 minutes; any other event as it is."""
    from perfloop.actuators import sign
    from perfloop.identity import PrivateKey
    from perfloop.schemas import Recommendation

    if not isinstance(event, Recommendation):
        return event
    key = PrivateKey.load(settings.home / "keys" / "streams.key")
    return sign(event.model_copy(update={"expires_ts_ns": time.time_ns() + 300 * NS}), key)


def publish(settings: StackSettings, topic: str, *events: Any) -> None:
    """Publish control-plane events as a bare client would (keyed by their job, a setting by
    whom it applies to), and wait for the broker to take them."""
    from confluent_kafka import Producer

    from perfloop.schemas import ConfigChange, encode_event

    p = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 0})
    for ev in events:
        key = ev.applies_to if isinstance(ev, ConfigChange) else ev.job_id
        p.produce(topic, key=key.encode(), value=encode_event(ev))
    assert p.flush(15) == 0


def audit_of(settings: StackSettings, rec_id: str) -> list[tuple[Any, ...]]:
    """The ``audit`` rows of a recommendation (or a setting, by its event id): (outcome,
    actor, reason, command_id), oldest first, each once."""
    return query(
        settings,
        "SELECT outcome, actor, reason, command_id FROM audit WHERE rec_id = {r:String} "
        "ORDER BY ts LIMIT 1 BY event_id",
        r=rec_id,
    )


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def last_step_ns(truth: Path) -> int:
    """When the last step of a real-scenario job ended (the latest ``end_ns`` of the ground
    truth its ranks wrote to ``truth``, `bench.realworld_jobs`)."""
    ends = [json.loads(f.read_text()).get("end_ns") or 0 for f in truth.glob("rank*.json")]
    assert ends and max(ends) > 0, f"no step ended in the ground truth in {truth}"
    return max(ends)


def stream_settled(settings: StackSettings, job: str, last_step: int, *, at_most_s: float) -> None:
    """Wait until the stream tier has said what it will about the ended job ``job``, whose last
    step ended at ``last_step`` (wall clock, ns): on the evidence, rather than for a fixed time.

    - The job's end is in ``job_lifecycle``.
    - The 1 s window of the job that holds its last step (or a later one) has closed. The stream
      worker ticks a job's analyses (the funnel, the rules) before it closes windows, and closes
      a pane only once the analyses' clock is a lateness (1 s) past its end
      (`perfloop.streams.engine`): the diagnoses and recommendations of every step of the job
      were emitted with or before that window.
    - Every diagnosis of the job that opened is resolved: the job's end resolves what is still
      open, the funnel's last word on it. Past ``at_most_s`` after the job's end landed (the
      fixed settle this replaces), this one is waited for no longer: a hang's stall holds the
      job's clock back after its end (its ranks' last messages come after a silence as long as
      the stall), and its end may be resolved only later.

    On that evidence, ``SETTLE_MARGIN_S`` more for the rows of the same output on the other
    topics (the sink inserts each topic's rows in turn) and the actuator's commands.
    """
    wait_for(
        lambda: query(
            settings,
            "SELECT count() FROM job_lifecycle WHERE job_id = {j:String} AND rank = -1 "
            "AND state != 'started'",
            j=job,
        )[0][0],
        60,
        f"the end of job {job} in job_lifecycle",
    )
    fixed_settle_ends = time.monotonic() + at_most_s
    closed = (
        "SELECT max(toUnixTimestamp64Nano(ts)) FROM windows WHERE job_id = {j:String} "
        "AND window_s = 1"
    )
    wait_for(
        lambda: (query(settings, closed, j=job)[0][0] or 0) + NS > last_step,
        90,
        f"the closed window of job {job}'s last step",
    )
    said = (
        "SELECT groupUniqArrayIf(diagnosis_id, state = 'open'), groupUniqArrayIf(diagnosis_id, "
        "state = 'resolved') FROM diagnoses WHERE job_id = {j:String}"
    )
    while True:
        opened, resolved = query(settings, said, j=job)[0]
        if set(opened) <= set(resolved):
            time.sleep(SETTLE_MARGIN_S)
            return
        if time.monotonic() >= fixed_settle_ends:
            return
        time.sleep(0.25)


@contextlib.contextmanager
def private_stack(home: Path, *up_args: str, **env: str) -> Iterator[StackSettings]:
    """`perfloop up --detach` (and ``up_args``) on ``home`` and free ports (plus ``env``); on
    exit `down`, and wait until every process of the stack (restarted ones included) has
    exited."""
    full = stack_env(home) | env
    up = perfloop_cli("up", "--detach", *up_args, env=full)
    assert up.returncode == 0, f"perfloop up failed: {up.stdout}{up.stderr}"
    settings = settings_for(full)
    state = read_state(settings)
    assert state is not None
    try:
        yield settings
    finally:
        state = read_state(settings) or state
        down = perfloop_cli("down", env=full)
        assert down.returncode == 0, down.stderr
        pids = [state["supervisor_pid"]] + [s["pid"] for s in state["services"].values()]
        wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "the stack's processes to exit")


@pytest.fixture(scope="session")
def stack_metrics_port() -> int:
    """The port of the session stack's stream worker's /metrics."""
    return free_port()


@pytest.fixture(scope="session")
def stack(
    tmp_path_factory: pytest.TempPathFactory, stack_metrics_port: int
) -> Iterator[StackSettings]:
    home = tmp_path_factory.mktemp("perfloop-home")
    with private_stack(
        home,
        PERFLOOP_METRICS_PORT=str(stack_metrics_port),
        # The accountant: an ended job's row within seconds (the sink's 5 s flush, and a margin).
        PERFLOOP_ACCOUNTING_INTERVAL_S="2",
        PERFLOOP_ACCOUNTING_SETTLE_S="6",
        # The session's tests read topics from their start and time the stream tier: a broker
        # recycled under them (its own test: test_broker_recycle.py) would change both.
        PERFLOOP_BROKER_RECYCLE_MB="0",
    ) as settings:
        yield settings


@pytest.fixture(scope="session")
def stack_env_vars(stack: StackSettings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    env.update(
        PERFLOOP_HOME=str(stack.home),
        PERFLOOP_KAFKA_PORT=str(stack.kafka_port),
        PERFLOOP_CLICKHOUSE_PORT=str(stack.clickhouse_port),
    )
    return env
