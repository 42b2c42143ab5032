"""Every scenario's ground truth is exact and its signature shows in the emitted telemetry."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from perfloop.cli import build_parser
from perfloop.cli.simulate import simulate_command
from perfloop.exceptions import ConfigError
from perfloop.producers import SCENARIOS, Fault, SimulatedJob, plan_faults, scenario_config
from perfloop.producers.simulator import THROTTLE_SW_THERMAL
from perfloop.schemas import decode_batch, decode_event
from perfloop.schemas.topics import Topics

T0 = 1_763_712_000_000_000_000
DURATION = 60.0
NS = 1_000_000_000


class FakePublisher:
    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.messages.append((topic, value))
        return True

    def columns(self, kind: str) -> dict[str, np.ndarray]:
        batches = [decode_batch(v) for t, v in self.messages if t != Topics.JOB]
        batches = [b for b in batches if b.kind == kind]
        if not batches:
            return {"ts_ns": np.empty(0, np.int64)}
        return {c: np.concatenate([b.columns[c] for b in batches]) for c in batches[0].columns}

    def events(self, kind: str) -> list[Any]:
        out = [decode_event(v) for t, v in self.messages if t == Topics.JOB]
        return [e for e in out if kind == e.KIND]


class Run:
    """One scenario run on a fake publisher, with helpers in simulated seconds."""

    def __init__(self, scenario: str, *, seed: int = 1, nodes: int = 2, g: int = 2, **kw: Any):
        self.cfg = scenario_config(
            scenario,
            job_id="sc",
            nodes=nodes,
            ranks_per_node=g,
            duration_s=DURATION,
            seed=seed,
            speed=1e6,
            t0_ns=T0,
            **kw,
        )
        self.pub = FakePublisher()
        self.job = SimulatedJob(self.cfg, self.pub)  # type: ignore[arg-type]
        self.job.run(DURATION)
        self.faults = self.cfg.faults

    def cols(self, kind: str) -> dict[str, np.ndarray]:
        c = self.pub.columns(kind)
        c["t"] = (c["ts_ns"] - T0) / NS
        return c


def _between(c: dict[str, np.ndarray], lo: float, hi: float, ranks: Any = None) -> np.ndarray:
    sel = (c["t"] >= lo) & (c["t"] < hi)
    if ranks is not None:
        sel &= np.isin(c["rank"], list(ranks))
    return sel


def _allreduce_ms(run: Run, lo: float, hi: float) -> float:
    """Mean all-reduce time of the steps that start in [lo, hi): each step's shortest
    collective, the one of the last rank to arrive (the others also wait for it)."""
    c = run.cols("collective")
    sel = _between(c, lo, hi)
    first = c["step"][sel].min() + 1  # the first step may have started before ``lo``
    sel &= c["step"] >= first
    steps, inverse = np.unique(c["step"][sel], return_inverse=True)
    shortest = np.full(len(steps), np.inf)
    np.minimum.at(shortest, inverse, c["duration_ms"][sel])
    return float(shortest.mean())


def _phase_ms(run: Run, phase: str, lo: float, hi: float, rank: int) -> float:
    sp = run.cols("span")
    sel = _between(sp, lo, hi, [rank]) & (sp["phase"] == phase)
    return float(sp["duration_ms"][sel].mean())


# -- planning ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plans_are_reproducible_and_inside_the_run(scenario: str) -> None:
    cfg = scenario_config("healthy", job_id="p", nodes=2, ranks_per_node=4, duration_s=1)
    onsets = set()
    for seed in range(8):
        plan = plan_faults(scenario, cfg, duration_s=DURATION, seed=seed)
        assert plan == plan_faults(scenario, cfg, duration_s=DURATION, seed=seed)
        for f in plan:
            assert 0 < f.onset_s < DURATION
            assert f.end_s is None or f.onset_s < f.end_s <= DURATION
            assert all(0 <= r < cfg.world for r in f.ranks)
        onsets.add(tuple(f.onset_s for f in plan))
    assert len(onsets) == (1 if scenario == "healthy" else 8), "the seed picks the onsets"


def test_unknown_scenario_names_the_valid_ones() -> None:
    cfg = scenario_config("healthy", job_id="p", nodes=1, ranks_per_node=2, duration_s=1)
    with pytest.raises(ConfigError, match=r"unknown scenario 'slow'; valid: healthy, .*, mixed"):
        plan_faults("slow", cfg, duration_s=10, seed=0)


def test_comm_degradation_needs_two_ranks() -> None:
    cfg = scenario_config("healthy", job_id="p", nodes=1, ranks_per_node=1, duration_s=1)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        plan_faults("comm_degradation", cfg, duration_s=10, seed=0)


# -- ground truth -----------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "healthy"])
def test_ground_truth_is_exact_and_published(scenario: str) -> None:
    run = Run(scenario, seed=5)
    published = run.pub.events("ground_truth")
    assert published == run.job.ground_truth
    injected = [gt for gt in published if gt.fault != "oom"]
    assert [gt.fault for gt in injected] == [f.kind for f in run.faults]
    for gt, f in zip(injected, run.faults, strict=True):
        assert gt.scenario == scenario and gt.rank == -1
        assert gt.onset_ns == T0 + round(f.onset_s * NS)
        assert gt.end_ns == (0 if f.end_s is None else T0 + round(f.end_s * NS))
        assert gt.ranks == list(f.ranks) and gt.ts_ns == gt.onset_ns
        assert gt.nodes == sorted({f"sc-node-{r // 2}" for r in f.ranks})
        assert gt.node == gt.nodes[0] and gt.detail == f.describe()


def test_a_healthy_run_has_no_ground_truth_and_no_fault_signature() -> None:
    run = Run("healthy")
    assert run.job.ground_truth == [] and run.job.state == "finished"
    st, gpu = run.cols("step"), run.cols("gpu")
    assert (st["data_wait_ms"] / st["step_time_ms"]).max() < 0.05
    assert (gpu["throttle_reasons"] == 0).all() and (gpu["sm_clock_mhz"] == 1980).all()
    assert st["t"].max() >= DURATION - 0.2 and gpu["t"].max() >= DURATION - 0.2


# -- signatures -------------------------------------------------------------------------------
def test_dataloader_starvation_makes_its_ranks_wait_for_input() -> None:
    run = Run("dataloader_starvation", seed=2)
    (f,) = run.faults
    others = set(range(4)) - set(f.ranks)
    st = run.cols("step")
    share = st["data_wait_ms"] / st["step_time_ms"]
    mid = (f.onset_s + 0.3, f.end_s)
    assert share[_between(st, *mid, f.ranks)].mean() > 0.3
    if others:  # with one node, every rank starves
        assert share[_between(st, *mid, others)].mean() < 0.05
    assert share[_between(st, 0, f.onset_s)].max() < 0.05
    assert share[_between(st, f.end_s + 0.3, DURATION)].max() < 0.05
    first_slow = st["t"][(share > 0.2)].min()
    assert f.onset_s <= first_slow <= f.onset_s + 0.5, "effect from the first step after onset"
    host = run.cols("host")
    busy = host["loader_cpu_pct"][_between(host, *mid, f.ranks)]
    assert busy.mean() > 180, "both loader workers saturated"
    assert host["sys_iowait_pct"][_between(host, *mid, f.ranks)].mean() > 5


def test_a_straggler_is_slower_by_its_factor_and_the_others_wait_for_it() -> None:
    run = Run("straggler", seed=3)
    (f,) = run.faults
    (slow,) = f.ranks
    fast = next(r for r in range(4) if r != slow)
    mid = (f.onset_s + 0.5, f.end_s)
    compute = _phase_ms(run, "forward", *mid, slow) + _phase_ms(run, "backward", *mid, slow)
    peer = _phase_ms(run, "forward", *mid, fast) + _phase_ms(run, "backward", *mid, fast)
    assert compute / peer == pytest.approx(f.strength, rel=0.02)
    assert _phase_ms(run, "comm", *mid, fast) > 3 * _phase_ms(run, "comm", 0, f.onset_s, fast)
    gpu = run.cols("gpu")
    util_fast = gpu["sm_util_pct"][_between(gpu, *mid, [fast])].mean()
    assert util_fast < gpu["sm_util_pct"][_between(gpu, *mid, [slow])].mean() - 8
    assert (gpu["throttle_reasons"] == 0).all(), "not a thermal or power problem"
    before = _phase_ms(run, "forward", 0, f.onset_s, slow)
    after = _phase_ms(run, "forward", f.end_s + 0.5, DURATION, slow)
    assert after == pytest.approx(before, rel=0.02)


def test_thermal_throttle_drops_clocks_sets_reasons_and_slows_compute() -> None:
    run = Run("thermal_throttle", seed=4)
    (f,) = run.faults
    (hot,) = f.ranks
    gpu = run.cols("gpu")
    mine = gpu["rank"] == hot
    throttled = mine & (gpu["throttle_reasons"] & THROTTLE_SW_THERMAL).astype(bool)
    t = gpu["t"][throttled]
    assert t.min() == pytest.approx(np.ceil(f.onset_s * 10) / 10), "first tick at/after onset"
    assert t.max() < f.end_s
    during = _between(gpu, f.onset_s, f.end_s, [hot])
    assert throttled[during].all()
    assert np.abs(gpu["sm_clock_mhz"][during] - 1980 * f.strength).max() <= 7.5
    assert gpu["temp_c"][during].min() > 84
    assert (gpu["sm_clock_mhz"][~during] == 1980).all() and not throttled[~during].any()
    # the GPU heats up before it throttles (a precursor), and cools after
    ramp = gpu["temp_c"][_between(gpu, f.onset_s - 2, f.onset_s, [hot])]
    cool = gpu["temp_c"][_between(gpu, f.end_s + 0.5, DURATION, [hot])]
    assert ramp.mean() > cool.mean() + 10 and cool.max() < 80
    mid = (f.onset_s + 0.5, f.end_s)
    ratio = _phase_ms(run, "forward", *mid, hot) / _phase_ms(run, "forward", 0, f.onset_s, hot)
    assert ratio == pytest.approx(1 / f.strength, rel=0.03)


def test_a_memory_leak_grows_until_the_job_runs_out_of_memory() -> None:
    run = Run("memory_leak", seed=6)
    (f,) = run.faults
    (rank,) = f.ranks
    assert run.job.state == "failed"
    leak_gt, oom_gt = run.job.ground_truth
    assert (leak_gt.fault, oom_gt.fault, oom_gt.ranks) == ("memory_leak", "oom", [rank])
    t_oom = (oom_gt.onset_ns - T0) / NS
    assert f.onset_s < t_oom < DURATION
    gpu = run.cols("gpu")
    mem = gpu["mem_used_bytes"][gpu["rank"] == rank]
    t = gpu["t"][gpu["rank"] == rank]
    assert (mem[t < f.onset_s] == mem[0]).all(), "flat before the leak"
    assert np.all(np.diff(mem[t > f.onset_s + 0.2]) >= 0) and mem[-1] > mem[0] + (30 << 30)
    total = int(gpu["mem_total_bytes"][0])
    assert (mem <= total).all() and mem[-1] > total - (1 << 30) - f.strength
    st = run.cols("step")
    alloc = st["mem_allocated_bytes"][st["rank"] == rank]
    np.testing.assert_allclose(np.diff(alloc[-20:]), f.strength, rtol=1e-6)
    for kind in ("step", "span", "collective", "gpu", "host"):
        assert run.cols(kind)["ts_ns"].max() <= oom_gt.onset_ns, f"no {kind} after the OOM"
    ends = {(e.rank, e.state, e.exit_code) for e in run.pub.events("lifecycle") if e.ts_ns > T0}
    assert (rank, "failed", 1) in ends and (-1, "failed", 1) in ends
    assert {e[1] for e in ends if e[0] not in (rank, -1)} == {"killed"}


def test_comm_degradation_slows_every_all_reduce() -> None:
    run = Run("comm_degradation", seed=7)
    (f,) = run.faults
    before, during = _allreduce_ms(run, 0, f.onset_s), _allreduce_ms(run, f.onset_s, f.end_s)
    assert during / before == pytest.approx(f.strength, rel=0.05)
    if run.cfg.nodes == 1:
        return  # inside one node a slower NVLink ring still hides mostly under backward
    st = run.cols("step")  # across nodes it does not: steps slow down...
    slow = np.median(st["step_time_ms"][_between(st, f.onset_s + 0.5, f.end_s)])
    assert slow > 1.5 * np.median(st["step_time_ms"][_between(st, 0, f.onset_s)])
    host = run.cols("host")  # ...and the network moves fewer bytes per second
    net_before = host["net_rx_bytes_per_s"][_between(host, 1, f.onset_s)].mean()
    net_during = host["net_rx_bytes_per_s"][_between(host, f.onset_s + 1, f.end_s)].mean()
    assert net_during < 0.6 * net_before


def test_a_hang_stops_every_step_while_the_processes_live_on() -> None:
    run = Run("hang", seed=8)
    (f,) = run.faults
    (stuck,) = f.ranks
    onset_ns = T0 + round(f.onset_s * NS)
    for kind in ("step", "span", "collective"):
        assert run.cols(kind)["ts_ns"].max() <= onset_ns, f"{kind} after the hang"
    st = run.cols("step")
    assert st["t"].max() > f.onset_s - 0.5, "steps ran up to the hang"
    gpu, host = run.cols("gpu"), run.cols("host")
    assert gpu["t"].max() == pytest.approx(DURATION) and host["t"].max() == pytest.approx(DURATION)
    late = _between(gpu, f.onset_s + 0.2, DURATION)
    assert gpu["sm_util_pct"][late & (gpu["rank"] != stuck)].min() > 95, "NCCL spins"
    assert gpu["sm_util_pct"][late & (gpu["rank"] == stuck)].max() < 5
    assert gpu["power_w"][late].max() < 200
    end = [e for e in run.pub.events("lifecycle") if e.rank == -1][-1]
    assert (end.state, end.exit_code, end.ts_ns) == ("killed", 137, T0 + int(DURATION * NS))


def test_mixed_faults_show_at_their_own_times_and_places() -> None:
    run = Run("mixed", seed=9, nodes=2, g=4)
    kinds = [f.kind for f in run.faults]
    assert kinds == ["dataloader_starvation", "straggler", "thermal_throttle", "comm_degradation"]
    starve, strag, hot, comm = run.faults
    assert starve.onset_s < strag.onset_s < hot.onset_s < comm.onset_s
    assert strag.ranks != hot.ranks and set(starve.ranks) != set(comm.ranks)
    st, gpu = run.cols("step"), run.cols("gpu")
    share = st["data_wait_ms"] / st["step_time_ms"]
    assert share[_between(st, starve.onset_s + 0.5, starve.end_s, starve.ranks)].mean() > 0.3
    assert share[_between(st, starve.end_s + 0.5, DURATION)].max() < 0.05
    (r,) = strag.ranks
    win = (max(strag.onset_s, starve.end_s) + 0.5, min(strag.end_s, hot.onset_s))
    peer = next(p for p in range(8) if p not in (r, *hot.ranks))
    ratio = _phase_ms(run, "backward", *win, r) / _phase_ms(run, "backward", *win, peer)
    assert ratio == pytest.approx(strag.strength, rel=0.03)
    throttled = gpu["throttle_reasons"] > 0
    assert set(gpu["rank"][throttled].tolist()) == set(hot.ranks)
    assert gpu["t"][throttled].min() >= hot.onset_s and gpu["t"][throttled].max() < hot.end_s
    before = _allreduce_ms(run, 0, starve.onset_s)
    assert _allreduce_ms(run, comm.onset_s, comm.end_s) == pytest.approx(4 * before, rel=0.05)


# -- determinism, commands, pace --------------------------------------------------------------
def _content(run: Run, shift_ns: int = 0) -> list[Any]:
    """The run's job events in order, then each (kind, node, producer)'s samples joined: how
    the samples split into messages follows the wall clock (a flush every publish interval),
    so only what was published is compared, not where the message boundaries fell."""
    events: list[Any] = []
    samples: dict[tuple[str, str, str], dict[str, list[Any]]] = {}
    for topic, value in run.pub.messages:
        if topic == Topics.JOB:
            doc = decode_event(value).model_dump(exclude={"event_id"})
            for k in ("ts_ns", "onset_ns", "end_ns"):
                if doc.get(k):
                    doc[k] -= shift_ns
            events.append(doc)
        else:
            b = decode_batch(value)
            cols = {k: v.tolist() for k, v in b.columns.items()}
            cols["ts_ns"] = [t - shift_ns for t in cols["ts_ns"]]
            joined = samples.setdefault((b.kind, b.node, b.producer_id), {k: [] for k in cols})
            for k, v in cols.items():
                joined[k].extend(v)
    return [*events, *sorted(samples.items())]


def test_same_seed_same_events_whatever_the_time_base() -> None:
    a = Run("mixed", seed=11)
    assert _content(Run("mixed", seed=11)) == _content(a)
    later = FakePublisher()
    SimulatedJob(replace(a.cfg, t0_ns=T0 + 7 * NS), later).run(DURATION)  # type: ignore[arg-type]
    shifted = Run.__new__(Run)
    shifted.pub = later
    assert _content(shifted, shift_ns=7 * NS) == _content(a)
    assert _content(Run("mixed", seed=12)) != _content(a)


def test_more_workers_through_the_knob_handler_end_the_starvation() -> None:
    cfg = scenario_config(
        "dataloader_starvation",
        job_id="k",
        nodes=1,
        ranks_per_node=2,
        duration_s=DURATION,
        seed=2,
        speed=1e6,
        t0_ns=T0,
    )
    (f,) = cfg.faults
    pub = FakePublisher()
    job = SimulatedJob(cfg, pub)  # type: ignore[arg-type]
    set_workers = job.knob_handlers()["dataloader.num_workers"]
    applied: list[float] = []

    def step_boundary(step: int) -> None:  # what JobAgent.step_boundary does with a command
        if not applied and job.clock_s > f.onset_s + 3:
            set_workers(6)
            applied.append(job.clock_s)

    job.run(DURATION, step_boundary=step_boundary)
    st = pub.columns("step")
    t = (st["ts_ns"] - T0) / NS
    share = st["data_wait_ms"] / st["step_time_ms"]
    assert share[(t > f.onset_s + 0.5) & (t < applied[0])].mean() > 0.3
    assert share[(t > applied[0] + 0.3) & (t < f.end_s)].mean() < 0.05
    assert set(st["num_workers"][t > applied[0] + 0.3].tolist()) == {6}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += 1

    def time_ns(self) -> int:
        return T0


def test_rate_sets_the_pace_in_samples_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfloop.producers.simulator as sim

    clock = FakeClock()
    monkeypatch.setattr(sim, "time", clock)
    cfg = scenario_config(
        "healthy", job_id="r", nodes=2, ranks_per_node=8, duration_s=1, rate=200_000.0
    )
    job = SimulatedJob(cfg, FakePublisher())  # type: ignore[arg-type]
    ticks: list[int] = []
    job.run(30.0, on_tick=lambda: ticks.append(job.samples))
    # the pace is computed from samples, so the (fake) wall time is samples / rate
    assert job.samples / clock.now == pytest.approx(200_000, rel=0.02)
    assert job.pace > 100, "event time runs faster than real time"
    assert len(ticks) < job.step / 5, "many steps of all ranks are generated at once"
    assert job.t0_ns == T0 - int(30 * (1 - 1 / job.pace) * NS), "ends at the wall time"


def test_speed_sets_the_pace_in_simulated_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    import perfloop.producers.simulator as sim

    clock = FakeClock()
    monkeypatch.setattr(sim, "time", clock)
    cfg = scenario_config("healthy", job_id="s", nodes=1, ranks_per_node=2, duration_s=1, speed=5)
    SimulatedJob(cfg, FakePublisher()).run(10.0)  # type: ignore[arg-type]
    assert clock.now == pytest.approx(2.0, abs=0.15)
    clock1 = FakeClock()
    monkeypatch.setattr(sim, "time", clock1)
    cfg1 = scenario_config("healthy", job_id="s", nodes=1, ranks_per_node=2, duration_s=1)
    job = SimulatedJob(cfg1, FakePublisher())  # type: ignore[arg-type]
    job.run(3.0)
    assert clock1.now == pytest.approx(3.0, abs=0.15) and job.t0_ns == T0, "real time"


# -- the command's argument errors ------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["simulate", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "slow"], "unknown scenario 'slow'; valid: healthy, dataloader_starvation"),
        (["--scenario", "hang", "--nodes", "0"], "--nodes must be ≥ 1, got 0"),
        (["--scenario", "hang", "--ranks-per-node", "-1"], "--ranks-per-node must be ≥ 1"),
        (["--scenario", "hang", "--duration", "0"], "--duration must be > 0 s, got 0"),
        (["--scenario", "hang", "--duration", "-3"], "--duration must be > 0 s"),
        (["--scenario", "hang", "--speed", "0"], "--speed must be > 0"),
        (["--scenario", "hang", "--rate", "-1"], "--rate must be > 0"),
        (["--scenario", "hang", "--job-id", "a b"], "--job-id 'a b' must match"),
        (["--scenario", "hang", "--ground-truth", "/nonexistent/dir/gt.jsonl"], "cannot write"),
    ],
)
def test_bad_arguments_are_one_line_errors_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from perfloop.settings import ProducerSettings

    rc = simulate_command(_args(*argv), ProducerSettings(kafka_port=1))
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("perfloop: error: ") and message in err and err.count("\n") == 1


def test_fault_factors_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"thermal_throttle factor 1\.5 is out of range"):
        Fault("thermal_throttle", 1.0, factor=1.5)
    with pytest.raises(ConfigError, match="must come after its onset"):
        Fault("straggler", 5.0, end_s=4.0)


def test_no_broker_is_one_line_before_anything_runs(tmp_path: Any) -> None:
    from perfloop.exceptions import BrokerError
    from perfloop.settings import ProducerSettings

    gt = tmp_path / "gt.jsonl"
    args = _args("--scenario", "healthy", "--duration", "1", "--ground-truth", str(gt))
    with pytest.raises(BrokerError, match=r"127\.0\.0\.1:1 is unreachable"):
        simulate_command(args, ProducerSettings(kafka_port=1), signing_key=b"k")
    assert gt.read_text() == ""
