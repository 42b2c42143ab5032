"""The evaluation harness: its matching rules on hand-made runs, and the acceptance check —
precision and recall ≥ 0.9 and median latency ≤ 2 s per fault kind on simulated jobs, on seeds
never tuned on. The same check on the tuning matrix (three shapes, the ten tuning seeds, ~3.5 min)
is `python bench/detection.py --seeds 0:10 --check`."""

from __future__ import annotations

from typing import Any

from bench.detection import missed_targets
from perfloop.evaluation import (
    SCENARIOS,
    RunResult,
    RunSpec,
    evaluate,
    format_table,
    score,
)
from perfloop.schemas import Diagnosis, GroundTruth
from perfloop.schemas.job import FAULT_KINDS

S = 1_000_000_000
T = 1_700_000_000 * S


def gt(fault: str, onset_s: float, end_s: float = 0.0, ranks: tuple[int, ...] = (1,)) -> Any:
    return GroundTruth(
        ts_ns=T + int(onset_s * S), job_id="j", node="n", rank=-1, scenario="x", fault=fault,
        onset_ns=T + int(onset_s * S), end_ns=T + int(end_s * S) if end_s else 0,
        ranks=list(ranks),
    )  # fmt: skip


def diag(kind: str, at_s: float, *, ranks: tuple[int, ...] = (1,), **kw: Any) -> Diagnosis:
    fields: dict[str, Any] = dict(
        ts_ns=T + int(at_s * S), job_id="j", node="n", rank=-1, diagnosis_id=f"{kind}{at_s}",
        bottleneck=kind, level="network", loop="training", state="open", onset_ns=T,
        step_share=0.3, confidence=0.9, critical_path=True, ranks=list(ranks),
    )  # fmt: skip
    fields.update(kw)
    return Diagnosis(**fields)


def run(truth: list[Any], diags: list[Diagnosis], *, end_s: float = 60.0, world: int = 4) -> Any:
    return RunResult(RunSpec("x", 0), truth, diags, world, T + int(end_s * S))


def test_a_diagnosis_matches_while_its_fault_is_active() -> None:
    faults = [gt("straggler", 10, 20)]
    for at, hit in [(8.9, False), (9.1, True), (15, True), (21.9, True), (22.1, False)]:
        kinds, _ = score([run(faults, [diag("straggler", at)])])
        s = kinds["straggler"]
        assert (s.matched, s.detected, s.diagnoses) == (int(hit), int(hit), 1), at
        assert s.precision == (1.0 if hit else 0.0)
        assert s.recall == (1.0 if hit else 0.0)


def test_a_fault_that_lasts_to_the_end_is_active_until_the_run_ends() -> None:
    faults = [gt("hang", 30)]
    kinds, _ = score([run(faults, [diag("hang", 51.5)], end_s=50)])
    assert kinds["hang"].matched == 1
    kinds, _ = score([run(faults, [diag("hang", 52.5)], end_s=50)])
    assert kinds["hang"].matched == 0


def test_precision_counts_healthy_runs_wrong_kinds_and_duplicates() -> None:
    runs = [
        run([gt("straggler", 10, 20)], [diag("straggler", 11), diag("straggler", 12)]),
        run([], [diag("straggler", 11)]),  # a healthy run
        run([gt("hang", 10)], [diag("straggler", 11)]),  # right time, wrong kind
    ]
    kinds, _ = score(runs)
    s = kinds["straggler"]
    assert (s.faults, s.detected, s.diagnoses, s.matched, s.duplicates) == (1, 1, 4, 2, 1)
    assert s.precision == 0.5 and s.recall == 1.0
    assert s.latencies_s == [1.0], "latency from the first match"
    assert kinds["hang"].recall == 0.0
    assert s.false_alarms == ["eval-x-1x4-s0", "eval-x-1x4-s0"]


def test_explained_diagnoses_are_neither_hits_nor_false_alarms() -> None:
    runs = [run([gt("straggler", 10, 20)], [diag("straggler", 11, explained_by="hang")])]
    kinds, _ = score(runs)
    assert (kinds["straggler"].diagnoses, kinds["straggler"].detected) == (0, 0)
    runs = [run([], [diag("straggler", 11, explained_by="thermal_throttle")])]
    assert score(runs)[0]["straggler"].diagnoses == 0


def test_only_openings_count() -> None:
    runs = [run([gt("straggler", 10, 20)], [diag("straggler", 11, state="update")])]
    assert score(runs)[0]["straggler"].diagnoses == 0


def test_rank_attribution() -> None:
    faults = [gt("straggler", 10, 20, ranks=(1,))]
    cases = [((1,), 1, 1), ((1, 2), 1, 0), ((2,), 0, 0), ((), 1, 0)]  # () = every rank
    for ranks, overlap, exact in cases:
        s = score([run(faults, [diag("straggler", 11, ranks=ranks)])])[0]["straggler"]
        assert (s.matched, s.overlap, s.exact) == (1, overlap, exact), ranks
    s = score([run([gt("comm_degradation", 5, 9, ranks=(0, 1, 2, 3))],
                   [diag("comm_degradation", 6, ranks=())])])[0]["comm_degradation"]  # fmt: skip
    assert (s.overlap, s.exact) == (1, 1), "a job-wide fault named job-wide is exact"


def test_other_kinds_are_reported_apart() -> None:
    runs = [run([], [diag("exposed_comm", 3), diag("compute_bound", 4, critical_path=False)])]
    kinds, others = score(runs)
    assert others == {
        "exposed_comm": {"root": 1, "critical_path": 1},
        "compute_bound": {"root": 1, "critical_path": 0},
    }
    assert all(k.diagnoses == 0 for k in kinds.values())
    table = format_table(kinds, others)
    assert all(k in table for k in FAULT_KINDS) and "exposed_comm 1" in table


def _acceptance(seeds: tuple[int, ...], shapes: tuple[tuple[int, int], ...], dur: float) -> None:
    kinds, others = score(evaluate(SCENARIOS, seeds, shapes, duration_s=dur))
    print(format_table(kinds, others))
    assert all(kinds[k].faults > 0 for k in FAULT_KINDS)
    assert missed_targets(kinds, others) == []


def test_acceptance_on_a_reduced_matrix() -> None:
    """Every scenario on two shapes and two seeds outside the tuning and reporting sets."""
    _acceptance((200, 201), ((1, 4), (2, 4)), 30.0)


def test_the_check_can_fail() -> None:
    """A blind detector scores zero recall, a trigger-happy one loses precision."""
    from perfloop.streams.funnel import DetectConfig

    blind = DetectConfig().replace_key("straggler.enabled", False)
    kinds, others = score(evaluate(["straggler"], (200,), ((1, 4),), duration_s=30.0, config=blind))
    assert kinds["straggler"].recall == 0.0
    missed = missed_targets(kinds, others)  # the bench's --check says so, and what else is off
    assert any(m.startswith("straggler: recall 0.000 < 0.9") for m in missed), missed
    assert any(m.startswith("hang: no fault of this kind") for m in missed), missed
    eager = DetectConfig()
    for key, value in (
        ("straggler.score_threshold", 0.01),
        ("straggler.median_steps", 1),
        ("straggler.max_persist_s", 0.0),
        ("straggler.persist_s", 0.0),
        ("straggler.warmup_steps", 0),
    ):
        eager = eager.replace_key(key, value)
    kinds, _ = score(evaluate(["healthy"], (200,), ((2, 4),), duration_s=30.0, config=eager))
    assert kinds["straggler"].diagnoses > 0 and kinds["straggler"].precision == 0.0
