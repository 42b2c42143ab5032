"""Span tiling: `Recorder` turns phase spans into tiled steps and hands their rows over.

The `Recorder` is the core both the explicit API (`perfloop.producers.training.Monitor`) and
the zero-code-change hooks (`perfloop.producers.hooks`) record through: depth-0 spans of a step
tile it, gaps glued onto the span before or recorded as ``"other"``, so a step's spans add up
to its step time. The training thread only appends tuples; the rows are cleaned
(`perfloop.producers._training_rows`) and handed to the emitter every ``handover_ns``.
`ErrorCounter` counts what failed on the way and logs each kind once, so nothing here raises
into the training loop.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from perfloop.producers._training_callbacks import (
    Callback,
    CallbackSet,
    CollectiveRecord,
    SpanRecord,
    StepRecord,
)
from perfloop.producers._training_rows import (
    COLLECTIVE_COLUMNS,
    SPAN_COLUMNS,
    as_columns,
    step_row,
)

__all__ = ["ErrorCounter", "Recorder"]

log = logging.getLogger("perfloop.producers")


class ErrorCounter:
    """Counts failures and logs each kind once (never raises)."""

    def __init__(self) -> None:
        self.count = 0
        self._seen: set[str] = set()

    def __call__(self, where: str, exc: BaseException) -> None:
        self.count += 1
        if where not in self._seen:
            self._seen.add(where)
            log.warning("perfloop: %s failed (counted, reported once): %s", where, exc)


class Recorder:
    """Tiles steps with phase spans and hands the rows to an emitter (one training thread).

    Times are ``time.perf_counter_ns`` values; rows carry Unix ns. With ``contiguous`` (the
    hooks) a step ends where the next one starts and the first starts at the first span;
    otherwise (the explicit API) `open_step` starts each step. Depth-0 spans of a step never
    overlap; the gaps between them are glued onto the span before (up to ``glue_ns``) or
    recorded as ``("user", "other")`` spans, and two spans of the same phase closer than
    ``coalesce_ns`` become one, so the spans of a step sum to its step time.

    The training thread only appends tuples: memory is read at most every
    ``memory_every_ns``, and rows are cleaned (losses read with ``resolve``) and handed to
    the emitter every ``handover_ns``, by `drain` on another thread when ``background``.

    >>> r = Recorder(None, wall_offset_ns=0)
    >>> r.span("data_wait", "data_wait", 0, 2_000_000)
    >>> r.span("forward", "forward", 2_010_000, 5_000_000)   # 10 µs glue → data_wait
    >>> r.span("backward", "backward", 6_000_000, 9_000_000)  # 1 ms gap → "other"
    >>> rec = r.end_step(9_020_000)                             # 20 µs glue → backward
    >>> rec.step, rec.step_time_ms, rec.phase_ms
    (0, 9.02, {'data_wait': 2.01, 'forward': 2.99, 'other': 1.0, 'backward': 3.02})
    """

    def __init__(
        self,
        emitter: Any,
        *,
        rank: int = 0,
        contiguous: bool = True,
        callbacks: Callback | None = None,
        glue_ns: int = 50_000,
        coalesce_ns: int = 200_000,
        wall_offset_ns: int | None = None,
        memory: Callable[[], dict[str, int]] | None = None,
        errors: ErrorCounter | None = None,
        handover_ns: int = 100_000_000,
        memory_every_ns: int = 250_000_000,
        resolve: Callable[[Any], float | None] | None = None,
    ) -> None:
        self.emitter = emitter
        self.rank = rank
        self.contiguous = contiguous
        if not isinstance(callbacks, CallbackSet):
            callbacks = CallbackSet([callbacks] if callbacks is not None else [])
        self.callbacks = callbacks
        self.glue_ns = glue_ns
        self.coalesce_ns = coalesce_ns
        self.offset = (
            time.time_ns() - time.perf_counter_ns() if wall_offset_ns is None else wall_offset_ns
        )
        self.memory = memory
        self.errors = errors or ErrorCounter()
        self.step = 0
        self.steps = 0  # finished
        self.step_ms_total = 0.0
        self._start: int | None = None
        self._cursor = 0
        self._last: list[Any] | None = None  # the pending depth-0 span [phase, name, t0, t1]
        self._phase_ms: dict[str, float] = {}
        self._spans: list[tuple[Any, ...]] = []  # rows in SPAN_COLUMNS order
        self._steps: list[dict[str, Any]] = []
        self._colls: list[tuple[Any, ...]] = []  # rows in COLLECTIVE_COLUMNS order
        self.handover_ns = handover_ns
        self._handed = 0
        self.background = False
        self._draining = threading.Lock()
        self._outbox: collections.deque[tuple[list[Any], list[Any], list[Any]]] = (
            collections.deque()
        )
        self.memory_every_ns = memory_every_ns
        self._mem_t = -(1 << 62)
        self._mem: dict[str, int] | None = None
        self.resolve = resolve

    @property
    def started(self) -> bool:
        """Whether a step is open."""
        return self._start is not None

    @property
    def cursor(self) -> int:
        """Where the depth-0 spans recorded so far end."""
        return self._cursor

    # -- spans -------------------------------------------------------------------------
    def _emit(
        self,
        phase: str,
        name: str,
        t0: int,
        t1: int,
        depth: int,
        tiles: bool = True,
        step: int | None = None,
    ) -> None:
        ms = (t1 - t0) / 1e6
        step = self.step if step is None else step
        self._spans.append((t0 + self.offset, self.rank, step, phase, name, ms, depth))
        if depth == 0 and tiles:
            key = name if phase == "user" else phase
            self._phase_ms[key] = self._phase_ms.get(key, 0.0) + ms
        if "on_phase_end" in self.callbacks.wanted:
            try:
                self.callbacks.on_phase_end(
                    SpanRecord(step, phase, name, t0 + self.offset, ms, depth)
                )
            except Exception as e:
                self.errors("a callback (on_phase_end)", e)

    def _flush_last(self) -> None:
        last = self._last
        if last is not None:
            self._last = None
            self._emit(last[0], last[1], last[2], last[3], 0)

    def _begin(self, t: int) -> None:
        self._start = self._cursor = t
        if "on_step_begin" in self.callbacks.wanted:
            try:
                self.callbacks.on_step_begin(self.step)
            except Exception as e:
                self.errors("a callback (on_step_begin)", e)

    def open_step(self, t: int) -> None:
        """Start a step at ``t`` (explicit API); a step already open is left as it is."""
        if self._start is None:
            self._begin(t)

    def span(
        self, phase: str, name: str, t0: int, t1: int, depth: int = 0, step: int | None = None
    ) -> None:
        """Record a span from ``t0`` to ``t1``; depth-0 spans arrive in time order. A nested
        span (``depth`` ≥ 1) may name the ``step`` it belongs to (default: the open one)."""
        if t1 < t0:
            t1 = t0
        if depth:
            self._emit(phase, name, t0, t1, depth, step=step)
            return
        if self._start is None:
            if not self.contiguous:  # outside a step block: kept, but it tiles nothing
                self._emit(phase, name, t0, t1, 0, tiles=False)
                return
            self._begin(t0)
        cur = self._cursor
        if t0 < cur:
            if t1 <= cur:  # inside what is already recorded: a nested span
                self._emit(phase, name, t0, t1, 1)
                return
            t0 = cur
        last = self._last
        gap = t0 - cur
        if last is not None and last[0] == phase and last[1] == name and gap <= self.coalesce_ns:
            last[3] = t1
            self._cursor = t1
            return
        if gap > 0:
            if gap <= self.glue_ns:
                if last is not None:
                    last[3] = t0
                else:
                    t0 = cur
            else:
                self._flush_last()
                self._emit("user", "other", cur, t0, 0)
        self._flush_last()
        self._last = [phase, name, t0, t1]
        self._cursor = t1

    def collective(
        self,
        op: str,
        t0: int,
        t1: int,
        *,
        size_bytes: int = 0,
        group: str = "",
        group_size: int = 0,
        dtype: str = "",
        step: int | None = None,
    ) -> None:
        """Record one collective call as a `CollectiveOp` row (its span is the caller's), in
        ``step`` (default: the open one)."""
        ms = max(t1 - t0, 0) / 1e6
        step = self.step if step is None else step
        self._colls.append(
            (
                t0 + self.offset,
                self.rank,
                step,
                op,
                size_bytes,
                group[:128],
                group_size,
                ms,
                dtype[:32],
            )
        )
        if "on_collective" in self.callbacks.wanted:
            try:
                self.callbacks.on_collective(
                    CollectiveRecord(
                        step, op, t0 + self.offset, ms, size_bytes, group, group_size, dtype
                    )
                )
            except Exception as e:
                self.errors("a callback (on_collective)", e)

    # -- steps -------------------------------------------------------------------------
    def end_step(
        self, t: int, fields: dict[str, Any] | None = None, **figures: Any
    ) -> StepRecord | None:
        """Close the open step at ``t`` with its figures (`StepEvent` names), given as the
        ``fields`` dict or as keywords. They are cleaned when rows are handed over (a
        ``loss`` may be a list of values to average, read with ``resolve``).

        Returns the step's record, or None when no step was open (nothing to time).
        """
        start = self._start
        if start is None:
            if self.contiguous:
                self._begin(t)
            return None
        cur = self._cursor
        gap = t - cur
        if gap > 0:
            if gap <= self.glue_ns and self._last is not None:
                self._last[3] = t
            else:
                self._flush_last()
                self._emit("user", "other", cur, t, 0)
        self._flush_last()
        step_ms = max((t - start) / 1e6, 1e-6)
        if fields is None:
            fields = figures
        if self.memory is not None and t - self._mem_t >= self.memory_every_ns:
            self._mem_t = t
            try:
                self._mem = self.memory()
            except Exception as e:
                self.errors("reading memory", e)
        phase_ms = self._phase_ms
        self._steps.append(
            (
                t + self.offset,
                self.rank,
                self.step,
                step_ms,
                phase_ms.get("data_wait", 0.0),
                fields,
                self._mem,
            )
        )
        rec = StepRecord(self.step, start + self.offset, t + self.offset, step_ms, phase_ms)
        rec.fields = fields
        self._phase_ms = {}
        self.step += 1
        self.steps += 1
        self.step_ms_total += step_ms
        self._start = None
        if t - self._handed >= self.handover_ns:
            self._handed = t
            self.handover()
        if "on_step_end" in self.callbacks.wanted:
            try:
                self.callbacks.on_step_end(rec)
            except Exception as e:
                self.errors("a callback (on_step_end)", e)
        if self.contiguous:
            self._begin(t)
        return rec

    def _step_rows(self, steps: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
        rows = []
        for ts, rank, step, step_ms, data_wait, fields, mem in steps:
            row = step_row(fields, self.resolve)
            if mem:
                row.update(mem)
            row["ts_ns"], row["rank"], row["step"] = ts, rank, step
            row["step_time_ms"], row["data_wait_ms"] = step_ms, data_wait
            rows.append(row)
        return {k: [r[k] for r in rows] for k in rows[0]}

    def handover(self) -> None:
        """Hand the pending rows over: to the emitter at once, or with ``background`` set,
        to `drain` (another thread cleans them, reads losses and calls the emitter)."""
        batch = (self._steps, self._spans, self._colls)
        self._steps, self._spans, self._colls = [], [], []
        if self.background:
            self._outbox.append(batch)
        else:
            self._publish(batch)

    def drain(self) -> None:
        """Publish what `handover` queued (thread-safe against the training thread, and one
        drain at a time, so batches reach the emitter in the order they were queued)."""
        out = self._outbox
        with self._draining:
            while out:
                try:
                    batch = out.popleft()
                except IndexError:
                    return
                self._publish(batch)

    def _publish(self, batch: tuple[list[Any], list[Any], list[Any]]) -> None:
        steps, spans, colls = batch
        em = self.emitter
        if em is None:
            return
        try:
            if steps:
                em.extend("step", **self._step_rows(steps))
            if spans:
                em.extend("span", **as_columns(SPAN_COLUMNS, spans))
            if colls:
                em.extend("collective", **as_columns(COLLECTIVE_COLUMNS, colls))
        except Exception as e:
            self.errors("handing rows to the emitter", e)

    def close(self) -> None:
        """Record the last open span of an unfinished step and publish everything."""
        self._flush_last()
        self.handover()
        self.drain()
