"""PhaseMachine on simulated jobs (in-process, simulated wall clock) and hand-built jobs.

GPU-only classification accuracy is measured against ground truth computed here from the
simulator's phase spans (each GPU sample's label is the phase covering most of the 100 ms NVML
averaged over before it), on a job whose steps (1.8 s) are long enough for 10-Hz sampling to
resolve their phases. The bound asserted (0.9) leaves room under the ~0.98-0.99 measured: about a
quarter of the samples straddle a phase boundary, and a straddling sample whose phases are nearly
even can go either way.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from perfloop.exceptions import ConfigError
from perfloop.producers import _simulator_samples
from perfloop.schemas import JobLifecycle, PhaseChange, decode_batch
from perfloop.schemas.codec import Batch, encode_batch
from perfloop.streams.phases import STEP_PHASES, PhaseMachine
from perfloop.streams.phases._signatures import SignatureLibrary
from tests.helpers import SIM_T0, simulate

T0 = SIM_T0
MS = 1_000_000
S = 1_000_000_000
TICK_NS = 250 * MS
DELAY_NS = 50 * MS
# A job with 1.8-s steps: data wait ~0.5 s, forward 0.4, backward 0.6, comm ~0.15, optimizer 0.15.
LONG_STEPS = {
    "forward_ms": 400.0,
    "backward_ms": 600.0,
    "optimizer_ms": 150.0,
    "model_params": 3_000_000_000,
    "comm_overlap": 0.2,
    "load_ms": 3600.0,
    "nodes": 2,
    "activation_bytes": 8 << 30,
}
# Another GPU's signature (a memory-bound model): not the priors' picture of a step.
OTHER_SIGNATURE = np.array(
    [[5.0, 3.0, 0.10, 0.0], [80.0, 70.0, 0.6, 0.0], [85.0, 75.0, 0.7, 0.3],
     [40.0, 30.0, 0.25, 1.0], [60.0, 92.0, 0.45, 0.0]]
)  # fmt: skip


def feed(
    pm: PhaseMachine, messages: list[Any], *, before: Any = None, end_pad_ns: int = 5 * S
) -> list[PhaseChange]:
    """Feed messages as the engine would, ticking every 250 ms of simulated wall time."""
    events: list[PhaseChange] = []
    wall = next_tick = 0
    for m in messages:
        ts = int(m.columns["ts_ns"].max()) if isinstance(m, Batch) else m.ts_ns
        wall = max(wall, ts + DELAY_NS)
        next_tick = next_tick or -(-wall // TICK_NS) * TICK_NS  # ticks on a fixed grid
        while next_tick <= wall:
            events.extend(pm.tick(next_tick))
            next_tick += TICK_NS
        if isinstance(m, Batch):
            if before is not None:
                before(m)
            pm.observe(m, wall)
        else:
            pm.observe_event(m, wall)
    events.extend(pm.tick(wall + end_pad_ns))
    return events


def run_events(events: list[PhaseChange]) -> list[tuple[str, str, str]]:
    return [(e.phase, e.previous, e.source) for e in events if e.level == "run"]


def without_spans(messages: list[Any]) -> list[Any]:
    return [m for m in messages if not (isinstance(m, Batch) and m.kind == "span")]


def columns(messages: list[Any], kind: str) -> dict[str, np.ndarray]:
    bs = [m for m in messages if isinstance(m, Batch) and m.kind == kind]
    return {c: np.concatenate([b.columns[c] for b in bs]) for c in bs[0].columns}


def span_truth(spans: dict[str, np.ndarray], rank: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Phase code covering most of [ts - 100 ms, ts] for each GPU sample (-1: uncovered)."""
    code = np.array([STEP_PHASES.index(p) for p in spans["phase"]])
    start = spans["ts_ns"]
    end = start + np.rint(spans["duration_ms"] * 1e6).astype(np.int64)
    out = np.full(len(ts), -1)
    for r in np.unique(rank):
        mine = spans["rank"] == r
        order = np.argsort(start[mine])
        s, e, c = start[mine][order], end[mine][order], code[mine][order]
        for i in np.flatnonzero(rank == r):
            lo, hi = ts[i] - 100 * MS, ts[i]
            cover = np.zeros(len(STEP_PHASES))
            a, b = np.searchsorted(e, lo, "right"), np.searchsorted(s, hi, "left")
            for k in range(a, b):
                cover[c[k]] += min(e[k], hi) - max(s[k], lo)
            if cover.sum() >= 50 * MS:
                out[i] = int(cover.argmax())
    return out


# --- run level -----------------------------------------------------------------------------------


def test_a_simulated_job_warms_up_runs_steady_and_finishes() -> None:
    cfg, msgs = simulate("healthy", 30.0)
    pm = PhaseMachine(warmup_min_steps=10, cv_window=8)
    events = feed(pm, msgs)
    runs = [e for e in events if e.level == "run"]
    assert run_events(events) == [
        ("warmup", "", "steps"),
        ("steady", "warmup", "steps"),
        ("finished", "steady", "lifecycle"),
    ]
    warm, steady, done = runs
    assert warm.since_ns == pytest.approx(T0, abs=1 * MS) and warm.step == 0
    # steady from the first step of the first stable window, decided after 10 steps
    assert 0 <= steady.step <= 10 and steady.ts_ns - T0 < 2 * S
    assert warm.next_phase == "steady" and warm.next_ts_ns > warm.since_ns
    assert done.ts_ns - T0 == pytest.approx(30 * S, abs=0.2 * S)
    assert pm.run_phase(cfg.job_id) == "finished"


def _steps_batch(job: str, first: int, ends_ns: list[int], ms: list[float], ranks: int) -> Batch:
    n = len(ends_ns)
    cols = {
        "ts_ns": [e + r * 1000 for e in ends_ns for r in range(ranks)],
        "rank": [r for _ in range(n) for r in range(ranks)],
        "step": [first + i for i in range(n) for _ in range(ranks)],
        "step_time_ms": [m for m in ms for _ in range(ranks)],
    }
    return decode_batch(encode_batch("step", cols, job_id=job, node="n0"))


def test_warmup_lasts_until_the_step_times_settle() -> None:
    # compile and cache warm-up: the first steps take 500 ms and fall to 100 ms by step 20
    ms = [max(100.0, 500.0 - 20.0 * i) for i in range(60)]
    ends = list(np.cumsum(np.array(ms) * MS).astype(np.int64) + T0)
    pm = PhaseMachine(warmup_min_steps=5, cv_window=8, warmup_cv=0.05)
    events = []
    for i in range(0, 60, 2):
        pm.observe(_steps_batch("w", i, ends[i : i + 2], ms[i : i + 2], 2), ends[i + 1])
        events += pm.tick(ends[i + 1])
    steady = [e for e in events if e.phase == "steady"]
    assert len(steady) == 1
    # 8 steps within 5% of their mean: the window starts once the times are down to ~100 ms
    first_flat = next(i for i, m in enumerate(ms) if m == 100.0)
    assert first_flat - 2 <= steady[0].step <= first_flat + 1
    assert steady[0].since_ns == ends[steady[0].step - 1] + 1000  # rank 1 ends 1 µs later


def test_a_hang_stalls_the_run() -> None:
    cfg, msgs = simulate("hang", 40.0)
    [fault] = cfg.faults
    pm = PhaseMachine(min_stall_s=5.0)
    events = feed(pm, msgs)
    assert [p for p, _, _ in run_events(events)] == ["warmup", "steady", "stalled", "finished"]
    stalled = next(e for e in events if e.phase == "stalled")
    onset = T0 + int(fault.onset_s * S)
    assert onset - 150 * MS <= stalled.since_ns <= onset  # progress stopped at the last step
    # the hung GPUs spin at low power: no evaluation or checkpoint is read into the pause
    assert stalled.ts_ns - onset <= 5.5 * S


def _episodic_job(
    *, spans: bool, kinds: tuple[str, ...] = ("eval",), every: int = 50, seed: int = 0
) -> tuple[list[Batch], list[tuple[str, int, int]]]:
    """Two ranks, 100-ms steps; every ``every`` steps an episode of the next kind (2.5-3.5 s)
    with no steps: the GPU busy for an eval, idle for a checkpoint; GPU samples at 10 Hz."""
    rng = np.random.default_rng(seed)
    t, step, out, episodes = T0, 0, [], []
    sig = {
        "step": (95.0, 60.0, 560.0),
        "eval": (90.0, 50.0, 490.0),
        "checkpoint": (3.0, 2.0, 110.0),
    }
    timeline: list[tuple[int, int, str]] = []
    for k in range(9):
        for _ in range(every):
            timeline.append((t, t + 100 * MS, "step"))
            t += 100 * MS
        if k == 8:
            break
        kind = kinds[k % len(kinds)]
        d = int(rng.uniform(2.5, 3.5) * S)
        timeline.append((t, t + d, kind))
        episodes.append((kind, t, t + d))
        t += d
    end = t
    for w0 in range(T0, end, 250 * MS):
        w1 = w0 + 250 * MS
        done = [(a, b, k) for a, b, k in timeline if w0 < b <= w1]
        steps = [(a, b) for a, b, k in done if k == "step"]
        if steps:
            out.append(_steps_batch("e", step, [b for _, b in steps], [100.0] * len(steps), 2))
            step += len(steps)
        eps = [(a, b, k) for a, b, k in done if k != "step"]
        if spans and eps:
            cols = {
                "ts_ns": [a for a, _, _ in eps for _ in range(2)],
                "rank": [r for _ in eps for r in range(2)],
                "step": [step] * (2 * len(eps)),
                "phase": [k for _, _, k in eps for _ in range(2)],
                "name": [k for _, _, k in eps for _ in range(2)],
                "duration_ms": [(b - a) / MS for a, b, _ in eps for _ in range(2)],
            }
            out.append(decode_batch(encode_batch("span", cols, job_id="e", node="n0")))
        ticks = [x for x in range(w0 + 100 * MS, w1 + 1, 100 * MS) if x <= end]
        if not ticks:
            continue
        kind_at = [next(k for a, b, k in timeline if a < x <= b) for x in ticks]
        sm, mem, pw = (np.array([sig[k][j] for k in kind_at for _ in range(2)]) for j in range(3))
        cols = {
            "ts_ns": [x for x in ticks for _ in range(2)],
            "rank": [0, 1] * len(ticks),
            "device": [0, 1] * len(ticks),
            "sm_util_pct": sm.tolist(),
            "mem_util_pct": mem.tolist(),
            "power_w": pw.tolist(),
            "power_limit_w": [700.0] * (2 * len(ticks)),
        }
        out.append(decode_batch(encode_batch("gpu", cols, job_id="e", node="n0")))
    return out, episodes


def test_evaluations_from_spans_and_the_predicted_next_one() -> None:
    msgs, episodes = _episodic_job(spans=True)
    events = feed(PhaseMachine(), msgs)
    evals = [e for e in events if e.level == "run" and e.phase == "eval"]
    backs = [e for e in events if e.level == "run" and e.previous == "eval"]
    assert len(evals) == len(backs) == len(episodes)
    for (_, start, end), ev, back in zip(episodes, evals, backs, strict=True):
        # told by the GPU during the pause (since: the last step's end), or by the spans
        assert abs(ev.since_ns - start) <= 1000 and ev.source in ("gpu", "spans")
        assert back.since_ns == end and back.phase == "steady"
        assert back.duration_ms == pytest.approx((end - start) / MS)
    # after two evaluations the machine predicts the next from their interval (~8 s)
    errors = []
    for back, (_, nxt, _) in zip(backs[1:], episodes[2:], strict=False):
        assert back.next_phase == "eval"
        errors.append(abs(back.next_ts_ns - nxt) / S)
    interval = (episodes[-1][1] - episodes[0][1]) / (len(episodes) - 1) / S
    print(f"next eval predicted within {max(errors):.2f} s (interval {interval:.1f} s)")
    assert max(errors) < 0.15 * interval, errors  # durations vary ±0.5 s around 3 s
    # the eval's own prediction: its end, from the learned length
    assert evals[-1].next_phase == "steady"
    assert abs(evals[-1].next_ts_ns - episodes[-1][2]) < 0.6 * S


def test_evaluations_and_checkpoints_from_gpu_signals_alone() -> None:
    msgs, episodes = _episodic_job(spans=False, kinds=("eval", "checkpoint"))
    events = feed(PhaseMachine(), msgs)
    runs = [e for e in events if e.level == "run" and e.phase in ("eval", "checkpoint")]
    assert [(e.phase, e.source) for e in runs] == [(k, "gpu") for k, _, _ in episodes]
    for e, (_, start, _) in zip(runs, episodes, strict=True):
        assert abs(e.since_ns - start) <= 1000  # the last step's end (rank 1 ends 1 µs later)
        assert e.ts_ns - start <= 2.6 * S  # told within the pause: 2 s + a tick or two
    backs = [e for e in events if e.level == "run" and e.previous in ("eval", "checkpoint")]
    assert [b.phase for b in backs] == ["steady"] * len(episodes)
    assert not [e for e in events if e.phase == "stalled"]


# --- step level ----------------------------------------------------------------------------------


def test_the_dominant_step_phase_follows_a_starving_data_loader() -> None:
    cfg, msgs = simulate("dataloader_starvation", 60.0)
    [fault] = cfg.faults
    pm = PhaseMachine()
    events = feed(pm, msgs)
    steps = [e for e in events if e.level == "step"]
    assert [(e.phase, e.source) for e in steps] == [
        ("backward", "spans"),
        ("data_wait", "spans"),
        ("backward", "spans"),
    ]
    onset, end = T0 + int(fault.onset_s * S), T0 + int(fault.end_s * S)
    assert onset < steps[1].ts_ns < onset + 8 * S
    assert end < steps[2].ts_ns < end + 8 * S
    assert steps[2].duration_ms == pytest.approx((steps[2].ts_ns - steps[1].ts_ns) / MS)
    assert all(e.next_phase in STEP_PHASES and e.next_ts_ns >= e.ts_ns for e in steps)


def test_event_rate_stays_bounded_for_a_bigger_job() -> None:
    _cfg, msgs = simulate("mixed", 60.0, nodes=2, ranks_per_node=8)
    pm = PhaseMachine()
    events = feed(pm, msgs)
    samples = sum(len(m) for m in msgs if isinstance(m, Batch))
    steps = [e for e in events if e.level == "step"]
    assert samples > 40_000
    assert len(steps) <= 60 / pm.step_emit_s  # the per-job bound
    assert len(events) <= 12
    for e in events:
        assert PhaseChange.model_validate(e.model_dump()) == e


def _classify_job(messages: list[Any]) -> tuple[PhaseMachine, list[np.ndarray], list[Batch]]:
    pm = PhaseMachine()
    predicted: list[np.ndarray] = []
    gpu: list[Batch] = []

    def before(b: Batch) -> None:  # classify each sample before the machine learns from it
        if b.kind == "gpu":
            predicted.append(pm.classify(b)[0])
            gpu.append(b)

    feed(pm, messages, before=before)
    return pm, predicted, gpu


def _accuracy(
    msgs: list[Any], predicted: list[np.ndarray], gpu: list[Batch], after_s: float = 0.0
) -> float:
    """Share of GPU samples (later than ``after_s``) whose predicted phase is the truth."""
    ts = np.concatenate([b.columns["ts_ns"] for b in gpu])
    truth = span_truth(columns(msgs, "span"), np.concatenate([b.columns["rank"] for b in gpu]), ts)
    names = np.concatenate(predicted)
    ok = (truth >= 0) & (ts >= T0 + after_s * S)
    return float((names[ok] == np.asarray(STEP_PHASES, dtype=object)[truth[ok]]).mean())


def test_gpu_only_classification_agrees_with_the_spans() -> None:
    cfg, msgs = simulate("healthy", 90.0, **LONG_STEPS)
    pm, predicted, gpu = _classify_job(without_spans(msgs))
    acc = _accuracy(msgs, predicted, gpu)
    print(f"GPU-only classification accuracy vs spans (1.8-s steps, 10 Hz): {acc:.3f}")
    assert acc >= 0.9
    assert np.isnan(pm.accuracy(cfg.job_id))  # no spans: nothing to score itself against
    # with spans too, the library learns from them and scores itself before each label
    pm2, predicted2, gpu2 = _classify_job(msgs)
    print(f"  with spans as labels: {_accuracy(msgs, predicted2, gpu2):.3f} (self-scored "
          f"{pm2.accuracy(cfg.job_id):.3f})")  # fmt: skip
    assert pm2.accuracy(cfg.job_id) >= 0.9 and _accuracy(msgs, predicted2, gpu2) >= 0.9


def test_gpu_only_classification_learns_a_signature_unlike_the_priors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # patched where the GPU samples look it up
    signature = _simulator_samples._SIGNATURE
    monkeypatch.setattr(
        _simulator_samples, "_SIGNATURE", np.concatenate([OTHER_SIGNATURE, signature[5:]])
    )
    _cfg, msgs = simulate("healthy", 90.0, **LONG_STEPS)
    _pm, predicted, gpu = _classify_job(without_spans(msgs))
    learned = _accuracy(msgs, predicted, gpu)
    settled = _accuracy(msgs, predicted, gpu, after_s=10.0)  # once it clustered its own samples
    fresh = SignatureLibrary()  # the generic priors alone
    priors = [
        np.asarray(STEP_PHASES, dtype=object)[fresh.classify(fresh.features(_raw(b)))[0]]
        for b in gpu
    ]
    prior_acc = _accuracy(msgs, priors, gpu)
    print(
        f"unfamiliar signature: learned {learned:.3f} ({settled:.3f} after its first 10 s), "
        f"priors alone {prior_acc:.3f}"
    )
    assert settled >= 0.9 and learned > prior_acc + 0.1


def _raw(b: Batch) -> np.ndarray:
    from perfloop.streams.phases._signatures import gpu_features

    return gpu_features(b.columns)


def test_short_steps_are_not_read_from_gpu_samples_that_blur_them() -> None:
    # 100-ms steps sampled at 10 Hz: each sample averages a whole step
    _cfg, msgs = simulate("dataloader_starvation", 40.0)
    events = feed(PhaseMachine(), without_spans(msgs))
    assert not [e for e in events if e.level == "step"]
    assert [p for p, _, _ in run_events(events)] == ["warmup", "steady", "finished"]


def test_predicted_next_step_phase_transition() -> None:
    cfg, msgs = simulate("healthy", 90.0, **LONG_STEPS)
    half = len(msgs) // 2
    pm = PhaseMachine()
    feed(pm, msgs[:half], end_pad_ns=0)
    spans = columns(msgs, "span")
    seen = max(int(m.columns["ts_ns"].max()) for m in msgs[:half] if isinstance(m, Batch))
    errors, right = [], []
    for rank in range(cfg.world):
        mine = spans["rank"] == rank
        starts = np.sort(spans["ts_ns"][mine])
        end_of_known = pm._jobs[cfg.job_id].rank_end[rank]
        for t in range(end_of_known + 50 * MS, end_of_known + 1800 * MS, 100 * MS):
            phase, _, t_next = pm.predict(cfg.job_id, rank, t)
            actual = starts[np.searchsorted(starts, t, side="right")]
            errors.append(abs(t_next - actual) / MS)
            i = np.searchsorted(starts, t, side="right") - 1
            right.append(phase == spans["phase"][mine][np.argsort(spans["ts_ns"][mine])][i])
    step_ms = np.median(columns(msgs, "step")["step_time_ms"])
    print(
        f"next step-phase transition within the next step: median error {np.median(errors):.0f}"
        f" ms, p90 {np.percentile(errors, 90):.0f} ms (step {step_ms:.0f} ms); "
        f"current phase right {np.mean(right):.2f}"
    )
    assert seen > T0
    assert np.median(errors) < 0.05 * step_ms and np.percentile(errors, 90) < 0.15 * step_ms
    assert np.mean(right) > 0.85


# --- the component interface ---------------------------------------------------------------------


def test_configure_changes_settings_and_rejects_bad_ones() -> None:
    pm = PhaseMachine()
    assert pm.configure("phases.step_emit_s", 1.0) == (5.0, 1.0)
    assert pm.configure("phases.warmup_min_steps", 20) == (10, 20)
    with pytest.raises(ConfigError, match=r"unknown phase machine setting 'phases\.nope'"):
        pm.configure("phases.nope", 1)
    with pytest.raises(ConfigError, match=r"phases\.warmup_cv must be a number in"):
        pm.configure("phases.warmup_cv", -0.1)
    with pytest.raises(ConfigError, match=r"phases\.cv_window must be an integer"):
        pm.configure("phases.cv_window", 3.5)
    with pytest.raises(ConfigError):
        pm.configure("windows.x", 1)
    assert pm.step_emit_s == 1.0


def test_snapshot_and_restore_continue_exactly() -> None:
    _cfg, msgs = simulate("dataloader_starvation", 40.0)
    half = len(msgs) // 2
    whole = feed(PhaseMachine(), msgs)
    a = PhaseMachine()
    first = feed(a, msgs[:half], end_pad_ns=0)
    b = PhaseMachine()
    b.restore(pickle.loads(pickle.dumps(a.snapshot())))
    rest = feed(b, msgs[half:])
    key = [(e.level, e.phase, e.previous, e.since_ns, e.step) for e in whole]
    assert [(e.level, e.phase, e.previous, e.since_ns, e.step) for e in first + rest] == key


def test_a_restarted_job_warms_up_again() -> None:
    pm = PhaseMachine(warmup_min_steps=2, cv_window=2)
    ends = [T0 + i * 100 * MS for i in range(1, 5)]
    pm.observe(_steps_batch("r", 0, ends, [100.0] * 4, 1), ends[-1])
    end = JobLifecycle(ts_ns=ends[-1], job_id="r", node="n0", rank=-1, state="failed")
    pm.observe_event(end, ends[-1])
    late = _steps_batch("r", 4, [ends[-1] + 100 * MS], [100.0], 1)
    pm.observe(late, ends[-1] + 100 * MS)  # after the end: ignored
    events = pm.tick(ends[-1] + 200 * MS)
    assert [e.phase for e in events] == ["warmup", "steady", "finished"]
    start = JobLifecycle(ts_ns=T0 + 10 * S, job_id="r", node="n0", rank=-1, state="started")
    pm.observe_event(start, T0 + 10 * S)
    pm.observe(_steps_batch("r", 0, [T0 + 11 * S], [100.0], 1), T0 + 11 * S)
    assert [e.phase for e in pm.tick(T0 + 11 * S)] == ["warmup"]


def test_state_does_not_grow_with_the_length_of_the_run() -> None:
    """The span timeline is kept only as far back as GPU samples may still need it: a job
    ten times longer leaves the same state behind (it grew by every span before)."""
    sizes = []
    for seconds in (30.0, 300.0):
        _, messages = simulate("healthy", seconds, nodes=1, ranks_per_node=4)
        pm = PhaseMachine()
        feed(pm, messages, end_pad_ns=0)
        sizes.append(len(pickle.dumps(pm.snapshot())))
    assert sizes[1] < 1.5 * sizes[0], sizes
