"""The funnel's detectors on hand-made data-parallel jobs: each fault's signal, its onset,
rank, evidence and explanation, and the conditions that must *not* raise a diagnosis."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from perfloop.schemas import Diagnosis, GroundTruth, JobLifecycle
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel, actionable

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
S = 1_000_000_000
GIB = float(1 << 30)


class Synth:
    """A hand-made data-parallel job. Each step every rank waits for its batch (``wait``),
    computes (``compute``: forward, backward, optimizer), then all meet in an all-reduce that
    takes ``comm`` ms once the last rank arrives, so every rank shares the step time. GPU
    samples every 100 ms per rank; messages arrive ``delay`` after their newest sample."""

    def __init__(
        self,
        *,
        nodes: int = 1,
        per_node: int = 4,
        compute: float = 90.0,
        comm: float = 10.0,
        spans: bool = True,
        collectives: bool = True,
        delay_ms: float = 300.0,
        job: str = "j",
        comm_name: str = "comm",
    ) -> None:
        self.job, self.nodes, self.per_node = job, nodes, per_node
        self.comm_name = comm_name  # the comm spans' name ("send"/"recv": point-to-point)
        self.world = nodes * per_node
        self.compute, self.comm = compute, comm
        self.spans, self.collectives = spans, collectives
        self.delay = int(delay_ms * MS)
        self.t = T0
        self.step = 0
        self.next_gpu = T0
        self.mem = np.full(self.world, 20 * GIB)
        self.rng = np.random.default_rng(0)
        self.items: list[tuple[int, Any]] = []
        self.gpu_util = np.full(self.world, 90.0)
        self.gpu_clock = np.full(self.world, 1980.0)
        self.gpu_reasons = np.zeros(self.world, dtype=np.int64)
        self.gpu_xid = np.zeros(self.world, dtype=np.int64)
        self.gpu_rank = np.arange(self.world)  # -1: a GPU no rank claims
        self.cpu = np.full(nodes, 20.0)

    def node(self, n: int) -> str:
        return f"{self.job}-node-{n}"

    def _emit(self, kind: str, cols: dict[str, np.ndarray], newest: int) -> None:
        owner = cols.pop("_node", cols["rank"] // self.per_node)
        for n in range(self.nodes):
            mine = owner == n
            if not mine.any():
                continue
            part = {k: v[mine].tolist() for k, v in cols.items()}
            data = encode_batch(kind, part, job_id=self.job, node=self.node(n))
            self.items.append((newest + self.delay, decode_batch(data)))

    def event(self, event: Any) -> None:
        self.items.append((event.ts_ns + self.delay, event))

    def steps(
        self,
        n: int,
        *,
        compute: Any = None,
        wait: Any = 0.0,
        comm: float | None = None,
        leak: Any = 0.0,
    ) -> None:
        """``n`` steps; ``compute`` / ``wait`` / ``leak`` are per rank (scalar or array, or a
        callable of the step index giving one)."""
        w = self.world
        for _ in range(n):

            def per_rank(x: Any, default: float) -> np.ndarray:
                x = x(self.step) if callable(x) else x
                return np.broadcast_to(np.asarray(default if x is None else x, float), (w,))

            c = per_rank(compute, self.compute) * self.rng.normal(1, 0.01, w)
            wt = per_rank(wait, 0.0) + np.abs(self.rng.normal(0, 0.3, w))
            self.mem += per_rank(leak, 0.0)
            arrive = wt + c
            end = arrive.max() + (self.comm if comm is None else comm) * self.rng.normal(1, 0.01)
            end_ns = self.t + int(end * MS)
            ranks = np.arange(w)
            self._gpu(end_ns)
            step_col = np.full(w, self.step)
            if self.spans:
                phases = ["data_wait", "forward", "backward", "comm", "optimizer"]
                dur = np.stack([wt, 0.35 * c, 0.55 * c, end - arrive, 0.1 * c], axis=1)
                self._emit(
                    "span",
                    {
                        "ts_ns": np.full(w * 5, self.t),
                        "rank": np.repeat(ranks, 5),
                        "step": np.repeat(step_col, 5),
                        "phase": np.array(phases * w, dtype=object),
                        "name": np.array(
                            [self.comm_name if p == "comm" else p for p in phases] * w,
                            dtype=object,
                        ),
                        "duration_ms": dur.ravel(),
                    },
                    end_ns,
                )
            if self.collectives:
                self._emit(
                    "collective",
                    {
                        "ts_ns": self.t + (arrive * MS).astype(np.int64),
                        "rank": ranks,
                        "step": step_col,
                        "op": np.array(
                            [self.comm_name if self.comm_name != "comm" else "all_reduce"] * w,
                            dtype=object,
                        ),
                        "duration_ms": end - arrive,
                    },
                    end_ns,
                )
            self._emit(
                "step",
                {
                    "ts_ns": np.full(w, end_ns),
                    "rank": ranks,
                    "step": step_col,
                    "step_time_ms": np.full(w, end),
                    "data_wait_ms": wt,
                    "mem_allocated_bytes": self.mem.astype(np.int64),
                    "mem_peak_bytes": (self.mem + 10 * GIB).astype(np.int64),
                },
                end_ns,
            )
            self.t = end_ns
            self.step += 1

    def stall(self, seconds: float) -> None:
        """No step completes for ``seconds``; GPU samples go on."""
        self.t += int(seconds * S)
        self._gpu(self.t)

    def _gpu(self, until_ns: int) -> None:
        ticks = np.arange(self.next_gpu, until_ns, 100 * MS)
        if not len(ticks):
            return
        self.next_gpu = int(ticks[-1]) + 100 * MS
        w, k = self.world, len(ticks)
        ranks = np.tile(np.arange(w), k)
        self._emit(
            "gpu",
            {
                "ts_ns": np.repeat(ticks, w),
                "rank": np.tile(self.gpu_rank, k),
                "device": ranks % self.per_node,
                "sm_util_pct": np.tile(self.gpu_util, k),
                "mem_util_pct": np.tile(self.gpu_util * 0.4, k),
                "sm_clock_mhz": np.tile(self.gpu_clock, k),
                "throttle_reasons": np.tile(self.gpu_reasons, k),
                "temp_c": np.tile(np.where(self.gpu_reasons & 0x60, 88.0, 60.0), k),
                "xid_events": np.tile(self.gpu_xid, k),
                "last_xid": np.tile(np.where(self.gpu_xid > 0, 79, 0), k),
                "mem_total_bytes": np.full(w * k, int(80 * GIB)),
                "_node": ranks // self.per_node,
            },
            int(ticks[-1]),
        )
        self.gpu_xid[:] = 0
        self._emit(
            "host",
            {
                "ts_ns": np.full(w, int(ticks[-1])),
                "rank": np.arange(w),
                "sys_cpu_pct": np.repeat(self.cpu, self.per_node),
                "proc_cpu_pct": np.full(w, 100.0),
            },
            int(ticks[-1]),
        )

    def feed(self, funnel: Funnel, *, tail_s: float = 3.0) -> list[Diagnosis]:
        """Deliver every item in arrival order, ticking every 250 ms; return the diagnoses."""
        out: list[Diagnosis] = []
        items = sorted(self.items, key=lambda x: x[0])
        self.items = []
        next_tick = getattr(self, "_next_tick", items[0][0] if items else T0)
        for wall, item in items:
            while next_tick <= wall:
                out += funnel.tick(next_tick)
                next_tick += 250 * MS
            if hasattr(item, "columns"):
                funnel.observe(item, wall)
            else:
                funnel.observe_event(item, wall)
        end = (items[-1][0] if items else next_tick) + int(tail_s * S)
        while next_tick <= end:
            out += funnel.tick(next_tick)
            next_tick += 250 * MS
        self._next_tick = next_tick
        return out


def opened(diags: list[Diagnosis], bottleneck: str | None = None) -> list[Diagnosis]:
    return [d for d in diags if d.state == "open" and bottleneck in (None, d.bottleneck)]


def roots(diags: list[Diagnosis]) -> set[str]:
    """Root diagnoses that are not kernel-level context."""
    return {d.bottleneck for d in opened(diags) if not d.explained_by and d.level != "kernel"}


def test_healthy_job_raises_no_fault() -> None:
    job = Synth(nodes=2, per_node=4)
    job.steps(80)
    assert roots(job.feed(Funnel())) == set()


def test_straggler_opens_on_the_slow_rank_with_its_score_and_resolves() -> None:
    job = Synth()
    job.steps(90)  # the warm-up, and the steps the job's noise is learned from
    onset = job.t
    job.steps(40, compute=lambda s: [90, 90, 135, 90])
    diags = job.feed(f := Funnel())
    (d,) = opened(diags, "straggler")
    assert (d.ranks, d.rank, d.level, d.loop, d.explained_by) == ([2], 2, "network", "training", "")
    assert d.evidence["score"] == pytest.approx(1 - 1 / 1.5, abs=0.02)
    assert d.critical_path and d.step_share > 0.3
    assert abs(d.onset_ns - onset) < 700 * MS, "onset: within the first slow steps"
    assert d.ts_ns - onset < 5 * S, "slow for 3 s (noise is brief), then open"
    assert roots(diags) == {"straggler"}
    job.steps(20)
    later = job.feed(f)
    (r,) = [x for x in later if x.state == "resolved"]
    assert r.diagnosis_id == d.diagnosis_id


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_rank_that_shares_its_cpu_is_named_though_on_time_in_some_steps(seed: int) -> None:
    """CPU contention: the rank runs on time for a few steps (a time slice of its own), then
    waits a few (the other process's): a third of its steps are on time, in scattered blocks,
    while any rank falls behind now and then. It is the straggler, and only it."""
    rng = np.random.default_rng(seed)
    blocks = {"left": 0, "slow": False}

    def noise() -> np.ndarray:
        c = np.full(4, 90.0)
        if rng.random() < 0.3:
            c[rng.integers(4)] *= rng.uniform(1.1, 1.5)
        return c

    def contended(_: int) -> np.ndarray:
        c = noise()
        if not blocks["left"]:
            blocks["slow"] = not blocks["slow"]
            blocks["left"] = int(rng.integers(4, 14) if blocks["slow"] else rng.integers(3, 8))
        blocks["left"] -= 1
        if blocks["slow"]:
            c[2] = 90.0 * rng.uniform(1.3, 2.0)
        return c

    job = Synth()
    job.steps(80, compute=lambda _: noise())
    onset = job.t
    job.steps(200, compute=contended)
    found = opened(job.feed(Funnel()), "straggler")
    assert found and {tuple(d.ranks) for d in found} == {(2,)}
    assert found[0].ts_ns - onset < 10 * S


def test_straggler_without_spans_reads_compute_from_collectives() -> None:
    job = Synth(spans=False)
    job.steps(20)
    job.steps(40, compute=lambda s: [90, 90, 90, 140])
    (d,) = opened(job.feed(Funnel()), "straggler")
    assert d.ranks == [3]


def test_a_straggler_below_the_threshold_is_not_one() -> None:
    job = Synth()
    job.steps(20)
    job.steps(30, compute=lambda s: [90, 90, 99, 90])  # 10% slower: score 0.09 < 0.12
    assert opened(job.feed(Funnel()), "straggler") == []


def test_thermal_throttle_explains_the_straggler_on_its_rank() -> None:
    job = Synth()
    job.steps(20)
    onset = job.t
    job.gpu_reasons[1] = 0x20 | 0x40
    job.gpu_clock[1] = 1980 * 0.6
    job.steps(40, compute=lambda s: [90, 150, 90, 90])
    diags = job.feed(Funnel())
    (th,) = opened(diags, "thermal_throttle")
    (st,) = opened(diags, "straggler")
    assert (th.ranks, th.explained_by, th.critical_path, th.loop) == ([1], "", True, "inner")
    assert th.evidence["clock_ratio"] == pytest.approx(0.6, abs=0.01)
    assert th.ts_ns - onset < 1.5 * S
    assert (st.ranks, st.explained_by, st.critical_path) == ([1], "thermal_throttle", False)
    assert [d.bottleneck for d in actionable(diags)] == ["thermal_throttle"]


def test_a_throttled_gpu_no_rank_claims_explains_stragglers_on_its_node_only() -> None:
    job = Synth(nodes=2, per_node=2)
    job.gpu_rank[3] = -1
    job.steps(20)
    job.gpu_reasons[3] = 0x40
    job.gpu_clock[3] = 1200.0
    job.steps(40, compute=[150, 90, 90, 150])
    diags = job.feed(Funnel())
    (th,) = opened(diags, "thermal_throttle")
    assert (th.rank, th.ranks, th.nodes) == (-1, [], ["j-node-1"])
    why = {d.rank: d.explained_by for d in opened(diags, "straggler")}
    assert why == {0: "", 3: "thermal_throttle"}


def test_throttle_reason_without_a_clock_drop_is_not_a_throttle() -> None:
    job = Synth()
    job.steps(10)
    job.gpu_reasons[:] = 0x4  # power-cap bit while the clock holds: harmless
    job.steps(30)
    assert opened(job.feed(Funnel()), "power_throttle") == []


def test_power_throttle_on_every_gpu() -> None:
    job = Synth(nodes=1, per_node=2)
    job.steps(10)
    job.gpu_reasons[:] = 0x4
    job.gpu_clock[:] = 1500.0
    job.steps(20, compute=110.0)
    diags = opened(job.feed(Funnel()), "power_throttle")
    assert sorted(d.rank for d in diags) == [0, 1]
    assert all(d.level == "cluster_health" and not d.explained_by for d in diags)


def test_dataloader_starvation_is_per_node_and_is_not_comm_degradation() -> None:
    job = Synth(nodes=2, per_node=2)
    job.steps(20)
    onset = job.t
    job.steps(20, wait=[0, 0, 100, 100])  # node 1's loaders cannot keep up
    diags = job.feed(Funnel())
    (d,) = opened(diags, "dataloader_starvation")
    assert (d.ranks, d.nodes, d.level) == ([2, 3], ["j-node-1"], "host")
    assert d.evidence["data_wait_share"] == pytest.approx(100 / 200, abs=0.05)
    assert d.ts_ns - onset < 2 * S
    # node 0's ranks now wait ~100 ms in the all-reduce: that is not a network problem
    assert roots(diags) == {"dataloader_starvation"}


def test_comm_degradation_against_the_learned_baseline() -> None:
    job = Synth(comm=20.0)
    job.steps(20)
    onset = job.t
    job.steps(40, comm=80.0)
    diags = job.feed(Funnel())
    (d,) = opened(diags, "comm_degradation")
    assert d.evidence["ratio"] == pytest.approx(4.0, rel=0.1)
    assert d.evidence["baseline_ms"] == pytest.approx(20.0, rel=0.1)
    assert d.ts_ns - onset < 5 * S
    (e,) = opened(diags, "exposed_comm")  # 80 of 170 ms is communication nobody hides
    assert e.explained_by == "comm_degradation" and not e.critical_path
    assert roots(diags) == {"comm_degradation"}


@pytest.mark.parametrize(("name", "exposed"), [("comm", True), ("recv", False), ("send", False)])
def test_a_pipelines_sends_and_receives_are_not_exposed_comm(name: str, exposed: bool) -> None:
    # 80 of ~170 ms of every step in communication: a collective no rank hides is exposed
    # comm; a pipeline's point-to-point waits (its bubble) are not, whatever their share
    job = Synth(comm=80.0, comm_name=name)
    job.steps(60)
    diags = job.feed(Funnel())
    assert len(opened(diags, "exposed_comm")) == exposed
    assert not (roots(diags) - {"exposed_comm"})


@pytest.mark.parametrize("spans", [True, False])
@pytest.mark.parametrize(("name", "pipeline"), [("comm", False), ("recv", True)])
def test_a_pipelines_heavier_stage_is_its_load_imbalance(
    name: str, pipeline: bool, spans: bool
) -> None:
    # rank 3 computes twice what the others do, every step: among data-parallel peers it is
    # the straggler they wait for; a pipeline's stages (ranks that send and receive point to
    # point) do different work by design, so a heavier stage is no straggler, but the whole
    # pipeline runs at its pace: a load imbalance on that stage (with spans or from its
    # collectives alone), a third of each step lost (1 - mean/max: 1 - 112.5/180)
    job = Synth(comm_name=name, spans=spans)
    job.steps(20)
    onset = job.t
    job.steps(60, compute=lambda s: [90, 90, 90, 180])
    diags = job.feed(Funnel())
    assert {r for d in opened(diags, "straggler") for r in d.ranks} == (set() if pipeline else {3})
    imbalanced = opened(diags, "load_imbalance")
    if not pipeline:
        assert not imbalanced
        return
    (d,) = imbalanced
    assert d.ranks == [3]
    assert d.evidence["imbalance"] == pytest.approx(0.375, abs=0.03)
    assert d.evidence["stage_compute_ms"] == pytest.approx(180, rel=0.05)
    assert d.onset_ns >= onset - 3 * S and d.ts_ns - onset < 10 * S


@pytest.mark.parametrize(
    "compute",
    [
        pytest.param(lambda s: [90, 99, 90, 95], id="a-stage-10pct-heavier"),
        pytest.param(lambda s: [180 if r == s % 4 else 90 for r in range(4)], id="rotating"),
        pytest.param(lambda s: [180 if s % 3 == 0 else 90, 90, 90, 90], id="one-step-in-three"),
    ],
)
def test_a_pipeline_near_balance_or_with_passing_spikes_is_no_load_imbalance(compute: Any) -> None:
    # stages ~10 % apart (a real partition is never exact), the heaviest rank changing from
    # step to step, or one rank heavy in a third of the steps: nothing to move between stages
    job = Synth(comm_name="recv")
    job.steps(20)
    job.steps(80, compute=compute)
    diags = job.feed(Funnel())
    assert not opened(diags, "load_imbalance") and not opened(diags, "straggler")


def test_a_pipelines_heavier_stage_names_all_its_replicas() -> None:
    # two stages of two data-parallel replicas each (ranks 0, 2 and 1, 3): the heavier
    # stage's replicas are named together
    job = Synth(comm_name="recv")
    job.steps(20)
    job.steps(60, compute=lambda s: [90, 170, 90, 180])
    (d,) = opened(job.feed(Funnel()), "load_imbalance")
    assert d.ranks == [1, 3]


@pytest.mark.parametrize("spans", [True, False])
@pytest.mark.parametrize(
    ("after", "ratio", "others"),
    [([90, 180, 90, 100], 2.0, 1.0), ([112, 300, 90, 100], 3.33, 1.24)],
    ids=["alone", "a-neighbour-a-little-too"],
)
def test_a_pipeline_rank_slowed_from_outside_is_its_straggler(
    spans: bool, after: list[int], ratio: float, others: float
) -> None:
    # the stages differ by the cut (rank 3 computes 100 ms, the others 90, from the start);
    # once each rank's own baseline is known, rank 1's compute doubles (another process on
    # its CPU), or triples while its neighbour's rises by a quarter (the slow rank's work
    # takes from it): rank 1, and only it, is the straggler, against its own past; a stage
    # that became heavy is no load imbalance of the cut
    job = Synth(comm_name="recv", spans=spans)
    job.steps(90, compute=lambda s: [90, 90, 90, 100])
    onset = job.t
    job.steps(60, compute=after)
    diags = job.feed(Funnel())
    (d,) = opened(diags, "straggler")
    assert d.ranks == [1] and d.evidence["pipeline"] == 1
    assert d.evidence["ratio"] == pytest.approx(ratio, rel=0.1)
    assert d.evidence["baseline_compute_ms"] == pytest.approx(90, rel=0.05)
    assert d.evidence["others_ratio"] == pytest.approx(others, abs=0.06)
    assert d.onset_ns >= onset - 1 * S and d.ts_ns - onset < 10 * S
    assert not opened(diags, "load_imbalance")


@pytest.mark.parametrize(
    "compute",
    [
        pytest.param(lambda s: [135, 135, 135, 150], id="every-stage-slower"),
        pytest.param(lambda s: [126, 180, 90, 100], id="one-2x-a-neighbour-1.4x"),
        pytest.param(lambda s: [90, 108, 90, 100], id="one-rank-20pct-slower"),
        pytest.param(lambda s: [90, 180 if s % 3 == 0 else 90, 90, 100], id="one-step-in-three"),
    ],
)
def test_a_pipeline_slowing_down_alike_or_a_little_has_no_straggler(compute: Any) -> None:
    # every stage 1.5x slower (a busier machine, a new phase: nobody's), one rank twice as
    # slow while its neighbour is 1.4x (more than a quarter of its rise: a shared cause),
    # one rank 20 % slower
    # (below the 25 % a stage must slow by), or one rank slow in a third of the steps only
    job = Synth(comm_name="recv")
    job.steps(90, compute=lambda s: [90, 90, 90, 100])
    job.steps(80, compute=compute)
    diags = job.feed(Funnel())
    assert not opened(diags, "straggler")
    # the stages are uneven now: only the rank that computes most may be called heavy
    assert all(d.ranks == [1] for d in opened(diags, "load_imbalance"))


def test_waiting_for_a_straggler_is_not_comm_degradation() -> None:
    job = Synth(comm=20.0)
    job.steps(20)
    job.steps(30, compute=lambda s: [90, 90, 90, 180])  # the others wait 90 ms in comm
    assert roots(job.feed(Funnel())) == {"straggler"}


def test_memory_leak_reports_growth_and_time_to_oom() -> None:
    job = Synth()
    job.steps(20)
    onset = job.t
    job.steps(15, leak=[0, 0, 0, 512 << 20])
    diags = job.feed(Funnel())
    (d,) = opened(diags, "memory_leak")
    assert (d.ranks, d.loop, d.level, d.critical_path) == ([3], "product", "memory", True)
    assert d.evidence["growth_bytes_per_step"] == pytest.approx(512 << 20)
    headroom = 80 * GIB - (job.mem[3] + 10 * GIB)
    assert d.evidence["time_to_oom_s"] > 0
    # about headroom / growth steps of ~0.1 s (when detected, the rank held less)
    assert d.evidence["time_to_oom_s"] >= headroom / (512 << 20) * 0.09
    assert d.ts_ns - onset < 2 * S


def test_oom_comes_from_the_lifecycle_and_ground_truth_is_ignored() -> None:
    job = Synth()
    job.steps(10)
    job.event(
        GroundTruth(ts_ns=job.t, job_id="j", node="n", rank=-1, scenario="x", fault="hang",
                    onset_ns=job.t, ranks=[0])
    )  # fmt: skip
    job.event(
        JobLifecycle(ts_ns=job.t, job_id="j", node="j-node-0", rank=2, state="failed",
                     exit_code=1, message="torch.OutOfMemoryError: CUDA out of memory")
    )  # fmt: skip
    job.event(JobLifecycle(ts_ns=job.t, job_id="j", node="j-node-0", rank=-1, state="failed"))
    diags = job.feed(Funnel())
    assert roots(diags) == {"oom"}
    (d,) = opened(diags, "oom")
    assert (d.ranks, d.loop, d.critical_path) == ([2], "product", True)
    assert {x.state for x in diags if x.bottleneck == "oom"} == {"open", "resolved"}


def test_hang_waits_for_the_adaptive_timeout_and_names_the_idle_rank() -> None:
    job = Synth()
    job.steps(30)  # ~100 ms steps: timeout max(1 s, 8 x p99) = 1 s
    f = Funnel()
    job.feed(f, tail_s=0)
    job.gpu_util[:] = 100.0  # blocked in the all-reduce: NCCL kernels spin
    job.gpu_util[1] = 0.0  # rank 1 never got there
    job.stall(0.6)
    assert opened(job.feed(f, tail_s=0), "hang") == []
    job.stall(1.0)
    (d,) = opened(job.feed(f, tail_s=0), "hang")
    assert (d.ranks, d.loop, d.critical_path) == ([1], "product", True)
    assert d.evidence["timeout_s"] == pytest.approx(1.0)
    job.gpu_util[:] = 90.0
    job.steps(3)
    assert [x.state for x in job.feed(f) if x.bottleneck == "hang"] == ["resolved"]


def test_hang_timeout_scales_with_the_jobs_step_time() -> None:
    job = Synth(compute=390.0)  # 0.4 s steps: timeout 8 x p99 ≈ 3.2 s
    job.steps(20)
    f = Funnel()
    job.feed(f, tail_s=0)
    job.gpu_util[:] = 100.0
    job.stall(2.5)
    assert opened(job.feed(f, tail_s=0), "hang") == []
    job.stall(1.5)
    (d,) = opened(job.feed(f, tail_s=0), "hang")
    assert d.evidence["timeout_s"] == pytest.approx(8 * 0.4, rel=0.05)
    assert d.ranks == []  # no GPU idles: the culprit is unknown


def test_a_pause_with_idle_gpus_needs_the_long_timeout() -> None:
    job = Synth()
    job.steps(30)
    f = Funnel()
    job.feed(f, tail_s=0)
    job.gpu_util[:] = 0.0  # every GPU idles: a checkpoint or an evaluation, not a hang
    job.stall(10)
    assert opened(job.feed(f, tail_s=0), "hang") == []
    job.stall(25)
    assert len(opened(job.feed(f, tail_s=0), "hang")) == 1


def test_gpu_error_from_an_xid() -> None:
    job = Synth()
    job.steps(10)
    job.gpu_xid[3] = 1
    job.steps(5)
    (d,) = opened(job.feed(Funnel()), "gpu_error")
    assert (d.ranks, d.level, d.loop, d.critical_path) == ([3], "cluster_health", "product", True)
    assert d.evidence["last_xid"] == 79


def test_cpu_saturation_explains_the_starvation_on_its_node() -> None:
    job = Synth(nodes=2, per_node=2)
    job.steps(20)
    job.cpu[1] = 99.0
    job.steps(40, wait=[0, 0, 80, 80])
    diags = job.feed(Funnel())
    (cpu,) = opened(diags, "cpu_saturation")
    (dl,) = opened(diags, "dataloader_starvation")
    assert (cpu.nodes, cpu.explained_by) == (["j-node-1"], "")
    assert dl.explained_by == "cpu_saturation"


def test_load_imbalance_when_the_slowest_rank_rotates() -> None:
    job = Synth()
    job.steps(20)

    def rotating(step: int) -> list[float]:
        c = [90.0] * 4
        c[step % 4] = 130.0
        return c

    job.steps(60, compute=rotating)
    diags = job.feed(Funnel())
    assert roots(diags) == {"load_imbalance"}
    (d,) = opened(diags, "load_imbalance")
    assert d.evidence["imbalance"] == pytest.approx(1 - 90 / 130, abs=0.03)


def test_roofline_class_is_context_only() -> None:
    job = Synth()
    job.steps(60)
    diags = [d for d in opened(job.feed(Funnel())) if d.level == "kernel"]
    assert [d.bottleneck for d in diags] == ["compute_bound"]
    assert not diags[0].critical_path and diags[0].confidence <= 0.5
