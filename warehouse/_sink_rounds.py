"""The warehouse sink's rounds of reading telemetry (``telemetry_in_rounds``).

The telemetry partitions are resumed shortly before each flush and each is paused again once
read to its end, so a partition is fetched about once a flush instead of several times a
second (see `perfloop.warehouse.sink` for why). Only a partition a message was taken from
since its latest assignment is paused, and only at exactly its end.
"""

from __future__ import annotations

from confluent_kafka import Consumer, TopicPartition

from perfloop.warehouse._sink_insert import SinkStats

ROUND_LEAD_S = 0.4
"""A round of reading the telemetry partitions opens this long before the flush it feeds."""
ROUND_IDLE_S = 0.3
"""A round's telemetry partitions found at their end this long (plus twice the fetch wait:
a fetch has answered since; at most 0.8 flush intervals) after it opened are paused, whether
or not they told their end."""


class Rounds:
    """Which telemetry partitions are paused until the next round, and which were taken from.

    ``fast_topics`` are never paused; ``idle_s`` is how long into a round a partition found at
    its end is paused even if it did not tell its end.
    """

    def __init__(
        self, consumer: Consumer, fast_topics: frozenset[str], idle_s: float, stats: SinkStats
    ) -> None:
        self._consumer = consumer
        self._fast = fast_topics
        self._idle_s = idle_s
        self._stats = stats
        # The flush the last round was opened for, when, whether its partitions at their end
        # were paused, and those paused since.
        self._for = -1.0
        self._opened = 0.0
        self._idle_checked = True
        self.held: set[tuple[str, int]] = set()
        # Partitions a message was taken from since their latest assignment: only these are
        # paused, so a partition is never paused at a position that is not its own (one kept
        # from before a rebalance or a broker restart, to which resuming would seek back).
        self.taken: set[tuple[str, int]] = set()

    def pace(self, now: float, next_flush: float, *, reading: bool) -> None:
        """Resume the held partitions ``ROUND_LEAD_S`` before the flush, and pause each again
        when it tells its end (`at_end`), or when it is found at its end (its position at the
        end the last fetch saw) a while into the round (a partition with nothing new does not
        tell its end again). A partition still behind stays resumed, so a backlog is read at
        full speed. ``reading`` is False while the batch is full (nothing counts as idle)."""
        if now >= next_flush - ROUND_LEAD_S and self._for != next_flush:
            self._for = next_flush
            self._opened = now
            self._idle_checked = False
            held = [TopicPartition(t, p) for t, p in self.held]
            self.held.clear()
            if held:
                assigned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
                held = [tp for tp in held if (tp.topic, tp.partition) in assigned]
                if held:
                    self._consumer.resume(held)
                    self._stats.rounds += 1
        elif not reading:
            self._opened = now
        elif not self._idle_checked and now - self._opened >= self._idle_s:
            self._idle_checked = True
            open_ = [
                tp
                for tp in self._consumer.assignment()
                if tp.topic not in self._fast and (tp.topic, tp.partition) not in self.held
            ]
            if open_:
                at = self._consumer.position(open_)
                idle = [pos for pos in at if self.at_end(pos, self._cached_end(pos))]
                if idle:
                    self.hold(idle)

    def _cached_end(self, tp: TopicPartition) -> int:
        """The partition's end as its last fetch saw it (-1: not known)."""
        return int(self._consumer.get_watermark_offsets(tp, cached=True)[1])

    def at_end(self, pos: TopicPartition, end: int) -> bool:
        """Whether the partition may be paused as read to ``end``: a message was taken from it
        since its latest assignment and its position is exactly there. A position past the
        end means the log was lost (a broker restarted empty): the consumer's reset to the
        new log's start shows only when it next takes a message, and pausing before then would
        send it back to the old position at every round."""
        key = (pos.topic, pos.partition)
        return key in self.taken and key not in self.held and end >= 0 and pos.offset == end

    def hold(self, parts: list[TopicPartition]) -> None:
        """Pause telemetry partitions until the next round."""
        self._consumer.pause(parts)
        self.held.update((tp.topic, tp.partition) for tp in parts)

    def revoke(self, keys: set[tuple[str, int]], *, resume: bool) -> None:
        """Forget revoked partitions; resume the held ones first if ``resume`` (a pause
        outlives the assignment in librdkafka: one assigned again would never be read)."""
        held = [TopicPartition(t, p) for t, p in self.held & keys]
        if held and resume:
            self._consumer.resume(held)
        self.held -= keys
        self.taken -= keys
