"""The Faust stream app: one ingest agent per input topic around one `StreamEngine`.

Agents read ``perfloop.telemetry.{gpu,host,step,span,job}`` and ``perfloop.control`` in
groups of messages, hand each to the engine, and send what it rejects to ``perfloop.dlq``
with the reason and the source in its headers; an agent never dies on bad input (even an
unexpected error in a component is logged, dead-lettered and survived). With each message the
engine learns whether its partition has been read to its end (its offset against the
partition's high-water mark from the consumer's last fetch): while a backlog is drained, the
sources it carries are not silent, so nothing closes early (see `perfloop.streams.engine`). A
timer ticks the engine every ``tick_interval_s`` (first telling it which partitions it has not
read from yet have input waiting, and which held ones have since been read to their end) and
publishes closed windows (``perfloop.windows``), phase changes, diagnoses, the online models'
predictions (``perfloop.predictions``) and recommendations, keyed by job, through a librdkafka
producer whose threads deliver them off the event loop (`perfloop.streams._publisher`).

Processing is at least once, with durable state, one `StreamEngine` per input partition
number (`perfloop.streams.shards`): input is read without automatic acknowledgement; every
``snapshot_interval_s`` (longer for a large state, see `SNAPSHOT_SHARE`) each engine whose
state may have changed is written to ``$PERFLOOP_HOME/streams/<worker_name>/<p>.snapshot``
(atomically, fsync'd), and every ``changelog_interval_s``, when its partition is revoked and
when the worker stops, to the changelog topic (`perfloop.streams._changelog`), which a
worker on any node reads; only then is the input it covers acknowledged (so the group's
commit, which a worker reads from when no snapshot of a partition reached it, never passes
the changelog's snapshot; the file only spares this worker re-reading). A worker given a
partition restores the newest snapshot it can read (its own file or the changelog's) and
skips what it holds when the consumer reads it again from the group's commit; what
was emitted after that snapshot may be emitted again (docs/guarantees.md states the bounds).
A partition kept through a rebalance skips what the consumer reads again from its commit.
Positions count only in the broker cluster they were taken in: against another one (the
embedded broker restarted empty gets a new cluster id) they are forgotten and the state
kept, so the new log is read, not skipped. Faust does not wait for unacknowledged input at a
rebalance or a stop (``stream_wait_empty`` off): the snapshot taken then acknowledges it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import faust
from faust.types import TP

from perfloop.autogroup import CatchUp
from perfloop.bad_input import ErrorAction, Failed, OnError, dead_letter_policy, decide
from perfloop.exceptions import WarehouseError
from perfloop.kafka import cluster_id, dlq_headers
from perfloop.schemas import encode_event
from perfloop.schemas.arrow_batch import warm_up
from perfloop.schemas.topics import Topics
from perfloop.schemas.windows import encode_windows
from perfloop.service_heap import GcClock, libc_trim
from perfloop.settings import StreamsSettings
from perfloop.streams._auth import faust_credentials
from perfloop.streams._changelog import Changelog
from perfloop.streams._fetching import pace_fetches, set_fetch_wait
from perfloop.streams._metrics_http import MetricsEndpoint
from perfloop.streams._publisher import Output
from perfloop.streams._signer import RecommendationSigner
from perfloop.streams._stats_line import stats_line
from perfloop.streams.engine import (
    INPUT_TOPICS,
    TELEMETRY_TOPICS,
    Outputs,
    StreamEngine,
    Unreadable,
    write_snapshot,
)
from perfloop.streams.positions import POSITIONS, write_positions
from perfloop.streams.predict.history import load_history
from perfloop.streams.shards import Shards
from perfloop.streams.windows import WindowColumns, split_by_job
from perfloop.warehouse.tables import TABLES

__all__ = [
    "StreamsService",
    "create_app",
    "pace_fetches",
    "sent_ns",
    "set_fetch_wait",
    "streams_policy",
    "windows_messages",
]

log = logging.getLogger("perfloop.streams")


# A tick later than this many intervals means the loop was blocked (see hold_all).
BLOCKED_TICKS = 2
HOLD_FRESH_S = 1.0
"""After a hold, how long until the consumer's view of a partition's end counts again when
the fetches cannot be watched (`pace_fetches` not in place): more than a fetch's wait on an
idle partition, at most `StreamsSettings.fetch_max_wait_ms`. Where they can, the view counts
again as soon as a fetch sent after the hold has been answered for the partition."""
POLL_FRESH_S = 1.5
"""A partition's end counts as known only if the consumer fetched it this recently (an idle
partition is fetched at least every `StreamsSettings.fetch_max_wait_ms`)."""
# Held (unacknowledged) input beyond this while snapshots fail is acknowledged anyway.
MAX_HELD_EVENTS = 20_000
SNAPSHOT_SHARE = 0.1
"""Taking snapshots may cost at most this share of the worker's time: a state so large that
serialising it every ``snapshot_interval_s`` would cost more (many jobs) is snapshotted less
often, and the bound on what a restart repeats stretches with it (the stats line says how
often snapshots are taken)."""


def sent_ns(msg: Any) -> int:
    """When a message was sent, by its Kafka timestamp (-1: it has none)."""
    ts = getattr(msg, "timestamp", None)
    return int(ts * 1e9) if isinstance(ts, int | float) and ts > 0 else -1


def windows_messages(cols: WindowColumns) -> list[tuple[bytes, bytes]]:
    """Closed windows as ``(key, value)`` messages: per job, Arrow IPC (v3), at most
    2000 rows each (`perfloop.schemas.windows`)."""
    out = []
    for job, part in split_by_job(cols).items():
        out.extend(encode_windows(part, job.encode()))
    return out


def local_path(settings: StreamsSettings, partition: int) -> Path:
    """Where the worker keeps its own copy of a partition's latest snapshot."""
    return settings.home_dir / "streams" / settings.worker_name / f"{partition}.snapshot"


def streams_policy(exc: BaseException, message: Failed) -> ErrorAction:
    """The stream workers' `perfloop.bad_input` policy: `dead_letter_policy`, except for a
    message that is no perfloop message of its topic (`Unreadable`) on a topic the sink stores:
    the sink reads it with the same codecs and dead-letters it, so the worker skips it (logged
    and counted in its ``rejected``), and a bad message is one dead letter. What only the
    stream tier refuses (an event time far off this worker's clock, a refused config change,
    a component's bug) is dead-lettered here.

    >>> m = Failed("perfloop.telemetry.step", 0, 7, b"job", b"{")
    >>> streams_policy(Unreadable("not valid JSON"), m), streams_policy(ValueError("x"), m)
    ('skip', 'dead_letter')
    """
    if isinstance(exc, Unreadable) and message.topic in TABLES:
        return "skip"
    return dead_letter_policy(exc, message)


def create_app(settings: StreamsSettings, on_error: OnError = streams_policy) -> faust.App:
    """Build the Faust app, its agents and timers for the given settings. ``on_error``
    decides what becomes of an input message the worker cannot take (`perfloop.bad_input`;
    by default `streams_policy`: it goes to ``perfloop.dlq`` with the reason, unless the sink
    dead-letters it, and the worker goes on)."""
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        broker_credentials=faust_credentials(settings),  # as every librdkafka client's
        broker_session_timeout=settings.broker_session_timeout_s,
        broker_heartbeat_interval=1.0,
        topic_partitions=settings.topic_partitions,
        topic_allow_declare=True,
        web_enabled=False,
        store="memory://",
        processing_guarantee="at_least_once",
        # Input is acknowledged only once a snapshot holds it (below); a rebalance or a stop
        # must not wait for that (Faust would, without end, at a stop): the snapshot written
        # on revocation and at the stop acknowledges what the engines hold.
        stream_wait_empty=False,
        datadir=str(settings.home_dir / "streams"),
    )

    def topic(name: str) -> Any:
        return app.topic(name, value_serializer="raw", key_serializer="raw")

    # What the worker publishes goes out by librdkafka, off the loop (`Output`); Faust's own
    # producer stays idle.
    output = Output(settings)
    signed = RecommendationSigner.of(settings)  # what it recommends, signed (`_signer`)

    shards = Shards(settings)
    changelog = Changelog(settings)
    changelog.start()  # the standby copy of every partition's state (`perfloop.streams._changelog`)
    # The warehouse's history of finished jobs, for the cross-run models: read in a thread so
    # a slow or absent warehouse never holds up the worker, learned in the loop at a tick.
    history: list[list[tuple[dict[str, float], float, float]]] = []
    if shards.history_wanted:

        def read_history() -> None:
            try:
                history.append(load_history(settings))
            except WarehouseError as e:
                log.warning("cross-run models start without the warehouse's history: %s", e)

        threading.Thread(target=read_history, name="job-history", daemon=True).start()
    shards.use_cluster(cluster_id(settings))
    metrics = MetricsEndpoint(settings, shards, app, output)  # /metrics (docs/alerts.md)
    held: list[Any] = []
    # Partitions being restored (their input waits), and whether a rebalance is under way (the
    # engines are not ticked between a revocation and the assignment that follows it: the
    # partitions that move are another worker's from their last snapshot on).
    restoring: dict[int, asyncio.Event] = {}
    moving = {"frozen": False}
    # No input is taken from a revocation until the assignment after it has been handled:
    # Faust resumes fetching before it tells the app of the assignment, and a message taken
    # then would find its partition's engine not restored yet.
    assigned_gate = asyncio.Event()
    state_lock = asyncio.Lock()
    trim = libc_trim()
    gc_clock = GcClock()
    catch_up = CatchUp.from_env()  # in the embedded stack: a yielding group, raised when behind
    if catch_up is not None and catch_up.raised:
        log.info("starting behind: scheduling group %s", catch_up.describe("raised"))
    # When the loop is blocked (a long tick, a snapshot, a run of messages) the consumer does
    # not fetch, so the partition ends it knows go stale: a partition that looked read to its
    # end may have new input waiting. After such a block every telemetry partition is held
    # (its sources' silence not counted) until a fetch sent after the block shows it read to
    # its end (`fresh`): a busy worker never closes windows on data it has not read yet. The
    # hold is "unsure" (`WindowSet.set_channel`): once it ends, the silence counts from before
    # it, so a worker whose own window closes block it does not keep restarting the silence
    # that closes the last windows of a job that stopped.
    loop = {"free_at": time.monotonic()}
    held_at: dict[tuple[str, int], float] = {}

    def fresh(tp: TP) -> bool:
        """Whether what the consumer knows of the partition's end postdates the last hold:
        a fetch sent after it was answered (or, fetches not watched, HOLD_FRESH_S passed)."""
        key = (tp.topic, tp.partition)
        at = held_at.get(key)
        if at is None:
            return True
        pace = pace_fetches(app, settings.fetch_min_interval_ms)
        if pace is not None:
            ok = pace["answered"].get(key, -1e9) >= at
        else:
            ok = time.monotonic() - at >= HOLD_FRESH_S
        if ok:
            del held_at[key]
        return ok

    def hold_all(now: int) -> None:
        start = time.monotonic()
        for tp in app.consumer.assignment():
            engine = shards.engines.get(tp.partition)
            if tp.topic in TELEMETRY_TOPICS and engine is not None:
                engine.set_input(tp.topic, tp.partition, caught_up=False, wall_ns=now, unsure=True)
                held_at[(tp.topic, tp.partition)] = start

    def hold_partition(p: int, engine: StreamEngine, now: int) -> None:
        """Hold the partition's telemetry until it is known read to its end again: a rebalance
        or a restore is no silence of its sources (a definite hold: their silence counts from
        when it ends)."""
        start = time.monotonic()
        for t in TELEMETRY_TOPICS:
            engine.set_input(t, p, caught_up=False, wall_ns=now)
            held_at[(t, p)] = start

    def highwater(tp: TP) -> int | None:
        """The partition's end from the consumer's last fetch (None: unknown or not assigned)."""
        try:
            hw = app.consumer.highwater(tp)
        except Exception:  # not assigned (any more), or no consumer yet
            return None
        return None if hw is None or hw < 0 else int(hw)

    def polled_recently(tp: TP) -> bool:
        """Whether the consumer fetched the partition in the last POLL_FRESH_S: only then is
        the end it knows current (Faust stops fetching a partition whose records it holds
        unprocessed, so a busy worker's view of the end can be seconds old)."""
        try:
            polled_ms = app.consumer._thread._ensure_consumer().last_poll_timestamp(tp)
        except Exception:  # not assigned, not started, or another consumer driver
            return True
        return polled_ms is not None and time.time() * 1000 - polled_ms <= POLL_FRESH_S * 1000

    def caught_up(tp: TP, offset: int) -> bool:
        """Whether ``offset`` is the partition's last message as far as the consumer knows, and
        it knows it from a recent fetch (an unknown end, or a partition no longer assigned,
        counts as read)."""
        hw = highwater(tp)
        return hw is None or (offset + 1 >= hw and polled_recently(tp))

    async def check_inputs(now: int) -> None:
        """Tell the engine which telemetry partitions have input left: those not read from
        yet (unfetched, or fetched short of their end) and those held whose end was reached."""
        held = set(shards.held_inputs)
        unread = []
        for tp in app.consumer.assignment():
            engine = shards.engines.get(tp.partition)
            if tp.topic not in TELEMETRY_TOPICS or engine is None or tp.partition in restoring:
                continue
            pos = engine.position(tp.topic, tp.partition)
            if pos is None:
                unread.append(tp)
            elif (tp.topic, tp.partition) in held and caught_up(tp, pos - 1) and fresh(tp):
                engine.set_input(tp.topic, tp.partition, caught_up=True, wall_ns=now)
        fetched = await asyncio.gather(
            *(asyncio.wait_for(app.consumer.position(tp), 0.1) for tp in unread),
            return_exceptions=True,
        )
        for tp, at in zip(unread, fetched, strict=True):
            engine = shards.engines.get(tp.partition)
            if engine is None:  # dropped meanwhile
                continue
            hw = highwater(tp)  # unknown, or not fetched to its end: input left to read
            behind = hw is None or not isinstance(at, int) or at < hw
            unsure = not behind and not fresh(tp)
            engine.set_input(
                tp.topic, tp.partition, caught_up=not (behind or unsure), wall_ns=now, unsure=unsure
            )

    async def emit(o: Outputs) -> None:
        if o.windows is not None:
            for key, value in windows_messages(o.windows):
                await output.send(Topics.WINDOWS, key, value)
        for name, events in (
            (Topics.PHASES, o.phases),
            (Topics.DIAGNOSES, o.diagnoses),
            (Topics.RECOMMENDATIONS, signed(o.recommendations)),
            (Topics.PREDICTIONS, o.predictions),
            (Topics.ACTUATIONS, o.refusals),  # settings changes refused: the sink audits them
        ):
            for ev in events:
                await output.send(name, ev.job_id.encode(), encode_event(ev))
        for d in o.diagnoses:
            if d.state == "open":
                log.info("diagnosis %s %s (%s) ranks %s", d.job_id, d.bottleneck, d.level, d.ranks)
        for r in o.recommendations:
            log.info(
                "recommendation for %s: %s %s -> %s", r.job_id, r.knob, r.from_value, r.to_value
            )

    async def ingest(stream: Any) -> None:
        # One event at a time: Faust's take_events acknowledges what it yields, which would
        # let committed offsets pass the snapshot; a message carries a whole batch anyway.
        async for event in stream.noack().events():
            msg = event.message
            if not assigned_gate.is_set():
                await assigned_gate.wait()
            wait = restoring.get(msg.partition)
            if wait is not None:  # its engine is being restored
                await wait.wait()
            engine = shards.engine(msg.partition)
            value = event.value if isinstance(event.value, bytes) else b""
            at_end = caught_up(msg.tp, msg.offset)
            unsure = at_end and not fresh(msg.tp)
            now, sent = time.time_ns(), sent_ns(msg)
            if catch_up is not None and sent > 0:
                catch_up.seen((now - sent) / 1e9)
            try:
                engine.ingest(
                    msg.topic, value, wall_ns=now, partition=msg.partition,
                    offset=msg.offset, caught_up=at_end and not unsure, sent_ns=sent,
                    unsure=unsure,
                )  # fmt: skip
                metrics.message(msg.topic, value, now, sent)
            except Exception as e:  # bad input, or a component's bug: never stops the worker
                failed = Failed(msg.topic, msg.partition, msg.offset, msg.key, value)
                action, why = decide(on_error, e, failed, log)
                engine.rejected[msg.topic] += 1
                if action == "dead_letter":
                    headers = dlq_headers(why, msg.topic, msg.partition, msg.offset)
                    await output.send(Topics.DLQ, msg.key, value, headers=headers)
            held.append(event)

    for topic_name in INPUT_TOPICS:
        name = "ingest-" + topic_name.rsplit(".", 1)[-1]
        app.agent(topic(topic_name), name=name)(ingest)

    @app.timer(settings.tick_interval_s)
    async def tick() -> None:
        if not gc_clock.frozen:  # the first tick: the worker has started
            log.info("%d objects made while starting frozen (out of the collector's walks)",
                     gc_clock.freeze())  # fmt: skip
        outs: list[Outputs] = []
        try:
            now = time.time_ns()
            set_fetch_wait(app, settings.fetch_max_wait_ms)
            pace_fetches(app, settings.fetch_min_interval_ms)
            if time.monotonic() - loop["free_at"] > BLOCKED_TICKS * settings.tick_interval_s:
                hold_all(now)  # the loop was blocked: the partition ends known may be stale
            if not moving["frozen"]:
                await check_inputs(now)
                if history and (n := shards.learn_history(history[-1])) is not None:
                    history.pop()
                    log.info("cross-run models learned from %d finished jobs in the warehouse", n)
                for p, engine in list(shards.engines.items()):
                    if p not in restoring:
                        outs.append(engine.tick(now))
        except Exception:  # logged; the next tick tries again
            log.exception("tick failed")
            return
        finally:
            loop["free_at"] = time.monotonic()
        for o in outs:
            if o:
                await emit(o)
            metrics.tick(o, now)  # never raises
        if not outs:
            metrics.tick(Outputs(), now)
        output.poll()
        if catch_up is not None and (moved := catch_up.tick()) is not None:
            word = "behind" if moved == "raised" else "caught up"
            log.info("input %s: scheduling group %s", word, catch_up.describe(moved))

    snap = {"next": 0.0, "every": settings.snapshot_interval_s, "bytes": 0, "dumps_s": 0.0}
    snap["shared_at"] = time.monotonic()  # the last write to the changelog
    # per partition, the positions of the last snapshot written to the file / to the changelog
    written: dict[bool, dict[int, dict[tuple[str, int], int]]] = {False: {}, True: {}}

    def write_all(data: dict[int, bytes], shared: bool) -> None:
        for p, d in data.items():
            write_snapshot(local_path(settings, p), d)
            if shared:
                changelog.write(p, d)

    async def replaced() -> bool:
        """Whether the broker is another cluster than the one the engines read (the embedded
        one restarted empty or recycled): their offsets then mean nothing in its log, and a
        commit of them would make the group read the new log from there, skipping the rest
        (the embedded broker answers a fetch past a partition's end with nothing)."""
        now = await asyncio.get_running_loop().run_in_executor(None, cluster_id, settings)
        return None not in (now, shards.cluster_id) and now != shards.cluster_id

    async def take_snapshots(why: str) -> bool:
        """Snapshot every engine whose state may have changed to the changelog, then
        acknowledge the input the snapshots cover; False if they could not be written."""
        async with state_lock:
            # The state and the input it covers are taken together (no await between them);
            # what was emitted up to then is delivered before the state is written, so a
            # snapshot never holds a closed window whose row a kill could still lose; then
            # that input is acked.
            start = time.monotonic()
            # the changelog (which another worker restores from) less often than the local
            # copy (which this worker restores from): each write stays in the embedded broker
            shared = why != "periodic" or start - snap["shared_at"] >= settings.changelog_interval_s
            data, offsets = {}, {}
            for p, engine in shards.engines.items():
                if p in restoring:
                    continue
                offsets[p] = engine.offsets
                if engine.jobs or offsets[p] != written[shared].get(p):
                    data[p] = engine.dumps()
            took = time.monotonic() - start
            snap["every"] = max(settings.snapshot_interval_s, took / SNAPSHOT_SHARE)
            snap["next"] = start + snap["every"] - settings.snapshot_interval_s / 2
            snap["bytes"], snap["dumps_s"] = sum(len(d) for d in data.values()), took
            covered = held[:]
            held.clear()
            try:
                if not await output.flush():
                    raise OSError("what the worker published was not all delivered")
                # written off the event loop (the input keeps flowing meanwhile)
                await asyncio.get_running_loop().run_in_executor(None, write_all, data, shared)
                for kind in (False, True) if shared else (False,):
                    written[kind].update({p: offsets[p] for p in data})
                if shared:
                    snap["shared_at"] = start
                    if await replaced():  # its offsets are in the old log: never committed
                        log.info("the broker was replaced: %d messages not acknowledged",
                                 len(covered))  # fmt: skip
                        covered = []
                else:  # acknowledged once the changelog holds it: the commit is what another
                    held[:0] = covered  # worker reads from when no snapshot of it reached it
                    covered = []
            except Exception as e:  # broker trouble: keep the input, try again
                log.warning("stream snapshot (%s) failed: %s", why, e)
                held[:0] = covered
                if len(held) < MAX_HELD_EVENTS:
                    return False
                log.warning("acknowledging %d messages without a snapshot", len(held))
                covered = held[:]
                held.clear()
            for event in covered:
                event.ack()
        if trim is not None:
            # Each snapshot allocates and frees its whole pickled state; glibc keeps the freed
            # pages unless asked, and the worker's RSS crept up by a few MiB a minute.
            trim(0)
        return True

    @app.timer(settings.snapshot_interval_s)
    async def snapshot() -> None:
        if time.monotonic() >= snap["next"] and not moving["frozen"]:
            await take_snapshots("periodic")
        if not moving["frozen"]:  # how far it has read, for the stack (`streams.positions`)
            read = {}
            for p, engine in shards.engines.items():
                if p not in restoring:
                    read.update(engine.offsets)
            where = settings.home_dir / "streams" / settings.worker_name / POSITIONS
            write_positions(where, shards.cluster_id, read, at=time.time())

    @app.on_partitions_revoked.connect
    async def revoked(app: faust.App, revoked: Any = (), **kwargs: Any) -> None:
        # A rebalance: input stops until the assignment. Every engine's telemetry is held (the
        # pause is no silence of the jobs), its state written (a partition that moves is
        # restored from it by its next worker), and the engines rest until the assignment.
        moving["frozen"] = True
        assigned_gate.clear()
        now = time.time_ns()
        for p, engine in shards.engines.items():
            hold_partition(p, engine, now)
        if await take_snapshots("rebalance"):
            log.info("rebalance: the state of %d partition(s) written", len(shards.engines))

    def read_local(p: int) -> bytes | None:
        try:
            return local_path(settings, p).read_bytes()
        except OSError:
            return None

    @app.on_partitions_assigned.connect
    async def assigned(app: faust.App, assigned: Any = (), **kwargs: Any) -> None:
        try:
            await take_assignment({tp.partition for tp in assigned if tp.topic in INPUT_TOPICS})
        finally:  # whatever happened, input flows again (a partition not restored starts fresh)
            moving["frozen"] = False
            assigned_gate.set()

    async def take_assignment(parts: set[int]) -> None:
        # the broker may have been replaced meanwhile (the embedded one restarted empty): the
        # positions the engines hold are then positions in another log
        cluster = await asyncio.get_running_loop().run_in_executor(None, cluster_id, settings)
        shards.use_cluster(cluster)
        for p in sorted(set(shards.engines) - parts):
            jobs = shards.jobs(p)
            shards.drop(p)
            for kind in written.values():
                kind.pop(p, None)
            log.info("partition %d moved to another worker with its %d job(s)", p, len(jobs))
        new = sorted(parts - set(shards.engines))
        for p in new:
            restoring[p] = asyncio.Event()
        try:
            for p in new:
                try:
                    data = await asyncio.get_running_loop().run_in_executor(
                        None, changelog.latest, p, settings.restore_timeout_s
                    )
                except OSError as e:
                    log.warning("partition %d: no snapshot from the changelog: %s", p, e)
                    data = None
                mine = await asyncio.get_running_loop().run_in_executor(None, read_local, p)
                engine = shards.add(p, data, mine)
                hold_partition(p, engine, time.time_ns())
                if engine.offsets:
                    # the group's commit never passes the changelog's snapshot (input is
                    # acknowledged once it holds it), nor this worker's newer file: reading
                    # from it, the engine skips what the snapshot holds
                    log.info(
                        "partition %d: %d job(s) restored from its snapshot",
                        p, len(engine.jobs),
                    )  # fmt: skip
        finally:
            for p in new:
                restoring.pop(p).set()
        log.info("assigned partition(s) %s", sorted(parts))

    @app.on_before_shutdown.connect
    async def close_output(app: faust.App, **kwargs: Any) -> None:
        if not moving["frozen"]:
            try:  # a stop that lets it: the next worker repeats nothing
                await asyncio.wait_for(take_snapshots("stop"), settings.restore_timeout_s)
            except Exception as e:  # the broker gone: the last periodic snapshot stands
                log.warning("no last snapshot at stop: %s", e)
        output.close()
        changelog.close()

    @app.timer(10.0)
    async def report() -> None:
        fetches = (pace_fetches(app, settings.fetch_min_interval_ms) or {}).get("fetches", 0)
        log.info("%s", stats_line(shards, len(held), snap, changelog, fetches, gc_clock, output))

    app.perfloop_shards = shards  # type: ignore[attr-defined]
    app.perfloop_metrics = metrics  # type: ignore[attr-defined]
    return app


class StreamsService:
    """Runs the stream app as a Faust worker; SIGTERM stops it."""

    def __init__(self, settings: StreamsSettings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self._worker: faust.Worker | None = None

    def start(self) -> None:
        self._worker = faust.Worker(self.app, loglevel="INFO", quiet=True)

    def run(self) -> None:
        warm_up()  # before the first job's input, not with it
        self.start()
        assert self._worker is not None
        self.app.perfloop_metrics.start()  # type: ignore[attr-defined]
        try:
            self._worker.execute_from_commandline()
        finally:
            self.app.perfloop_metrics.stop()  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self._worker is not None:
            self._worker.stop_and_shutdown()
