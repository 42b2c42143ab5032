"""A stream worker's engines: one `StreamEngine` per input partition number.

Every input topic is keyed by job and has the same number of partitions, so partition ``p``
of each carries the same jobs, and the consumer group gives all of a partition number's
topics to one worker (Faust assigns co-partitioned topics together). The engine of ``p``
holds the state of exactly those jobs: when the partition moves, its state moves whole — the
worker that loses it writes a last snapshot and drops the engine (its jobs are neither closed
nor diagnosed nor taken for silent: they are someone else's now); the worker that gains it
restores the engine from that snapshot (`perfloop.streams._changelog`).

`Shards` routes each message to its partition's engine and sums what the engines count for
the worker's stats and metrics: only what this worker did (a restored engine's counters start
from what it came with), and what dropped engines did stays counted.

The cross-run models (`PredictionHost.cross_step` / ``cross_mem``) learn from every finished
job the worker sees and from the warehouse's history: the engines share one pair (the most
experienced one they come with), rather than each learning alone.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from perfloop.settings import StreamsSettings
from perfloop.streams.engine import StreamEngine, Unpickler

__all__ = ["Shards"]

log = logging.getLogger("perfloop.streams")


def _cluster(state: Any) -> Any:
    return state.get("cluster_id") if isinstance(state, dict) else None


def _read(state: Any) -> int:
    """How much of its partition a snapshot has read (its offsets summed)."""
    offsets = state.get("offsets") if isinstance(state, dict) else None
    return sum(offsets.values()) if isinstance(offsets, dict) else -1


class Shards:
    """The worker's engines by input partition number (see the module)."""

    def __init__(self, settings: StreamsSettings) -> None:
        self.settings = settings
        self.engines: dict[int, StreamEngine] = {}
        self.cluster_id: str | None = None
        self.moves: Counter[str] = Counter()  # restored, fresh, dropped, unreadable
        self._base: dict[int, tuple[Counter[str], Counter[str], int]] = {}
        self._retired: Counter[str] = Counter()
        self._retired_rejected: Counter[str] = Counter()
        self._retired_late = 0
        self._cross: tuple[Any, Any] | None = None
        self.predict_enabled = StreamEngine(settings).predict.enabled

    # -- the engines ------------------------------------------------------------------------
    def engine(self, partition: int) -> StreamEngine:
        """The partition's engine (a fresh one if it has none)."""
        e = self.engines.get(partition)
        return e if e is not None else self.add(partition)

    def add(self, partition: int, *snapshots: bytes | None) -> StreamEngine:
        """Give the partition an engine, restored from the newest of ``snapshots``
        (`StreamEngine.dumps` output; None: none) if there is one: the one that has read the
        most of the partition, among those taken in the broker cluster read now if any is.
        An unreadable snapshot is logged and left out."""
        e = StreamEngine(self.settings)
        states = []
        for data in snapshots:
            if data is None:
                continue
            try:
                states.append(Unpickler(io.BytesIO(data)).load())
            except Exception as ex:  # bytes from a file or a topic: never stops the worker
                log.warning("ignoring an unreadable snapshot of partition %d: %s", partition, ex)
                self.moves["unreadable"] += 1
        here = [st for st in states if _cluster(st) in (None, self.cluster_id)]
        for state in sorted(here or states, key=_read, reverse=True):
            try:
                e.restore(state)
                self.moves["restored"] += 1
                break
            except Exception as ex:  # another version's, or damaged: a fresh engine instead
                log.warning("ignoring an unreadable snapshot of partition %d: %s", partition, ex)
                self.moves["unreadable"] += 1
                e = StreamEngine(self.settings)
        else:
            self.moves["fresh"] += 1
        e.use_cluster(self.cluster_id)
        self._share(e)
        self.engines[partition] = e
        self._base[partition] = (Counter(e.stats), Counter(e.rejected), e.windows.late_samples)
        return e

    def drop(self, partition: int) -> StreamEngine | None:
        """Let the partition's engine go (its jobs are another worker's now); what it did
        stays in the worker's counts."""
        e = self.engines.pop(partition, None)
        if e is None:
            return None
        stats, rejected, late = self._base.pop(partition)
        self._retired.update(e.stats - stats)
        self._retired_rejected.update(e.rejected - rejected)
        self._retired_late += e.windows.late_samples - late
        self.moves["dropped"] += 1
        return e

    def use_cluster(self, cluster_id: str | None) -> None:
        """The broker cluster the engines read from (None: unknown, nothing changes)."""
        if cluster_id is None:
            return
        self.cluster_id = cluster_id
        for e in self.engines.values():
            e.use_cluster(cluster_id)

    def _share(self, e: StreamEngine) -> None:
        mine = (e.predict.cross_step, e.predict.cross_mem)
        if self._cross is None or mine[0].n_seen > self._cross[0].n_seen:
            self._cross = mine
            for other in self.engines.values():
                other.predict.cross_step, other.predict.cross_mem = mine
        e.predict.cross_step, e.predict.cross_mem = self._cross

    def learn_history(self, jobs: Iterable[tuple[dict[str, float], float, float]]) -> int | None:
        """Teach the shared cross-run models (`PredictionHost.learn_history`); None while the
        worker has no engine yet (no partition assigned): try again later."""
        e = next(iter(self.engines.values()), None)
        return None if e is None else e.predict.learn_history(jobs)

    @property
    def history_wanted(self) -> bool:
        """Whether the cross-run models are on and have yet to learn anything."""
        return self.predict_enabled and (self._cross is None or self._cross[0].n_seen == 0)

    def jobs(self, partition: int) -> list[str]:
        e = self.engines.get(partition)
        return [] if e is None else e.jobs

    # -- the worker's view ------------------------------------------------------------------
    @property
    def stats(self) -> Counter[str]:
        total = Counter(self._retired)
        for p, e in self.engines.items():
            total.update(e.stats - self._base[p][0])
        return total

    @property
    def rejected(self) -> Counter[str]:
        total = Counter(self._retired_rejected)
        for p, e in self.engines.items():
            total.update(e.rejected - self._base[p][1])
        return total

    @property
    def late_samples(self) -> int:
        return self._retired_late + sum(
            e.windows.late_samples - self._base[p][2] for p, e in self.engines.items()
        )

    @property
    def late_by_kind(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for e in self.engines.values():
            total.update(e.windows.late_by_kind)
        return total

    @property
    def held_inputs(self) -> list[tuple[str, int]]:
        return [tp for e in self.engines.values() for tp in e.held_inputs]

    def position(self, topic: str, partition: int) -> int | None:
        e = self.engines.get(partition)
        return None if e is None else e.position(topic, partition)

    def recent(self, job_id: str) -> Any:
        for e in self.engines.values():
            if job_id in e.jobs:
                return e.recent(job_id)
        return []
