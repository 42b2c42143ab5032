"""The Funnel as a stream-engine component: diagnosis lifecycle (open / update / resolved,
stable ids, update rate), explanations, live settings, snapshots and bounded state."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from perfloop.evaluation import RunSpec, run_scenario
from perfloop.exceptions import ConfigError
from perfloop.schemas import Diagnosis, GroundTruth, JobLifecycle, decode_event, encode_event
from perfloop.schemas.analysis import BOTTLENECKS
from perfloop.schemas.codec import Batch
from perfloop.streams.funnel import EXPLAINS, LOOPS, DetectConfig, Funnel, actionable

MS = 1_000_000
S = 1_000_000_000


def _messages(spec: RunSpec) -> tuple[list[tuple[int, Any]], int]:
    """The decoded messages of a simulated run with their arrival times (as the evaluation
    delivers them), captured by replaying through a recording funnel."""
    got: list[tuple[int, Any]] = []

    class Record(Funnel):
        def observe(self, batch: Batch, wall_ns: int) -> None:
            got.append((wall_ns, batch))

        def observe_event(self, event: Any, wall_ns: int) -> None:
            got.append((wall_ns, event))

    import perfloop.evaluation as ev

    real = ev.Funnel
    ev.Funnel = Record  # type: ignore[misc]
    try:
        res = run_scenario(spec)
    finally:
        ev.Funnel = real  # type: ignore[misc]
    return got, res.world


def _feed(f: Funnel, items: list[tuple[int, Any]], next_tick: int) -> tuple[list[Diagnosis], int]:
    out: list[Diagnosis] = []
    for wall, item in items:
        while next_tick <= wall:
            out += f.tick(next_tick)
            next_tick += 250 * MS
        if isinstance(item, Batch):
            f.observe(item, wall)
        else:
            f.observe_event(item, wall)
    return out, next_tick


def _strip(ds: list[Diagnosis]) -> list[dict[str, Any]]:
    return [d.model_dump(exclude={"event_id"}) for d in ds]


@pytest.fixture(scope="module")
def thermal() -> list[tuple[int, Any]]:
    return _messages(RunSpec("thermal_throttle", 3, 1, 4, duration_s=30.0))[0]


def test_every_diagnosis_is_well_formed_and_ids_are_stable(thermal: list) -> None:
    out, _ = _feed(Funnel(), thermal, thermal[0][0])
    out += Funnel().tick(0)  # a fresh funnel has nothing to say
    assert out
    by_id: dict[str, list[Diagnosis]] = {}
    for d in out:
        assert decode_event(encode_event(d)) == d
        assert BOTTLENECKS[d.bottleneck] == d.level and d.loop == LOOPS.get(d.bottleneck, "inner")
        by_id.setdefault(d.diagnosis_id, []).append(d)
    for ds in by_id.values():
        states = [d.state for d in ds]
        assert states[0] == "open" and states.count("open") == 1
        assert "resolved" not in states[:-1]
        assert len({(d.bottleneck, d.rank) for d in ds}) == 1
        assert all(d.onset_ns == ds[0].onset_ns for d in ds)
        assert all(d.onset_ns <= d.ts_ns for d in ds)


def test_updates_come_at_most_every_update_s(thermal: list) -> None:
    for update_s in (2.0, 10.0):
        f = Funnel(DetectConfig().replace_key("funnel.update_s", update_s))
        out, _ = _feed(f, thermal, thermal[0][0])
        last: dict[str, tuple[int, str, bool]] = {}
        updates = 0
        for d in out:
            prev = last.get(d.diagnosis_id)
            if d.state == "update" and prev is not None:
                updates += 1
                changed = (d.explained_by, d.critical_path) != prev[1:]
                assert changed or d.ts_ns - prev[0] >= update_s * S
            last[d.diagnosis_id] = (d.ts_ns, d.explained_by, d.critical_path)
        assert updates > 0


def test_job_end_resolves_everything_and_later_data_is_ignored(thermal: list) -> None:
    f = Funnel()
    out, tick = _feed(f, thermal, thermal[0][0])
    out += f.tick(tick)
    tick += 250 * MS
    open_ids = {d.diagnosis_id for d in out if d.state == "open"}
    resolved = {d.diagnosis_id for d in out if d.state == "resolved"}
    assert open_ids and open_ids == resolved, "the simulated job ends: nothing stays open"
    late = [(w + 10 * S, b) for w, b in thermal if isinstance(b, Batch)][:200]
    again, _ = _feed(f, late, tick)
    assert again == [] and f.snapshot()["jobs"] == {}


def test_ground_truth_is_not_an_input(thermal: list) -> None:
    with_gt, _ = _feed(Funnel(), thermal, thermal[0][0])
    without = [(w, m) for w, m in thermal if not isinstance(m, GroundTruth)]
    assert len(without) < len(thermal)
    without_gt, _ = _feed(Funnel(), without, thermal[0][0])
    assert _strip(with_gt) == _strip(without_gt)


def test_snapshot_restore_continues_exactly(thermal: list) -> None:
    cut = len(thermal) // 2
    whole, _ = _feed(Funnel(), thermal, thermal[0][0])
    f = Funnel()
    first, tick = _feed(f, thermal[:cut], thermal[0][0])
    g = Funnel()
    g.restore(pickle.loads(pickle.dumps(f.snapshot())))
    rest, _ = _feed(g, thermal[cut:], tick)
    assert _strip(first + rest) == _strip(whole)


def test_configure_changes_detection_live() -> None:
    f = Funnel()
    assert f.configure("detect.straggler.score_threshold", 0.5) == (0.12, 0.5)
    assert f.configure("detect.hang.enabled", False) == (True, False)
    assert f.configure("detect.straggler.persist_steps", 5.0) == (3, 5)
    assert f.config.straggler.persist_steps == 5
    items, _ = _messages(RunSpec("straggler", 2, 1, 4, duration_s=30.0))
    out, _ = _feed(f, items, items[0][0])
    assert not [d for d in out if d.bottleneck == "straggler"], "the straggler's score is < 0.5"
    out, _ = _feed(Funnel(), items, items[0][0])
    assert [d for d in out if d.bottleneck == "straggler" and d.state == "open"]


@pytest.mark.parametrize("scenario", ["thermal_throttle", "straggler", "dataloader_starvation"])
def test_detectors_run_again_only_on_new_input_and_find_the_same(
    scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step and device detectors are skipped at a tick with nothing new for the job (no
    batch, no event, the same settings): the diagnoses are those of running them every tick."""
    import perfloop.streams.funnel as funnel_mod

    items, _ = _messages(RunSpec(scenario, 5, 1, 4, duration_s=30.0))
    # delivered in bursts, 3 s of input at a time (a producer that batches, a backlog read):
    # most ticks then have nothing new
    t0 = items[0][0]
    items = [(t0 + (w - t0) // (3 * 10**9 + 1) * 3 * 10**9 + 3 * 10**9, it) for w, it in items]

    class EveryTick(Funnel):
        def tick(self, wall_ns: int, jobs: Any = None) -> list[Diagnosis]:
            for job in self._jobs.values():
                job.evaluated = None
            return super().tick(wall_ns, jobs)

    runs = [0]
    real = funnel_mod.step_detectors

    def counted(job: Any, cfg: Any) -> None:
        runs[0] += 1
        real(job, cfg)

    every, _ = _feed(EveryTick(), items, items[0][0])
    monkeypatch.setattr(funnel_mod, "step_detectors", counted)
    ticks = [0]

    class Counted(Funnel):
        def tick(self, wall_ns: int, jobs: Any = None) -> list[Diagnosis]:
            ticks[0] += len(self._jobs)
            return super().tick(wall_ns, jobs)

    skipping, _ = _feed(Counted(), items, items[0][0])
    assert every and _strip(skipping) == _strip(every)
    assert 0 < runs[0] < ticks[0] / 2, (runs, ticks)


def test_a_setting_for_one_job_applies_to_that_job_alone() -> None:
    items, _ = _messages(RunSpec("straggler", 2, 1, 4, duration_s=30.0))
    job = items[0][1].job_id

    def stragglers(f: Funnel) -> list[Diagnosis]:
        out, _ = _feed(f, items, items[0][0])
        return [d for d in out if d.bottleneck == "straggler" and d.state == "open"]

    mine = Funnel()
    assert mine.configure("detect.straggler.score_threshold", 0.5, job=job) == (0.12, 0.5)
    # a later change for every job leaves the job's own value as it is
    assert mine.configure("detect.straggler.score_threshold", 0.3) == (0.12, 0.3)
    assert mine.config_for(job).straggler.score_threshold == 0.5
    assert mine.config_for("another").straggler.score_threshold == 0.3
    restored = Funnel()
    restored.restore(pickle.loads(pickle.dumps(mine.snapshot())))
    assert restored.config_for(job).straggler.score_threshold == 0.5
    assert not stragglers(restored), "the straggler's score is < 0.5 for this job"
    other = Funnel()
    other.configure("detect.straggler.score_threshold", 0.5, job="another-job")
    assert stragglers(other), "another job's setting changes nothing here"
    with pytest.raises(ConfigError, match="must be in"):
        mine.configure("detect.straggler.score_threshold", 2.0, job=job)
    assert mine.config_for(job).straggler.score_threshold == 0.5


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("straggler.score_threshold", 0.5, "start with detect."),
        ("detect.nope.x", 1, "valid detectors"),
        ("detect.straggler.nope", 1, "valid: baseline_steps, clear_steps"),
        ("detect.straggler.score_threshold", 2.0, "must be in [0.01, 0.99], got 2.0"),
        ("detect.straggler.score_threshold", "high", "must be a number"),
        ("detect.straggler.persist_steps", 2.5, "whole number"),
        ("detect.hang.enabled", 1, "true or false"),
        ("detect.hang.k", float("nan"), "must be in"),
    ],
)
def test_configure_refuses_bad_settings(key: str, value: Any, message: str) -> None:
    f = Funnel()
    before = f.config
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        f.configure(key, value)
    assert f.config == before


def test_config_round_trips_through_a_dict() -> None:
    cfg = DetectConfig().replace_key("comm.ratio_threshold", 1.8)
    assert DetectConfig.from_dict(cfg.to_dict()) == cfg


def test_explanations_form_a_hierarchy() -> None:
    for cause, symptoms in EXPLAINS.items():
        assert cause in BOTTLENECKS
        for symptom, scope in symptoms.items():
            assert symptom in BOTTLENECKS and scope in ("job", "ranks", "nodes", "whole_nodes")

    # no cycles: a symptom never explains its cause, directly or not
    def reach(a: str, seen: set[str]) -> set[str]:
        for b in EXPLAINS.get(a, {}):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    for cause in EXPLAINS:
        assert cause not in reach(cause, set())
    assert set(LOOPS) <= set(BOTTLENECKS)


def test_actionable_keeps_root_critical_open_diagnoses() -> None:
    base = dict(
        ts_ns=2, job_id="j", node="n", rank=-1, bottleneck="hang", level="cluster_health",
        loop="product", onset_ns=1, step_share=1.0, confidence=0.9,
    )  # fmt: skip
    ds = [
        Diagnosis(diagnosis_id="a", state="open", critical_path=True, **base),
        Diagnosis(diagnosis_id="b", state="update", critical_path=True, **base),
        Diagnosis(diagnosis_id="c", state="resolved", critical_path=True, **base),
        Diagnosis(diagnosis_id="d", state="open", critical_path=False, **base),
        Diagnosis(diagnosis_id="e", state="open", critical_path=True, explained_by="x", **base),
    ]
    assert [d.diagnosis_id for d in actionable(ds)] == ["a", "b"]


def test_a_silent_job_is_forgotten() -> None:
    f = Funnel(DetectConfig().replace_key("funnel.idle_job_s", 10.0))
    ev = JobLifecycle(ts_ns=S, job_id="j", node="n0", rank=0, state="running")
    f.observe_event(ev, S)
    items, _ = _messages(RunSpec("healthy", 1, 1, 2, duration_s=5.0))
    for wall, item in items:
        if isinstance(item, Batch):
            f.observe(item, wall)
    f.tick(items[-1][0])
    assert list(f.snapshot()["jobs"])
    f.tick(items[-1][0] + 11 * S)
    assert f.snapshot()["jobs"] == {}
