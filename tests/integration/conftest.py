"""One real embedded stack (Tansu broker, chDB warehouse, perfloop services) per test session."""

from __future__ import annotations

import contextlib
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


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@contextlib.contextmanager
def private_stack(home: Path, **env: str) -> Iterator[StackSettings]:
    """`perfloop up --detach` on ``home`` and free ports (plus ``env``); on exit `down`, and
    wait until every process of the stack (restarted ones included) has exited."""
    full = stack_env(home) | env
    up = perfloop_cli("up", "--detach", env=full)
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
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(tmp_path_factory.mktemp("perfloop-home")) as settings:
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
