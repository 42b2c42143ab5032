"""Acceptance (issue 25): clients reach a warehouse that requires TLS and a password — the
embedded warehouse server serving HTTPS with a test certificate — and fail with one clear line
when the password or the CA is wrong.

The server is the real one (``python -m perfloop.stack.warehouse_server``, chDB on a data
directory of the test's own) with ``PERFLOOP_CLICKHOUSE_TLS_CERT``/``_KEY`` and
``PERFLOOP_CLICKHOUSE_PASSWORD``; the certificate authority is made by the test
(`tests.tls`). The clients are perfloop's own: `perfloop.warehouse.client` and ``perfloop
sql`` as a user runs it.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from perfloop.exceptions import WarehouseError
from perfloop.settings import StackSettings
from perfloop.stack.control import _http_ok
from perfloop.warehouse import client
from tests.tls import Pki, make_pki

from .conftest import perfloop_cli, stack_env, wait_for

pytestmark = pytest.mark.integration

PASSWORD = f"pw-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, str], Pki]]:
    home = tmp_path_factory.mktemp("perfloop-tls")
    pki = make_pki(home / "pki")
    env = stack_env(home) | {
        "PERFLOOP_CLICKHOUSE_TLS_CERT": str(pki.cert),
        "PERFLOOP_CLICKHOUSE_TLS_KEY": str(pki.key),
        "PERFLOOP_CLICKHOUSE_PASSWORD": PASSWORD,
        "PERFLOOP_CLICKHOUSE_CA": str(pki.ca),
    }
    log = (home / "warehouse.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "perfloop.stack.warehouse_server", "--data-dir", str(home / "wh")],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"https://127.0.0.1:{env['PERFLOOP_CLICKHOUSE_PORT']}"
        wait_for(lambda: _http_ok(url, pki.ca) or proc.poll() is not None, 60, "the server")
        assert proc.poll() is None, (home / "warehouse.log").read_text()
        yield env, pki
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
        text = (home / "warehouse.log").read_text(errors="replace")
        assert PASSWORD not in text, "the password is in the server's log"


def _settings(env: dict[str, str], **over: object) -> StackSettings:
    base: dict[str, object] = {
        "home": Path(env["PERFLOOP_HOME"]),
        "clickhouse_port": int(env["PERFLOOP_CLICKHOUSE_PORT"]),
        "clickhouse_tls_cert": Path(env["PERFLOOP_CLICKHOUSE_TLS_CERT"]),
        "clickhouse_tls_key": Path(env["PERFLOOP_CLICKHOUSE_TLS_KEY"]),
        "clickhouse_ca": Path(env["PERFLOOP_CLICKHOUSE_CA"]),
        "clickhouse_password": PASSWORD,
    }
    return StackSettings(**(base | over))  # type: ignore[arg-type]


def test_with_the_ca_and_the_password_a_client_queries_over_https(
    tls_server: tuple[dict[str, str], Pki],
) -> None:
    env, _ = tls_server
    s = _settings(env)
    assert s.clickhouse_url.startswith("https://")
    c = client(s, database="default")
    assert c.query("SELECT 40 + 2").result_rows == [(42,)]
    c.command(f"CREATE DATABASE IF NOT EXISTS {s.clickhouse_database}")
    c.command("CREATE TABLE IF NOT EXISTS t (x UInt32) ENGINE = MergeTree ORDER BY x")
    c.insert("t", [[1], [2]], column_names=["x"])
    assert c.query("SELECT sum(x) FROM t").result_rows == [(3,)]
    # and as a user runs it, with the environment only
    out = perfloop_cli("sql", "SELECT 6 * 7 AS answer", env=env)
    assert out.returncode == 0 and "42" in out.stdout, out.stderr


@pytest.mark.parametrize(
    ("case", "over", "says"),
    [
        ("wrong password", {"clickhouse_password": "nope"}, "was refused: wrong password"),
        ("no password", {"clickhouse_password": ""}, "was refused: wrong password"),
        ("another user", {"clickhouse_user": "mallory"}, "user 'mallory' was refused"),
        ("wrong CA", {"clickhouse_ca": "other"}, "its TLS certificate is not trusted"),
        ("no CA", {"clickhouse_ca": None}, "its TLS certificate is not trusted"),
        ("plain HTTP", {"clickhouse_tls_cert": None, "clickhouse_tls_key": None}, "HTTPS"),
    ],
)
def test_a_wrong_password_or_ca_is_one_clear_line(
    tls_server: tuple[dict[str, str], Pki],
    tmp_path: Path,
    case: str,
    over: dict[str, object],
    says: str,
) -> None:
    env, _ = tls_server
    if over.get("clickhouse_ca") == "other":
        over = {"clickhouse_ca": make_pki(tmp_path, "other").ca}
    with pytest.raises(WarehouseError) as e:
        client(_settings(env, **over), database="default").query("SELECT 1")
    line = str(e.value)
    assert "\n" not in line and says in line, line
    assert PASSWORD not in line

    # the CLI: one line on stderr, exit 1, no traceback
    cli_env = dict(env)
    for k, v in over.items():
        name = f"PERFLOOP_{k.upper()}"
        if v is None:
            cli_env.pop(name, None)
        else:
            cli_env[name] = str(v)
    out = perfloop_cli("sql", "SELECT 1", env=cli_env)
    err = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode != 0 and len(err) == 1 and says in err[0], (case, out.stderr)
    assert "Traceback" not in out.stderr and PASSWORD not in out.stderr


def test_ping_needs_no_password_and_the_server_outlives_bad_clients(
    tls_server: tuple[dict[str, str], Pki], tmp_path: Path
) -> None:
    env, pki = tls_server
    port = int(env["PERFLOOP_CLICKHOUSE_PORT"])
    url = f"https://127.0.0.1:{port}"
    assert _http_ok(url, pki.ca)  # the supervisor's readiness check
    assert not _http_ok(url, make_pki(tmp_path, "other").ca)
    # a client that speaks no TLS, one that stalls in its handshake, one that hangs up
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(OSError):
            assert b"Ok." not in raw.recv(100)
    stalled = socket.create_connection(("127.0.0.1", port), timeout=5)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with ctx.wrap_socket(
        socket.create_connection(("127.0.0.1", port)), server_hostname="localhost"
    ):
        pass
    try:  # answered while the stalled one still waits (a blocked server would time out)
        c = client(_settings(env), database="default", timeout_s=10)
        assert c.query("SELECT 1").result_rows == [(1,)]
    finally:
        stalled.close()
