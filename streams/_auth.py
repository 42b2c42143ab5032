"""The stream workers' Faust (aiokafka) consumer and producer get the same Kafka security as
every librdkafka client (`perfloop.kafka.security_config`), from the same settings."""

from __future__ import annotations

import ssl

import faust
from faust.types.auth import CredentialsT

from perfloop.exceptions import ConfigError
from perfloop.settings import BaseServiceSettings

__all__ = ["faust_credentials"]


def faust_credentials(settings: BaseServiceSettings) -> CredentialsT | None:
    """Faust's ``broker_credentials`` for the settings' protocol (None: plaintext); a CA,
    certificate or key that cannot be loaded is a `ConfigError` line.

    >>> from perfloop.settings import StackSettings
    >>> faust_credentials(StackSettings()) is None
    True
    >>> c = faust_credentials(StackSettings(kafka_security_protocol="SASL_PLAINTEXT",
    ...     kafka_sasl_username="ann", kafka_sasl_password="pw"))
    >>> c.protocol.value, c.mechanism.value, c.username
    ('SASL_PLAINTEXT', 'SCRAM-SHA-512', 'ann')
    """
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return None
    context = _ssl_context(settings) if protocol.endswith("SSL") else None
    if protocol == "SSL":
        assert context is not None
        return faust.SSLCredentials(context)
    return faust.SASLCredentials(
        username=settings.kafka_sasl_username,
        password=settings.kafka_sasl_password.get_secret_value(),
        ssl_context=context,
        mechanism=settings.kafka_sasl_mechanism,
    )


def _ssl_context(settings: BaseServiceSettings) -> ssl.SSLContext:
    """Checks the broker's certificate against ``kafka_ssl_ca`` (or the system's CAs), and
    presents ``kafka_ssl_cert`` for mutual TLS when it is set."""
    ca = settings.kafka_ssl_ca
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot read the Kafka CA {ca} (PERFLOOP_KAFKA_SSL_CA): {e}") from None
    cert, key = settings.kafka_ssl_cert, settings.kafka_ssl_key
    if cert is not None and key is not None:
        try:
            context.load_cert_chain(
                str(cert), str(key), settings.kafka_ssl_key_password.get_secret_value() or None
            )
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"cannot load the Kafka client certificate {cert} with its key {key} "
                f"(PERFLOOP_KAFKA_SSL_CERT, _KEY, _KEY_PASSWORD): {e}"
            ) from None
    return context
