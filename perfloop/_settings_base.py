"""What every perfloop process's settings share (`perfloop.settings` re-exports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["DEV_SIGNING_KEY", "SETTINGS_CONFIG", "BaseServiceSettings"]

SETTINGS_CONFIG = SettingsConfigDict(
    env_prefix="PERFLOOP_", frozen=True, extra="ignore", populate_by_name=True
)


DEV_SIGNING_KEY = "perfloop-embedded-dev-key"
"""The embedded stack's command-signing key; set ``PERFLOOP_SIGNING_KEY`` in production."""


class BaseServiceSettings(BaseSettings):
    """What every perfloop process needs: where state lives and how to reach the stack."""

    model_config = SETTINGS_CONFIG

    home: Path = Field(Path(".perfloop"), description="Logs and state of the embedded stack.")
    host: str = Field("127.0.0.1", description="Loopback address the embedded stack binds.")
    kafka_port: int = Field(19092, ge=1, le=65535)
    clickhouse_port: int = Field(18123, ge=1, le=65535)
    kafka_bootstrap_override: str | None = Field(
        None, alias="PERFLOOP_KAFKA_BOOTSTRAP", description="External Kafka-API bootstrap."
    )
    clickhouse_url_override: str | None = Field(
        None, alias="PERFLOOP_CLICKHOUSE_URL", description="External ClickHouse HTTP URL."
    )
    clickhouse_database: str = Field("perfloop", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    clickhouse_user: str = "default"
    clickhouse_password: SecretStr = SecretStr("")
    """The warehouse user's password. The embedded warehouse asks for it (user and password)
    on every query once it is set; with none it answers anyone who reaches its port."""
    clickhouse_ca: Path | None = None
    """The CA certificate (PEM) the clients check the warehouse's HTTPS certificate against
    (none: the system's CAs)."""
    clickhouse_tls_cert: Path | None = None
    """The embedded warehouse's certificate chain (PEM). With it and ``clickhouse_tls_key`` it
    serves HTTPS only, and the stack's warehouse URL is ``https://``."""
    clickhouse_tls_key: Path | None = None
    """The private key (PEM) of ``clickhouse_tls_cert``."""
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How every Kafka client (librdkafka's and the stream workers' Faust consumer) talks to
    the broker: ``SSL`` (TLS, with a client certificate for mutual TLS), ``SASL_SSL`` (a user
    and password over TLS), ``SASL_PLAINTEXT`` (a user and password, unencrypted)."""
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    kafka_sasl_username: str = ""
    kafka_sasl_password: SecretStr = SecretStr("")
    kafka_ssl_ca: Path | None = None
    """The CA certificate (PEM) the broker's certificate is checked against (none: the
    system's CAs)."""
    kafka_ssl_cert: Path | None = None
    """This client's certificate (PEM), for mutual TLS; with ``kafka_ssl_key``."""
    kafka_ssl_key: Path | None = None
    kafka_ssl_key_password: SecretStr = SecretStr("")
    principal_key: Path | None = None
    """This person's (or process's) Ed25519 private key (PEM, `perfloop keys new`): the CLI
    signs approvals, rejections, capture requests and actuator settings with it, for an
    actuator with a roster (``PERFLOOP_ROSTER``). Unset: ``$PERFLOOP_HOME/keys/owner.key``
    when it exists (the embedded stack's owner, made by `perfloop up`), else the shared key."""
    topic_partitions: int = Field(4, ge=1, le=1024)
    broker_keeps_log: bool | None = None
    """Whether the broker keeps its log when it restarts (None: where it is not the embedded
    one, i.e. with ``PERFLOOP_KAFKA_BOOTSTRAP``). The embedded broker does not, and the
    supervisor says so to its services; their producers are then not idempotent
    (`perfloop.kafka.producer`)."""

    @model_validator(mode="after")
    def _security(self) -> BaseServiceSettings:
        if (self.clickhouse_tls_cert is None) != (self.clickhouse_tls_key is None):
            raise ValueError(
                "PERFLOOP_CLICKHOUSE_TLS_CERT and PERFLOOP_CLICKHOUSE_TLS_KEY go together"
            )
        if (self.kafka_ssl_cert is None) != (self.kafka_ssl_key is None):
            raise ValueError("PERFLOOP_KAFKA_SSL_CERT and PERFLOOP_KAFKA_SSL_KEY go together")
        protocol = self.kafka_security_protocol
        if protocol.startswith("SASL") and not (
            self.kafka_sasl_username and self.kafka_sasl_password.get_secret_value()
        ):
            raise ValueError(
                f"PERFLOOP_KAFKA_SECURITY_PROTOCOL={protocol} needs PERFLOOP_KAFKA_SASL_USERNAME "
                "and PERFLOOP_KAFKA_SASL_PASSWORD"
            )
        tls_files = self.kafka_ssl_ca or self.kafka_ssl_cert
        if tls_files and not protocol.endswith("SSL"):
            # refused rather than ignored: a file meant for TLS with a plaintext connection
            raise ValueError(
                "PERFLOOP_KAFKA_SSL_* is set but PERFLOOP_KAFKA_SECURITY_PROTOCOL is "
                f"{protocol}: set it to SSL or SASL_SSL"
            )
        return self

    @property
    def external_kafka(self) -> bool:
        return bool(self.kafka_bootstrap_override)

    @property
    def keeps_log(self) -> bool:
        return self.external_kafka if self.broker_keeps_log is None else self.broker_keeps_log

    @property
    def external_clickhouse(self) -> bool:
        return bool(self.clickhouse_url_override)

    @property
    def kafka_bootstrap(self) -> str:
        return self.kafka_bootstrap_override or f"{self.host}:{self.kafka_port}"

    @property
    def clickhouse_url(self) -> str:
        scheme = "https" if self.clickhouse_tls_cert else "http"
        return self.clickhouse_url_override or f"{scheme}://{self.host}:{self.clickhouse_port}"

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def command_keyring_path(self) -> Path | None:
        """``command_keyring`` where the settings have one, else the embedded stack's keyring
        of its actuator's key (``$PERFLOOP_HOME/keys/commands.json``) where it exists: a job
        on the stack's machine then takes only commands that key signed."""
        own = getattr(self, "command_keyring", None)
        if own is not None:
            return Path(own)
        ring = self.home_dir / "keys" / "commands.json"
        return ring if ring.exists() else None

    @property
    def roster_path(self) -> Path | None:
        """``roster`` where the settings have one, else the embedded stack's roster
        (``$PERFLOOP_HOME/keys/roster.json``) where it exists: a job on the stack's machine
        then takes only the sampling changes a principal signed within their role."""
        own = getattr(self, "roster", None)
        if own is not None:
            return Path(own)
        roster = self.home_dir / "keys" / "roster.json"
        return roster if roster.exists() else None

    @property
    def principal_key_path(self) -> Path | None:
        """``principal_key``, else the embedded stack's owner key where it exists."""
        if self.principal_key is not None:
            return self.principal_key
        owner = self.home_dir / "keys" / "owner.key"
        return owner if owner.exists() else None
