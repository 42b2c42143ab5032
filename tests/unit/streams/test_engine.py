"""The stream engine: what happens to each kind of bad input, live configuration, snapshots, and
the whole path (ingest → windows, phases, funnel → recommendation) on a simulated job."""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import orjson
import pytest

from perfloop.evaluation import RunSpec, replay, simulate
from perfloop.exceptions import ConfigError
from perfloop.schemas import (
    BatchBuilder,
    ConfigChange,
    JobLifecycle,
    SchemaError,
    decode_batch,
    encode_batch,
    encode_event,
)
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings
from perfloop.streams.engine import Outputs, StreamEngine

NS = 1_000_000_000
NOW = 1_800_000_000 * NS


def _steps(n: int = 20, *, t0: int = NOW - 30 * NS, job: str = "j") -> bytes:
    b = BatchBuilder("step", job_id=job, node="n0", producer_id="t")
    for i in range(n):
        b.add(ts_ns=t0 + i * 100_000_000, rank=i % 2, step=i // 2, step_time_ms=100.0)
    return b.encode()


_STEP_COLS = {"ts_ns": [NOW], "rank": [0], "step": [0], "step_time_ms": [100.0]}


def _engine(**kw: object) -> StreamEngine:
    return StreamEngine(StreamsSettings(**kw))


def _config(key: str, value: object, target: str = "streams", job: str = "*") -> bytes:
    return encode_event(
        ConfigChange(
            ts_ns=NOW,
            job_id="ops" if job == "*" else job,
            node="t",
            rank=-1,
            target=target,
            key=key,
            value=value,
            applies_to=job,
        )
    )


BAD_INPUT = [
    # (what, topic, payload, words of the one-line reason)
    ("malformed JSON", Topics.STEP, b"\x00{", "not valid JSON"),
    ("unknown version", Topics.STEP, None, "schema_version 99"),
    ("wrong kind for the topic", Topics.GPU, _steps(), "does not belong on perfloop.telemetry.gpu"),
    ("clock far ahead", Topics.STEP, _steps(t0=NOW + 3600 * NS), "ahead of this worker's clock"),
    ("event time too old", Topics.STEP, _steps(t0=NOW - 40 * 86400 * NS), "behind this worker"),
    ("oversize", Topics.STEP, b"{" + b" " * (5 << 20) + b"}", "bytes"),
    ("command-like junk on control", Topics.CONTROL, b'{"kind": "nope"}', "unknown kind"),
    ("unknown stream setting", Topics.CONTROL, _config("windows.nope", 1), "windows.nope"),
    ("bad value for a setting", Topics.CONTROL, _config("windows.lateness_s", -3), "lateness"),
    (
        "a window setting for one job",
        Topics.CONTROL,
        _config("windows.lateness_s", 2, job="j"),
        "only detect.* settings can be set for one job",
    ),
    ("batch on the job topic", Topics.JOB, _steps(), "got an Arrow telemetry batch"),
    ("a topic it does not read", Topics.WINDOWS, _steps(), "does not read"),
]


@pytest.mark.parametrize(
    ("what", "topic", "payload", "reason"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT]
)
def test_bad_input_raises_one_line_and_changes_nothing(
    what: str, topic: str, payload: bytes | None, reason: str
) -> None:
    if payload is None:
        doc = orjson.loads(encode_batch("step", _STEP_COLS, job_id="j", node="n0", wire="json"))
        payload = orjson.dumps({**doc, "schema_version": 99})
    eng = _engine()
    before = pickle.dumps(eng.snapshot()["windows"])
    with pytest.raises(SchemaError) as e:
        eng.ingest(topic, payload, wall_ns=NOW)
    msg = str(e.value)
    assert reason in msg and "\n" not in msg, msg
    assert eng.stats["samples"] == 0 and pickle.dumps(eng.snapshot()["windows"]) == before
    # the engine takes good input afterwards
    assert eng.ingest(Topics.STEP, _steps(), wall_ns=NOW) == 20


def test_live_config_changes_apply_and_sampling_changes_are_left_to_producers() -> None:
    eng = _engine()
    eng.ingest(Topics.CONTROL, _config("windows.lateness_s", 0.5), wall_ns=NOW)
    eng.ingest(Topics.CONTROL, _config("rules.cooldown_s", 5), wall_ns=NOW)
    eng.ingest(Topics.CONTROL, _config("ingest.max_skew_s", 60), wall_ns=NOW)
    eng.ingest(Topics.CONTROL, _config("sampling.gpu_interval_ms", 50, "producers"), wall_ns=NOW)
    assert [(c.key, new) for c, _, new in eng.applied] == [
        ("windows.lateness_s", 0.5),
        ("rules.cooldown_s", 5.0),
        ("ingest.max_skew_s", 60.0),
    ]
    assert eng.windows.lateness_s == 0.5 and eng.rule.cooldown_ns == 5 * NS
    with pytest.raises(SchemaError, match="ahead"):  # the new skew bound holds
        eng.ingest(Topics.STEP, _steps(t0=NOW + 120 * NS), wall_ns=NOW)
    with pytest.raises(ConfigError, match="valid prefixes"):
        eng.configure("nonsense", 1)


def test_a_detector_setting_for_one_job_reaches_that_job_only() -> None:
    eng = _engine()
    eng.ingest(Topics.CONTROL, _config("detect.hang.floor_s", 45, job="j1"), wall_ns=NOW)
    [(change, old, new)] = eng.applied
    assert (change.applies_to, old, new) == ("j1", eng.funnel.config.hang.floor_s, 45)
    assert eng.funnel.config_for("j1").hang.floor_s == 45
    assert eng.funnel.config_for("j2").hang.floor_s == eng.funnel.config.hang.floor_s != 45


def test_with_a_roster_only_a_signed_change_within_the_signers_role_applies(
    tmp_path: Path,
) -> None:
    from perfloop.actuators.signing import sign
    from perfloop.actuators.trust import signed_by
    from perfloop.identity import PrivateKey, TrustedKey
    from perfloop.roster import Principal, Role, owner_roster
    from perfloop.schemas import decode_event

    owner, ana, stranger = PrivateKey.generate(), PrivateKey.generate(), PrivateKey.generate()
    roster = owner_roster(owner)
    roster.principals["ana"] = Principal("ana", (Role(("*",), ("actuator.*",), "auto"),))
    roster.keyring.keys.update({k.key_id: k for k in [TrustedKey.of(ana.public_bytes(), "ana")]})
    path = tmp_path / "roster.json"
    roster.save(path)
    eng = _engine(roster=path)
    before = eng.windows.lateness_s
    wall = time.time_ns()  # what the signatures' expiries are counted from

    def change(value: float) -> ConfigChange:
        return decode_event(_config("windows.lateness_s", value))  # type: ignore[return-value]

    tampered = signed_by(change(4.0), owner).model_copy(update={"value": 5.0})
    replay = signed_by(change(3.0), owner)
    bad = {
        "unsigned": change(1.0),
        "a key not in the roster": signed_by(change(1.5), stranger),
        "out of role": signed_by(change(2.0), ana),  # ana may set actuator.* only
        "tampered": tampered,
        "expired": sign(change(6.0).model_copy(update={"expires_ts_ns": wall - NS}), owner),
        "shared key": sign(change(7.0), b"shared"),
    }
    for what, event in bad.items():
        with pytest.raises(SchemaError, match="refused"):
            eng.ingest(Topics.CONTROL, encode_event(event), wall_ns=wall)
        assert eng.windows.lateness_s == before, what
    eng.ingest(Topics.CONTROL, encode_event(replay), wall_ns=wall)
    assert eng.windows.lateness_s == 3.0  # the owner's, signed: applied
    again = replay.model_copy(update={"event_id": replay.event_id})  # the same event resent
    eng._recent = type(eng._recent)(10)  # as a worker that forgot it read it (a restore)
    with pytest.raises(SchemaError, match="replayed"):
        eng.ingest(Topics.CONTROL, encode_event(again), wall_ns=wall)
    refusals = eng.tick(wall).refusals
    assert len(refusals) == len(bad) + 1
    assert {r.outcome for r in refusals} == {"refused"}
    assert all(r.reason.startswith("config refused: by the stream tier") for r in refusals)
    by_id = {r.rec_id: r for r in refusals}
    assert by_id[bad["out of role"].event_id].actor == "ana"
    assert "no role that sets windows.lateness_s" in by_id[bad["out of role"].event_id].reason
    assert by_id[bad["unsigned"].event_id].knob == "windows.lateness_s"
    # a change for every job comes on every partition: one audit row, whichever engine refused
    assert all(r.event_id == f"{r.rec_id}-refused" for r in refusals)


def test_without_a_roster_changes_are_taken_unsigned() -> None:
    eng = _engine()
    eng.ingest(Topics.CONTROL, _config("windows.lateness_s", 0.5), wall_ns=NOW)
    assert eng.windows.lateness_s == 0.5 and not eng.tick(NOW).refusals


def _run(
    eng: StreamEngine,
    messages: Sequence[tuple[str, bytes]],
    start: int = 0,
    stop: int | None = None,
    *,
    wall: int = 0,
    first_offset: int | None = None,
) -> tuple[Outputs, int]:
    """Feed messages (offsets = their index, or from ``first_offset`` on) with the receive
    clock of the evaluation, ticking every 4 messages; without ``stop``, end with a tick far
    in the future. Returns what came out (windows as sorted row tuples) and the clock."""
    total = Outputs(windows=None)
    rows: list[dict[str, list[object]]] = []

    def collect(o: Outputs) -> None:
        if o.windows is not None:
            rows.append({k: np.asarray(v).tolist() for k, v in o.windows.items()})
        total.diagnoses.extend(o.diagnoses)
        total.recommendations.extend(o.recommendations)
        total.phases.extend(o.phases)

    for i, (topic, value) in enumerate(messages[start:stop], start):
        if not topic.endswith(".job") and topic != Topics.CONTROL:
            b = decode_batch(value)
            wall = max(wall, int(b.columns["ts_ns"].max()) + 300_000_000)
        offset = i if first_offset is None else first_offset + i - start
        eng.ingest(topic, value, wall_ns=wall, offset=offset)
        if i % 4 == 0:
            collect(eng.tick(wall))
    if stop is None:
        collect(eng.tick(wall + 120 * NS))
    keys = ("job_id", "node", "rank", "device", "metric", "window_s", "hop_s", "ts_ns", "count")
    total.windows = {
        "rows": sorted(tuple(r[k][i] for k in keys) for r in rows for i in range(len(r["ts_ns"])))
    }
    return total, wall


@pytest.fixture(scope="module")
def starvation() -> tuple[list[tuple[str, bytes]], int]:
    return simulate(RunSpec("dataloader_starvation", 3, nodes=1, ranks_per_node=4, duration_s=40))


def test_simulated_starvation_is_windowed_diagnosed_and_answered(
    starvation: tuple[list[tuple[str, bytes]], int],
) -> None:
    messages, world = starvation
    eng = _engine()
    out, _ = _run(eng, messages)
    rows = out.windows["rows"]  # type: ignore[index]
    step_1s = [r for r in rows if r[4] == "step_time_ms" and r[5] == 1 and r[6] == 1]
    steps = sum(len(decode_batch(v)) for t, v in messages if t == Topics.STEP)
    assert sum(r[8] for r in step_1s) + eng.windows.late_samples >= steps
    assert eng.windows.late_samples <= 0.01 * eng.stats["samples"], "live-like input is on time"
    assert {r[5] for r in rows} >= {1.0, 10.0, 60.0}
    opened = [d for d in out.diagnoses if d.state == "open" and not d.explained_by]
    assert "dataloader_starvation" in {d.bottleneck for d in opened}
    (rec,) = out.recommendations
    assert rec.knob == "dataloader.num_workers" and rec.to_value > rec.from_value
    # the engine's funnel sees what the offline evaluation's funnel sees
    offline = replay(
        RunSpec("dataloader_starvation", 3, nodes=1, ranks_per_node=4), messages, world
    )
    assert {(d.bottleneck, d.state) for d in opened} <= {
        (d.bottleneck, d.state) for d in offline.diagnoses
    }


def test_a_restored_snapshot_resumes_exactly(
    starvation: tuple[list[tuple[str, bytes]], int], tmp_path: Path
) -> None:
    messages, _ = starvation
    whole, _ = _run(_engine(), messages)
    # a worker runs to `half`, snapshots, and is killed
    half = len(messages) // 2
    first = _engine()
    before, wall = _run(first, messages, stop=half)
    path = tmp_path / "0.snapshot"
    assert first.save(path) > 0
    # its successor restores and re-reads from an older committed offset: those are skipped
    again = _engine()
    assert again.load(path)
    after, _ = _run(again, messages, start=half - 10, wall=wall)
    assert again.stats["replayed"] == 10
    rows = before.windows["rows"] + after.windows["rows"]  # type: ignore[index]
    assert len(after.windows["rows"]) > 0  # type: ignore[index]
    assert sorted(rows) == whole.windows["rows"], "every window once, with the same counts"
    assert [d.diagnosis_id for d in before.diagnoses + after.diagnoses] == [
        d.diagnosis_id for d in whole.diagnoses
    ]


@pytest.mark.parametrize(
    ("taken_in", "now_in", "forgotten"),
    [
        ("cluster-a", "cluster-a", False),  # the same broker: re-read messages are skipped
        ("cluster-a", "cluster-b", True),  # a broker restarted empty: its log is read
        (None, "cluster-b", False),  # a snapshot that does not say: positions kept
    ],
)
def test_snapshot_positions_count_only_in_the_cluster_they_were_taken_in(
    starvation: tuple[list[tuple[str, bytes]], int],
    tmp_path: Path,
    taken_in: str | None,
    now_in: str,
    forgotten: bool,
) -> None:
    messages, _ = starvation
    whole = _engine()
    _run(whole, messages)
    half = len(messages) // 2
    first = _engine()
    first.use_cluster(taken_in)
    _, wall = _run(first, messages, stop=half)
    path = tmp_path / "0.snapshot"
    first.save(path)
    again = _engine()
    assert again.load(path)
    assert again.use_cluster(now_in) is forgotten
    assert again.cluster_id == now_in
    if forgotten:  # the new log holds what came after the snapshot, from offset 0 on
        _run(again, messages, start=half, wall=wall, first_offset=0)
        assert again.stats["replayed"] == 0
    else:  # the same log, re-read from a commit 10 messages older than the snapshot
        _run(again, messages, start=half - 10, wall=wall)
        assert again.stats["replayed"] == 10
    assert again.stats["samples"] == whole.stats["samples"], "every sample counted once"
    assert again.snapshot()["cluster_id"] == now_in


def test_unreadable_snapshot_is_ignored(tmp_path: Path) -> None:
    p = tmp_path / "0.snapshot"
    p.write_bytes(b"not a pickle")
    assert not _engine().load(p)
    assert not _engine().load(tmp_path / "missing")


def test_lifecycle_events_reach_the_components() -> None:
    eng = _engine()
    eng.ingest(Topics.STEP, _steps(), wall_ns=NOW)
    ev = JobLifecycle(ts_ns=NOW - 20 * NS, job_id="j", node="n0", rank=-1, state="finished")
    assert eng.ingest(Topics.JOB, encode_event(ev), wall_ns=NOW) == 0
    assert eng.stats["events"] == 1


def test_a_cpu_job_with_too_many_threads_gets_a_thread_recommendation() -> None:
    """Job info says 8 threads on 2 CPUs; once 30+ steps ran with that configuration the tick
    recommends fewer threads, and the engine learns from the verdict on the actuations topic."""
    from perfloop.schemas import ActuationResult, Command, JobInfo

    eng = _engine()
    info = JobInfo(ts_ns=NOW - 40 * NS, job_id="j", node="n0", rank=0, cpu_count=2,
                   extra={"torch.num_threads": "8", "cpu_affinity": "2"})  # fmt: skip
    eng.ingest(Topics.JOB, encode_event(info), wall_ns=NOW)
    b = BatchBuilder("step", job_id="j", node="n0", producer_id="t")
    for i in range(60):
        b.add(ts_ns=NOW - 30 * NS + i * 100_000_000, rank=0, step=i, step_time_ms=100.0,
              data_wait_ms=10.0)  # fmt: skip
    eng.ingest(Topics.STEP, b.encode(), wall_ns=NOW)
    # the job's clock moves on with the wall's once its input is read: tick through 30 s
    recs = [r for k in range(30) for r in eng.tick(NOW + k * NS).recommendations]
    assert [(r.knob, r.from_value, r.to_value) for r in recs] == [("torch.num_threads", 8, 2)]
    cmd = Command(ts_ns=NOW, job_id="j", node="n0", rank=-1, seq=1, knob="torch.num_threads",
                  from_value=8, value=2, expires_ts_ns=NOW + 60 * NS)  # fmt: skip
    eng.ingest(Topics.CONTROL, encode_event(cmd), wall_ns=NOW)
    verdict = ActuationResult(ts_ns=NOW, job_id="j", node="n0", rank=0, command_id=cmd.event_id,
                              status="kept", knob="torch.num_threads", value=2,
                              evidence={"before_ms": 100.0, "after_ms": 75.0})  # fmt: skip
    eng.ingest(Topics.ACTUATIONS, encode_event(verdict), wall_ns=NOW)
    (rec,) = eng.outcomes.records.values()
    assert (rec.kept, rec.gains) == (1, [0.25])
    restored = _engine()
    restored.restore(pickle.loads(pickle.dumps(eng.snapshot())))
    assert restored.outcomes.records == eng.outcomes.records
