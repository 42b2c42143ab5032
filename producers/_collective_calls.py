"""The host spans of one collective call, and the call that launched a comm kernel.

Private to trace replay. A collective call leaves nested comm spans on the thread that made it
(the API op, ``record_param_comms``, the backend's work); `HostComms` gathers them as the first
pass streams by, groups each nest into one `Call`, and finds the call whose spans hold a
kernel's launch. Re-exported by `perfloop.producers._collectives`, which turns what a call's
spans say into its row.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from perfloop.producers._collective_events import BACKEND, Said

__all__ = ["Call", "HostComms", "HostSpan"]


@dataclass(slots=True)
class HostSpan:
    """One comm span of the host timeline: its times (µs), `span_kind` and what it says."""

    start: float
    end: float
    kind: int
    said: Said


@dataclass(slots=True)
class Call:
    """The host spans of one collective call: an API or ``record_param_comms`` span and every
    comm span that starts inside it on its thread (or one backend span on its own)."""

    spans: list[HostSpan]
    anchor_end: float

    def has(self, kind: int, *, named: bool = False) -> bool:
        """Whether a span of ``kind`` is in the call (one that names its collective, if
        ``named``)."""
        return any(s.kind == kind and (not named or s.said.op) for s in self.spans)

    def extent(self, kind: int | None = None) -> tuple[float, float]:
        ss = [s for s in self.spans if kind is None or s.kind == kind] or self.spans
        return min(s.start for s in ss), max(s.end for s in ss)

    def parts(self, after_params: Sequence[Said] = ()) -> list[Said]:
        """What its spans say, most authoritative first: API spans (outermost first), then
        ``record_param_comms``, then ``after_params`` (a kernel's own arguments), then backend."""
        ordered = sorted(self.spans, key=lambda s: (s.kind, s.start, -s.end))
        host = [s.said for s in ordered if s.kind != BACKEND]
        return host + list(after_params) + [s.said for s in ordered if s.kind == BACKEND]


class HostComms:
    """The collective calls of a trace's host timeline, and which one launched a kernel.

    `add` the comm spans as they stream by, then `close` once: spans nested on one thread
    become one `Call`. A backend span joins the API call it starts inside, but takes in no
    later span (gloo's ``send``, timed until its peer receives, can outlast the next call).
    """

    def __init__(self) -> None:
        self._spans: dict[Hashable, list[HostSpan]] = defaultdict(list)
        self.calls: list[Call] = []
        self._starts: dict[Hashable, list[float]] = {}
        self._index: dict[Hashable, list[int]] = {}

    def add(self, thread: Hashable, start: float, end: float, kind: int, said: Said) -> None:
        self._spans[thread].append(HostSpan(start, max(end, start), kind, said))

    def close(self) -> None:
        for thread, spans in self._spans.items():
            spans.sort(key=lambda s: (s.start, -s.end, s.kind))
            cur: Call | None = None
            mine: list[int] = []
            for s in spans:
                if cur is not None and s.start <= cur.anchor_end:
                    cur.spans.append(s)
                    if s.kind != BACKEND:
                        cur.anchor_end = max(cur.anchor_end, s.end)
                    continue
                call = Call([s], s.end if s.kind != BACKEND else -math.inf)
                cur = call if s.kind != BACKEND else None
                mine.append(len(self.calls))
                self.calls.append(call)
            self._starts[thread] = [self.calls[i].spans[0].start for i in mine]
            self._index[thread] = mine
        self._spans.clear()

    def at(self, thread: Hashable, ts: float) -> int | None:
        """Index in `calls` of the latest call on ``thread`` whose spans hold ``ts``."""
        starts = self._starts.get(thread)
        if not starts:
            return None
        j = bisect.bisect_right(starts, ts) - 1
        for k in range(j, max(j - 16, -1), -1):  # overlapping calls on one thread are rare
            i = self._index[thread][k]
            if self.calls[i].extent()[1] >= ts:
                return i
        return None

    def has(self, kind: int, *, named: bool = False) -> bool:
        """Whether some call has a span of ``kind`` (that names its collective, if ``named``)."""
        return any(c.has(kind, named=named) for c in self.calls)
