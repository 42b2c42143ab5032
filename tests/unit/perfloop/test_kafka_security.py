"""Kafka security settings reach every client: librdkafka's (`perfloop.kafka`, which every
producer, consumer and admin client is built from) and the stream workers' Faust consumer
(`perfloop.streams.app.create_app`), checked on the configuration each builds, and accepted
by both libraries. Bad combinations are refused with one line."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from perfloop.exceptions import ConfigError
from perfloop.kafka import _common, security_config
from perfloop.settings import StackSettings, StreamsSettings, load_settings
from perfloop.streams._auth import faust_credentials
from tests.tls import Pki, make_pki


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PERFLOOP_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("kafka-pki"))


def _settings(pki: Pki, protocol: str, **over: Any) -> StackSettings:
    kw: dict[str, Any] = {"kafka_security_protocol": protocol}
    if protocol.startswith("SASL"):
        kw |= {"kafka_sasl_username": "ann", "kafka_sasl_password": "pw-secret"}
    if protocol.endswith("SSL"):
        kw |= {"kafka_ssl_ca": pki.ca, "kafka_ssl_cert": pki.cert, "kafka_ssl_key": pki.key}
    return StackSettings(**(kw | over))


@pytest.mark.parametrize("protocol", ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"])
def test_librdkafka_and_faust_get_the_same_security(pki: Pki, protocol: str) -> None:
    s = _settings(pki, protocol, kafka_sasl_mechanism="SCRAM-SHA-256")
    rd = _common(s)
    aio = credentials_to_aiokafka_auth(faust_credentials(s))  # what Faust hands aiokafka
    assert aio["security_protocol"] == rd.get("security.protocol", "PLAINTEXT") == protocol
    if protocol.startswith("SASL"):
        assert (rd["sasl.mechanism"], rd["sasl.username"], rd["sasl.password"]) == (
            "SCRAM-SHA-256", "ann", "pw-secret",
        )  # fmt: skip
        assert (aio["sasl_mechanism"], aio["sasl_plain_username"], aio["sasl_plain_password"]) == (
            "SCRAM-SHA-256", "ann", "pw-secret",
        )  # fmt: skip
    else:
        assert not any(k.startswith("sasl") for k in rd) and "sasl_mechanism" not in aio
    if protocol.endswith("SSL"):
        assert rd["ssl.ca.location"] == str(pki.ca)
        assert (rd["ssl.certificate.location"], rd["ssl.key.location"]) == (
            str(pki.cert), str(pki.key),
        )  # fmt: skip
        ctx = aio["ssl_context"]
        assert [c["subject"] for c in ctx.get_ca_certs()] == [
            ((("commonName", "perfloop-test CA"),),)
        ]  # the CA given, not the system's
    else:
        assert not any(k.startswith("ssl") for k in rd) and aio.get("ssl_context") is None
    # both libraries take it as it is (librdkafka checks the files and names here)
    Producer(rd).flush(0)
    c = Consumer(rd | {"group.id": "g"})
    c.close()

    async def build() -> None:
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", **aio)
        await consumer.stop()

    asyncio.run(build())


def test_the_stream_workers_faust_app_is_given_the_credentials(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    import perfloop.streams.app as app_module

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_app(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise Stop  # nothing else of the worker is built

    monkeypatch.setattr(app_module.faust, "App", fake_app)
    s = StreamsSettings(
        kafka_security_protocol="SASL_SSL", kafka_sasl_username="ann",
        kafka_sasl_password="pw-secret", kafka_ssl_ca=pki.ca,
    )  # fmt: skip
    with pytest.raises(Stop):
        app_module.create_app(s)
    auth = credentials_to_aiokafka_auth(seen["broker_credentials"])
    assert auth["security_protocol"] == "SASL_SSL"
    assert auth["sasl_plain_username"] == "ann" and auth["sasl_mechanism"] == "SCRAM-SHA-512"


def test_a_client_certificate_with_a_key_password_is_loaded(tmp_path: Path, pki: Pki) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.key.read_bytes(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"unlock"),
        )
    )
    s = _settings(pki, "SSL", kafka_ssl_key=locked, kafka_ssl_key_password="unlock")
    assert security_config(s)["ssl.key.password"] == "unlock"
    faust_credentials(s)  # loads the chain with the password
    Producer(_common(s)).flush(0)
    wrong = _settings(pki, "SSL", kafka_ssl_key=locked, kafka_ssl_key_password="no")
    with pytest.raises(ConfigError, match=r"cannot load the Kafka client certificate .*_PASSWORD"):
        faust_credentials(wrong)
    with pytest.raises(ConfigError, match="cannot read the Kafka CA"):
        faust_credentials(_settings(pki, "SSL", kafka_ssl_ca=tmp_path / "none.pem"))


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"PERFLOOP_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "needs PERFLOOP_KAFKA_SASL_USERNAME"),
        ({"PERFLOOP_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
          "PERFLOOP_KAFKA_SASL_USERNAME": "a"},
         "needs PERFLOOP_KAFKA_SASL_USERNAME and PERFLOOP_KAFKA_SASL_PASSWORD"),
        ({"PERFLOOP_KAFKA_SSL_CA": "/ca.pem"}, "PERFLOOP_KAFKA_SECURITY_PROTOCOL is PLAINTEXT"),
        ({"PERFLOOP_KAFKA_SECURITY_PROTOCOL": "SSL", "PERFLOOP_KAFKA_SSL_CERT": "/c.pem"},
         "PERFLOOP_KAFKA_SSL_CERT and PERFLOOP_KAFKA_SSL_KEY go together"),
        ({"PERFLOOP_KAFKA_SECURITY_PROTOCOL": "TLS"}, "Input should be 'PLAINTEXT', 'SSL'"),
        ({"PERFLOOP_KAFKA_SASL_MECHANISM": "GSSAPI"}, "PERFLOOP_KAFKA_SASL_MECHANISM='GSSAPI'"),
    ],
)  # fmt: skip
def test_bad_combinations_are_one_line(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], says: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load_settings(StackSettings)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_secrets_are_not_in_the_settings_text(pki: Pki) -> None:
    s = _settings(pki, "SASL_SSL", kafka_ssl_key_password="keypw")
    shown = repr(s) + str(s.model_dump())
    assert "pw-secret" not in shown and "keypw" not in shown
