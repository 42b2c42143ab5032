"""Giving freed heap memory back to the system (the long-running services call it)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["libc_trim"]


def libc_trim() -> Callable[[int], object] | None:
    """glibc's ``malloc_trim``, where there is one (call it with 0)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None
