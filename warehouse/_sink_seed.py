"""The ids of the messages already in the warehouse, for a sink that starts (``seed_ids``).

A sink remembers the ids of the messages it took (`RecentIds`) to drop one sent twice: a
producer resends what a restarted or recycled broker lost, and a sink reads again what it
inserted but had not committed when it stopped. A sink that starts remembers nothing, so
before it reads it takes the ids of the rows that landed in the last ``window_s`` seconds of
event time from the tables it fills. The message's id is the column ``event_id`` of its rows,
except for telemetry batches: their rows' ids are ``<batch id>-<index>``, and the batch id is
the message's.

Event time, not insert time: the tables have no insert time. A message read again after a
restart was published about as long ago as its rows' time (a sink behind by more than the
window drops no repeat of what it inserted last).
"""

from __future__ import annotations

import logging

from clickhouse_connect.driver.client import Client

from perfloop.schemas.topics import Topics
from perfloop.warehouse.tables import TABLES

__all__ = ["seed_ids", "seed_queries"]

log = logging.getLogger("perfloop.sink")

_BATCH_TOPICS = (Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN)


def seed_queries(window_s: float, limit: int) -> list[str]:
    """One query per table the sink fills: the distinct message ids of its rows whose time is
    within ``window_s`` seconds of now, newest first, at most ``limit``.

    >>> q = seed_queries(600, 1000)
    >>> [s for s in q if "FROM steps " in s][0]  # doctest: +NORMALIZE_WHITESPACE
    "SELECT substring(event_id, 1, length(event_id) - 2) AS id, max(ts) AS t FROM steps
     WHERE ts >= now64(9) - toIntervalMillisecond(600000) AND endsWith(event_id, '-0')
     GROUP BY id ORDER BY t DESC LIMIT 1000"
    """
    batch_tables = {t for topic in _BATCH_TOPICS for t in TABLES[topic]}
    since = f"ts >= now64(9) - toIntervalMillisecond({int(window_s * 1000)})"
    out = []
    for table in sorted({t for tables in TABLES.values() for t in tables}):
        if table in batch_tables:  # the first row of each batch names it
            what, where = (
                "substring(event_id, 1, length(event_id) - 2)",
                " AND endsWith(event_id, '-0')",
            )
        else:
            what, where = "event_id", ""
        out.append(
            f"SELECT {what} AS id, max(ts) AS t FROM {table} WHERE {since}{where} "
            f"GROUP BY id ORDER BY t DESC LIMIT {int(limit)}"
        )
    return out


def seed_ids(ch: Client, window_s: float, limit: int) -> list[str]:
    """The ids of the messages whose rows landed within the last ``window_s`` seconds of
    event time, the newest ``limit`` of them, oldest first. A table that cannot be read (not
    made yet, the warehouse down) adds none, and the log says so in one line: a repeat of its
    rows may then land once more."""
    if window_s <= 0:
        return []
    found: list[tuple[object, str]] = []
    failed: list[str] = []
    for sql in seed_queries(window_s, limit):
        try:
            rows = ch.query(sql).result_rows
        except Exception as e:  # a missing table, an unreachable warehouse: start without
            failed.append((str(e).strip().splitlines() or [type(e).__name__])[0])
            continue
        found.extend((t, str(i)) for i, t in rows)
    if failed:
        log.warning("starting without the ids already in %d table(s): %s", len(failed), failed[0])
    found.sort(key=lambda r: r[0])
    return [i for _, i in found[-limit:]]
