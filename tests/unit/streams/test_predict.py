"""The online models hosted in the stream engine: predictions, their realisation, their state."""

from __future__ import annotations

import math
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfloop.exceptions import ConfigError
from perfloop.schemas import JobLifecycle, PhaseChange, Prediction, decode_event, encode_event
from perfloop.schemas.codec import Batch, encode_batch
from perfloop.schemas.topics import KIND_TOPICS, Topics
from perfloop.settings import StreamsSettings
from perfloop.streams.engine import StreamEngine
from perfloop.streams.predict import STEP_TARGETS, PredictionHost
from tests.helpers import simulate

NS = 1_000_000_000


def _feed(
    eng: StreamEngine, messages: list[Any], *, final: bool = True, first: int = 0
) -> list[Prediction]:
    """Messages in order (offsets = their index from ``first``), the receive clock just after
    each one's newest sample, a tick every 4 messages; with ``final``, a last tick far ahead."""
    out: list[Prediction] = []
    wall = 0
    for i, m in enumerate(messages, first):
        if isinstance(m, Batch):
            wall = max(wall, int(m.columns["ts_ns"].max()) + 300_000_000)
            topic = KIND_TOPICS[m.kind]
            data = encode_batch(m.kind, m.columns, job_id=m.job_id, node=m.node)
        else:
            topic, data = Topics.JOB, encode_event(m)
        eng.ingest(topic, data, wall_ns=wall, offset=i)
        if i % 4 == 0:
            out.extend(eng.tick(wall).predictions)
    if final:
        out.extend(eng.tick(wall + 120 * NS).predictions)
    return out


def _window_medians(messages: list[Any]) -> dict[int, float]:
    """Independently: per second, the median step time over every rank of the steps whose
    last rank ended in that second."""
    rows: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for m in messages:
        if isinstance(m, Batch) and m.kind == "step":
            for st, ts, v in zip(
                m.columns["step"], m.columns["ts_ns"], m.columns["step_time_ms"], strict=True
            ):
                rows[int(st)].append((int(ts), float(v)))
    per_sec: dict[int, list[float]] = defaultdict(list)
    for r in rows.values():
        per_sec[max(t for t, _ in r) // NS] += [v for _, v in r]
    return {s: float(np.median(v)) for s, v in per_sec.items()}


@pytest.fixture(scope="module")
def starvation() -> tuple[list[Any], list[Prediction]]:
    _, messages = simulate("dataloader_starvation", 120.0)
    return messages, _feed(StreamEngine(StreamsSettings()), messages)


def test_next_step_times_are_predicted_and_realised_by_the_next_window(
    starvation: tuple[list[Any], list[Prediction]],
) -> None:
    messages, preds = starvation
    medians = _window_medians(messages)
    made = {p.prediction_id: p for p in preds if p.state == "predicted"}
    done = [p for p in preds if p.state == "realised" and p.target == "step_time_ms"]
    assert {p.target for p in made.values()} >= {"step_time_ms", "forward_ms", "data_wait_ms"}
    # one forecast per target every 5 s of event time once 10 windows were learned
    assert 15 <= len(done) <= 25
    gaps = np.diff(sorted(p.for_ts_ns for p in done)) / NS
    assert gaps.min() >= 5
    for p in done:
        first = made[p.prediction_id]  # realised after it was predicted, same forecast
        assert (p.value, p.step, p.baseline) == (first.value, first.step, first.baseline)
        second = p.for_ts_ns // NS - 1  # the window it forecast
        assert p.realised == pytest.approx(medians[second])
        assert p.ts_ns >= first.ts_ns
    # forecasts are near what came (the starvation makes steps 2-3x longer mid-run)
    ape = [abs(p.value - p.realised) / p.realised for p in done]  # type: ignore[operator]
    assert float(np.median(ape)) < 0.1


def test_a_regime_change_is_flagged_when_the_loader_starves(
    starvation: tuple[list[Any], list[Prediction]],
) -> None:
    _, preds = starvation
    changes = [p for p in preds if p.target == "regime_change"]
    assert changes, "the starvation moves step time and data-wait share"
    assert all(p.model == "RegimeDetector" and p.evidence for p in changes)


@pytest.fixture(scope="module")
def leak() -> list[Any]:
    return simulate("memory_leak", 180.0, ranks_per_node=2)[1]


def test_a_memory_leak_is_warned_before_the_oom_and_realised_by_it(leak: list[Any]) -> None:
    messages = leak
    eng = StreamEngine(StreamsSettings())
    preds = _feed(eng, messages)
    oom = [
        m for m in messages if isinstance(m, JobLifecycle) and m.state == "failed" and m.rank == -1
    ]
    warned = [p for p in preds if p.target == "time_to_oom_s" and p.state == "predicted"]
    assert oom and warned
    first = min(p.ts_ns for p in warned)
    assert (oom[0].ts_ns - first) / NS >= 30, "the first warning comes at least 30 s ahead"
    realised = [p for p in preds if p.target == "time_to_oom_s" and p.state == "realised"]
    assert {p.prediction_id for p in realised} == {p.prediction_id for p in warned}
    for p in realised:
        assert p.realised == pytest.approx((oom[0].ts_ns - p.ts_ns) / NS)


def test_a_failure_that_is_not_out_of_memory_realises_no_oom_warning(leak: list[Any]) -> None:
    # the same job, but its end says something else ("room" is not "oom")
    messages = [
        m.model_copy(update={"message": "no room left on the scratch disk"})
        if isinstance(m, JobLifecycle) and m.state == "failed"
        else m
        for m in leak
    ]
    preds = _feed(StreamEngine(StreamsSettings()), messages)
    assert [p for p in preds if p.target == "time_to_oom_s" and p.state == "predicted"]
    assert not [p for p in preds if p.target == "time_to_oom_s" and p.state == "realised"]


def test_a_healthy_job_gets_no_oom_warning_and_no_regime_change() -> None:
    _, messages = simulate("healthy", 90.0)
    preds = _feed(StreamEngine(StreamsSettings()), messages)
    assert any(p.target == "step_time_ms" for p in preds)
    assert not [p for p in preds if p.target in ("time_to_oom_s", "regime_change")]


def test_models_survive_a_snapshot_and_predict_as_before(
    starvation: tuple[list[Any], list[Prediction]],
) -> None:
    messages, whole = starvation
    half = len(messages) // 2
    first = StreamEngine(StreamsSettings())
    before = _feed(first, messages[:half], final=False)
    again = StreamEngine(StreamsSettings())
    again.restore(pickle.loads(first.dumps()))
    after = _feed(again, messages[half:], first=half)
    ids = [p.prediction_id + p.state for p in before + after]
    want = [p.prediction_id + p.state for p in whole]
    assert sorted(ids) == sorted(want)
    values = {p.prediction_id + p.state: p.value for p in whole}
    assert all(values[p.prediction_id + p.state] == p.value for p in after)


def test_a_snapshot_written_before_the_stream_tier_had_subpackages_still_resumes(
    starvation: tuple[list[Any], list[Prediction]], tmp_path: Path
) -> None:
    """A snapshot names two classes by the module they were in when the stream tier was flat
    (``perfloop.streams.predict._Job``, ``perfloop.streams._phase_steps.StepRecord``): a
    worker of this release loads it and predicts as after its own snapshot."""
    messages, whole = starvation
    half = len(messages) // 2
    first = StreamEngine(StreamsSettings())
    _feed(first, messages[:half], final=False)
    data = pickle.dumps(first.snapshot(), protocol=2)  # a class is "c<module>\n<name>\n"
    for new, old in (
        (b"perfloop.streams.predict.host\n_Job\n", b"perfloop.streams.predict\n_Job\n"),
        (
            b"perfloop.streams.steps.records\nStepRecord\n",
            b"perfloop.streams._phase_steps\nStepRecord\n",
        ),
    ):
        assert new in data
        data = data.replace(new, old)
    with pytest.raises((AttributeError, ImportError)):
        pickle.loads(data)  # as a plain unpickler finds them
    path = tmp_path / "0.snapshot"
    path.write_bytes(data)
    again = StreamEngine(StreamsSettings())
    assert again.load(path)
    after = _feed(again, messages[half:], first=half)
    values = {p.prediction_id + p.state: p.value for p in whole}
    assert after and all(values[p.prediction_id + p.state] == p.value for p in after)


def test_predictions_can_be_turned_off_live_and_bad_settings_are_refused() -> None:
    _, messages = simulate("healthy", 30.0)
    eng = StreamEngine(StreamsSettings())
    assert eng.configure("predict.enabled", False) == (True, False)
    assert _feed(eng, messages) == []
    host = PredictionHost()
    assert host.configure("predict.oom_horizon_s", 300) == (120.0, 300.0)
    for key, value in [
        ("predict.enabled", 1),
        ("predict.oom_horizon_s", -1),
        ("predict.anomaly_threshold", math.nan),
        ("predict.nope", 1),
    ]:
        with pytest.raises(ConfigError, match="predict"):
            host.configure(key, value)


def test_predictions_travel_as_events_and_keep_their_targets(
    starvation: tuple[list[Any], list[Prediction]],
) -> None:
    _, preds = starvation
    for p in preds[:50]:
        back = decode_event(encode_event(p))
        assert back == p
    assert {p.target for p in preds if p.model == "StepTimeForecaster"} <= set(STEP_TARGETS)


def test_a_new_job_is_predicted_from_the_jobs_that_ran_before() -> None:
    # Past jobs of three model sizes whose compute scales with the size; a fourth job like
    # the second is predicted from them, and realised when it ends.
    eng = StreamEngine(StreamsSettings())
    sizes = [(3e8, 15.0, 29.0), (6e8, 30.0, 58.0), (1.2e9, 60.0, 116.0), (6e8, 30.0, 58.0)]
    preds: list[Prediction] = []
    for i, (params, fwd, bwd) in enumerate(sizes):
        _, messages = simulate(
            "healthy",
            20.0,
            job_id=f"job-{i}",
            model_params=int(params),
            forward_ms=fwd,
            backward_ms=bwd,
            load_ms=10.0,
            seed=10 + i,
        )
        preds += _feed(eng, messages, first=10_000 * i)
    cross = [p for p in preds if p.model == "CrossRunPredictor"]
    assert not [p for p in cross if p.job_id in ("job-0",)], "nothing to compare the first with"
    made = {p.target: p for p in cross if p.job_id == "job-3" and p.state == "predicted"}
    came = {p.target: p for p in cross if p.job_id == "job-3" and p.state == "realised"}
    assert set(made) == set(came) == {"job_step_time_ms", "job_mem_peak_bytes"}
    step = came["job_step_time_ms"]
    assert abs(step.value - step.realised) / step.realised < 0.05  # type: ignore[operator]
    assert eng.predict.cross_step.n_seen == 4  # every job taught it when it ended
    assert eng.predict.learn_history([({"params": 1e9}, 100.0, 2e10)]) == 1
    assert eng.predict.cross_step.n_seen == 5


def test_settings_choose_whether_and_how_often_to_forecast() -> None:
    eng = StreamEngine(StreamsSettings(predictions=False, prediction_every_s=2.0))
    assert (eng.predict.enabled, eng.predict.every_s) == (False, 2.0)
    assert StreamEngine(StreamsSettings()).predict.enabled
    _, messages = simulate("healthy", 60.0)
    every2 = _feed(StreamEngine(StreamsSettings(prediction_every_s=2.0)), messages)
    every5 = _feed(StreamEngine(StreamsSettings()), messages)
    n2 = sum(p.target == "step_time_ms" and p.state == "predicted" for p in every2)
    n5 = sum(p.target == "step_time_ms" and p.state == "predicted" for p in every5)
    assert n2 > 2 * n5 > 0


def test_phase_forecasts_of_one_start_in_different_phases_are_different_events() -> None:
    """The phase machine can say twice what began at one moment (a stall, then steady after
    all, since the same time): two forecasts, two event ids, or the sink, which stores an
    event id once, would drop the second. The same change again gives the same id."""

    def changes(host: PredictionHost) -> list[Prediction]:
        def change(phase: str, since_s: int, at_s: float, previous: str) -> PhaseChange:
            return PhaseChange(
                ts_ns=int(at_s * NS), job_id="j", node="n0", rank=-1, level="run", phase=phase,
                previous=previous, since_ns=since_s * NS, source="spans", step=1,
            )  # fmt: skip

        t, previous = 0, "warmup"
        for _ in range(6):  # the forecaster learns how long each phase lasts
            for phase, lasts in (("steady", 30), ("stalled", 5)):
                host.phases([change(phase, t, t + 0.5, previous)])
                previous, t = phase, t + lasts
        host.phases([change("stalled", t, t + 1, previous)])
        host.phases([change("steady", t, t + 20, "stalled")])
        out = host.tick((t + 60) * NS, ["j"]) + host.drain()
        return [p for p in out if p.target == "next_phase_s" and p.state == "predicted"]

    first, again = changes(PredictionHost()), changes(PredictionHost())
    last_two = first[-2:]
    assert [p.summary.split()[0] for p in last_two] == ["stalled", "steady"]
    assert last_two[0].event_id != last_two[1].event_id
    assert len({p.event_id for p in first}) == len(first)
    assert [p.event_id for p in again] == [p.event_id for p in first]  # a restart: same events
