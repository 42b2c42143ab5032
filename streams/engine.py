"""The stream worker's pure core: messages in; windows, phases, diagnoses, recommendations out.

`StreamEngine` is what the Faust app (`perfloop.streams.app`) hosts, kept free of Faust and of
I/O so that tests, benchmarks and the offline evaluation drive it directly. For each message
the app hands over (`ingest`), the engine:

1. **validates** it — schema and version (`decode_batch` / `decode_event`), size, the kind
   belonging on its topic, event time within ``max_skew_s`` ahead of and ``max_age_s``
   behind the receiving clock. Anything else raises `SchemaError` with a one-line reason;
   the app sends the message to ``perfloop.dlq`` and goes on.
2. **skips** it when it was read already (its offset is below the partition's position, or a
   restored snapshot's: a consumer that starts over from its last commit, or a fetch a seek
   repeats), counting it in ``stats["replayed"]``; and when its batch or event id is among
   the last ``recent_ids`` read (a producer resent it to a broker that lost its log, at other
   offsets: `perfloop.streams._recent`), counting it in ``stats["repeated"]``.
3. **hands** the decoded batch to `WindowSet` (1/10/60 s windows) at once, and queues it, with
   the job events (job info, lifecycle), for the analyses — `StepAnalysis` (per-step
   busy/idle/straggler analysis), `PhaseMachine` and `Funnel`; a ``ConfigChange`` for the
   streams is applied live (`configure`).

Time. Everything the engine computes depends on the messages' event time, not on how fast
they are read: a backlog drained at 100x gives the windows, phases and diagnoses of the same
data read live. Two things make it so:

* **Silence is only real on a caught-up input.** The app says with each message whether its
  topic partition has been read to its end (``caught_up``), and between messages which
  partitions have input left (`set_input`). Until one has been read to its end, the sources
  that come by it do not move on with the wall clock, and a job waits for a topic it has sent
  nothing on while a partition of it has input left (`WindowSet.set_channel`): no pane closes
  before its data is read, and draining a backlog drops nothing as late. Once it has, a
  source that sends nothing moves on with the wall clock: a job that stops still has its
  windows closed and is diagnosed as hung on time. (Data a producer publishes late, after
  its partition was read to its end, is late as ever.)
* **The analyses run on each job's event-time clock.** A job's clock is its telemetry's
  watermark (`WindowSet.watermark_ns` over its telemetry sources: the event time up to which
  all of them have been read, moved on by real silence only). Queued input is handed to the
  analyses in event-time order once the clock passes it, and the analyses are ticked at every
  ``tick_interval_s`` boundary of the clock, with the event time as their clock: the same
  messages give the same calls in the same order at any read speed. Diagnoses, phase changes
  and recommendations therefore carry event time in ``ts_ns``; only closed windows carry the
  wall time they closed (``closed_ns``). The windows of the step analysis's derived metrics
  wait for the job's open steps (`StepAnalysis.open_since`), so none of them is late. The
  clocks and the handing over are the engine's `EventTime` part (`perfloop.streams._event_time`).

`tick` closes what is due and returns it as `Outputs`. `snapshot` / `restore` capture every
component's state, the queued input and the offsets it covers; the app writes a snapshot
before it acknowledges the input it holds, so a worker killed at any moment resumes from its
last snapshot and re-reads only the messages after it: those messages are processed once, and
the windows and diagnoses emitted between that snapshot and the kill may be emitted a second
time (at most a snapshot interval of them: ``snapshot_interval_s``, stretched for a state so
large that serialising it would take more than a tenth of the worker's time, see
`perfloop.streams.app`; the windows table keeps one row per window identity, see docs/tables.md).
"""

from __future__ import annotations

import heapq
import io
import logging
import os
import pickle
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfloop.actuators.trust import refusal, roster_gate
from perfloop.exceptions import ConfigError
from perfloop.schemas import (
    ActuationResult,
    Batch,
    Command,
    ConfigChange,
    Decision,
    Diagnosis,
    PhaseChange,
    Prediction,
    Recommendation,
    SchemaError,
    decode_batch,
    decode_event,
)
from perfloop.schemas.topics import KIND_TOPICS, Topics
from perfloop.settings import StreamsSettings
from perfloop.streams._event_time import EventTime, JobClock
from perfloop.streams._recent import RecentIds
from perfloop.streams.funnel import Funnel
from perfloop.streams.outcomes import Outcomes
from perfloop.streams.phases import PhaseMachine
from perfloop.streams.predict import PredictionHost
from perfloop.streams.rules import DataWaitRule, StragglerRule, ThreadRule
from perfloop.streams.steps import DERIVED_METRICS, StepAnalysis
from perfloop.streams.windows import NS, WindowSet, parse_specs

__all__ = [
    "DEFAULT_DERIVED",
    "INPUT_TOPICS",
    "SNAPSHOT_VERSION",
    "TELEMETRY_TOPICS",
    "Outputs",
    "StreamEngine",
    "Unpickler",
    "Unreadable",
    "write_snapshot",
]

log = logging.getLogger("perfloop.streams")

SNAPSHOT_VERSION = 2
DEFAULT_DERIVED = ("gpu_idle_ms", "straggler_score")
"""`StepAnalysis` metrics windowed by default (``windows.metrics.derived`` picks others)."""
TELEMETRY_TOPICS = (Topics.GPU, Topics.HOST, Topics.STEP, Topics.SPAN)
INPUT_TOPICS = (*TELEMETRY_TOPICS, Topics.JOB, Topics.CONTROL, Topics.ACTUATIONS)
_TOPIC_KINDS = {t: {k for k, kt in KIND_TOPICS.items() if kt == t} for t in INPUT_TOPICS}


class Unreadable(SchemaError):
    """A message that is no perfloop message of its topic (bytes the codecs cannot decode,
    or a kind that does not belong on the topic): every reader of the topic decodes it with
    the same codecs (`perfloop.schemas`) and refuses it alike (the sink dead-letters what it
    stores; `streams.app`'s policy leaves those to it)."""


def _decoded(decode: Any, data: bytes) -> Any:
    try:
        return decode(data)
    except SchemaError as e:
        raise Unreadable(str(e)) from None


_MOVED_CLASSES = {
    ("perfloop.streams.predict", "_Job"): "perfloop.streams.predict.host",
    ("perfloop.streams._phase_steps", "StepRecord"): "perfloop.streams.steps.records",
}
"""Classes a snapshot holds by reference, at the module they had before the stream tier's
subpackages (the snapshots written then still load): (old module, name) → their module now."""


@dataclass
class Outputs:
    """What one `StreamEngine.tick` produced."""

    windows: dict[str, Any] | None = None  # columnar, the perfloop.windows message columns
    phases: list[PhaseChange] = field(default_factory=list)
    diagnoses: list[Diagnosis] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    predictions: list[Prediction] = field(default_factory=list)
    refusals: list[Decision] = field(default_factory=list)  # settings changes refused

    @property
    def window_rows(self) -> int:
        return 0 if not self.windows else len(self.windows["ts_ns"])

    def __bool__(self) -> bool:
        return bool(
            self.window_rows
            or self.phases
            or self.diagnoses
            or self.recommendations
            or self.predictions
            or self.refusals
        )


_EVENT_OUTPUTS = {
    "phases": PhaseChange,
    "diagnoses": Diagnosis,
    "recommendations": Recommendation,
    "predictions": Prediction,
    "refusals": Decision,
}


class StreamEngine(EventTime):
    """Validates and routes messages to the stream components; closes what is due on `tick`."""

    def __init__(self, settings: StreamsSettings) -> None:
        self.settings = settings
        self.windows = WindowSet(
            parse_specs(settings.windows),
            lateness_s=settings.allowed_lateness_s,
            groups=TELEMETRY_TOPICS,
            new_job_grace_s=settings.new_job_grace_s,
        )
        self.steps = StepAnalysis()
        self.phases = PhaseMachine()
        self.funnel = Funnel()
        self.predict = PredictionHost(
            enabled=settings.predictions, every_s=settings.prediction_every_s
        )
        self.outcomes = Outcomes()
        self.rule = DataWaitRule(
            threshold=settings.data_wait_share_threshold,
            cooldown_s=settings.recommendation_cooldown_s,
            max_workers=max(2, 2 * (os.cpu_count() or 2)),
            outcomes=self.outcomes,
        )
        self.threads = ThreadRule(
            cooldown_s=settings.recommendation_cooldown_s, outcomes=self.outcomes
        )
        self.stragglers = StragglerRule()
        self.derived_metrics: tuple[str, ...] = DEFAULT_DERIVED
        self.max_skew_ns = int(settings.max_skew_s * NS)
        self.max_age_ns = int(settings.max_age_s * NS)
        self.stats: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # by topic
        self.applied: list[tuple[ConfigChange, Any, Any]] = []  # recent live changes
        self._offsets: dict[tuple[str, int], int] = {}  # next offset to read, per partition
        self._resume: dict[tuple[str, int], int] = {}  # from a restored snapshot
        self._recent = RecentIds(settings.recent_ids)  # batch and event ids read lately
        self._restored = False  # until the first message after a restore
        self.cluster_id: str | None = None  # of the broker the offsets are positions in
        self._tick_ns = max(1, int(settings.tick_interval_s * NS))
        self._time: dict[str, JobClock] = {}
        self._ended: dict[str, int] = {}  # job → event time it ended (-1: its state freed)
        self._seq = 0  # arrival order (ties of event time, within a source)
        self._out = Outputs()  # what the analyses produced since the last `tick`
        self.gate = roster_gate(settings.roster)  # who may change the settings, where signed

    # -- input -------------------------------------------------------------------------------
    def ingest(
        self,
        topic: str,
        data: bytes,
        *,
        wall_ns: int,
        partition: int = 0,
        offset: int = -1,
        caught_up: bool = True,
        sent_ns: int = -1,
        unsure: bool = False,
    ) -> int:
        """Take one message; return its samples (0 for an event or a skipped message).

        ``caught_up``: whether the message's topic partition has been read to its end with it
        (the app compares the offset with the partition's high-water mark); while it has not,
        the sources that come by it are silent only as far as its messages read since theirs
        were sent later (``sent_ns``: the message's timestamp, -1 unknown; see
        `perfloop.streams.windows`). ``unsure``: not known to be read to its end only because
        the app could not look lately (`WindowSet.set_channel`).

        Raise `SchemaError` with a one-line reason if the message is bad; nothing of it is
        then applied, and the engine's state is as if it had never arrived.
        """
        tp = (topic, partition)
        self._resumed(wall_ns)
        self.stats["behind"] += not caught_up
        if offset >= 0:
            # read already: before a restored snapshot's positions, or again (a consumer
            # that starts over from its last commit, or a fetch repeated by a seek)
            if offset < max(self._resume.get(tp, -1), self._offsets.get(tp, -1)):
                self.stats["replayed"] += 1
                if topic in TELEMETRY_TOPICS:
                    self.windows.set_channel(
                        tp, caught_up=caught_up, wall_ns=wall_ns, group=topic, unsure=unsure
                    )
                return 0
            self._offsets[tp] = max(self._offsets.get(tp, 0), offset + 1)
        if topic in TELEMETRY_TOPICS:
            batch = self._batch(topic, data, wall_ns)
            self.windows.set_channel(
                tp, caught_up=caught_up, wall_ns=wall_ns, group=topic, unsure=unsure
            )
            if not self._recent.add(batch.batch_id):  # resent (the broker lost its log)
                self.stats["repeated"] += 1
                return 0
            self.windows.observe(batch, wall_ns, tp, sent_ns)
            if len(batch):
                ts = batch.columns["ts_ns"]
                self._queue(batch.job_id, int(ts.max()), batch.kind, batch.node, batch)
                if batch.kind == "step":  # the derived metrics' windows wait for it
                    first = int(ts.min())
                    heapq.heappush(self._time[batch.job_id].step_mins, (first, self._seq - 1))
                    if self.derived_metrics:
                        self.windows.clock_source(
                            batch.job_id, batch.node, "derived", first, wall_ns
                        )
                self._advance(batch.job_id, wall_ns)
            self.stats["messages"] += 1
            self.stats["samples"] += len(batch)
            return len(batch)
        if topic in (Topics.JOB, Topics.CONTROL, Topics.ACTUATIONS):
            event = _decoded(decode_event, data)
            if event.KIND not in _TOPIC_KINDS[topic]:
                raise Unreadable(f"a {event.KIND} event does not belong on {topic}")
            if not self._recent.add(event.event_id):
                self.stats["repeated"] += 1
                return 0
            self.stats["events"] += 1
            if isinstance(event, ConfigChange):
                self._config(event, wall_ns)
            elif isinstance(event, Command):  # its verdict teaches the rules
                self.outcomes.expect(event.event_id, event.from_value, event.value)
            elif isinstance(event, ActuationResult):
                self.outcomes.observe(event)
            elif topic == Topics.JOB:
                self._queue(event.job_id, event.ts_ns, event.KIND, event.node, event)
                self._advance(event.job_id, wall_ns)
            return 0
        raise SchemaError(f"the stream worker does not read {topic}")

    def set_input(
        self, topic: str, partition: int, *, caught_up: bool, wall_ns: int, unsure: bool = False
    ) -> None:
        """Say whether a telemetry partition has input left to read, between messages: the app
        checks each tick the partitions it has not read from yet (a job waits for a topic it has
        sent nothing on while one of its partitions has input left) and the held ones (the
        message that reached the end may have been rejected). ``unsure``: see `ingest`."""
        group = topic if topic in TELEMETRY_TOPICS else None
        self.windows.set_channel(
            (topic, partition), caught_up=caught_up, wall_ns=wall_ns, group=group, unsure=unsure
        )

    @property
    def held_inputs(self) -> list[tuple[str, int]]:
        """Telemetry partitions with input left to read (their sources' silence is held)."""
        return list(self.windows.held_channels)

    @property
    def jobs(self) -> list[str]:
        """The jobs the engine holds state for."""
        return list(self._time)

    @property
    def offsets(self) -> dict[tuple[str, int], int]:
        """The next offset to read, per (topic, partition) read."""
        return dict(self._offsets)

    @property
    def late_samples(self) -> int:
        return self.windows.late_samples

    def recent(self, job_id: str) -> Any:
        """The job's recent completed steps (`StepAnalysis.recent`)."""
        return self.steps.recent(job_id)

    def position(self, topic: str, partition: int) -> int | None:
        """The next offset of the partition to read (None: none read yet)."""
        return self._offsets.get((topic, partition))

    def use_cluster(self, cluster_id: str | None) -> bool:
        """Tell the engine which broker cluster it reads from (None: unknown). Offsets of a
        restored snapshot taken against another cluster (an embedded broker restarted empty,
        or another Kafka cluster) are positions in another log: they are forgotten, so the
        new log's messages are read rather than skipped as already held; the state is kept.
        Return True if positions were forgotten."""
        if cluster_id is None:
            return False
        stale = self.cluster_id is not None and self.cluster_id != cluster_id
        if stale and self._offsets:
            log.warning(
                "stream snapshot positions are in cluster %s, the broker is %s: %d partition "
                "positions forgotten, the state kept",
                self.cluster_id, cluster_id, len(self._offsets),
            )  # fmt: skip
            self._offsets, self._resume = {}, {}
        self.cluster_id = cluster_id
        return stale

    def _resumed(self, wall_ns: int) -> None:
        if self._restored:  # the downtime is not the sources' silence
            self.windows.resume(wall_ns)
            for jt in self._time.values():
                jt.at_wall = max(jt.at_wall, wall_ns)
            self._restored = False

    def _batch(self, topic: str, data: bytes, wall_ns: int) -> Batch:
        batch = _decoded(decode_batch, data)
        if batch.kind not in _TOPIC_KINDS[topic]:
            raise Unreadable(f"a {batch.kind} batch does not belong on {topic}")
        if len(batch):
            ts = batch.columns["ts_ns"]
            ahead = int(ts.max()) - wall_ns
            if ahead > self.max_skew_ns:
                raise SchemaError(
                    f"{batch.kind} batch from {batch.node}: event time {ahead / NS:.0f} s ahead "
                    f"of this worker's clock (limit {self.max_skew_ns / NS:.0f} s); "
                    "check the producer's clock"
                )
            behind = wall_ns - int(ts.min())
            if behind > self.max_age_ns:
                raise SchemaError(
                    f"{batch.kind} batch from {batch.node}: event time {behind / NS:.0f} s "
                    f"behind this worker's clock (limit {self.max_age_ns / NS:.0f} s)"
                )
        return batch

    # -- live configuration ------------------------------------------------------------------
    def _config(self, change: ConfigChange, wall_ns: int) -> None:
        if change.target != "streams":
            return  # sampling changes are for the producers
        if self.gate is not None:  # a roster: signed, in time, once, within the signer's role
            who, why = self.gate.check(change, now_ns=wall_ns)
            if why:  # on record in `audit` (one row, whichever partitions it came on)
                refused = refusal(change, tier="observe", actor=who, now_ns=wall_ns,
                                  reason=f"by the stream tier: {why}")  # fmt: skip
                self._out.refusals.append(refused.model_copy(
                    update={"event_id": f"{change.event_id}-refused"}))  # fmt: skip
                raise SchemaError(f"config change {change.key} refused: {why} (claimed by {who})")
        try:
            old, new = self.configure(change.key, change.value, job=change.applies_to)
        except ConfigError as e:
            raise SchemaError(f"config change {change.key}={change.value!r} refused: {e}") from None
        log.info(
            "config %s for %s: %r -> %r (by %s)",
            change.key,
            "every job" if change.applies_to == "*" else change.applies_to,
            old,
            new,
            change.author or "?",
        )
        self.applied = [*self.applied[-99:], (change, old, new)]

    def configure(self, key: str, value: Any, job: str = "*") -> tuple[Any, Any]:
        """Change one setting live, for every job ("*") or for ``job`` alone (the detectors'
        ``detect.*`` settings only); raise `ConfigError` naming the valid keys if unknown."""
        if job != "*":
            if not key.startswith("detect."):
                raise ConfigError(
                    f"{key} applies to every job: only detect.* settings can be set for one job"
                )
            return self.funnel.configure(key, value, job=job)
        if key == "windows.metrics.derived":
            names = value.split(",") if isinstance(value, str) else list(value)
            new = tuple(dict.fromkeys(str(n).strip() for n in names if str(n).strip()))
            bad = [n for n in new if n not in DERIVED_METRICS]
            if bad:
                raise ConfigError(
                    f"unknown derived metrics {bad}; valid: {', '.join(DERIVED_METRICS)}"
                )
            old_d, self.derived_metrics = self.derived_metrics, new
            return ",".join(old_d), ",".join(new)
        head = key.split(".", 1)[0]
        target = {
            "windows": self.windows,
            "steps": self.steps,
            "phases": self.phases,
            "detect": self.funnel,
            "rules": self.rule,
            "predict": self.predict,
        }.get(head)
        if target is not None:
            return target.configure(key, value)
        if key in ("ingest.max_skew_s", "ingest.max_age_s"):
            v = _positive(key, value)
            attr = "max_skew_ns" if key.endswith("skew_s") else "max_age_ns"
            old = getattr(self, attr) / NS
            setattr(self, attr, int(v * NS))
            return old, v
        raise ConfigError(
            f"unknown stream setting {key!r}; valid prefixes: windows., steps., phases., "
            "detect., rules., predict., and ingest.max_skew_s, ingest.max_age_s"
        )

    # -- output ------------------------------------------------------------------------------
    def tick(self, wall_ns: int) -> Outputs:
        """Advance every job's clock and analyses, close due windows; return everything that
        became due since the last tick."""
        self._resumed(wall_ns)
        for job in list(self._time):
            self._advance(job, wall_ns)
            if self._forget_time(job, wall_ns):
                del self._time[job]
                self._ended.pop(job, None)
                self.predict.forget(job)
                self.threads.forget(job)
                self.rule.forget(job)
                self.stragglers.forget(job)
                self.outcomes.forget(job)
        self._out.predictions.extend(self.predict.drain())
        out, self._out = self._out, Outputs()
        cols = self.windows.advance(wall_ns)
        if cols is not None and len(cols["ts_ns"]):
            out.windows = cols
        self.stats["window_rows"] += out.window_rows
        self.stats["phase_events"] += len(out.phases)
        self.stats["diagnoses"] += len(out.diagnoses)
        self.stats["recommendations"] += len(out.recommendations)
        self.stats["predictions"] += len(out.predictions)
        return out

    # -- durable state -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a restarted worker needs to resume, with the offsets it covers."""
        return {
            "version": SNAPSHOT_VERSION,
            "offsets": dict(self._offsets),
            "cluster_id": self.cluster_id,
            "windows": self.windows.snapshot(),
            "steps": self.steps.snapshot(),
            "phases": self.phases.snapshot(),
            "funnel": self.funnel.snapshot(),
            "rule": self.rule.snapshot(),
            "threads": self.threads.snapshot(),
            "stragglers": self.stragglers.snapshot(),
            "outcomes": self.outcomes.snapshot(),
            "predict": self.predict.snapshot(),
            "derived_metrics": self.derived_metrics,
            "stats": dict(self.stats),
            "time": {job: jt.state() for job, jt in self._time.items()},
            "ended": dict(self._ended),
            "seq": self._seq,
            "out": {k: [e.model_dump() for e in getattr(self._out, k)] for k in _EVENT_OUTPUTS},
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from `snapshot` output: messages below its offsets are skipped when re-read."""
        if state.get("version") != SNAPSHOT_VERSION:
            raise ConfigError(
                f"stream snapshot version {state.get('version')!r} is not {SNAPSHOT_VERSION}"
            )
        self.windows.restore(state["windows"])
        self.steps.restore(state["steps"])
        self.phases.restore(state["phases"])
        self.funnel.restore(state["funnel"])
        self.rule.restore(state["rule"])
        self.threads.restore(state.get("threads", {}))
        self.stragglers.restore(state.get("stragglers", {}))
        self.outcomes.restore(state.get("outcomes", {}))
        self.predict.restore(state.get("predict", {}))
        self.derived_metrics = tuple(state.get("derived_metrics", DEFAULT_DERIVED))
        self._offsets = dict(state["offsets"])
        self._resume = dict(state["offsets"])
        self.cluster_id = state.get("cluster_id")
        self.stats.update(state.get("stats", {}))
        self.stats["restored"] += 1
        self._time = {job: JobClock.from_state(d) for job, d in state["time"].items()}
        self._ended = dict(state.get("ended", {}))
        self._seq = state["seq"]
        self._out = Outputs(
            **{k: [t(**e) for e in state["out"].get(k, [])] for k, t in _EVENT_OUTPUTS.items()}
        )
        self._restored = True

    def dumps(self) -> bytes:
        """`snapshot` serialised, for `save` (taking it and writing it can then be apart)."""
        return pickle.dumps(self.snapshot(), protocol=pickle.HIGHEST_PROTOCOL)

    def save(self, path: Path, data: bytes | None = None) -> int:
        """Write a snapshot (``data`` from `dumps`, or now) atomically (`write_snapshot`).
        Returns its size."""
        return write_snapshot(path, self.dumps() if data is None else data)

    def load(self, path: Path) -> bool:
        """Restore from ``path`` if it exists; an unreadable snapshot is logged and ignored."""
        if not path.exists():
            return False
        try:
            self.restore(Unpickler(io.BytesIO(path.read_bytes())).load())  # written by `save`
        except (OSError, pickle.UnpicklingError, ConfigError, KeyError, EOFError) as e:
            log.warning("ignoring unreadable stream snapshot %s: %s", path, e)
            return False
        return True


def write_snapshot(path: Path, data: bytes) -> int:
    """Write ``data`` to ``path`` atomically: temporary file, fsync, rename, fsync of the
    folder. Returns its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


def _positive(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{key} must be a number > 0, got {value!r}")
    return float(value)


class Unpickler(pickle.Unpickler):
    """Reads a snapshot, finding a class that moved (`_MOVED_CLASSES`) at its new module."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(_MOVED_CLASSES.get((module, name), module), name)
