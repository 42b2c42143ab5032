"""Event time in the stream engine: the same messages give the same windows, phases, diagnoses
and recommendations whether they are read live, 100x compressed, or drained as a backlog by a
consumer that reads its topics unevenly and stalls between fetches; a backlog drops no sample
as late; a job whose input is read to its end and that goes silent is still windowed and
diagnosed as hung on time, and one whose input is still being read is not."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

import pytest

from perfloop.evaluation import RunSpec, simulate
from perfloop.schemas import BatchBuilder, GroundTruth, decode_batch, decode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings
from perfloop.streams.engine import Outputs, StreamEngine

NS = 1_000_000_000
TICK = NS // 4  # the app's default tick interval
WINDOW_KEY = ("node", "rank", "device", "metric", "window_s", "hop_s", "ts_ns")


class Arrival(NamedTuple):
    wall_ns: int
    topic: str
    value: bytes
    offset: int
    caught_up: bool


class Result(NamedTuple):
    engine: StreamEngine
    windows: Counter[tuple[Any, ...]]  # window identity -> count
    diagnoses: list[tuple[Any, ...]]
    phases: list[dict[str, Any]]
    recommendations: list[tuple[Any, ...]]


def _event_time(topic: str, value: bytes) -> int:
    if topic == Topics.JOB:
        return decode_event(value).ts_ns
    return int(decode_batch(value).columns["ts_ns"].max())


def _offsets(messages: list[tuple[str, bytes]]) -> tuple[list[int], dict[str, int]]:
    """Each message's offset in its topic (one partition each) and each topic's last index."""
    seen: Counter[str] = Counter()
    offsets = []
    for topic, _ in messages:
        offsets.append(seen[topic])
        seen[topic] += 1
    return offsets, {t: i for i, (t, _) in enumerate(messages)}


def live(messages: list[tuple[str, bytes]]) -> list[Arrival]:
    """In event-time order, each arriving at its event time, every partition read to its end."""
    et = [_event_time(t, v) for t, v in messages]
    order = sorted(range(len(messages)), key=lambda i: et[i])
    # a partition's offsets are the order its messages arrived in
    offsets, _ = _offsets([messages[i] for i in order])
    return [Arrival(et[i], *messages[i], offsets[n], True) for n, i in enumerate(order)]


def compressed(messages: list[tuple[str, bytes]], factor: int = 100) -> list[Arrival]:
    """In publishing order, read ``factor`` times faster than they were made and ending 20 s
    after the last event; each partition lags until its last message."""
    et = [_event_time(t, v) for t, v in messages]
    end = max(et)
    offsets, last = _offsets(messages)
    out, newest, wall = [], 0, 0
    for i, (topic, value) in enumerate(messages):
        newest = max(newest, et[i])
        wall = max(wall, end + 20 * NS - (end - newest) // factor)
        out.append(Arrival(wall, topic, value, offsets[i], i == last[topic]))
    return out


def backlog(messages: list[tuple[str, bytes]], seed: int = 1) -> list[Arrival]:
    """A consumer draining a backlog the way Faust does: each topic is fetched in chunks of a
    random number of messages, the fetched messages are taken round-robin across topics (so
    the topics drift apart in event time), and every fetch round stalls 1.5 s of wall time."""
    offsets, last = _offsets(messages)
    per_topic: dict[str, list[int]] = defaultdict(list)
    for i, (topic, _) in enumerate(messages):
        per_topic[topic].append(i)
    rnd = random.Random(seed)
    fetched: dict[str, list[int]] = {t: [] for t in per_topic}
    out: list[Arrival] = []
    wall = max(_event_time(*m) for m in messages) - 60 * NS
    while any(per_topic.values()) or any(fetched.values()):
        for topic, todo in per_topic.items():
            if not fetched[topic] and todo:
                k = rnd.choice([3, 10, 40, 120])
                fetched[topic], per_topic[topic] = todo[:k], todo[k:]
        wall += 3 * NS // 2
        while all(fetched[t] or not per_topic[t] for t in fetched) and any(fetched.values()):
            for topic, queue in fetched.items():
                if queue:
                    i = queue.pop(0)
                    wall += NS // 200
                    out.append(Arrival(wall, *messages[i], offsets[i], i == last[topic]))
    return out


def feed(arrivals: Iterable[Arrival], *, tail_s: float = 60.0) -> Result:
    """Ingest the arrivals with a tick every 0.25 s of wall time, then tick on for ``tail_s``
    of silence and once far ahead (so every window closes)."""
    eng = StreamEngine(StreamsSettings())
    windows: Counter[tuple[Any, ...]] = Counter()
    total = Outputs()

    def collect(o: Outputs) -> None:
        if o.windows is not None:
            cols = [o.windows[k].tolist() for k in WINDOW_KEY]
            for key, count in zip(
                zip(*cols, strict=True), o.windows["count"].tolist(), strict=True
            ):
                windows[key] += count
        total.diagnoses.extend(o.diagnoses)
        total.phases.extend(o.phases)
        total.recommendations.extend(o.recommendations)

    next_tick = 0
    for a in arrivals:
        next_tick = next_tick or a.wall_ns
        while next_tick <= a.wall_ns:
            collect(eng.tick(next_tick))
            next_tick += TICK
        eng.ingest(a.topic, a.value, wall_ns=a.wall_ns, offset=a.offset, caught_up=a.caught_up)
    end = next_tick + int(tail_s * NS)
    while next_tick <= end:
        collect(eng.tick(next_tick))
        next_tick += TICK
    collect(eng.tick(end + 3600 * NS))
    diagnoses = [
        (d.ts_ns, d.diagnosis_id, d.state, d.bottleneck, tuple(d.ranks), d.explained_by,
         d.critical_path)
        for d in total.diagnoses
    ]  # fmt: skip
    phases = [{**p.model_dump(), "event_id": ""} for p in total.phases]
    recs = [(r.ts_ns, r.knob, r.from_value, r.to_value) for r in total.recommendations]
    return Result(eng, windows, diagnoses, phases, recs)


SCENARIOS = {
    # scenario: (shape, the fault's diagnosis)
    "dataloader_starvation": ((1, 4), "dataloader_starvation"),
    "straggler": ((2, 4), "straggler"),
    "hang": ((1, 4), "hang"),
}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> tuple[str, list[tuple[str, bytes]]]:
    (nodes, per_node), _ = SCENARIOS[request.param]
    messages, _ = simulate(RunSpec(request.param, 3, nodes, per_node, duration_s=40))
    return request.param, messages


def test_the_same_messages_give_the_same_results_at_any_read_speed(
    scenario: tuple[str, list[tuple[str, bytes]]],
) -> None:
    name, messages = scenario
    runs = {
        "live": feed(live(messages)),
        "compressed": feed(compressed(messages)),
        "backlog": feed(backlog(messages)),
    }
    steps = sum(len(decode_batch(v)) for t, v in messages if t == Topics.STEP)
    for how, run in runs.items():
        assert run.engine.windows.late_samples == 0, f"{how}: samples dropped as late"
        step_1s = [c for k, c in run.windows.items() if k[3:6] == ("step_time_ms", 1.0, 1.0)]
        assert sum(step_1s) == steps, f"{how}: every step sample is in a 1 s window"
    ref = runs["live"]
    one_s = {k: c for k, c in ref.windows.items() if k[4] == 1.0}
    assert len(one_s) > 1000
    for how in ("compressed", "backlog"):
        run = runs[how]
        assert {k: c for k, c in run.windows.items() if k[4] == 1.0} == one_s, how
        assert run.windows == ref.windows, f"{how}: the 10 s and 60 s windows too"
        assert run.diagnoses == ref.diagnoses, how
        assert run.phases == ref.phases, how
        assert run.recommendations == ref.recommendations, how

    # the fault is diagnosed, at its event time
    fault = SCENARIOS[name][1]
    (truth,) = [
        e for t, v in messages if t == Topics.JOB for e in [decode_event(v)]
        if isinstance(e, GroundTruth)
    ]  # fmt: skip
    opened = [d for d in ref.diagnoses if d[2] == "open" and d[3] == fault and not d[5]]
    assert opened, f"no {fault} diagnosis in {ref.diagnoses}"
    latency_s = (opened[0][0] - truth.onset_ns) / NS
    assert 0 <= latency_s <= 3, f"{fault} opened {latency_s:.2f} s of event time after onset"
    if name == "dataloader_starvation":
        assert ref.recommendations, "the starvation is answered"


# -- a job that goes silent -------------------------------------------------------------------
T0 = 1_700_000_040 * NS


def _steady_steps(
    job: str, seconds: int, *, ranks: int = 2, step_ns: int = NS // 10
) -> list[bytes]:
    """One step batch a quarter second, every rank a step every ``step_ns``."""
    out = []
    n = seconds * NS // step_ns
    per = TICK // step_ns
    for first in range(0, n, per):
        b = BatchBuilder("step", job_id=job, node="n0", producer_id="t")
        for s in range(first, first + per):
            for r in range(ranks):
                b.add(ts_ns=T0 + (s + 1) * step_ns, rank=r, step=s, step_time_ms=100.0,
                      num_workers=2)  # fmt: skip
        out.append(b.encode())
    return out


def _silent_job(*, caught_up: bool) -> tuple[StreamEngine, list[Outputs], int]:
    """20 s of steps read live, then nothing for 60 s; the last message says whether its
    partition was read to its end."""
    eng = StreamEngine(StreamsSettings())
    outs = []
    batches = _steady_steps("j", 20)
    for i, value in enumerate(batches):
        wall = T0 + (i + 1) * TICK + NS // 10
        last = i == len(batches) - 1
        eng.ingest(Topics.STEP, value, wall_ns=wall, offset=i, caught_up=caught_up or not last)
        outs.append(eng.tick(wall))
    end = wall
    for k in range(1, 241):
        outs.append(eng.tick(end + k * TICK))
    return eng, outs, end


def _closed_until(outs: list[Outputs]) -> int:
    ends = [int(o.windows["window_end_ns"].max()) for o in outs if o.windows is not None]
    return max(ends, default=0)


def test_a_caught_up_job_that_goes_silent_is_windowed_and_diagnosed_as_hung() -> None:
    _, outs, _ = _silent_job(caught_up=True)
    assert _closed_until(outs) >= T0 + 20 * NS, "its last seconds close without new data"
    hangs = [d for o in outs for d in o.diagnoses if d.bottleneck == "hang" and d.state == "open"]
    assert len(hangs) == 1
    stall_s = (hangs[0].ts_ns - (T0 + 20 * NS)) / NS
    assert 30 <= stall_s <= 32, "no GPU evidence: the slow timeout (30 s) in event time"


def test_a_job_whose_partition_is_still_being_read_is_not_silent() -> None:
    eng, outs, end = _silent_job(caught_up=False)
    assert _closed_until(outs) <= T0 + 20 * NS - eng.windows.lateness_s * NS
    assert not [d for o in outs for d in o.diagnoses if d.bottleneck == "hang"]
    assert eng.held_inputs == [(Topics.STEP, 0)]
    # the app learns that the partition has been read to its end: the silence counts from then
    eng.set_input(Topics.STEP, 0, caught_up=True, wall_ns=end + 60 * NS)
    later = [eng.tick(end + 60 * NS + k * TICK) for k in range(1, 161)]
    assert _closed_until(later) >= T0 + 20 * NS
    hangs = [d for o in later for d in o.diagnoses if d.bottleneck == "hang"]
    assert [d.state for d in hangs][:1] == ["open"]
