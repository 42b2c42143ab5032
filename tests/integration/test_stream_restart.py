"""Acceptance: the stream worker is SIGKILLed mid-run and restarted by the supervisor; its
windows continue from its last snapshot with nothing missing, and the only windows emitted
twice are those closed between that snapshot and the kill (the documented bound).

A producer publishes steady step batches for 4 ranks (one step per rank every 50 ms) for
about 30 s; the worker is killed 12 s in. Every 1 s tumbling window of ``step_time_ms`` of
every rank must then be in the warehouse with exactly the number of steps the producer sent
in that second. The kill runs on a stack of its own (the session stack is shared).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher
from perfloop.settings import StackSettings, StreamsSettings
from perfloop.stack import read_state
from perfloop.warehouse import client

from .conftest import private_stack, wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000
RANKS = 4
STEP_NS = 50_000_000


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(tmp_path_factory.mktemp("perfloop-stream-restart")) as settings:
        yield settings


def _streams(stack: StackSettings) -> dict[str, int]:
    state = read_state(stack)
    assert state is not None, "the stack is not up"
    s = state["services"]["streams"]
    return {"pid": int(s["pid"]), "restarts": int(s["restarts"])}


def _live(stack: StackSettings, job: str) -> bool:
    """Whether the job's 1 s windows in the warehouse reach 4 s before now."""
    ch = client(stack)
    try:
        (latest,) = ch.query(
            "SELECT max(toUnixTimestamp64Nano(ts)) FROM windows WHERE job_id = {j:String} "
            "AND metric = 'step_time_ms' AND window_s = 1",
            parameters={"j": job},
        ).result_rows[0]
    finally:
        ch.close()
    return bool(latest) and int(latest) >= time.time_ns() - 4 * NS


def test_killed_stream_worker_resumes_from_its_snapshot(own_stack: StackSettings) -> None:
    defaults = StreamsSettings()
    job = f"it-restart-{uuid.uuid4().hex[:8]}"
    pub = Publisher(own_stack, producer_id=job, spool_dir=own_stack.home_dir / "spool" / job)
    em = Emitter(pub, job_id=job, node="n0", producer_id=job)
    sent: Counter[tuple[int, int]] = Counter()  # (rank, second) -> steps
    before = _streams(own_stack)
    killed_at = 0
    step = 0
    t_next = time.time_ns() // STEP_NS * STEP_NS
    start = time.monotonic()
    while time.monotonic() - start < 30:
        now = time.time_ns()
        ts = np.arange(t_next, now, STEP_NS, dtype=np.int64)
        if len(ts):
            t_next = int(ts[-1]) + STEP_NS
            ranks = np.tile(np.arange(RANKS), len(ts))
            tss = np.repeat(ts, RANKS)
            steps = np.repeat(np.arange(step, step + len(ts)), RANKS)
            step += len(ts)
            em.extend(
                "step",
                ts_ns=tss,
                rank=ranks,
                step=steps,
                step_time_ms=50.0 + ranks,
                data_wait_ms=np.full(len(tss), 2.0),
                num_workers=np.full(len(tss), 4),
            )
            em.flush()
            for r, sec in zip(ranks.tolist(), (tss // NS).tolist(), strict=True):
                sent[(r, sec)] += 1
        # kill 12 s in, once the worker is live (its windows reach the last few seconds): the
        # bound below is for a worker that keeps up, not one still reading a start-up backlog
        if not killed_at and time.monotonic() - start > 12 and _live(own_stack, job):
            os.kill(before["pid"], signal.SIGKILL)
            killed_at = time.time_ns()
        time.sleep(0.1)
    assert killed_at, "the stream worker never kept up within 30 s"
    assert pub.flush(15) == 0
    pub.close()
    last_sec = max(sec for _, sec in sent)
    first_sec = min(sec for _, sec in sent)

    after = _streams(own_stack)
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]

    ch = client(own_stack)
    q = (
        "SELECT rank, toUnixTimestamp64Nano(ts), count, count() OVER "
        "(PARTITION BY rank, ts) FROM windows WHERE job_id = {j:String} "
        "AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1"
    )

    def rows() -> list[tuple[int, int, int, int]]:
        return [tuple(r) for r in ch.query(q, parameters={"j": job}).result_rows]

    try:
        # the last full second closes once the lateness has passed; allow the restart's backlog
        try:
            wait_for(
                lambda: {(r, t // NS) for r, t, _, _ in rows()} >= set(sent),
                90,
                "a 1 s window for every second of every rank",
            )
        except AssertionError as e:
            have = {(r, t // NS) for r, t, _, _ in rows()}
            missing = sorted(set(sent) - have)
            raise AssertionError(
                f"{e}: {len(missing)} missing, e.g. {missing[:8]}; killed at "
                f"{killed_at // NS}, data {first_sec}..{last_sec}"
            ) from None
        got = rows()
    finally:
        ch.close()
    counts = {(r, t // NS): c for r, t, c, _ in got}
    assert {k: counts[k] for k in sent} == dict(sent), "every step counted once per window"
    dup = sorted({t // NS for _, t, _, n in got if n > 1})
    assert all(n <= 2 for *_, n in got), "a window is emitted at most twice"
    # Only windows closed between the last snapshot before the kill and the kill repeat.
    lateness, snap = defaults.allowed_lateness_s, defaults.snapshot_interval_s
    lo = killed_at / NS - snap - lateness - defaults.tick_interval_s - 2.0
    hi = killed_at / NS - lateness + 1.0
    assert all(lo <= sec + 1 <= hi for sec in dup), (dup, killed_at / NS)
    assert first_sec < killed_at // NS < last_sec
