"""Acceptance (issue 25): the embedded stack beyond loopback, `perfloop up --listen ADDR`.

A stack of the module's own listens at this machine's own address (not loopback, where it
has one), its broker recycled every few MiB. A node gets its bundle from `perfloop keys
client` and, with a home of its own, runs a simulated 8-rank job with a starving loader through
it. Then:

- a client without TLS, with TLS but no client certificate, or with a certificate another CA
  signed reaches no broker; the warehouse answers neither plain HTTP nor HTTPS without the
  password;
- the job's every step is in the warehouse, once, across the broker's recycles (each broker
  process behind a TLS front of its own), no service restarted, and the starving loader was
  diagnosed;
- the CLI on the stack's machine, with no settings, reaches the stack with its own client
  settings; a person's bundle with ``--warehouse`` queries it from another home, one without
  it gets one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from perfloop.listening import reach_listening_stack
from perfloop.settings import StackSettings
from perfloop.stack import read_state
from tests.tls import make_pki

from .conftest import perfloop_cli, private_stack, query, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _this_machine() -> str:
    """An address of this machine other than loopback, where it has one."""
    candidates: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
        s.connect(("192.0.2.1", 9))  # no packet is sent: the route's source address
        candidates.append(s.getsockname()[0])
    with contextlib.suppress(OSError):
        candidates.append(socket.gethostbyname(socket.gethostname()))
    for addr in candidates:
        if not addr.startswith("127."):
            with socket.socket() as s:
                try:
                    s.bind((addr, 0))
                except OSError:
                    continue
            return addr
    return "127.0.0.1"


ADDR = _this_machine()


@pytest.fixture(scope="module")
def listening(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(
        tmp_path_factory.mktemp("perfloop-listen"),
        "--listen",
        ADDR,
        PERFLOOP_BROKER_RECYCLE_MB="4",
        PERFLOOP_BROKER_RECYCLE_RETRY_S="5",
    ) as settings:
        yield reach_listening_stack(settings)


def _home_env(stack: StackSettings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    return env | {"PERFLOOP_HOME": str(stack.home)}


def _node_env(bundle: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    for line in bundle.read_text().splitlines():
        name, _, value = line.partition("=")
        env[name] = value
    return env | {"PERFLOOP_HOME": str(home)}


def _metadata(conf: dict[str, str]) -> bool:
    client = AdminClient({"bootstrap.servers": f"{ADDR}:{conf.pop('port')}", "log_level": 0} | conf)
    try:
        client.list_topics(timeout=3)
    except Exception:
        return False
    return True


def test_a_node_reaches_the_listening_stack_only_with_its_certificate(
    listening: StackSettings, tmp_path: Path
) -> None:
    stack = listening
    state = read_state(stack)
    assert state is not None
    assert state["kafka_bootstrap"] == f"{ADDR}:{stack.kafka_port}"
    assert state["clickhouse_url"] == f"https://{ADDR}:{stack.clickhouse_port}"

    made = perfloop_cli("keys", "client", "node-1", "--out", str(tmp_path / "node-1"),
                        env=_home_env(stack))  # fmt: skip
    assert made.returncode == 0, made.stderr
    node = _node_env(tmp_path / "node-1" / "perfloop.env", tmp_path / "node-home")

    # who reaches nothing: no TLS, TLS without a certificate, a certificate of another CA
    port = str(stack.kafka_port)
    ca = node["PERFLOOP_KAFKA_SSL_CA"]
    other = make_pki(tmp_path / "other", "intruder")
    assert not _metadata({"port": port})
    assert not _metadata({"port": port, "security.protocol": "SSL", "ssl.ca.location": ca})
    assert not _metadata({"port": port, "security.protocol": "SSL", "ssl.ca.location": ca,
                          "ssl.certificate.location": str(other.cert),
                          "ssl.key.location": str(other.key)})  # fmt: skip
    assert _metadata({"port": port, "security.protocol": "SSL", "ssl.ca.location": ca,
                      "ssl.certificate.location": node["PERFLOOP_KAFKA_SSL_CERT"],
                      "ssl.key.location": node["PERFLOOP_KAFKA_SSL_KEY"]})  # fmt: skip
    said = (stack.home / "logs" / "supervisor.log").read_text()
    assert f"refused a client at {ADDR}: TLS handshake failed" in said  # on record
    url = f"{ADDR}:{stack.clickhouse_port}/?query=SELECT%201"
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{url}", timeout=5)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(
            f"https://{url}", timeout=5, context=ssl.create_default_context(cafile=ca)
        )
    assert refused.value.code == 401

    # a job on the node, through the fronts, across the broker's recycles
    job = "listen-node-job"
    run = perfloop_cli("simulate", "--scenario", "dataloader_starvation", "--nodes", "2",
                       "--ranks-per-node", "4", "--duration", "120", "--speed", "4",
                       "--job-id", job, env=node, timeout=180)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    done = re.search(r"done: finished.* ([\d,]+) steps", run.stdout)
    assert done is not None, run.stdout
    expected = int(done.group(1).replace(",", "")) * 8

    def landed() -> int:
        sql = "SELECT count() FROM steps WHERE job_id = {j:String}"
        return int(query(stack, sql, j=job)[0][0])

    wait_for(lambda: landed() >= expected, 30, "the job's steps in the warehouse")
    rows = landed()
    assert rows == expected
    distinct = query(stack, "SELECT count(DISTINCT (node, rank, step)) FROM steps "
                     "WHERE job_id = {j:String}", j=job)[0][0]  # fmt: skip
    assert distinct == rows, "a step landed twice"
    state = read_state(stack)
    assert state is not None
    assert state["broker_recycling"]["recycles"] >= 1, state["broker_recycling"]
    assert all(s["restarts"] == 0 for s in state["services"].values()), state["services"]
    diagnosed = (
        "SELECT count() FROM diagnoses WHERE job_id = {j:String} "
        "AND bottleneck = 'dataloader_starvation'"
    )
    wait_for(lambda: query(stack, diagnosed, j=job)[0][0], 30, "the starving loader's diagnosis")

    # the stack's machine with no settings; a person's machine with and without the password
    local = perfloop_cli("sql", "SELECT count() FROM steps", env=_home_env(stack))
    assert local.returncode == 0 and str(rows) in local.stdout, local.stdout + local.stderr
    made = perfloop_cli("keys", "client", "laptop", "--warehouse", "--out",
                        str(tmp_path / "laptop"), env=_home_env(stack))  # fmt: skip
    assert made.returncode == 0, made.stderr
    laptop = _node_env(tmp_path / "laptop" / "perfloop.env", tmp_path / "laptop-home")
    asked = perfloop_cli("sql", "SELECT count() FROM steps", env=laptop)
    assert asked.returncode == 0 and str(rows) in asked.stdout, asked.stdout + asked.stderr
    node["PERFLOOP_CLICKHOUSE_URL"] = laptop["PERFLOOP_CLICKHOUSE_URL"]
    node["PERFLOOP_CLICKHOUSE_CA"] = laptop["PERFLOOP_CLICKHOUSE_CA"]
    denied = perfloop_cli("sql", "SELECT count() FROM steps", env=node)
    assert denied.returncode != 0
    assert len(denied.stderr.strip().splitlines()) == 1, denied.stderr
