"""The error hierarchy: one root, narrow subclasses; vendor errors are wrapped at the boundary."""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "ConfigError",
    "PerfloopError",
    "ServiceError",
    "StackError",
    "WarehouseError",
]


class PerfloopError(Exception):
    """Root of every error perfloop raises on purpose. Its message is one line for a person."""


class ConfigError(PerfloopError):
    """A setting or a command-line value is invalid."""


class StackError(PerfloopError):
    """The embedded stack could not be brought up, inspected or brought down."""


class BrokerError(PerfloopError):
    """The Kafka-API broker is unreachable or refused a request."""


class WarehouseError(PerfloopError):
    """The ClickHouse warehouse is unreachable or refused a request."""


class ServiceError(PerfloopError):
    """A long-running perfloop service failed to start or stopped unexpectedly."""
