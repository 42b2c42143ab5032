"""How the stream worker's consumer fetches: its longest wait, and fetches paced apart.

Faust's consumer is aiokafka's; these reach its fetcher (`perfloop.streams.app` re-exports
them).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import faust
from faust.types import TP

__all__ = ["pace_fetches", "set_fetch_wait"]


def _fetcher(app: faust.App, needs: str) -> Any:
    """The app's aiokafka fetcher if it exists and has attribute ``needs``, else None."""
    try:
        fetcher = app.consumer._thread._ensure_consumer()._fetcher
    except Exception:  # not started yet, or another consumer driver
        return None
    return fetcher if fetcher is not None and hasattr(fetcher, needs) else None


def set_fetch_wait(app: faust.App, wait_ms: int) -> bool:
    """Give the app's consumer fetches this longest wait; False until its fetcher exists.

    Faust fixes it at 1.5 s, which on the embedded broker delays input by ~0.4 s at the
    median (`perfloop.stack.broker`); the fetcher reads the value for each fetch it builds.
    """
    fetcher = _fetcher(app, "_fetch_max_wait_ms")
    if fetcher is None:
        return False
    fetcher._fetch_max_wait_ms = wait_ms
    return True


def pace_fetches(app: faust.App, interval_ms: int) -> dict[str, Any] | None:
    """Send the app's consumer fetches at least ``interval_ms`` apart (per broker); return
    the pacing state, or None until its fetcher exists: ``interval_s``, ``fetches`` (sent)
    and ``answered`` (per (topic, partition), the `time.monotonic` at which the latest fetch
    whose answer gave the partition's end was sent: that end is at least that recent).

    A fetch is answered as soon as any of its partitions has new records, so the consumer
    would fetch again each time a producer publishes; the embedded broker lists every stored
    batch of each such partition per fetch (`perfloop.stack.broker`). Waiting before the next
    fetch lets the records of several publishes come in one. Calling it again changes the
    interval.
    """
    fetcher = _fetcher(app, "_proc_fetch_request")
    if fetcher is None:
        return None
    state: dict[str, Any] | None = getattr(fetcher, "_perfloop_pace", None)
    if state is not None:
        state["interval_s"] = interval_ms / 1000
        return state
    pace: dict[str, Any] = {
        "interval_s": interval_ms / 1000,
        "fetches": 0,
        "last": {},
        "answered": {},  # (topic, partition): when the latest fetch answered for it was sent
    }
    send = fetcher._proc_fetch_request

    async def paced(assignment: Any, node_id: int, request: Any) -> Any:
        wait = pace["last"].get(node_id, -1e9) + pace["interval_s"] - time.monotonic()
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:  # closed or unassigned meanwhile: as aiokafka does
                return False
        sent, sent_ms = time.monotonic(), int(time.time() * 1000)
        pace["last"][node_id] = sent
        pace["fetches"] += 1
        result = await send(assignment, node_id, request)
        answered = pace["answered"]
        for topic, parts in request.topics:
            for partition, *_ in parts:
                try:  # the partition's end was taken from this answer (aiokafka stamps it)
                    stamp = assignment.state_value(TP(topic, partition)).timestamp
                except Exception:  # unassigned meanwhile
                    continue
                if stamp is not None and stamp >= sent_ms:
                    answered[(topic, partition)] = sent
        return result

    fetcher._proc_fetch_request = paced
    fetcher._perfloop_pace = pace
    return pace
