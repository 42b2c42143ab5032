"""The warehouse tier: ClickHouse over SQL for a job's history.

- `perfloop.warehouse.access`: clients (one per thread), one query on a client of its own
  (`query`), applying the migrations, waiting for a job's rows to land; its functions are
  also here (``from perfloop.warehouse import client``);
- `perfloop.warehouse.tables`: which table each event kind and each topic fills;
- `perfloop.warehouse.migrations`: every table, view and rollup, as versioned changes;
- `perfloop.warehouse.rollups`: the 1 s / 1 min / 1 h rollups of raw telemetry;
- `perfloop.warehouse.sink`: the service that fills the tables from the topics.
"""

from perfloop.deprecation import moved
from perfloop.warehouse.access import client, migrate, query, unix_ns, wait_settled

__all__ = ["client", "migrate", "query", "unix_ns", "wait_settled"]

__getattr__ = moved(__name__, {"UNKNOWN_SETTING": "perfloop.warehouse.access"})
