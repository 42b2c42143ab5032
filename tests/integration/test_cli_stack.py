"""`perfloop up/down` as a user runs them, and the one-line errors when something is wrong."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from perfloop.kafka import cluster_id
from perfloop.schemas.topics import TOPICS
from perfloop.stack import read_state

from .conftest import perfloop_cli, pid_alive, settings_for, stack_env, wait_for

pytestmark = pytest.mark.integration


def _one_line_error(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got: {out!r}"
    assert "Traceback" not in out
    return lines[0]


def test_down_leaves_no_process_behind(tmp_path: Path) -> None:
    env = stack_env(tmp_path)
    try:
        up = perfloop_cli("up", "--detach", env=env)
        assert up.returncode == 0, up.stderr
        state = read_state(settings_for(env))
        assert state is not None
        first = [state["supervisor_pid"]] + [s["pid"] for s in state["services"].values()]
        # the supervisor, broker, warehouse, stream worker, sink, actuator and accountant
        assert len(first) == 7 and all(pid_alive(p) for p in first)

        again = perfloop_cli("up", "--detach", env=env)  # idempotent: reports the running stack
        assert again.returncode == 0 and read_state(settings_for(env)) == state

        # A crashed service is restarted; the broker comes back with its topics recreated, as a
        # cluster of its own (its log starts empty: a stream snapshot's positions do not hold).
        first_cluster = cluster_id(settings_for(env))
        os.kill(state["services"]["broker"]["pid"], signal.SIGKILL)
        restarted = wait_for(
            lambda: (
                (s := read_state(settings_for(env)))
                and s["services"]["broker"]["restarts"] == 1
                and s["state"] == "up"
                and s
            ),
            30,
            "the broker to be restarted",
        )
        assert set(TOPICS) <= set(
            AdminClient({"bootstrap.servers": settings_for(env).kafka_bootstrap})
            .list_topics(timeout=10)
            .topics
        )
        second_cluster = cluster_id(settings_for(env))
        assert first_cluster and first_cluster.startswith("perfloop-")
        assert second_cluster and second_cluster.startswith("perfloop-")
        assert first_cluster != second_cluster
        pids = [restarted["supervisor_pid"]] + [s["pid"] for s in restarted["services"].values()]

        down = perfloop_cli("down", env=env)
        assert down.returncode == 0 and "stopped" in down.stdout
        wait_for(lambda: not any(pid_alive(p) for p in pids + first), 20, "every process to exit")
        assert read_state(settings_for(env)) is None
        for port in (env["PERFLOOP_KAFKA_PORT"], env["PERFLOOP_CLICKHOUSE_PORT"]):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", int(port)))  # free again
        status = perfloop_cli("status", env=env)
        assert status.returncode == 3 and "down" in status.stdout
        assert perfloop_cli("down", env=env).stdout.strip() == "perfloop was not running"
    finally:  # a failed check must not leave the stack running
        perfloop_cli("down", env=env)


@pytest.mark.parametrize("which", ["PERFLOOP_KAFKA_PORT", "PERFLOOP_CLICKHOUSE_PORT"])
def test_port_in_use_is_one_line(tmp_path: Path, which: str) -> None:
    env = stack_env(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env[which] = str(holder.getsockname()[1])
        out = perfloop_cli("up", env=env, timeout=60)
    assert out.returncode == 1
    line = _one_line_error(out.stderr)
    assert f"port {env[which]} on 127.0.0.1 is in use" in line and which in line


def test_unreachable_external_kafka_is_one_line(tmp_path: Path) -> None:
    env = stack_env(tmp_path) | {"PERFLOOP_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    out = perfloop_cli("up", "--detach", env=env, timeout=60)
    assert out.returncode == 1
    assert "Kafka broker at 127.0.0.1:1 is unreachable" in _one_line_error(out.stderr)


def test_unreachable_external_clickhouse_is_one_line(tmp_path: Path) -> None:
    env = stack_env(tmp_path) | {"PERFLOOP_CLICKHOUSE_URL": "http://127.0.0.1:1"}
    out = perfloop_cli("sql", "SELECT 1", env=env, timeout=60)
    assert out.returncode == 1
    assert "ClickHouse at http://127.0.0.1:1 is unreachable" in _one_line_error(out.stderr)
    # `up` checks the external warehouse before starting anything (the broker is embedded
    # here and its port is free, so only the warehouse can fail).
    out = perfloop_cli("up", "--detach", env=env, timeout=60)
    assert out.returncode == 1
    assert "ClickHouse at http://127.0.0.1:1 is unreachable" in _one_line_error(out.stderr)


def test_unknown_option_is_one_line(tmp_path: Path) -> None:
    out = perfloop_cli("up", "--no-such-option", env=stack_env(tmp_path))
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-option" in _one_line_error(out.stderr)
    out = perfloop_cli("no-such-command", env=stack_env(tmp_path))
    assert out.returncode == 2
    assert "invalid choice" in _one_line_error(out.stderr)


def test_sql_command_against_the_stack(stack_env_vars: dict[str, str]) -> None:
    out = perfloop_cli(
        "sql",
        "SELECT version FROM schema_migrations ORDER BY version",
        "--format",
        "json",
        env=stack_env_vars,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == '{"version": 1}'
    bad = perfloop_cli("sql", "SELEC nonsense", env=stack_env_vars)
    assert bad.returncode == 1
    assert "DB::Exception" in _one_line_error(bad.stderr)
    missing = perfloop_cli("sql", "SELECT count() FROM no_such_table", env=stack_env_vars)
    assert missing.returncode == 1
    assert _one_line_error(missing.stderr).endswith(
        "the warehouse has no no_such_table table yet; run `perfloop migrate`"
    )


def test_sql_takes_format_ddl_and_several_statements(stack_env_vars: dict[str, str]) -> None:
    """What a ClickHouse client takes: the server's own FORMAT, DDL and INSERT (``ok``), and
    several statements run in order; a failing one stops the rest in one line that says how
    many ran."""
    fmt = perfloop_cli("sql", "SELECT 1 AS x, 'a;b' AS s FORMAT JSONEachRow", env=stack_env_vars)
    assert fmt.returncode == 0, fmt.stderr
    assert fmt.stdout == '{"x":1,"s":"a;b"}\n'
    script = (
        "CREATE TABLE sql_cli_t (x Int32) ENGINE = Memory; "
        "INSERT INTO sql_cli_t VALUES (1), (2); "
        "SELECT sum(x) AS total FROM sql_cli_t -- a comment; not a statement\n; "
        "DROP TABLE sql_cli_t;"
    )
    out = perfloop_cli("sql", script, env=stack_env_vars)
    assert out.returncode == 0, out.stderr
    blocks = [b.split() for b in out.stdout.strip().split("\n\n")]
    assert blocks == [["ok"], ["ok"], ["total", "-----", "3"], ["ok"]], out.stdout
    gone = perfloop_cli("sql", "EXISTS TABLE sql_cli_t", "--format", "json", env=stack_env_vars)
    assert gone.returncode == 0 and gone.stdout.strip() == '{"result": 0}', gone.stdout
    bad = perfloop_cli("sql", "SELECT 1 AS a; SELEC 2; SELECT 3", env=stack_env_vars)
    assert bad.returncode == 1 and bad.stdout.split() == ["a", "-", "1"]
    assert _one_line_error(bad.stderr).startswith("perfloop: statement 2 of 3 (1 ran before it): ")
    empty = perfloop_cli("sql", " ; -- nothing", env=stack_env_vars)
    assert empty.returncode != 0 and "empty query" in _one_line_error(empty.stderr)


def test_capture_refuses_an_unknown_job_and_a_bad_step_count(
    stack_env_vars: dict[str, str],
) -> None:
    """`perfloop capture` asks only a job the warehouse knows, for a step count the knob
    allows; each refusal is one line (the whole path, on a real job: docs/actuation.md)."""
    out = perfloop_cli("capture", "no-such-job", "--steps", "3", env=stack_env_vars)
    assert out.returncode == 1
    assert "no job 'no-such-job' in the warehouse" in _one_line_error(out.stderr)
    bad = perfloop_cli("capture", "j", "--steps", "500", env=stack_env_vars)
    assert bad.returncode == 2 and "takes 1 to 50 steps" in _one_line_error(bad.stderr)
