"""Errors raised when an event or a batch does not match its schema."""

from __future__ import annotations

from perfloop.exceptions import PerfloopError

__all__ = ["SchemaError"]


class SchemaError(PerfloopError):
    """An event or batch is malformed; the message names the bad field and value."""
