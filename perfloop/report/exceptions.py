"""Errors the report raises: a job the warehouse does not know."""

from __future__ import annotations

from perfloop.exceptions import PerfloopError

__all__ = ["UnknownJobError"]


class UnknownJobError(PerfloopError):
    """The warehouse holds no row of the job; the message names the most recent jobs."""
