"""The sink's batches: the rows waiting for one table's insert, the messages they came from,
and the ids of recent messages (to drop one sent twice). No I/O; `perfloop.warehouse.sink` uses
them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import pyarrow as pa

from perfloop.warehouse._sink_rows import Part, Rows, part_rows

__all__ = ["Flight", "Pending", "RecentIds", "Source"]


@dataclass
class Source:
    """The message one part of a pending batch came from (to dead-letter it)."""

    message_id: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass
class Pending:
    """Rows waiting for one table's next insert: one part per message, and the messages."""

    parts: list[Part] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0
    sources: list[Source] = field(default_factory=list)

    def extend(self, part: Part, source: Source) -> None:
        self.parts.append(part)
        self.rows += part_rows(part)
        self.bytes += len(source.value)
        self.sources.append(source)

    def token(self, table: str) -> str:
        """The insert's deduplication token: a hash of the messages it holds, by their own ids.

        Offsets would not do: a broker that restarts empty numbers its log from 0 again, so a
        new insert could repeat an old token and be dropped by the warehouse as a retry.
        """
        ids = sorted(s.message_id for s in self.sources)
        return hashlib.sha256("\n".join([table, *ids]).encode()).hexdigest()[:32]

    def only(self, i: int) -> Pending:
        """The rows of message ``i``, as a batch of their own."""
        one = Pending()
        one.extend(self.parts[i], self.sources[i])
        return one

    def arrow(self) -> pa.Table:
        """The Arrow parts as one table (parts of older and newer schemas padded with nulls)."""
        parts = self.parts
        try:
            table = pa.Table.from_batches(parts)
        except pa.ArrowInvalid:
            tables = [pa.Table.from_batches([p]) for p in parts]
            table = pa.concat_tables(tables, promote_options="permissive")
        return table.unify_dictionaries()

    def lists(self) -> Rows:
        """The list parts, concatenated column by column."""
        cols: Rows = {}
        for part in self.parts:
            for k, v in part.items():
                cols.setdefault(k, []).extend(v)
        return cols


class RecentIds:
    """The ids of the last ``capacity`` messages taken, to drop a message sent twice."""

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def __contains__(self, key: str) -> bool:
        return key in self._ids

    def add(self, key: str) -> None:
        self._ids[key] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def discard(self, key: str) -> None:
        self._ids.pop(key, None)


class Flight:
    """Batches sealed for one round of inserts, the offsets they complete, and how it went.

    The insert thread fills ``rejected`` (ids of messages it dead-lettered, for the reading
    thread to forget) and ``error`` (the warehouse was unavailable), then sets ``done``. Until
    it has taken its last batch, the reading thread may `join` rows someone waits for to it:
    they go in next, before the rest of the telemetry.
    """

    def __init__(self, batches: dict[str, Pending], offsets: dict[tuple[str, int], int]) -> None:
        self.batches = batches
        self.offsets = offsets
        self.rejected: list[str] = []
        self.error: Exception | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._first: frozenset[str] = frozenset()

    def join(
        self,
        batches: dict[str, Pending],
        offsets: dict[tuple[str, int], int],
        first: frozenset[str],
    ) -> bool:
        """Add ``batches`` (tables not in the flight now), inserted next, and the ``offsets``
        they complete; False (nothing added) if the insert thread has taken its last batch."""
        with self._lock:
            if self._closed or any(t in self.batches for t in batches):
                return False
            self.batches.update(batches)
            self.offsets.update(offsets)
            self._first = first
            return True

    def next_table(self) -> str | None:
        """The next table to insert (the insert thread), one of ``first`` before the others;
        None when none is left, and then nothing can join any more."""
        with self._lock:
            tables = list(self.batches)
            for t in tables:
                if t in self._first:
                    return t
            if tables:
                return tables[0]
            self._closed = True
            return None

    def close(self) -> None:
        """Take no more batches (the insert thread, before it sets ``done``)."""
        with self._lock:
            self._closed = True

    def reopen(self) -> None:
        """Open again for a retry of what is left (the reading thread, the flight not done)."""
        with self._lock:
            self._closed = False

    @property
    def rows(self) -> int:
        # list() copies the values at once: the insert thread drops batches as they land
        return sum(p.rows for p in list(self.batches.values()))

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in list(self.batches.values()))
