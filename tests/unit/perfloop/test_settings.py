"""Settings: read from PERFLOOP_* variables, external addresses win, bad values fail early."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from perfloop.settings import (
    ActuatorSettings,
    BaseServiceSettings,
    SinkSettings,
    StackSettings,
    StreamsSettings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PERFLOOP_"):
            monkeypatch.delenv(name)


def test_defaults_point_at_the_embedded_stack() -> None:
    s = BaseServiceSettings()
    assert s.kafka_bootstrap == "127.0.0.1:19092"
    assert s.clickhouse_url == "http://127.0.0.1:18123"
    assert not s.external_kafka and not s.external_clickhouse


def test_variables_with_the_prefix_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_HOST", "10.0.0.5")
    monkeypatch.setenv("PERFLOOP_KAFKA_PORT", "29092")
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_PORT", "28123")
    monkeypatch.setenv("PERFLOOP_HOME", "/tmp/perfloop-home")
    s = BaseServiceSettings()
    assert s.kafka_bootstrap == "10.0.0.5:29092"
    assert s.clickhouse_url == "http://10.0.0.5:28123"
    assert s.home == Path("/tmp/perfloop-home")


def test_variables_without_the_prefix_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_PORT", "29092")
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "elsewhere:9092")
    assert BaseServiceSettings().kafka_bootstrap == "127.0.0.1:19092"


def test_external_addresses_override_the_embedded_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", "kafka-0:9092,kafka-1:9092")
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_URL", "https://ch.example:8443")
    monkeypatch.setenv("PERFLOOP_KAFKA_PORT", "29092")
    s = BaseServiceSettings()
    assert s.external_kafka and s.external_clickhouse
    assert s.kafka_bootstrap == "kafka-0:9092,kafka-1:9092"
    assert s.clickhouse_url == "https://ch.example:8443"


def test_external_addresses_can_be_passed_by_variable_name_or_field_name() -> None:
    by_alias = BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1")
    by_field = BaseServiceSettings(clickhouse_url_override="http://ch:1")
    assert by_alias.kafka_bootstrap == "127.0.0.1:1"
    assert by_field.clickhouse_url == "http://ch:1"


def test_empty_override_falls_back_to_the_embedded_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", "")
    s = BaseServiceSettings()
    assert not s.external_kafka
    assert s.kafka_bootstrap == "127.0.0.1:19092"


def test_every_service_reads_the_shared_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", "k:1")
    for cls in (StackSettings, StreamsSettings, SinkSettings, ActuatorSettings):
        assert cls().kafka_bootstrap == "k:1"


@pytest.mark.parametrize(
    ("cls", "name", "value"),
    [
        (BaseServiceSettings, "PERFLOOP_KAFKA_PORT", "0"),
        (BaseServiceSettings, "PERFLOOP_KAFKA_PORT", "65536"),
        (BaseServiceSettings, "PERFLOOP_KAFKA_PORT", "kafka"),
        (BaseServiceSettings, "PERFLOOP_CLICKHOUSE_PORT", "-1"),
        (BaseServiceSettings, "PERFLOOP_CLICKHOUSE_DATABASE", "drop table; --"),
        (BaseServiceSettings, "PERFLOOP_TOPIC_PARTITIONS", "0"),
        (StackSettings, "PERFLOOP_START_TIMEOUT_S", "0"),
        (StreamsSettings, "PERFLOOP_TICK_INTERVAL_S", "0"),
        (StreamsSettings, "PERFLOOP_DATA_WAIT_SHARE_THRESHOLD", "1.5"),
        (StreamsSettings, "PERFLOOP_ALLOWED_LATENESS_S", "-1"),
        (StreamsSettings, "PERFLOOP_FETCH_MAX_WAIT_MS", "1500"),  # past the freshness bound
        (SinkSettings, "PERFLOOP_MAX_BATCH_ROWS", "0"),
        (SinkSettings, "PERFLOOP_FETCH_MIN_BYTES", "0"),
        (ActuatorSettings, "PERFLOOP_TIER", "yolo"),
        (ActuatorSettings, "PERFLOOP_COMMAND_TTL_S", "0"),
    ],
)
def test_invalid_values_raise(
    monkeypatch: pytest.MonkeyPatch, cls: type[BaseServiceSettings], name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(pydantic.ValidationError) as info:
        cls()
    field = name.removeprefix("PERFLOOP_").lower()
    assert info.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("tier", ["observe", "recommend", "approve", "auto"])
def test_every_documented_tier_is_accepted(monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    monkeypatch.setenv("PERFLOOP_TIER", tier)
    assert ActuatorSettings().tier == tier


def test_settings_are_frozen() -> None:
    s = BaseServiceSettings()
    with pytest.raises(pydantic.ValidationError):
        s.kafka_port = 1  # type: ignore[misc]


def test_secrets_do_not_show_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_SIGNING_KEY", "s3cret-key")
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_PASSWORD", "hunter2")
    s = ActuatorSettings()
    assert s.signing_key.get_secret_value() == "s3cret-key"
    assert "s3cret-key" not in repr(s) and "hunter2" not in repr(s)


def test_the_warehouse_is_https_with_a_certificate_and_key_and_refused_with_one_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from perfloop.exceptions import ConfigError
    from perfloop.settings import load_settings

    assert StackSettings().clickhouse_url.startswith("http://")
    both = StackSettings(clickhouse_tls_cert=tmp_path / "c.pem", clickhouse_tls_key=tmp_path / "k")
    assert both.clickhouse_url == f"https://127.0.0.1:{both.clickhouse_port}"
    # the password is a secret: never in the settings' text
    s = StackSettings(clickhouse_password="hunter2")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_TLS_CERT", str(tmp_path / "c.pem"))
    with pytest.raises(ConfigError) as e:
        load_settings(StackSettings)
    assert str(e.value) == (
        "invalid settings: PERFLOOP_CLICKHOUSE_TLS_CERT and PERFLOOP_CLICKHOUSE_TLS_KEY go together"
    )
