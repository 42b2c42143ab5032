"""One insert of the warehouse sink, and what the sink counts.

`insert` sends one table's batch with its deduplication token and sorts a failure into the two
cases the sink handles differently: `Unavailable` (the warehouse cannot take rows now: pause
and retry the same batch) and `Rejected` (the rows themselves are refused: split the batch and
dead-letter what is still refused). `SinkStats` is what the sink did since it started.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pyarrow as pa
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError

from perfloop.bad_input import Refused
from perfloop.exceptions import PerfloopError
from perfloop.warehouse._sink_batch import Pending

# ClickHouse error codes that say "not now" rather than "not this data": the insert is
# retried. Unknown table/database/column means the warehouse is not migrated yet: retried too.
TRANSIENT_CODES = frozenset(
    {3, 16, 47, 60, 81, 159, 164, 202, 203, 209, 210, 236, 241, 242, 252, 319, 394, 425, 999}
)
# Raised by the client while encoding rows it cannot send (besides its DataError).
ENCODING_ERRORS = (TypeError, ValueError, OverflowError, struct.error, pa.ArrowException)


class Rejected(Refused):
    """The warehouse (or the client encoding for it) refused the rows themselves."""


class Unavailable(Exception):
    """The warehouse cannot take rows now; retry later."""


@dataclass
class SinkStats:
    """What the sink did since it started (the log prints it every ``STATS_EVERY_S``)."""

    inserts: int = 0
    inserted_rows: int = 0
    max_insert_rows: int = 0
    dead_letters: int = 0  # messages sent to perfloop.dlq
    dead_letters_dropped: int = 0  # dead letters that could not land in dead_letters
    rejected: int = 0  # messages the warehouse refused as data (dead-lettered)
    duplicates: int = 0
    pauses: int = 0
    paused_s: float = 0.0
    rounds: int = 0  # rounds of reading that resumed telemetry partitions (`Sink._pace`)
    joined: int = 0  # times rows someone waits for joined a flight in the air (`Sink._join`)
    failed_inserts: int = 0
    max_pending_rows: int = 0  # rows held: the batch in the air and the one being filled
    max_pending_bytes: int = 0
    # where the time goes (seconds): waiting for messages, decoding them, inserting (in the
    # insert thread, alongside the others), waiting for a flight to land, committing
    read_s: float = 0.0
    decode_s: float = 0.0
    insert_s: float = 0.0
    wait_s: float = 0.0
    commit_s: float = 0.0

    def line(self, held: int) -> str:
        """The stats as one log line; ``held`` is the telemetry partitions paused now."""
        return (
            f"sink stats: {self.inserts} inserts, {self.inserted_rows} rows "
            f"({self.inserted_rows / self.inserts if self.inserts else 0.0:.0f} rows/insert, "
            f"max {self.max_insert_rows}), {self.dead_letters} dead letters, "
            f"{self.rejected} refused, {self.duplicates} duplicates, paused {self.pauses} times "
            f"for {self.paused_s:.1f} s, max pending {self.max_pending_rows} rows, "
            f"{self.rounds} rounds of telemetry ({held} partitions held now), {self.joined} "
            f"joined a flight; seconds reading {self.read_s:.1f}, decoding {self.decode_s:.1f}, "
            f"inserting {self.insert_s:.1f} (in its thread), waiting for it {self.wait_s:.1f}, "
            f"committing {self.commit_s:.1f}"
        )


def first_line(e: BaseException) -> str:
    """The first line of an error's text (at most 300 characters), or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def reachable(ch: Client) -> bool:
    """True if the warehouse answers a ping."""
    try:
        return bool(ch.ping())
    except Exception:
        return False


def insert(ch: Client, table: str, pending: Pending, stats: SinkStats) -> None:
    """Insert one batch; raise `Unavailable` (retry later) or `Rejected` (bad rows)."""
    settings = {
        "insert_deduplication_token": pending.token(table),
        # ... and in the rollups its materialized views feed (ClickHouse 24.8 does not
        # deduplicate them by default).
        "deduplicate_blocks_in_dependent_materialized_views": 1,
    }
    try:
        if isinstance(pending.parts[0], pa.RecordBatch):
            ch.insert_arrow(table, pending.arrow(), settings=settings)
        else:
            cols = pending.lists()
            ch.insert(
                table,
                list(cols.values()),
                column_names=list(cols),
                column_oriented=True,
                settings=settings,
            )
    except (ClickHouseError, PerfloopError, OSError, *ENCODING_ERRORS) as e:
        stats.failed_inserts += 1
        code = getattr(e, "code", None)
        if code:  # the server answered
            if code not in TRANSIENT_CODES and reachable(ch):
                raise Rejected(f"warehouse refused {table} rows: {first_line(e)}") from e
        elif not isinstance(e, (OperationalError, OSError, PerfloopError)):
            # The client could not encode the rows (a value out of range, an unknown
            # column): the rows are at fault, wherever they are sent.
            raise Rejected(f"cannot encode {table} rows: {first_line(e)}") from e
        raise Unavailable(f"insert into {table} failed: {first_line(e)}") from e
    stats.inserts += 1
    stats.inserted_rows += pending.rows
    stats.max_insert_rows = max(stats.max_insert_rows, pending.rows)
