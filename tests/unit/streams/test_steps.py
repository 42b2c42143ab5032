"""StepAnalysis on simulated jobs (in-process, simulated wall clock) and on hand-made batches."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from perfloop.exceptions import ConfigError
from perfloop.schemas import JobLifecycle, decode_batch
from perfloop.schemas.codec import Batch, encode_batch
from perfloop.streams.steps import DERIVED_METRICS, METRIC_COLUMNS, StepAnalysis, StepRecord
from tests.helpers import SIM_T0, simulate

T0 = SIM_T0
MS = 1_000_000
TICK_NS = 250 * MS
DELAY_NS = 50 * MS  # a message is received this long after its newest sample


def feed(component: Any, messages: list[Any], *, end_pad_ns: int = 30 * 10**9) -> list[Any]:
    """Feed messages as the engine would, ticking every 250 ms of simulated wall time."""
    outputs: list[Any] = []
    wall = next_tick = 0
    for m in messages:
        ts = int(m.columns["ts_ns"].max()) if isinstance(m, Batch) else m.ts_ns
        wall = max(wall, ts + DELAY_NS)
        if not next_tick:
            next_tick = wall
        while next_tick <= wall:
            outputs.append(component.tick(next_tick))
            next_tick += TICK_NS
        if isinstance(m, Batch):
            component.observe(m, wall)
        else:
            component.observe_event(m, wall)
    outputs.append(component.tick(wall + end_pad_ns))
    return outputs


def concat(outputs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {c: np.concatenate([o[c] for o in outputs]) for c in METRIC_COLUMNS}


def records(sa: StepAnalysis, job_id: str) -> dict[int, StepRecord]:
    return {r.step: r for r in sa.recent(job_id)}


# --- simulated jobs ------------------------------------------------------------------------------


def test_the_straggling_rank_arrives_last_and_scores_high_only_while_it_straggles() -> None:
    cfg, msgs = simulate("straggler", 60.0, nodes=2)
    [fault] = cfg.faults
    [culprit] = fault.ranks
    sa = StepAnalysis(recent_steps=1000)
    metrics = concat(feed(sa, msgs))
    recs = sorted(sa.recent(cfg.job_id), key=lambda r: r.step)
    assert len(recs) > 400 and all(len(r.ranks) == cfg.world for r in recs)
    start = [int(r.end_ns.min() - r.step_ms.max() * MS) for r in recs]
    during = [r for r, s in zip(recs, start, strict=True) if fault.active((s - T0) / 1e9)]
    before = [r for r, s in zip(recs, start, strict=True) if (s - T0) / 1e9 < fault.onset_s]
    assert len(during) > 100 and len(before) > 100
    assert np.mean([r.slowest_rank == culprit for r in during]) > 0.97
    # Its lateness is the compute it adds: (factor - 1) x (forward + backward + optimizer).
    extra = (fault.strength - 1) * (cfg.forward_ms + cfg.backward_ms + cfg.optimizer_ms)
    late = np.median([r.lateness_ms[list(r.ranks).index(culprit)] for r in during])
    assert late == pytest.approx(extra, rel=0.1)
    # Scores: the straggler saturates during the fault; nobody scores before it.
    ranks = metrics["rank"]
    score = metrics["metric"] == "straggler_score"
    ts = metrics["ts_ns"]
    in_fault = (ts - T0) / 1e9 > fault.onset_s + 5
    in_fault &= (ts - T0) / 1e9 < fault.end_s
    healthy = (ts - T0) / 1e9 < fault.onset_s
    assert metrics["value"][score & in_fault & (ranks == culprit)].min() > 0.9
    assert metrics["value"][score & in_fault & (ranks != culprit)].max() < 0.1
    assert metrics["value"][score & healthy].max() < 0.15


def test_phase_shares_come_from_the_spans_and_no_gpu_figures_without_kernel_summaries() -> None:
    cfg, msgs = simulate("dataloader_starvation", 30.0)
    sa = StepAnalysis(recent_steps=1000)
    metrics = concat(feed(sa, msgs))
    step_rows = {
        (int(r), int(s)): (t, w)
        for b in msgs
        if isinstance(b, Batch) and b.kind == "step"
        for r, s, t, w in zip(
            b.columns["rank"],
            b.columns["step"],
            b.columns["step_time_ms"],
            b.columns["data_wait_ms"],
            strict=True,
        )
    }
    recs = sa.recent(cfg.job_id)
    assert len(recs) == len({s for _, s in step_rows})
    for rec in recs:
        for i, rank in enumerate(rec.ranks.tolist()):
            step_ms, wait_ms = step_rows[rank, rec.step]
            assert rec.step_ms[i] == step_ms
            # the spans tile the step: the five phases add up to the step time ...
            assert np.nansum(rec.phase_ms[i]) == pytest.approx(step_ms, abs=0.01)
            # ... and the data-wait span is what the step event reported
            assert rec.phase_share("data_wait")[i] == pytest.approx(wait_ms / step_ms, abs=1e-3)
            assert np.isnan(rec.busy_ms[i]) and np.isnan(rec.idle_ms[i])
    names = set(metrics["metric"])
    assert {"data_wait_share", "comm_share", "collective_ms", "straggler_score"} <= names
    assert not names & {"gpu_busy_ms", "gpu_idle_ms", "idle_share"}
    assert names <= set(DERIVED_METRICS)
    # the starved node waits for data: its share rises with the fault
    [fault] = cfg.faults
    wait = metrics["metric"] == "data_wait_share"
    t = (metrics["ts_ns"] - T0) / 1e9
    assert np.median(metrics["value"][wait & (t > fault.onset_s + 2) & (t < fault.end_s)]) > 0.3
    assert np.median(metrics["value"][wait & (t < fault.onset_s)]) < 0.05


def test_steps_complete_at_the_first_tick_once_every_part_is_in() -> None:
    cfg, msgs = simulate("healthy", 10.0)
    sa = StepAnalysis(settle_s=5.0, recent_steps=1000)
    lag = []
    wall = 0
    for m in msgs:
        if not isinstance(m, Batch):
            continue
        wall = max(wall, int(m.columns["ts_ns"].max()) + DELAY_NS)
        sa.observe(m, wall)
        out = sa.tick(wall)
        lag.extend((wall - out["ts_ns"]) / 1e6)
    # After a rank's first step, the kinds it sends are known: no settle wait (5 s here).
    assert len(lag) > 1000 and np.percentile(lag, 99) < 1000
    assert len(sa.recent(cfg.job_id)) >= 80


def test_memory_stays_bounded_over_a_long_run() -> None:
    cfg, msgs = simulate("healthy", 120.0, ranks_per_node=2)
    sa = StepAnalysis(recent_steps=16, max_open_steps=8, straggler_window=5)
    feed(sa, msgs)
    job = sa._jobs[cfg.job_id]
    assert len(sa.recent(cfg.job_id)) == 16
    assert job.slot_step.shape == (8,) and job.hist.shape == (5, 2)
    assert sa.recent(cfg.job_id)[-1].step > 900


# --- hand-made batches ----------------------------------------------------------------------


def _batch(kind: str, job_id: str = "j", node: str = "n0", **cols: Any) -> Batch:
    return decode_batch(encode_batch(kind, cols, job_id=job_id, node=node))


def _steps(step: int, ranks: list[int], ends_ms: list[float], dur_ms: float = 100.0) -> Batch:
    return _batch(
        "step",
        ts_ns=[T0 + int(e * MS) for e in ends_ms],
        rank=ranks,
        step=[step] * len(ranks),
        step_time_ms=[dur_ms] * len(ranks),
    )


def test_a_missing_rank_times_out_and_is_named() -> None:
    sa = StepAnalysis(timeout_s=2.0)
    for s in range(3):
        sa.observe(_steps(s, [0, 1, 2], [100.0 * s] * 3), T0 + s * 100 * MS)
    sa.observe(_steps(3, [0, 1], [300.0, 300.0]), T0 + 300 * MS)
    sa.tick(T0 + 2 * 10**9)  # settled, but rank 2 is expected
    assert [r.step for r in sa.recent("j")] == [0, 1, 2]
    sa.tick(T0 + 3 * 10**9)
    last = sa.recent("j")[-1]
    assert last.step == 3 and last.missing_ranks == (2,) and last.ranks.tolist() == [0, 1]


def test_streams_without_the_union_row_give_no_idle() -> None:
    sa = StepAnalysis(settle_s=0.0)
    sa.observe(_steps(1, [0], [100.0]), T0)
    k = _batch(
        "kernel",
        ts_ns=[T0] * 2,
        rank=[0, 0],
        step=[1, 1],
        stream=[7, 9],
        kernel_class=["all", "all"],
        count=[3, 4],
        busy_ms=[70.0, 60.0],
    )
    sa.observe(k, T0)
    sa.tick(T0 + 1)
    [rec] = sa.recent("j")
    # two overlapping streams: their sum (130 ms) exceeds the 100-ms step; it is no union
    assert rec.busy_streams_sum_ms.tolist() == [130.0]
    assert np.isnan(rec.busy_ms[0]) and np.isnan(rec.idle_ms[0])


def test_late_rows_for_a_completed_step_are_counted_not_applied() -> None:
    sa = StepAnalysis(settle_s=0.0)
    sa.observe(_steps(5, [0, 1], [100.0, 110.0]), T0)
    sa.tick(T0 + 1)
    sa.observe(_steps(5, [0, 1], [100.0, 150.0]), T0 + 2)
    assert sa.tick(T0 + 3)["value"].size == 0
    assert sa.late_rows == 2 and len(sa.recent("j")) == 1


def test_a_finished_job_completes_its_steps_and_is_forgotten() -> None:
    sa = StepAnalysis(forget_s=5.0)
    sa.observe(_steps(1, [0, 1], [100.0, 100.0]), T0)
    end = JobLifecycle(ts_ns=T0, job_id="j", node="n0", rank=-1, state="finished", exit_code=0)
    sa.observe_event(end, T0 + 1)
    assert len(sa.tick(T0 + 2)["value"]) > 0  # no settle wait once the job ended
    assert sa.recent("j")
    sa.tick(T0 + 6 * 10**9)
    assert sa.recent("j") == [] and sa.scores("j") == {}


def test_a_smaller_ring_keeps_the_open_steps_it_can_hold() -> None:
    cfg, msgs = simulate("healthy", 20.0)
    whole = StepAnalysis(recent_steps=1000)
    feed(whole, msgs)
    sa = StepAnalysis(recent_steps=1000)
    half = len(msgs) // 2
    feed(sa, msgs[:half], end_pad_ns=0)
    assert sa.configure("steps.max_open_steps", 4) == (64, 4)
    feed(sa, msgs[half:])
    assert sa._jobs[cfg.job_id].slot_step.shape == (4,)
    assert sa.late_rows == sa.dropped_steps == 0
    got = {r.step: r.step_ms.tolist() for r in sa.recent(cfg.job_id)}
    assert got == {r.step: r.step_ms.tolist() for r in whole.recent(cfg.job_id)}


def test_configure_changes_settings_and_rejects_bad_ones() -> None:
    sa = StepAnalysis()
    assert sa.configure("steps.straggler_full_share", 0.3) == (0.2, 0.3)
    assert sa.configure("steps.straggler_window", 10) == (20, 10)
    with pytest.raises(ConfigError, match=r"unknown step analysis setting 'steps\.nope'"):
        sa.configure("steps.nope", 1)
    with pytest.raises(ConfigError, match=r"steps\.timeout_s must be a number in"):
        sa.configure("steps.timeout_s", -1)
    with pytest.raises(ConfigError, match=r"steps\.recent_steps must be an integer"):
        sa.configure("steps.recent_steps", 2.5)
    with pytest.raises(ConfigError):
        sa.configure("steps.settle_s", True)
    assert sa.straggler_full_share == 0.3 and sa.timeout_s == 10.0


def test_snapshot_and_restore_continue_exactly() -> None:
    cfg, msgs = simulate("straggler", 30.0)
    half = len(msgs) // 2
    a = StepAnalysis()
    out_a = feed(a, msgs)
    b = StepAnalysis()
    out_b = feed(b, msgs[:half], end_pad_ns=0)
    state = pickle.loads(pickle.dumps(b.snapshot()))
    c = StepAnalysis()
    c.restore(state)
    last_wall = max(int(m.columns["ts_ns"].max()) for m in msgs[:half] if isinstance(m, Batch))
    out_c = feed(c, msgs[half:])
    assert last_wall > 0
    got = concat(out_b + out_c)
    want = concat(out_a)
    for col in ("rank", "step", "metric", "value"):
        assert sorted(map(str, got[col])) == sorted(map(str, want[col])), col
    assert c.scores(cfg.job_id) == pytest.approx(a.scores(cfg.job_id))


def test_a_batch_of_more_steps_than_the_ring_holds_completes_every_step() -> None:
    # A backlog or a producer that batches long: 400 steps of 2 ranks in one batch, against a
    # ring of 64 open steps. Every step completes with its data (it used to complete 64 and
    # drop the rest: their slots were taken before their rows were written).
    n = 400
    steps = {
        "ts_ns": [T0 + i * 100 * MS + r * MS for i in range(n) for r in (0, 1)],
        "rank": [r for _ in range(n) for r in (0, 1)],
        "step": [i for i in range(n) for _ in (0, 1)],
        "step_time_ms": [100.0 + (i % 3) for i in range(n) for _ in (0, 1)],
    }
    sa = StepAnalysis(max_open_steps=64)
    wall = T0 + n * 100 * MS
    sa.observe(decode_batch(encode_batch("step", steps, job_id="j", node="n")), wall)
    sa.tick(wall + 60 * 10**9)
    done = sa.last_done
    assert sorted(r.step for r in done) == list(range(n))
    assert sa.dropped_steps == 0 and sa.late_rows == 0
    assert all(list(r.step_ms) == [100.0 + (r.step % 3)] * 2 for r in done)


@pytest.mark.parametrize(("name", "late_ms"), [("comm", 30.0), ("recv", 0.0)])
def test_a_pipelines_receives_are_no_lateness(name: str, late_ms: float) -> None:
    # Rank 1 spends 30 ms of the step blocked in communication, rank 0 none. In a collective
    # that makes rank 0 the one rank 1 waited for, 30 ms late; in a pipeline's receive it is
    # the stage waiting out its bubble, and nobody is late.
    sa = StepAnalysis(settle_s=0.0)
    sa.observe(_steps(1, [0, 1], [100.0, 100.0]), T0)
    phases = [("forward", 40.0), ("backward", 60.0), ("forward", 30.0), ("comm", 30.0)]
    phases += [("backward", 40.0)]
    sa.observe(
        _batch(
            "span",
            ts_ns=[T0] * 5,
            rank=[0, 0, 1, 1, 1],
            step=[1] * 5,
            phase=[p for p, _ in phases],
            name=[name if p == "comm" else p for p, _ in phases],
            duration_ms=[ms for _, ms in phases],
        ),
        T0,
    )
    sa.tick(T0 + 1)
    [rec] = sa.recent("j")
    early, late = sorted(rec.lateness_ms.tolist())  # (each against the median rank's arrival)
    assert late - early == pytest.approx(late_ms, abs=0.01)
