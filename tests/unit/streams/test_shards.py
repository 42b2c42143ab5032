"""A worker's engines by partition (`Shards`) and the changelog's snapshot records: a partition
that moves to another worker mid-run carries its jobs' state whole, and the two workers
together emit what one worker alone would."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import pytest

from perfloop.evaluation import RunSpec, simulate
from perfloop.schemas import decode_batch
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings
from perfloop.streams._changelog import CHUNK_BYTES, _Assembly, pieces
from perfloop.streams.engine import Outputs
from perfloop.streams.shards import Shards
from perfloop.streams.steps import DERIVED_METRICS

Message = tuple[int, int, str, bytes]  # partition, offset, topic, value


@pytest.fixture(scope="module")
def two_jobs() -> list[Message]:
    """A starving job on partition 0 and a healthy one on partition 1, in arrival order."""
    out: list[tuple[int, Message]] = []
    for p, spec in enumerate(
        (
            RunSpec("dataloader_starvation", 3, nodes=1, ranks_per_node=4, duration_s=40),
            RunSpec("healthy", 4, nodes=1, ranks_per_node=2, duration_s=30),
        )
    ):
        messages, _ = simulate(spec)
        ts = 0  # a job event goes with the batch before it: each job's order is kept
        for i, (topic, value) in enumerate(messages):
            if not topic.endswith(".job"):
                ts = int(decode_batch(value).columns["ts_ns"].max())
            out.append((ts, (p, i, topic, value)))
    out.sort(key=lambda x: (x[0], x[1][0], x[1][1]))
    return [m for _, m in out]


class _Collect:
    def __init__(self) -> None:
        self.rows: list[tuple[object, ...]] = []
        self.diagnoses: list[str] = []

    def take(self, o: Outputs) -> None:
        if o.windows is not None:
            cols = {k: np.asarray(v).tolist() for k, v in o.windows.items()}
            keys = ("job_id", "rank", "metric", "window_s", "hop_s", "ts_ns", "count")
            self.rows.extend(zip(*(cols[k] for k in keys), strict=True))
        self.diagnoses.extend(f"{d.diagnosis_id}:{d.state}" for d in o.diagnoses)


def _feed(
    workers: Sequence[Shards], owner: dict[int, int], messages: Sequence[tuple[int, Message]],
    wall: int, out: _Collect,
) -> int:  # fmt: skip
    for n, (p, offset, topic, value) in messages:
        if not topic.endswith(".job"):
            wall = max(wall, int(decode_batch(value).columns["ts_ns"].max()) + 300_000_000)
        workers[owner[p]].engine(p).ingest(topic, value, wall_ns=wall, partition=p, offset=offset)
        if n % 4 == 0:  # the same ticks in every run (a re-read message has none)
            for w in workers:
                for e in w.engines.values():
                    out.take(e.tick(wall))
    return wall


def _finish(workers: Sequence[Shards], wall: int, out: _Collect) -> None:
    for w in workers:
        for e in w.engines.values():
            out.take(e.tick(wall + 120 * 1_000_000_000))


def _telemetry(rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    return sorted(r for r in rows if r[2] not in DERIVED_METRICS)


def test_a_partition_moved_mid_run_emits_what_one_worker_would(two_jobs: list[Message]) -> None:
    settings = StreamsSettings()
    alone, whole = Shards(settings), _Collect()
    numbered = list(enumerate(two_jobs))
    _finish([alone], _feed([alone], {0: 0, 1: 0}, numbered, 0, whole), whole)
    assert sorted(alone.engines) == [0, 1] and len(alone.engines[0].jobs) == 1

    a, b, moved = Shards(settings), Shards(settings), _Collect()
    half = len(two_jobs) // 2
    wall = _feed([a, b], {0: 0, 1: 0}, numbered[:half], 0, moved)
    # a rebalance: partition 1 goes to worker b, from the snapshot a writes as it loses it
    snapshot = a.engines[1].dumps()
    gone = a.drop(1)
    assert gone is not None and gone.jobs and sorted(a.engines) == [0]
    b.add(1, snapshot)
    assert b.moves["restored"] == 1 and b.engines[1].jobs == gone.jobs
    # b re-reads partition 1 from an older commit: what the snapshot holds is skipped
    again = [(1, m) for m in two_jobs[:half] if m[0] == 1][-5:]
    wall = _feed([a, b], {0: 0, 1: 1}, [*again, *numbered[half:]], wall, moved)
    _finish([a, b], wall, moved)
    assert b.engines[1].stats["replayed"] == len(again)
    # Every window of the telemetry once, with the same counts. The step analysis's derived
    # metrics are left out: a restored engine's derived windows start at other seconds than
    # the original's (the restore's resume wakes sources that had gone quiet; see
    # `WindowSet.resume`), though none repeats.
    assert _telemetry(moved.rows) == _telemetry(whole.rows)
    derived = [r[:6] for r in moved.rows if r[2] in DERIVED_METRICS]
    assert derived and len(derived) == len(set(derived)), "no derived window twice"
    assert sorted(moved.diagnoses) == sorted(whole.diagnoses)
    assert any(d.endswith(":open") for d in whole.diagnoses), "the starving job was diagnosed"
    # the worker's counts: what each did, summed, is what one worker did
    assert a.stats["samples"] + b.stats["samples"] == alone.stats["samples"]
    assert a.stats["samples"] > 0 and b.stats["samples"] > 0


def test_a_partition_kept_through_a_rebalance_skips_what_it_reads_again(
    two_jobs: list[Message],
) -> None:
    """Eager rebalancing revokes every partition and assigns the kept ones again; the consumer
    then starts from its last commit, which may be older than what the engine holds."""
    shards, out = Shards(StreamsSettings()), _Collect()
    mine = [(n, m) for n, m in enumerate(two_jobs) if m[0] == 0]
    wall = _feed([shards], {0: 0}, mine[:60], 0, out)
    samples = shards.stats["samples"]
    _feed([shards], {0: 0}, [(1, m) for _, m in mine[50:60]], wall, out)
    assert shards.stats["replayed"] == 10 and shards.stats["samples"] == samples


def test_the_newest_snapshot_of_this_broker_is_restored(two_jobs: list[Message]) -> None:
    """A worker's own copy (written every snapshot interval) and the changelog's (less often):
    the one that has read more of the partition wins, among those of the broker read now."""
    settings = StreamsSettings()
    src, out = Shards(settings), _Collect()
    src.use_cluster("c1")
    mine = [(n, m) for n, m in enumerate(two_jobs) if m[0] == 0]
    wall = _feed([src], {0: 0}, mine[:40], 0, out)
    older = src.engines[0].dumps()
    _feed([src], {0: 0}, mine[40:80], wall, out)
    newer = src.engines[0].dumps()
    for order in ((older, newer), (newer, older)):
        shards = Shards(settings)
        shards.use_cluster("c1")
        assert shards.add(0, None, *order).offsets == src.engines[0].offsets
    # the broker was replaced: a snapshot of the new one wins even if it read less
    src.engines[0].use_cluster("c2")
    other = src.engines[0].dumps()
    shards = Shards(settings)
    shards.use_cluster("c2")
    assert shards.add(0, newer, other).cluster_id == "c2"


def test_an_unreadable_snapshot_gives_a_fresh_engine() -> None:
    shards = Shards(StreamsSettings())
    e = shards.add(2, b"not a snapshot")
    assert shards.moves == {"unreadable": 1, "fresh": 1}
    assert e.jobs == [] and shards.engines[2] is e


def test_the_engines_share_the_most_experienced_cross_run_models() -> None:
    settings = StreamsSettings()
    donor = Shards(settings)
    donor.engine(0)
    assert donor.learn_history([({"params": 1e6}, 100.0, 1e9)] * 3) == 3
    data = donor.engines[0].dumps()
    shards = Shards(settings)
    assert shards.learn_history([]) is None, "no engine yet: the history waits"
    fresh = shards.engine(5)
    assert shards.history_wanted
    shards.add(1, data)  # comes with three jobs learned: every engine uses its models
    assert fresh.predict.cross_step is shards.engines[1].predict.cross_step
    assert fresh.predict.cross_step.n_seen == 3 and not shards.history_wanted


def test_snapshot_records_are_cut_to_size_and_the_latest_complete_one_is_kept() -> None:
    big = np.random.default_rng(0).bytes(CHUNK_BYTES + 1000)  # incompressible: two pieces
    first, second = pieces(7, big, "s1"), pieces(7, b"small", "s2")
    assert [k for k, _, _ in first] == [b"7:0", b"7:1"] and len(second) == 1
    asm = _Assembly()

    def take(offset: int, rec: tuple[bytes, bytes, list[tuple[str, bytes]]]) -> None:
        asm.take(offset, rec[1], dict(rec[2]))

    take(0, first[0])
    assert asm.latest is None, "half a snapshot is none"
    take(1, first[1])
    assert asm.latest is not None and zlib.decompress(asm.latest) == big
    take(2, second[0])
    assert zlib.decompress(asm.latest) == b"small" and asm.latest_at == 2
    take(3, first[0])  # a piece of a write that died half-way replaces nothing
    assert zlib.decompress(asm.latest) == b"small"
    asm.take(4, b"junk", {"perfloop.part": b"x"})  # a record that is no piece: ignored
    assert zlib.decompress(asm.latest) == b"small"
    assert Topics.STREAM_STATE == "perfloop.streams.state"


def test_what_a_producer_resends_to_a_broker_that_lost_its_log_is_counted_once(
    two_jobs: list[Message],
) -> None:
    """The embedded broker restarts empty (a crash, or recycled on purpose): producers resend
    their last acknowledged messages, which land at other offsets of the new log. The engine
    forgets the old log's positions and drops the resent messages by their batch or event id;
    its windows and diagnoses are those of the run without the restart."""
    settings = StreamsSettings()
    numbered = list(enumerate(two_jobs))
    alone, whole = Shards(settings), _Collect()
    alone.use_cluster("c1")
    _finish([alone], _feed([alone], {0: 0, 1: 0}, numbered, 0, whole), whole)

    shards, out = Shards(settings), _Collect()
    shards.use_cluster("c1")
    half = len(two_jobs) // 2
    wall = _feed([shards], {0: 0, 1: 0}, numbered[:half], 0, out)
    shards.use_cluster("c2")  # the new broker: offsets start at 0 again
    # partition 0's producer resends its last 20 messages first, then goes on; every message
    # on the new log has a new offset (partition 1's keep theirs: any offset is new there)
    resent = [(n, m) for n, m in numbered[:half] if m[0] == 0][-20:]
    offsets = iter(range(len(two_jobs)))
    again = [
        (n, (p, next(offsets) if p == 0 else i, t, v))
        for n, (p, i, t, v) in [*resent, *numbered[half:]]
    ]
    wall = _feed([shards], {0: 0, 1: 0}, again, wall, out)
    _finish([shards], wall, out)
    assert shards.stats["repeated"] == len(resent) and shards.stats["replayed"] == 0
    assert shards.stats["samples"] == alone.stats["samples"]
    assert _telemetry(out.rows) == _telemetry(whole.rows)
    assert sorted(out.diagnoses) == sorted(whole.diagnoses)
