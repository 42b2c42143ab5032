"""The batch and event ids a stream worker read lately, to drop a message that comes twice.

Producers send a message again when the broker may have lost it: a `Publisher` keeps the last
``resend_window_s`` of what the broker acknowledged and resends it to a broker that restarted
empty (the embedded broker after a crash, or recycled on purpose: `perfloop.stack._recycle`).
The stream worker had read most of it already, at other offsets of the old log, so its skip by
offset cannot tell; the ids can: a batch id is a fresh random id per batch, and an event's id
one per event. Only the last ``limit`` ids are kept, oldest dropped first.

>>> seen = RecentIds(limit=2)
>>> seen.add("a"), seen.add("b"), seen.add("a")
(True, True, False)
>>> seen.add("c"), seen.add("a"), len(seen)
(True, True, 2)
"""

from __future__ import annotations

from collections import deque

__all__ = ["RecentIds"]


class RecentIds:
    """A set of the last ``limit`` ids added, in the order they came."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"RecentIds needs a limit of at least 1, got {limit}")
        self.limit = limit
        self._order: deque[str] = deque()
        self._ids: set[str] = set()

    def add(self, key: str) -> bool:
        """Remember ``key``; False when it is among the last ``limit`` ids already."""
        if key in self._ids:
            return False
        self._ids.add(key)
        self._order.append(key)
        if len(self._order) > self.limit:
            self._ids.discard(self._order.popleft())
        return True

    def __len__(self) -> int:
        return len(self._ids)
