"""The production topology in docker/: compose file, image and context rules.

No Docker engine is needed: the compose file is parsed and cross-checked against perfloop's
settings and CLI, the Dockerfile is read as text, and `docker compose config` (which only
parses and interpolates) runs when a Compose v2 binary is on the PATH.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from perfloop.settings import (
    AccountantSettings,
    ActuatorSettings,
    SinkSettings,
    StreamsSettings,
)

yaml = pytest.importorskip("yaml", reason="pyyaml (dev extra) is needed to read compose.yaml")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"

PERFLOOP_SERVICES = ("migrate", "streams", "sink", "actuator", "accountant")
SERVICE_SETTINGS = (StreamsSettings, SinkSettings, ActuatorSettings, AccountantSettings)
EXPECTED_COMMANDS = {
    "migrate": ["migrate"],
    "streams": ["service", "streams"],
    "sink": ["service", "sink"],
    "actuator": ["service", "actuator"],
    "accountant": ["service", "accountant"],
}
# What a deployer supplies; everything else has a default in compose.yaml.
REQUIRED_VARS = {
    "PERFLOOP_SIGNING_KEY": "test-key",
    "PERFLOOP_CLICKHOUSE_PASSWORD": "test-pw",
    "GRAFANA_ADMIN_PASSWORD": "test-admin-pw",
}

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """The subset of Compose interpolation compose.yaml uses: ${V}, ${V:-default}, ${V:?err}."""
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m["name"], m["op"], m["arg"]
        got = env.get(name)
        if op in (":-", "-"):
            return got if got else arg
        if op in (":?", "?"):
            if not got:
                raise KeyError(f"{name}: {arg}")
            return got
        return got or ""

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def _env_dict(environment: Any) -> dict[str, Any]:
    if environment is None:
        return {}
    if isinstance(environment, dict):
        return dict(environment)
    return dict(item.split("=", 1) if "=" in item else (item, None) for item in environment)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _accepted_env_names() -> set[str]:
    """Env names the service settings read: PERFLOOP_<field>, or the field's alias."""
    names: set[str] = set()
    for cls in SERVICE_SETTINGS:
        prefix = cls.model_config.get("env_prefix", "")
        for field_name, field in cls.model_fields.items():
            aliases = [a for a in (field.alias, field.validation_alias) if isinstance(a, str)]
            if aliases:
                names.update(a.upper() for a in aliases)
            else:
                names.add(f"{prefix}{field_name}".upper())
    return names


# --- services and images -------------------------------------------------------------------


def test_expected_services_present(services: dict[str, dict[str, Any]]) -> None:
    assert {"kafka", "clickhouse", *PERFLOOP_SERVICES} <= set(services)


def test_every_service_has_an_image_or_a_buildable_context(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"{name}: neither image nor build"
        build = svc.get("build")
        if build is None:
            image = svc["image"]
            assert re.fullmatch(r"[a-z0-9./_-]+:[A-Za-z0-9._-]+", image), (
                f"{name}: third-party image {image!r} must carry an explicit tag"
            )
            assert not image.endswith(":latest"), f"{name}: pin a tag, not latest"
            continue
        if isinstance(build, str):
            build = {"context": build}
        context = (DOCKER / build.get("context", ".")).resolve()
        assert context == ROOT, f"{name}: the build context must be the repository root"
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.resolve() == DOCKERFILE.resolve(), f"{name}: unexpected Dockerfile"
        assert dockerfile.is_file()
        assert (context / "pyproject.toml").is_file(), "`pip install .` needs pyproject.toml"


def test_infrastructure_images(services: dict[str, dict[str, Any]]) -> None:
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["clickhouse"]["image"].startswith("clickhouse/clickhouse-server:")


def test_perfloop_services_use_the_perfloop_image(services: dict[str, dict[str, Any]]) -> None:
    images = {services[s].get("image") for s in PERFLOOP_SERVICES}
    assert len(images) == 1, f"perfloop services disagree on the image: {images}"
    for name in PERFLOOP_SERVICES:
        assert services[name].get("build"), f"{name}: builds from docker/Dockerfile"


# --- environment -----------------------------------------------------------------------------


def test_perfloop_env_keys_map_to_settings_fields(services: dict[str, dict[str, Any]]) -> None:
    accepted = _accepted_env_names()
    for name in PERFLOOP_SERVICES:
        env = _env_dict(services[name].get("environment"))
        assert env, f"{name}: no environment"
        for key in env:
            assert key.startswith("PERFLOOP_"), f"{name}: {key} lacks the PERFLOOP_ prefix"
            assert key.upper() in accepted, (
                f"{name}: {key} is not a field or alias of the service settings classes"
            )


def test_perfloop_env_points_at_the_compose_services(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kafka_env = _env_dict(services["kafka"]["environment"])
    ch_env = _env_dict(services["clickhouse"]["environment"])
    advertised = _interpolate(str(kafka_env["KAFKA_ADVERTISED_LISTENERS"]), {})
    advertised_addrs = {item.split("://", 1)[1] for item in advertised.split(",")}

    for name in PERFLOOP_SERVICES:
        raw = _env_dict(services[name]["environment"])
        env = {k: str(_interpolate(v, REQUIRED_VARS)) for k, v in raw.items()}
        for key in list(os.environ):
            if key.startswith("PERFLOOP_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for cls in SERVICE_SETTINGS:
            s = cls()  # every value must also parse
            assert s.external_kafka and s.external_clickhouse
            assert s.kafka_bootstrap in advertised_addrs, (
                f"{name}: {s.kafka_bootstrap} is not an advertised Kafka listener"
            )
            host, _, port = s.kafka_bootstrap.rpartition(":")
            assert host in services and port.isdigit()
            assert s.clickhouse_url == "http://clickhouse:8123"
            assert s.clickhouse_database == _interpolate(ch_env["CLICKHOUSE_DB"], REQUIRED_VARS)
            assert s.clickhouse_user == _interpolate(ch_env["CLICKHOUSE_USER"], REQUIRED_VARS)
            assert s.clickhouse_password.get_secret_value() == _interpolate(
                ch_env["CLICKHOUSE_PASSWORD"], REQUIRED_VARS
            )
            assert str(s.home) == "/var/lib/perfloop"
        assert ActuatorSettings().signing_key.get_secret_value() == "test-key"
        # The partitions migrate creates should match the broker's default.
        assert str(env.get("PERFLOOP_TOPIC_PARTITIONS", "4")) == str(
            kafka_env.get("KAFKA_NUM_PARTITIONS", "4")
        )


def test_signing_key_must_be_provided(services: dict[str, dict[str, Any]]) -> None:
    for name in PERFLOOP_SERVICES:
        raw = _env_dict(services[name]["environment"])["PERFLOOP_SIGNING_KEY"]
        assert re.fullmatch(r"\$\{PERFLOOP_SIGNING_KEY:\?[^}]+\}", raw), raw
        with pytest.raises(KeyError):
            _interpolate(raw, {})


def test_kafka_is_a_single_node_kraft_combined_broker(
    services: dict[str, dict[str, Any]],
) -> None:
    env = {k: str(v) for k, v in _env_dict(services["kafka"]["environment"]).items()}
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node = env["KAFKA_NODE_ID"]
    voters = env["KAFKA_CONTROLLER_QUORUM_VOTERS"]
    assert voters.startswith(f"{node}@")
    listeners = dict(item.split("://", 1) for item in env["KAFKA_LISTENERS"].split(","))
    protocol_map = dict(
        item.split(":", 1) for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    assert set(listeners) <= set(protocol_map)
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in listeners
    assert voters.endswith(":" + listeners[env["KAFKA_CONTROLLER_LISTENER_NAMES"]].split(":")[-1])
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in listeners
    advertised = _interpolate(env["KAFKA_ADVERTISED_LISTENERS"], {})
    assert {item.split("://", 1)[0] for item in advertised.split(",")} <= set(listeners)
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == "1", key
    assert env["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] == "0"
    # The host listener is published for training nodes.
    assert any(str(p).split(":")[-1] == "9092" for p in services["kafka"]["ports"])


# --- ordering and health ---------------------------------------------------------------------


def test_depends_on_targets_exist_and_can_satisfy_their_condition(
    services: dict[str, dict[str, Any]],
) -> None:
    seen = 0
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for target, spec in deps.items():
            seen += 1
            assert target in services, f"{name} depends on unknown service {target}"
            condition = spec.get("condition", "service_started")
            if condition == "service_healthy":
                test = (services[target].get("healthcheck") or {}).get("test")
                assert test and test != ["NONE"], f"{target} has no healthcheck"
            elif condition == "service_completed_successfully":
                assert str(services[target].get("restart", "no")) == "no", (
                    f"{target} must be one-shot (restart: 'no')"
                )
            else:
                assert condition == "service_started", condition
    assert seen


def test_startup_order(services: dict[str, dict[str, Any]]) -> None:
    migrate_deps = services["migrate"]["depends_on"]
    for infra in ("kafka", "clickhouse"):
        assert migrate_deps[infra]["condition"] == "service_healthy"
    assert str(services["migrate"].get("restart")) == "no"
    for name in ("streams", "sink", "actuator"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["restart"] == "unless-stopped"


def test_healthchecks_use_the_images_own_tools(services: dict[str, dict[str, Any]]) -> None:
    kafka_test = " ".join(services["kafka"]["healthcheck"]["test"])
    assert "/opt/kafka/bin/kafka-" in kafka_test
    ch_test = " ".join(services["clickhouse"]["healthcheck"]["test"])
    assert "/ping" in ch_test or "clickhouse-client" in ch_test


def test_clickhouse_follows_the_image_docs(services: dict[str, dict[str, Any]]) -> None:
    ch = services["clickhouse"]
    env = _env_dict(ch["environment"])
    for key in ("CLICKHOUSE_DB", "CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD"):
        assert key in env
    assert str(env["CLICKHOUSE_DEFAULT_ACCESS_MANAGEMENT"]) == "1"
    assert ch["ulimits"]["nofile"] == {"soft": 262144, "hard": 262144}
    assert any(str(p).split(":")[-1] == "8123" for p in ch["ports"])
    assert any(str(v).endswith(":/var/lib/clickhouse") for v in ch["volumes"])


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes") or []:
            source = vol["source"] if isinstance(vol, dict) else str(vol).split(":", 1)[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source} is not declared"


# --- commands --------------------------------------------------------------------------------


def test_commands_are_the_expected_ones(services: dict[str, dict[str, Any]]) -> None:
    for name, argv in EXPECTED_COMMANDS.items():
        assert services[name]["command"] == argv


@pytest.mark.parametrize("service", PERFLOOP_SERVICES)
def test_cli_accepts_the_compose_command(services: dict[str, dict[str, Any]], service: str) -> None:
    if importlib.util.find_spec("perfloop.cli") is None:
        pytest.skip("perfloop.cli does not exist yet; cannot check the compose commands")
    from perfloop import cli

    assert hasattr(cli, "build_parser"), "perfloop.cli must expose build_parser()"
    parser = cli.build_parser()
    argv = services[service]["command"]
    try:
        parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on an unknown command
        pytest.fail(f"`perfloop {shlex.join(argv)}` is rejected by the CLI (exit {e.code})")


# --- image -----------------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile instructions as (KEYWORD, arguments), continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def _final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (kw, _) in enumerate(instructions) if kw == "FROM"]
    assert starts, "no FROM"
    return instructions[starts[-1] :]


def test_dockerfile_entrypoint_is_perfloop() -> None:
    final = _final_stage(_instructions(DOCKERFILE.read_text()))
    entrypoints = [args for kw, args in final if kw == "ENTRYPOINT"]
    assert entrypoints, "the final stage sets no ENTRYPOINT"
    assert json.loads(entrypoints[-1]) == ["perfloop"]


def test_dockerfile_runs_as_non_root() -> None:
    final = _final_stage(_instructions(DOCKERFILE.read_text()))
    users = [args for kw, args in final if kw == "USER"]
    assert users, "the final stage sets no USER"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_dockerfile_base_is_python_311_slim() -> None:
    instructions = _instructions(DOCKERFILE.read_text())
    args = {}
    for kw, rest in instructions:
        if kw == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k.strip()] = v.strip().strip('"')
    for kw, rest in instructions:
        if kw == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), image)
            assert image == "python:3.11-slim", image


def test_dockerfile_installs_the_project_without_torch() -> None:
    installs = []
    for kw, rest in _instructions(DOCKERFILE.read_text()):
        if kw != "RUN":
            continue
        for cmd in re.split(r"&&|;|\|\|", rest):
            words = cmd.split()
            if "pip" in words[:3] and "install" in words:
                installs.append(cmd)
    assert installs, "no pip install in the Dockerfile"
    assert any(re.search(r"install\s+(\.|/src|\S*/)(\s|$)", c) for c in installs), installs
    for cmd in installs:
        assert "torch" not in cmd.lower(), f"torch must not be installed: {cmd}"
        assert not re.search(r"\[[^\]]*\]", cmd), f"no extras in the image: {cmd}"


def test_dockerignore_trims_the_context() -> None:
    patterns = {
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in (".git", ".venv", ".perfloop"):
        assert needed in patterns, f"{needed} should be excluded from the build context"
    assert any("pytest_cache" in p for p in patterns)
    assert not any(p in ("pyproject.toml", "perfloop", "*") for p in patterns)


# --- docker compose config -------------------------------------------------------------------


def _compose_command() -> list[str] | None:
    """A Compose v2 CLI: the docker plugin, else a standalone v2 `docker-compose`."""
    candidates: list[list[str]] = []
    if docker := shutil.which("docker"):
        candidates.append([docker, "compose"])
    if standalone := shutil.which("docker-compose"):
        candidates.append([standalone])
    for cmd in candidates:
        try:
            r = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        m = re.search(r"version v?(\d+)\.", r.stdout)
        if r.returncode == 0 and m and int(m[1]) >= 2:
            return cmd
    return None


def _run_config(cmd: list[str], extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    env.pop("KAFKA_ADVERTISED_HOST", None)
    env.pop("COMPOSE_FILE", None)
    env.update(extra_env)
    return subprocess.run(
        [*cmd, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def test_docker_compose_config_accepts_the_file() -> None:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("no Docker Compose v2 CLI (`docker compose` plugin) on this machine")
    r = _run_config(cmd, REQUIRED_VARS)
    # Some wrappers swallow the exit status, so an error on stderr fails the test too.
    assert r.returncode == 0 and "error" not in r.stderr.lower(), r.stderr


def test_docker_compose_config_requires_the_signing_key() -> None:
    cmd = _compose_command()
    if cmd is None:
        pytest.skip("no Docker Compose v2 CLI (`docker compose` plugin) on this machine")
    env = {k: v for k, v in REQUIRED_VARS.items() if k != "PERFLOOP_SIGNING_KEY"}
    r = _run_config(cmd, env)
    assert r.returncode != 0 or "PERFLOOP_SIGNING_KEY" in r.stderr
    assert "set a signing key" in r.stderr
