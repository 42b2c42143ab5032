"""Acceptance: the embedded broker is recycled (replaced by an empty one) while jobs run, as
it is once its memory has grown by ``PERFLOOP_BROKER_RECYCLE_MB`` (`perfloop.stack._recycle`),
and nothing of the jobs' telemetry or of the stream tier's output is lost or doubled.

A stack of the module's own, with a recycle every few MiB: six simulated jobs (five healthy, one
with a starving loader) publish through the producers' `Publisher` (which resends its last
acknowledged messages to a broker that lost them) for 70 s. Then:

- the broker was replaced at least once, by a new process of a new cluster at a port of its
  own (the old one refuses), and no service restarted;
- every step sample is in the warehouse once, and no step of any rank is missing;
- the 1 s windows count every step sample once, and no window was emitted twice;
- the healthy jobs got no diagnosis; the starving one was diagnosed with its fault.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from perfloop.kafka import admin, cluster_id
from perfloop.producers import Publisher
from perfloop.producers.scenarios import scenario_config
from perfloop.producers.simulator import SimulatedJob
from perfloop.schemas.job import FAULT_KINDS
from perfloop.settings import StackSettings, StreamsSettings
from perfloop.stack import read_state

from .conftest import private_stack, query, short_seconds, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_S = 50.0
SCENARIOS = ("healthy",) * 5 + ("dataloader_starvation",)


@pytest.fixture(scope="module")
def recycling_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(
        tmp_path_factory.mktemp("perfloop-recycle"),
        PERFLOOP_BROKER_RECYCLE_MB="4",
        PERFLOOP_BROKER_RECYCLE_RETRY_S="5",
    ) as settings:
        yield settings


def _recycling(stack: StackSettings) -> dict[str, Any]:
    state = read_state(stack)
    assert state is not None, "the stack is not up"
    return dict(state.get("broker_recycling") or {})


def _broker_port(stack: StackSettings) -> int:
    """The port the broker advertises (its own, behind the stack's address)."""
    brokers = admin(stack).list_topics(timeout=10).brokers
    return int(next(iter(brokers.values())).port)


def _open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_recycled_broker_loses_and_doubles_nothing(recycling_stack: StackSettings) -> None:
    stack = recycling_stack
    run = uuid.uuid4().hex[:6]
    first_cluster = cluster_id(stack)
    first_port = _broker_port(stack)
    pub = Publisher(stack, producer_id=f"it-recycle-{run}")
    jobs = [
        SimulatedJob(
            scenario_config(sc, job_id=f"it-rc-{run}-{i}-{sc}", nodes=1, ranks_per_node=8,
                            duration_s=RUN_S, seed=i),
            pub,
        )
        for i, sc in enumerate(SCENARIOS)
    ]  # fmt: skip
    threads = [threading.Thread(target=j.run, args=(RUN_S,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(RUN_S + 60)
        assert pub.flush(60) == 0, f"still outstanding: {pub.stats}"
    finally:
        pub.close()
    st = pub.stats
    rec = _recycling(stack)
    log = (stack.home_dir / "logs" / "supervisor.log").read_text(errors="replace")
    assert rec.get("recycles", 0) >= 1, f"no recycle in {RUN_S:.0f} s: {rec}; log: {log[-2000:]}"
    assert cluster_id(stack) != first_cluster, "the broker is a new cluster"
    # at a port of its own: what a client knew of the old broker never reaches the new one
    # (`perfloop.stack._front`), and no service crashed on the way (librdkafka did, before)
    assert _broker_port(stack) != first_port and not _open(first_port)
    state = read_state(stack) or {}
    restarts = {n: s["restarts"] for n, s in state["services"].items() if s.get("restarts")}
    assert restarts == {}, f"services restarted during the recycles: {restarts}"
    assert st.broker_losses >= 1 and st.refused == st.failed == st.dropped == 0, st
    print(f"recycling: {json.dumps(rec)}; publisher: resent {st.resent}, spooled {st.spooled}")

    job_ids = [j.cfg.job_id for j in jobs]

    sent = sum(j.step * j.world for j in jobs)  # a step sample per rank and step

    def steps() -> tuple[int, int]:
        (n, uniq) = query(
            stack,
            "SELECT count(), uniqExact(job_id, rank, step) FROM steps "
            "WHERE job_id IN {j:Array(String)}",
            j=job_ids,
        )[0]
        return int(n), int(uniq)

    try:
        wait_for(lambda: steps()[1] >= sent, 90, f"all {sent} step samples in the warehouse")
    except AssertionError:
        raise AssertionError(f"{steps()} (rows, distinct) of {sent} step samples") from None
    time.sleep(2.5)  # a repeat would land within two sink flushes
    n, uniq = steps()
    assert n == uniq == sent, f"{n} step rows, {uniq} distinct, {sent} sent"

    def covered() -> tuple[int, int]:
        (c,) = query(
            stack,
            "SELECT sum(c) FROM (SELECT any(count) AS c FROM windows WHERE job_id IN "
            "{j:Array(String)} AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1 "
            "GROUP BY job_id, node, rank, device, ts)",
            j=job_ids,
        )[0]
        return n, int(c or 0)

    try:
        wait_for(lambda: covered()[1] >= n, 60, "the 1 s windows to count every step sample")
    except AssertionError:
        gaps = short_seconds(stack, job_ids)
        raise AssertionError(
            f"windows count {covered()[1]} of {n} step samples; recycled at "
            f"{rec.get('last_at')}; seconds (job, s, steps, windowed): {gaps[:40]}"
        ) from None
    time.sleep(StreamsSettings().allowed_lateness_s + 6)
    assert covered() == (n, n)
    (twice,) = query(
        stack,
        "SELECT count() FROM (SELECT job_id, rank, ts, count() AS k FROM windows WHERE job_id "
        "IN {j:Array(String)} AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1 "
        "GROUP BY job_id, node, rank, device, ts HAVING k > 1)",
        j=job_ids,
    )[0]
    assert twice == 0, f"{twice} windows emitted twice"

    found = query(
        stack,
        "SELECT job_id, groupUniqArray(bottleneck) FROM diagnoses WHERE job_id IN "
        "{j:Array(String)} GROUP BY job_id",
        j=job_ids,
    )
    kinds = {job: {k for k in ks if k in FAULT_KINDS} for job, ks in found}
    for job in job_ids:
        fault = job.rsplit("-", 1)[-1]
        want = {fault} if fault in FAULT_KINDS else set()
        assert kinds.get(job, set()) == want, f"{job}: diagnosed {kinds.get(job)}"


def test_the_unread_records_are_read_out_whole_and_written_back_in_order(
    stack: StackSettings,
) -> None:
    """What a recycle carries over (`perfloop.stack._carry`), on the real embedded broker: every
    record from each partition's start of unread to its end (the embedded broker reports no
    true end: `true_ends` finds it), with its key, headers and timestamp, and written back to
    the same partition in the same order."""
    from confluent_kafka.admin import NewTopic

    from perfloop.kafka import admin, producer
    from perfloop.stack._carry import CarryError, read_unread, write
    from perfloop.stack._recycle import true_ends

    src, dst = (f"it-carry-{uuid.uuid4().hex[:8]}-{n}" for n in ("old", "new"))
    a = admin(stack)
    for f in a.create_topics([NewTopic(t, 2, 1) for t in (src, dst)]).values():
        f.result(10)
    p = producer(stack)
    for i in range(600):
        p.produce(src, key=f"k{i}".encode(), value=f"v{i}".encode() * 50, partition=i % 2,
                  headers=[("id", str(i).encode())], timestamp=1_700_000_000_000 + i)  # fmt: skip
        if i % 97 == 0:
            p.flush(10)  # several record batches per partition
    assert p.flush(10) == 0
    ends = true_ends(stack, [src])
    assert ends == {(src, 0): 300, (src, 1): 300}, ends

    got = read_unread(stack, {(src, 0): 250, (src, 1): 0}, ends)
    assert len(got) == 50 + 300
    for part, first in ((0, 250), (1, 0)):
        ids = [int(dict(r.headers or [])["id"]) for r in got if r.partition == part]
        assert ids == list(range(2 * first + part, 600, 2)), (part, ids[:5])
    r0 = next(r for r in got if r.partition == 0)
    assert (r0.key, r0.value, r0.timestamp_ms) == (b"k500", b"v500" * 50, 1_700_000_000_500)
    with pytest.raises(CarryError, match="MiB of telemetry is unread"):
        read_unread(stack, {(src, 1): 0}, ends, max_bytes=1000)

    moved = [type(r)(dst, r.partition, r.key, r.value, r.headers, r.timestamp_ms) for r in got]
    assert write(stack, moved) == 0
    back = read_unread(stack, {(dst, 0): 0, (dst, 1): 0}, true_ends(stack, [dst]))

    def fields(recs: list[Any], part: int) -> list[tuple[Any, ...]]:
        return [(r.key, r.value, r.headers, r.timestamp_ms) for r in recs if r.partition == part]

    for part in (0, 1):
        assert fields(back, part) == fields(moved, part), part
