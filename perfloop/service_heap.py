"""The heap of the long-running services: giving freed memory back to the system, and keeping
the cyclic garbage collector off the objects that live as long as the process."""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Callable
from typing import Any

__all__ = ["GcClock", "libc_trim"]


def libc_trim() -> Callable[[int], object] | None:
    """glibc's ``malloc_trim``, where there is one (call it with 0)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class GcClock:
    """Counts the time the cyclic garbage collector takes, and freezes what a service built
    while starting (`freeze`).

    A full collection walks every tracked object. In the stream worker most of them are the
    ones it made starting up — modules, the Faust app, the restored state — and a walk over
    them blocked its event loop for about 0.1 s every few seconds under load. `freeze`
    collects once, then moves every object alive into the permanent generation, which no
    collection walks (`gc.freeze`): they are still freed when their last reference goes,
    only a reference cycle among them is never collected.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds = 0.0
        self.collections = 0
        self.frozen = 0
        self._at = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._at = self._clock()
        else:
            self.seconds += self._clock() - self._at
            self.collections += 1

    def freeze(self) -> int:
        """Collect, then freeze every object alive; return how many are frozen now."""
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        return self.frozen

    def close(self) -> None:
        """Stop counting (the callback is removed)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
