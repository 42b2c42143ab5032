"""The fields every event carries, and helpers shared by the event families."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["JOB_ID_PATTERN", "Event", "JobId", "new_event_id", "now_ns"]

JOB_ID_PATTERN = r"^[A-Za-z0-9._:/@+-]{1,128}$"
JobId = Annotated[str, Field(min_length=1, max_length=128, pattern=JOB_ID_PATTERN)]


def new_event_id() -> str:
    """A fresh random event id (32 hex characters) used for deduplication."""
    return uuid.uuid4().hex


def now_ns() -> int:
    """The current Unix time in integer nanoseconds."""
    return time.time_ns()


class Event(BaseModel):
    """Base of every event: versioned, frozen, integer-nanosecond event time.

    >>> class Ping(Event):
    ...     KIND: ClassVar[str] = "ping"
    >>> p = Ping(ts_ns=1, job_id="j1", node="n0", rank=0)
    >>> p.schema_version, len(p.event_id)
    (1, 32)
    """

    model_config = ConfigDict(frozen=True, extra="forbid", str_max_length=4096)

    KIND: ClassVar[str] = "event"
    SCHEMA_VERSION: ClassVar[int] = 1
    """The version this code writes; a family bumps it when it adds or changes fields."""
    MIN_SCHEMA_VERSION: ClassVar[int] = 1
    """The oldest version this code still reads (older fields keep their meaning)."""

    schema_version: int = Field(1, ge=1)
    event_id: str = Field(default_factory=new_event_id, min_length=1, max_length=64)
    ts_ns: int = Field(ge=0, description="Event time, Unix nanoseconds.")
    job_id: JobId
    node: str = Field(min_length=1, max_length=255)
    rank: int = Field(ge=-1, le=1 << 20, description="Process rank; -1 means the whole job.")

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if not cls.MIN_SCHEMA_VERSION <= v <= cls.SCHEMA_VERSION:
            raise ValueError(
                f"{cls.KIND} schema_version {v} is not supported; "
                f"supported: {cls.MIN_SCHEMA_VERSION}..{cls.SCHEMA_VERSION}"
            )
        return v
