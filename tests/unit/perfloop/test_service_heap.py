"""The services' heap helpers: the garbage collector's clock and the freeze after start-up."""

from __future__ import annotations

import gc
import weakref

from perfloop.service_heap import GcClock


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_gc_clock_counts_the_collections_it_sees_and_their_time() -> None:
    ticks = iter(range(0, 10_000, 5))  # a clock that moves 5 s at every reading
    clock = GcClock(clock=lambda: float(next(ticks)))
    enabled = gc.isenabled()
    gc.disable()  # only the collections made here (another thread's allocations start none)
    try:
        before = clock.collections, clock.seconds
        gc.collect()
        gc.collect(0)
        assert (clock.collections, clock.seconds) == (before[0] + 2, before[1] + 10.0)
    finally:
        clock.close()
        if enabled:
            gc.enable()
    assert clock._on_gc not in gc.callbacks
    gc.collect()
    assert clock.collections == before[0] + 2  # closed: no longer counting


def test_freeze_keeps_collections_off_what_was_alive_and_on_what_comes_after() -> None:
    clock = GcClock()
    old = _Node()
    old_ref = weakref.ref(old)
    try:
        frozen = clock.freeze()
        assert frozen == clock.frozen > 0  # (the count falls as frozen objects are freed)
        new = _Node()
        new_ref = weakref.ref(new)
        del old, new
        gc.collect()
        assert new_ref() is None  # made after the freeze: collected as ever
        assert old_ref() is not None  # frozen: no collection walks it
    finally:
        gc.unfreeze()
        clock.close()
    gc.collect()
    assert old_ref() is None  # back in the generations, collected
