"""Recycling the embedded broker, so that its memory and its cost per fetch stay bounded.

Tansu's memory storage keeps every record (no retention, no DeleteRecords:
`perfloop.stack.broker`) and each fetch costs it in proportion to what it holds, so a stack
that runs for days would run its machine out of memory and its broker out of CPU. Once the
broker's memory has grown by ``broker_recycle_mb`` since it started, the supervisor replaces it
with an empty one (a new cluster id) at a moment when nothing it holds is still needed:

1. **Read, nearly to the end.** The telemetry must have been read — by the sink (its
   committed offsets) and by the stream workers (their positions files,
   `perfloop.streams.positions`) — up to where it ended `LAG_S` before. Otherwise the next
   check, `CHECK_S` later, tries again. What came since is carried over (step 3).
2. **Quiet and read whole.** What no producer resends (the stream workers' outputs, the
   actuator's commands and decisions, the agents' acknowledgements, people's approvals) must
   have been read whole. The stream workers are stopped (SIGSTOP); once the sink (everything
   it lands) and the actuator (the recommendations, commands and acknowledgements) have
   committed the end of every such partition, and those ends have not moved for `QUIET_S`,
   the actuator and the notifier are stopped too and the sink's reading is checked once more.
   If that does not come within ``broker_recycle_wait_s`` the services go on and the recycle
   is tried again ``broker_recycle_retry_s`` later.
3. **Replaced.** The telemetry not read yet (from the slowest reader's position to the end)
   is read out of the old broker (`perfloop.stack._carry`). The broker is killed and started
   empty at a port of its own, its topics are made, and only then does the stack's address
   relay to it (`perfloop.stack._front`: no client reaches it with what it knew of the old
   one); every consumer group the old broker held offsets of is
   given offset 0 on every partition (a group that starts at the log's end would otherwise
   miss what was published before it joined again), and the unread telemetry is produced into
   the new broker. A producer that notices the lost log resends its last
   ``resend_window_s`` too (`Publisher`), which covers what arrived after the unread was read.
   The stream workers go on at once: they drop what arrives twice by its ids
   (`perfloop.streams._recent`), as the sink does. The actuator and the notifier go on
   `SETTLE_S` later, once the jobs' agents (which start at the end of the commands' log)
   have joined the new broker.

What a recycle may cost is stated in docs/guarantees.md: the pause (the stream tier's output
waits a few seconds; producers keep what they publish meanwhile), and the state the new broker
does not have (the stream workers' changelog, written again at their next snapshot; the
actuator's recall of what it acted on, kept in its memory while it runs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import OffsetSpec

from perfloop.kafka import admin, cluster_id, consumer
from perfloop.schemas.topics import TOPICS, Topics
from perfloop.settings import (
    ActuatorSettings,
    NotifierSettings,
    SinkSettings,
    StackSettings,
    StreamsSettings,
)
from perfloop.stack._carry import Carried, read_unread, start_of_unread, write
from perfloop.stack._headroom import rss_bytes
from perfloop.streams.positions import read_positions
from perfloop.warehouse.tables import TABLES

__all__ = ["RESENT", "Recycler", "Recycling", "caught_up", "true_ends"]

RESENT = (Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN, Topics.JOB)
"""Topics whose producers resend their last acknowledged messages to a broker that lost them."""
OTHERS = tuple(t for t in TOPICS if t not in RESENT and t != Topics.STREAM_STATE)
"""What no producer resends (the changelog is written again by the stream workers)."""
CHECK_S = 5.0
"""How often a due recycle checks whether the broker may go (step 1)."""
LAG_S = 10.0
"""The telemetry must have been read up to where it ended this long ago (the sink reads it in
rounds, one per flush); what came since is carried over. It bounds what is carried, and keeps
a recycle from starting while a reader is far behind."""
QUIET_S = 1.0
"""How long the ends of what no producer resends must stay put before the broker goes."""
SETTLE_S = 10.0
"""How long the actuator and the notifier wait, after the new broker is up, for the jobs'
agents to join it (a consumer group's join takes ~half the session timeout here)."""
LATE = ("actuator", "notifier")
"""Of those, the ones that go on `SETTLE_S` after the new broker is up (stopped once the
actuator has read what there was to read)."""
ACTUATOR_READS = frozenset({Topics.RECOMMENDATIONS, Topics.CONTROL, Topics.ACTUATIONS})
"""What the actuator reads that no producer resends."""

TP = tuple[str, int]
_ERRORS = (KafkaException, TimeoutError, OSError, ValueError)


def true_ends(
    settings: StackSettings, topics: Iterable[str], timeout_s: float = 5.0
) -> dict[TP, int]:
    """The next offset of every partition of ``topics``. The embedded broker's ListOffsets
    answers the last record batch's base offset + 1, not the end: the last batch of each
    non-empty partition is read to find its last record."""
    a = admin(settings)
    md = a.list_topics(timeout=timeout_s)
    tps = [
        TopicPartition(t, p)
        for t in topics
        if (tm := md.topics.get(t)) is not None and tm.error is None
        for p in tm.partitions
    ]
    if not tps:
        return {}
    futures = a.list_offsets({tp: OffsetSpec.latest() for tp in tps}, request_timeout=timeout_s)
    ends = {(tp.topic, tp.partition): int(f.result(timeout_s).offset) for tp, f in futures.items()}
    probe = [TopicPartition(t, p, e - 1) for (t, p), e in ends.items() if e > 0]
    if not probe:
        return ends
    c = consumer(settings, "perfloop-recycle-probe")
    try:
        c.assign(probe)
        left = {(tp.topic, tp.partition) for tp in probe}
        deadline = time.monotonic() + timeout_s
        drained = False
        # A fetch brings the last batch whole: once its first record is read, the rest is in
        # the consumer's queue, taken by one more call (records published since may come with
        # it: an end found later than the call's start is still an end that was there).
        while time.monotonic() < deadline:
            got = c.consume(10_000, 0.2 if left else 0.02)
            for m in got:
                if m.error() is None:
                    tp = (m.topic(), m.partition())
                    ends[tp] = max(ends[tp], int(m.offset() or 0) + 1)
                    left.discard(tp)
            if not left:
                if drained or not got:
                    break
                drained = True
        if left:
            raise TimeoutError(f"the last records of {len(left)} partition(s) were not read")
    finally:
        c.close()
    return ends


def committed(
    settings: StackSettings, group: str, tps: Iterable[TP], timeout_s: float = 5.0
) -> dict[TP, int]:
    """The group's committed offsets of ``tps`` (-1: none)."""
    tps = list(tps)
    if not tps:
        return {}
    a = admin(settings)  # held until the answer: a client that is gone never gives one
    req = ConsumerGroupTopicPartitions(group, [TopicPartition(t, p) for t, p in tps])
    (fut,) = a.list_consumer_group_offsets([req], request_timeout=timeout_s).values()
    got = fut.result(timeout_s).topic_partitions
    return {(tp.topic, tp.partition): int(tp.offset) for tp in got}


def caught_up(
    ends: dict[TP, int],
    sink: dict[TP, int],
    workers: list[dict[str, Any]],
    *,
    cluster: str | None,
    since: float,
) -> str | None:
    """Why the telemetry in ``ends`` is not read yet (None: it is): the sink's committed
    offsets (``sink``) and the positions of the stream workers that wrote theirs after
    ``since``, in ``cluster``, must reach every non-empty partition's end.

    >>> w = [{"cluster": "c", "at": 2.0, "offsets": {("t", 0): 7}}]
    >>> caught_up({("t", 0): 5}, {("t", 0): 5}, w, cluster="c", since=1.0) is None
    True
    >>> caught_up({("t", 0): 5}, {("t", 0): 3}, w, cluster="c", since=1.0)
    'the sink is 2 record(s) behind on t[0]'
    >>> caught_up({("t", 0): 5}, {("t", 0): 5}, w, cluster="c", since=3.0)
    'no stream worker has said lately how far it read t[0]'
    """
    fresh: dict[TP, int] = {}
    for w in workers:
        if w["cluster"] == cluster and w["at"] >= since:
            for tp, o in w["offsets"].items():
                fresh[tp] = max(fresh.get(tp, 0), o)
    for (t, p), end in sorted(ends.items()):
        if end <= 0:
            continue
        if (got := sink.get((t, p), -1)) < end:
            return f"the sink is {end - max(0, got)} record(s) behind on {t}[{p}]"
        if (t, p) not in fresh:
            return f"no stream worker has said lately how far it read {t}[{p}]"
        if fresh[(t, p)] < end:
            return f"the stream workers are {end - fresh[(t, p)]} record(s) behind on {t}[{p}]"
    return None


@dataclass
class Recycling:
    """What the recycler has done, for the state file and `perfloop status`."""

    recycles: int = 0
    given_up: int = 0
    last_at: float | None = None
    last_pause_s: float | None = None
    last_rss_bytes: int | None = None
    last_carried: int | None = None
    """How many unread telemetry records the last recycle carried to the new broker."""
    waiting: str = ""
    """Why a due recycle has not happened yet ("" when none is due)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class Recycler:
    """Decides when the embedded broker is replaced, and does it (see the module).

    ``services()`` gives the supervisor's running services (name → pid); ``replace()`` kills
    the broker and starts an empty one with its topics, and returns once it answers; ``say``
    writes a line to the supervisor's log. `step` is called from the supervisor's loop."""

    def __init__(
        self,
        settings: StackSettings,
        *,
        services: Callable[[], dict[str, int]],
        replace: Callable[[], None],
        say: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self.stats = Recycling()
        self._services = services
        self._replace = replace
        self._say = say
        self._next_check = 0.0
        self._ends: deque[tuple[float, dict[TP, int]]] = deque(maxlen=int(LAG_S / CHECK_S) + 2)
        self._said_at = -60.0
        self._late: tuple[float, list[int]] | None = None  # (when, pids) to go on later
        self._base: int | None = None  # the broker's RSS when it started

    def broker_started(self, pid: int) -> None:
        """A new broker process: its memory growth counts from now."""
        self._base = rss_bytes(pid)
        self._ends.clear()

    def resume(self) -> None:
        """Let every service a recycle stopped go on now (the stack is stopping)."""
        if self._late is not None:
            _signal(self._late[1], signal.SIGCONT)
            self._late = None

    def step(self, broker_pid: int | None) -> None:
        now = time.monotonic()
        if self._late is not None and now >= self._late[0]:
            _signal(self._late[1], signal.SIGCONT)
            self._late = None
        limit = self.settings.broker_recycle_mb
        if limit <= 0 or broker_pid is None or now < self._next_check:
            return
        self._next_check = now + CHECK_S
        rss = rss_bytes(broker_pid)
        if self._base is None:
            self._base = rss
        if rss is None or self._base is None or rss - self._base < limit * (1 << 20):
            self.stats.waiting = ""
            self._ends.clear()
            return
        try:
            ends = true_ends(self.settings, RESENT)
            cluster = cluster_id(self.settings)
            self._ends.append((time.time(), ends))
            old = [(t, e) for t, e in self._ends if t <= time.time() - LAG_S]
            if not old:
                self._wait("measuring how far the telemetry was read")
                return
            since, then = old[-1]
            sink = committed(self.settings, SinkSettings().group_id, then)
            why = caught_up(then, sink, read_positions(self.settings.home_dir),
                            cluster=cluster, since=since)  # fmt: skip
        except _ERRORS as e:
            self._wait(f"the broker did not answer: {_one_line(e)}")
            return
        if why is not None:
            self._wait(why)
            return
        self._recycle(rss)

    def _wait(self, why: str) -> None:
        """A due recycle waits: say why in the state, and in the log once a minute."""
        self.stats.waiting = why
        if time.monotonic() - self._said_at >= 60:
            self._said_at = time.monotonic()
            self._say(f"broker recycle due, waiting: {why}")

    def _recycle(self, rss: int) -> None:
        s = self.settings
        self.resume()  # what the last recycle left stopped goes on first
        started = time.monotonic()
        deadline = started + s.broker_recycle_wait_s
        running = self._services()
        workers = [pid for name, pid in running.items() if name.split("-")[0] == "streams"]
        late = [pid for name, pid in running.items() if name.split("-")[0] in LATE]
        # who must have read what no producer resends: the sink everything it lands, the
        # actuator (while it runs) the recommendations, approvals and acknowledgements
        readers = {SinkSettings().group_id: frozenset(TABLES)}
        if "actuator" in running:
            readers[ActuatorSettings().group_id] = ACTUATOR_READS
        stopped = list(workers)
        _signal(stopped, signal.SIGSTOP)  # no more windows, diagnoses, recommendations
        replaced = False
        took: dict[str, float] = {}  # how long each part of the pause took
        try:
            why = self._quiet(deadline, readers)
            if why is None:  # the actuator has acted on what there was: it stops too
                _signal(late, signal.SIGSTOP)
                stopped += late
                why = self._quiet(deadline, {SinkSettings().group_id: frozenset(TABLES)})
            if why is not None:
                self.stats.given_up += 1
                self.stats.waiting = f"not quiet within {s.broker_recycle_wait_s:.0f} s: {why}"
                self._next_check = time.monotonic() + s.broker_recycle_retry_s
                self._say(f"broker recycle put off for {s.broker_recycle_retry_s:.0f} s: {why}")
                return
            took["quiet"] = time.monotonic() - started
            groups = _groups(s)
            unread = self._unread()
            took["read out"] = time.monotonic() - started - sum(took.values())
            self._replace()
            replaced = True
            _start_at_zero(s, groups)
            took["new broker"] = time.monotonic() - started - sum(took.values())
            if lost := write(s, unread):
                self._say(f"broker recycle: {lost} of {len(unread)} unread record(s) not carried")
            took["carried"] = time.monotonic() - started - sum(took.values())
            self.stats.last_carried = len(unread) - lost
        except _ERRORS as e:
            self.stats.given_up += 1
            self.stats.waiting = f"recycle failed: {_one_line(e)}"
            self._next_check = time.monotonic() + s.broker_recycle_retry_s
            self._say(f"broker recycle failed ({_one_line(e)}); the services go on")
        finally:
            if replaced:  # the workers at once, the rest once the agents have joined
                _signal(workers, signal.SIGCONT)
                self._late = (time.monotonic() + SETTLE_S, [p for p in stopped if p in late])
            else:
                _signal(stopped, signal.SIGCONT)
        if replaced:
            st = self.stats
            st.recycles += 1
            st.last_at, st.last_rss_bytes, st.waiting = time.time(), rss, ""
            st.last_pause_s = round(time.monotonic() - started, 2)
            self._say(
                f"broker recycled at {rss / (1 << 20):.0f} MiB resident (recycle "
                f"{st.recycles}); the stream tier paused {st.last_pause_s:.1f} s ("
                + ", ".join(f"{k} {v:.1f} s" for k, v in took.items())
                + f"); {st.last_carried} unread telemetry record(s) carried over"
            )

    def _unread(self) -> list[Carried]:
        """The telemetry not read yet by the sink or a stream worker (stopped now), to its
        end and what arrived while it was read. What arrives after, in the moment before the
        broker goes, is resent by its producers, which have just published."""
        s = self.settings
        ends = true_ends(s, RESENT)
        starts = start_of_unread(
            ends,
            committed(s, SinkSettings().group_id, ends),
            read_positions(s.home_dir),
            cluster=cluster_id(s),
        )
        return read_unread(s, starts, ends)

    def _quiet(self, deadline: float, readers: dict[str, frozenset[str]]) -> str | None:
        """None once every non-empty partition of what no producer resends has been read to
        its end by each group of ``readers`` that reads its topic, and those ends have not
        moved for `QUIET_S`; else, at ``deadline``, why not."""
        s = self.settings
        last: dict[TP, int] | None = None
        stable = time.monotonic()
        why = "not checked"
        while time.monotonic() < deadline:
            ends = true_ends(s, OTHERS)
            if ends != last:
                last, stable = ends, time.monotonic()
            why = ""
            for group, topics in readers.items():
                read = {tp: e for tp, e in ends.items() if e > 0 and tp[0] in topics}
                got = committed(s, group, read)
                behind = [
                    f"{t}[{p}]" for (t, p), e in sorted(read.items()) if got.get((t, p), -1) < e
                ]
                if behind:
                    why = f"{group} has not read {', '.join(behind[:3])}"
                    break
            if not why and time.monotonic() - stable < QUIET_S:
                why = "records still arriving"
            if not why:
                return None
            time.sleep(0.25)
        return why


def _groups(settings: StackSettings) -> list[str]:
    """The consumer groups the broker holds offsets of (perfloop's probe left out), and the
    stack's own services' groups whether it holds any of theirs or not. The embedded broker
    answers a fetch past a partition's end with nothing, not an error: a consumer that kept
    its position in the old log (the stream worker's, with no committed offset to go back
    to) would wait until the new log grew past it, and skip what came before."""
    a = admin(settings)
    res = a.list_consumer_groups(request_timeout=5).result(5)
    own = {
        StreamsSettings().app_id,
        SinkSettings().group_id,
        ActuatorSettings().group_id,
        NotifierSettings().notifier_group_id,
    }
    listed = {g.group_id for g in res.valid}
    return sorted((listed | own) - {"perfloop-recycle-probe"})


def _start_at_zero(settings: StackSettings, groups: list[str]) -> None:
    """Commit offset 0 of every partition for each group, in the new broker: each reads it
    from its start, whatever its ``auto.offset.reset``. A group whose member joined already
    is refused (it reads from where it joined, which is after nothing)."""
    if not groups:
        return
    md = admin(settings).list_topics(timeout=5)
    zero = [
        TopicPartition(t, p, 0)
        for t in TOPICS
        if (tm := md.topics.get(t)) is not None
        for p in tm.partitions
    ]
    for g in groups:
        c = consumer(settings, g)
        try:
            c.commit(offsets=zero, asynchronous=False)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.UNKNOWN_MEMBER_ID:
                raise
        finally:
            c.close()


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _one_line(e: BaseException) -> str:
    text = e.args[0].str() if isinstance(e, KafkaException) and e.args else str(e)
    return " ".join(text.split())[:200] or type(e).__name__
