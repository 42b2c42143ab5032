"""The stream worker's stats line, logged every 10 s (`perfloop.streams.app`)."""

from __future__ import annotations

from typing import Any

from perfloop.service_heap import GcClock
from perfloop.streams._changelog import Changelog
from perfloop.streams._publisher import Output
from perfloop.streams.shards import Shards

__all__ = ["stats_line"]


def stats_line(
    shards: Shards,
    held: int,
    snap: dict[str, float],
    changelog: Changelog,
    fetches: int,
    gc_clock: GcClock,
    output: Output,
) -> str:
    """What the worker did so far: messages, samples, outputs, what it held and read again,
    its partitions and their moves, its snapshots, fetches, garbage collections and output.
    ``held`` is how many input messages wait for a snapshot to be acknowledged."""
    st: dict[str, Any] = shards.stats
    moves = dict(shards.moves) or "none"
    return (
        f"stream stats: {st['messages']} messages, {st['samples']} samples, {st['events']} "
        f"events, {sum(shards.rejected.values())} rejected, {shards.late_samples} late samples "
        f"{shards.late_by_kind or ''}, {st['window_rows']} window rows, {st['phase_events']} "
        f"phase events, {st['diagnoses']} diagnoses, {st['recommendations']} recommendations; "
        f"{st['replayed']} read again and skipped; {held} held, {st['behind']} read behind "
        f"their partition's end, {len(shards.held_inputs)} partitions behind now; "
        f"{len(shards.engines)} partitions (moves {moves}); snapshots every "
        f"{snap['every']:.1f} s ({snap['bytes'] / 1e6:.1f} MB, serialised in "
        f"{snap['dumps_s'] * 1000:.0f} ms; {changelog.written} written to the changelog, "
        f"{changelog.bytes / 1e6:.1f} MB compressed); {fetches} fetches; "
        f"{gc_clock.seconds:.1f} s in {gc_clock.collections} garbage collections; "
        f"{output.sent} published, {output.failed} undelivered"
    )
