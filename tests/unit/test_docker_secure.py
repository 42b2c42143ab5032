"""The secure production topology (docker/compose.secure.yaml over compose.yaml), checked as far
as a machine without Docker allows: the merged services' settings, the broker's listeners and
authorizer, the ACLs of each principal against the topics its code reads and writes, and the
two setup scripts run here against stand-ins of the Kafka and ClickHouse command-line tools
that record what they were asked."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from perfloop.schemas.topics import TOPICS, Topics
from perfloop.settings import ActuatorSettings, NotifierSettings, SinkSettings, StreamsSettings

yaml = pytest.importorskip("yaml", reason="pyyaml (dev extra) is needed to read compose files")

DOCKER = Path(__file__).resolve().parents[2] / "docker"
KAFKA_SERVICES = ("migrate", "streams", "sink", "actuator", "notifier")
PRINCIPALS = ("producer", "streams", "sink", "actuator", "notifier", "migrate", "operator")
CH_USERS = ("migrate", "streams", "sink", "actuator", "accountant", "grafana")
# Kafka's operation names (AclOperation, as kafka-acls.sh takes them)
OPERATIONS = {"All", "Read", "Write", "Create", "Delete", "Alter", "Describe", "ClusterAction",
              "DescribeConfigs", "AlterConfigs", "IdempotentWrite"}  # fmt: skip


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DOCKER / name).read_text())


REPLACED = {"command", "entrypoint", "test"}
"""Sequences an override file replaces (compose's merge rules: ``command``, ``entrypoint``,
``healthcheck.test``); every other sequence is appended to."""


def _merge(base: Any, over: Any) -> Any:
    """Compose's merge of an override file: mappings key by key, sequences appended but for
    `REPLACED`."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = v if k in REPLACED or k not in base else _merge(base[k], v)
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + [v for v in over if v not in base]
    return over


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    merged = _merge(_load("compose.yaml"), _load("compose.secure.yaml"))
    return merged["services"]


@pytest.fixture(scope="module")
def acls() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for line in (DOCKER / "kafka-acls.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            principal, op, kind, pattern, name = line.split("\t")
            rows.append((principal, op, kind, pattern, name))
    return rows


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    return {k: str(v) for k, v in env.items()}


def test_every_kafka_client_authenticates_as_its_own_principal_over_tls(
    services: dict[str, dict[str, Any]],
) -> None:
    users = set()
    for name in KAFKA_SERVICES:
        env = _env(services[name])
        assert env["PERFLOOP_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["PERFLOOP_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512", name
        assert env["PERFLOOP_KAFKA_SSL_CA"].startswith("/etc/perfloop/secrets/"), name
        assert "./secure:/etc/perfloop/secrets:ro" in services[name]["volumes"], name
        assert env["PERFLOOP_KAFKA_SASL_USERNAME"] == f"perfloop-{name}"
        assert env["PERFLOOP_KAFKA_SASL_PASSWORD"] == (
            f"${{PERFLOOP_KAFKA_PASSWORD_{name.upper()}:?set it}}"
        ), f"{name}: a password the deployer must give"
        users.add(env["PERFLOOP_KAFKA_SASL_USERNAME"])
    assert len(users) == len(KAFKA_SERVICES)


def test_every_warehouse_client_has_a_user_of_its_own(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in ("migrate", "streams", "sink", "actuator", "accountant"):
        env = _env(services[name])
        assert env["PERFLOOP_CLICKHOUSE_USER"] == f"perfloop-{name}"
        assert env["PERFLOOP_CLICKHOUSE_PASSWORD"].startswith(
            f"${{PERFLOOP_CLICKHOUSE_PASSWORD_{name.upper()}:?"
        )
    assert _env(services["grafana"])["CLICKHOUSE_USER"] == "perfloop-grafana"


def test_the_warehouse_speaks_https_only_and_every_client_checks_its_certificate(
    services: dict[str, dict[str, Any]],
) -> None:
    import xml.etree.ElementTree as ET

    for name in ("migrate", "streams", "sink", "actuator", "accountant"):
        env = _env(services[name])
        assert env["PERFLOOP_CLICKHOUSE_URL"] == "https://clickhouse:8443", name
        assert env["PERFLOOP_CLICKHOUSE_CA"] == "/etc/perfloop/secrets/ca.pem", name
        assert "./secure:/etc/perfloop/secrets:ro" in services[name]["volumes"], name
    ch = services["clickhouse"]
    mounts = dict(
        str(v).rsplit(":", 1)[0].split(":", 1) for v in ch["volumes"] if v.startswith(".")
    )
    config = mounts["./clickhouse-tls.xml"]
    assert config.startswith("/etc/clickhouse-server/config.d/") and config.endswith(".xml")
    root = ET.parse(DOCKER / "clickhouse-tls.xml").getroot()
    assert root.tag == "clickhouse"
    assert root.find("http_port").get("remove") == "1"  # no plain HTTP
    assert root.findtext("https_port") == "8443" and root.findtext("tcp_port_secure") == "9440"
    server = root.find("openSSL/server")
    for key in ("certificateFile", "privateKeyFile"):
        path = server.findtext(key)
        assert path.startswith(mounts["./secure"] + "/"), f"{key} {path} is not mounted"
    assert {"tlsv1", "tlsv1_1"} <= set(server.findtext("disableProtocols").split(","))
    assert "8443:8443" in ch["ports"]
    assert ch["healthcheck"]["test"][-1] == "https://clickhouse:8443/ping"


def test_the_services_settings_are_settings_fields(services: dict[str, dict[str, Any]]) -> None:
    classes = (StreamsSettings, SinkSettings, ActuatorSettings, NotifierSettings)
    fields = {
        (f.validation_alias if isinstance(f.validation_alias, str) else f"PERFLOOP_{n}").upper()
        for c in classes
        for n, f in c.model_fields.items()
    }
    for name in (*KAFKA_SERVICES, "accountant"):
        unknown = [k for k in _env(services[name]) if k.startswith("PERFLOOP_") and k not in fields]
        assert not unknown, f"{name}: {unknown}"


def test_commands_are_signed_with_the_actuators_ed25519_key(
    services: dict[str, dict[str, Any]],
) -> None:
    env = _env(services["actuator"])
    assert env["PERFLOOP_SIGNING_PRIVATE_KEY"] == "/etc/perfloop/secrets/actuator.key"
    assert env["PERFLOOP_COMMAND_KEYRING"] == "/etc/perfloop/secrets/commands.json"


def _property(env_name: str) -> str:
    """The server property an apache/kafka image environment variable sets (its documented
    rule: ``.`` is ``_``, ``_`` is ``__``, ``-`` is ``___``)."""
    body = env_name.removeprefix("KAFKA_")
    out, i = [], 0
    while i < len(body):
        if body.startswith("___", i):
            out.append("-")
            i += 3
        elif body.startswith("__", i):
            out.append("_")
            i += 2
        elif body[i] == "_":
            out.append(".")
            i += 1
        else:
            out.append(body[i].lower())
            i += 1
    return "".join(out)


def test_the_broker_takes_only_authenticated_tls_clients(
    services: dict[str, dict[str, Any]],
) -> None:
    env = _env(services["kafka"])
    props = {_property(k): v for k, v in env.items() if k.startswith("KAFKA_")}
    protocol = dict(p.split(":") for p in props["listener.security.protocol.map"].split(","))
    listeners = {
        name: addr.removeprefix("//")
        for name, addr in (entry.split(":", 1) for entry in props["listeners"].split(","))
    }
    assert set(protocol) == set(listeners) == {"CONTROLLER", "INTERNAL", "EXTERNAL"}
    assert protocol["INTERNAL"] == protocol["EXTERNAL"] == "SASL_SSL"
    # the one plaintext listener is the controller's, on the container's loopback only
    assert listeners["CONTROLLER"].startswith("127.0.0.1:")
    assert props["controller.quorum.voters"] == f"1@{listeners['CONTROLLER']}"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin;User:ANONYMOUS"
    assert props["listener.name.external.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert "ScramLoginModule" in props["listener.name.internal.scram-sha-512.sasl.jaas.config"]
    assert "ScramLoginModule" in props["listener.name.external.scram-sha-512.sasl.jaas.config"]
    plain = props["listener.name.internal.plain.sasl.jaas.config"]
    assert (
        'username="admin"' in plain
        and "user_admin=" in plain
        and "user_" not in plain.replace("user_admin", "")
    ), "PLAIN knows the admin only"
    assert props["ssl.keystore.type"] == props["ssl.truststore.type"] == "PEM"
    health = services["kafka"]["healthcheck"]["test"]
    assert health[0] == "CMD-SHELL" and len(health) == 2, "the overlay's check replaces the base's"
    assert "SASL_SSL" in health[1] and "--command-config" in health[1]
    assert "$$ADMIN_PASSWORD" in health[1] and "ADMIN_PASSWORD" in env
    assert not [k for k in env if k.startswith("KAFKA_") and "PASSWORD" in k], (
        "a KAFKA_* variable becomes a server property"
    )


def _covers(acls: list[tuple[str, ...]], principal: str, op: str, topic: str) -> bool:
    for who, operation, kind, pattern, name in acls:
        if who != principal or kind != "topic" or operation not in (op, "All"):
            continue
        if (pattern == "literal" and name == topic) or (
            pattern == "prefixed" and topic.startswith(name)
        ):
            return True
    return False


def test_each_principal_may_read_and_write_what_its_code_does(
    acls: list[tuple[str, ...]],
) -> None:
    from perfloop.stack._recycle import ACTUATOR_READS
    from perfloop.streams.engine import INPUT_TOPICS
    from perfloop.warehouse.tables import TABLES

    reads = {
        "perfloop-sink": list(TABLES),
        "perfloop-streams": [*INPUT_TOPICS, Topics.STREAM_STATE],
        "perfloop-actuator": [*ACTUATOR_READS, Topics.JOB],
        "perfloop-producer": [Topics.CONTROL],
        "perfloop-notifier": [Topics.DIAGNOSES, Topics.ACTUATIONS, Topics.PREDICTIONS],
    }
    writes = {
        "perfloop-producer": [Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN, Topics.JOB,
                              Topics.ACTUATIONS],
        "perfloop-streams": [Topics.WINDOWS, Topics.PHASES, Topics.DIAGNOSES, Topics.PREDICTIONS,
                             Topics.RECOMMENDATIONS, Topics.DLQ, Topics.STREAM_STATE],
        "perfloop-sink": [Topics.DLQ],
        "perfloop-actuator": [Topics.CONTROL, Topics.ACTUATIONS],
        "perfloop-operator": [Topics.RECOMMENDATIONS, Topics.CONTROL],
    }  # fmt: skip
    for principal, topics in reads.items():
        for t in topics:
            assert _covers(acls, principal, "Read", t), f"{principal} cannot read {t}"
    for principal, topics in writes.items():
        for t in topics:
            assert _covers(acls, principal, "Write", t), f"{principal} cannot write {t}"
    assert all(_covers(acls, "perfloop-migrate", "Create", t) for t in TOPICS)


def test_least_privilege_who_may_write_commands_and_telemetry(
    acls: list[tuple[str, ...]],
) -> None:
    principals = {a[0] for a in acls}
    assert principals == {f"perfloop-{p}" for p in PRINCIPALS}
    may_write = {t: {p for p in principals if _covers(acls, p, "Write", t)} for t in TOPICS}
    # commands and settings: the actuator and people only (signatures decide what counts)
    assert may_write[Topics.CONTROL] == {"perfloop-actuator", "perfloop-operator"}
    # training nodes write their telemetry and their acknowledgements, nothing else
    wrote = {t for t, who in may_write.items() if "perfloop-producer" in who}
    assert wrote == {Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN, Topics.JOB,
                     Topics.ACTUATIONS}  # fmt: skip
    # recommendations: the stream tier (signed) and people's approvals (signed) only
    assert may_write[Topics.RECOMMENDATIONS] == {"perfloop-streams", "perfloop-operator"}
    assert {op for _, op, *_ in acls} <= OPERATIONS
    assert {(k, p) for _, _, k, p, _ in acls} <= {
        ("topic", "literal"), ("topic", "prefixed"), ("group", "literal"),
        ("group", "prefixed"), ("cluster", "literal"),
    }  # fmt: skip
    nobody_all = [a for a in acls if a[1] == "All" and not a[4].startswith("perfloop-streams-")]
    assert not nobody_all, "All only on Faust's own topics"


def _stand_in(bin_dir: Path, name: str, log: Path) -> None:
    script = bin_dir / name
    script.write_text(
        f'#!/bin/bash\nprintf "%s\\n" "{name} $*" >> "{log}"\ncat >> "{log}" 2>/dev/null || true\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def _passwords(prefix: str, names: tuple[str, ...]) -> dict[str, str]:
    return {f"{prefix}{n.upper()}": f"{n}0123456789abcdef" for n in names}


def test_kafka_setup_makes_every_credential_and_acl(
    tmp_path: Path, acls: list[tuple[str, ...]]
) -> None:
    log = tmp_path / "calls.log"
    for tool in ("kafka-configs.sh", "kafka-acls.sh"):
        _stand_in(tmp_path, tool, log)
    env = {**os.environ, "KAFKA_BIN": str(tmp_path), "ACLS": str(DOCKER / "kafka-acls.tsv"),
           "KAFKA_ADMIN_PASSWORD": "admin0123456789ab",
           **_passwords("PERFLOOP_KAFKA_PASSWORD_", PRINCIPALS)}  # fmt: skip
    run = subprocess.run(["bash", str(DOCKER / "kafka-setup.sh")], env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    calls = [c for c in log.read_text().splitlines() if c.startswith("kafka-")]
    creds = [c for c in calls if c.startswith("kafka-configs.sh")]
    assert len(creds) == len(PRINCIPALS)
    for p in PRINCIPALS:
        assert any(f"--entity-name perfloop-{p}" in c and f"[password={p}0123456789abcdef]" in c
                   for c in creds), p  # fmt: skip
    added = [c for c in calls if c.startswith("kafka-acls.sh")]
    assert len(added) == len(acls)
    for (principal, op, kind, pattern, name), call in zip(acls, added, strict=True):
        assert f"--allow-principal User:{principal} --operation {op}" in call
        target = "--cluster" if kind == "cluster" else f"--{kind} {name}"
        assert f"{target} --resource-pattern-type {pattern}" in call
        assert "--command-config" in call and "--add" in call


def test_kafka_setup_refuses_a_weak_password_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "KAFKA_BIN": str(tmp_path), "KAFKA_ADMIN_PASSWORD": "x",
           **_passwords("PERFLOOP_KAFKA_PASSWORD_", PRINCIPALS),
           "PERFLOOP_KAFKA_PASSWORD_SINK": "short"}  # fmt: skip
    run = subprocess.run(["bash", str(DOCKER / "kafka-setup.sh")], env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.strip() == (
        "kafka-setup: PERFLOOP_KAFKA_PASSWORD_SINK must be 16 or more letters and digits"
    )


def test_clickhouse_users_each_get_their_role(tmp_path: Path) -> None:
    log = tmp_path / "sql.log"
    _stand_in(tmp_path, "clickhouse", log)
    env = {**os.environ, "CLICKHOUSE_CLIENT": f"{tmp_path / 'clickhouse'} client",
           "CLICKHOUSE_USER": "perfloop", "CLICKHOUSE_PASSWORD": "pw",
           **_passwords("PERFLOOP_CLICKHOUSE_PASSWORD_", CH_USERS)}  # fmt: skip
    run = subprocess.run(["bash", str(DOCKER / "clickhouse-users.sh")], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    sql = log.read_text()
    assert sql.startswith("clickhouse client --user perfloop --password pw --multiquery")
    grants = {"perfloop_schema": "ALL", "perfloop_writer": "INSERT, SELECT",
              "perfloop_reader": "SELECT"}  # fmt: skip
    for role, what in grants.items():
        assert f"GRANT {what} ON perfloop.* TO {role};" in sql
    roles = {"migrate": "perfloop_schema", "sink": "perfloop_writer",
             "accountant": "perfloop_writer", "streams": "perfloop_reader",
             "actuator": "perfloop_reader", "grafana": "perfloop_reader"}  # fmt: skip
    for user, role in roles.items():
        assert (f"CREATE USER IF NOT EXISTS `perfloop-{user}` IDENTIFIED WITH sha256_password "
                f"BY '{user}0123456789abcdef';") in sql  # fmt: skip
        assert f"GRANT {role} TO `perfloop-{user}`;" in sql
    bad = subprocess.run(["bash", str(DOCKER / "clickhouse-users.sh")],
                         env=env | {"PERFLOOP_CLICKHOUSE_PASSWORD_GRAFANA": "pw'; DROP"},
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 1 and "PERFLOOP_CLICKHOUSE_PASSWORD_GRAFANA must be" in bad.stderr
