"""Real `torchrun` and trainer jobs under `perfloop run`, against the real embedded stack: the
fast cases of the real-scenario suite (issue 21; the full suite with its figures is
``bench/realworld.py``). The scripts are the suite's own (`bench/realworld_jobs`), unmodified:
they do not import perfloop, and each writes its own ground truth.

What must hold:

- DDP's gradient all-reduce is recorded in ``collectives`` with its sizes: at every step each
  rank all-reduces the bytes of the model's gradients;
- the rank made slower, and only it, is named by a straggler diagnosis (never the rank that
  waits for it in the all-reduce);
- a healthy DDP run gets no straggler diagnosis;
- threads are never raised past a rank's CPU budget (2 ranks on a 2-CPU machine, each script
  sets 1 thread: nothing recommends or commands ``torch.num_threads`` above 1);
- a job that has ended gets no recommendation and no new diagnosis;
- a Lightning ``Trainer`` and a Hugging Face ``Trainer`` running unmodified have every step they
  ran in ``steps``, each with plausible phases (forward, backward and optimizer spans that tile
  the step).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.realworld_jobs.scenarios import JOBS
from perfloop.settings import StackSettings

from .conftest import last_step_ns, perfloop_cli, stream_settled, wait_for
from .conftest import query as _query

pytestmark = [pytest.mark.integration, pytest.mark.slow]

torch = pytest.importorskip("torch")

CPUS = len(os.sched_getaffinity(0))
TOLERANCE = 0.05  # depth-0 spans add up to the step time within this share
SETTLE_S = 20.0
"""The longest `stream_settled` waits, past a job's end, for its open diagnoses to be resolved:
the fixed settle it replaces (the stream tier had ~2 windows to speak)."""


def _torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), str(JOBS / script), *args]  # fmt: skip


def _run(
    env: dict[str, str], job: str, cmd: list[str], *, tier: str = "observe", timeout: float = 240
) -> str:
    """``perfloop run --tier TIER -- CMD``; its output (the job must end with 0)."""
    env = {k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = perfloop_cli(
        "run", "--job-id", job, "--tier", tier, "--no-gpu", "--", *cmd, env=env, timeout=timeout
    )
    assert out.returncode == 0, f"perfloop run failed ({out.returncode}):\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def _truth(folder: Path, rank: int = 0) -> dict[str, Any]:
    return dict(json.loads((folder / f"rank{rank}.json").read_text()))


class _Follow:
    """Records the job's diagnoses and recommendations as they arrive (wall clock)."""

    def __init__(self, settings: StackSettings, job: str) -> None:
        from perfloop.kafka import consumer
        from perfloop.schemas.topics import Topics

        self.job = job
        self.topics = [Topics.DIAGNOSES, Topics.RECOMMENDATIONS]
        self.events: list[tuple[int, Any]] = []
        self._c = consumer(settings, f"it-realworld-{job}")
        self._stop, self._assigned = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Follow:
        self._t.start()
        assert self._assigned.wait(30), "the consumer could not reach the topics"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(10)

    def _loop(self) -> None:
        from perfloop.kafka import tail
        from perfloop.schemas import SchemaError, decode_event

        try:
            tail(self._c, self.topics, self._stop, self._assigned)
            while not self._stop.is_set():
                msg = self._c.poll(0.2)
                if msg is None or msg.error() or (msg.key() or b"") != self.job.encode():
                    continue
                try:
                    self.events.append((time.time_ns(), decode_event(msg.value() or b"")))
                except SchemaError:
                    continue
        finally:
            self._c.close()


def _diagnoses(settings: StackSettings, job: str, kind: str) -> list[tuple[Any, ...]]:
    return _query(
        settings,
        "SELECT DISTINCT diagnosis_id, ranks, rank, state, summary FROM diagnoses "
        "WHERE job_id = {j:String} AND bottleneck = {k:String}",
        j=job,
        k=kind,
    )


def _named(rows: list[tuple[Any, ...]]) -> set[int]:
    """Every rank the diagnoses name (``ranks``, else ``rank`` when it is one)."""
    return {r for _, ranks, rank, *_ in rows for r in (ranks or ([rank] if rank >= 0 else []))}


# -- a healthy 2-rank DDP job under tier auto: collectives, no straggler, threads --------------


@pytest.fixture(scope="module")
def healthy_ddp(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    job = f"rw-it-ddp-{uuid.uuid4().hex[:8]}"
    truth = tmp_path_factory.mktemp("truth-ddp")
    cmd = _torchrun(2, "ddp.py", "--fault", "none", "--seconds", "30", "--seed", "11",
                    "--truth", str(truth))  # fmt: skip
    _run(stack_env_vars, job, cmd, tier="auto")
    stream_settled(stack, job, last_step_ns(truth), at_most_s=SETTLE_S)
    yield job, truth


def test_ddp_gradient_all_reduce_is_recorded_with_its_sizes(
    stack: StackSettings, healthy_ddp: tuple[str, Path]
) -> None:
    job, truth = healthy_ddp
    grad_bytes = _truth(truth)["params"]["grad_bytes"]
    steps = _truth(truth)["step_ms"]
    assert grad_bytes > 1 << 20 and len(steps) > 50
    # per rank and step: the bytes all-reduced (the script's own 4-byte stop flag every 10
    # steps aside, DDP's gradient buckets)
    rows = _query(
        stack,
        "SELECT rank, step, sumIf(size_bytes, size_bytes > 64), countIf(size_bytes > 64), "
        "min(duration_ms) FROM (SELECT * FROM collectives WHERE job_id = {j:String} "
        "AND op = 'all_reduce' LIMIT 1 BY event_id, step, op, size_bytes, duration_ms) "
        "GROUP BY rank, step HAVING countIf(size_bytes > 64) > 0",
        j=job,
    )
    per_rank = {r: [x for x in rows if x[0] == r] for r in (0, 1)}
    for rank, got in per_rank.items():
        # every step but the first (ours replaces no hook before the first step) is there
        assert len(got) >= len(steps) - 2, (
            f"rank {rank}: DDP's all-reduce recorded at {len(got)} of {len(steps)} steps"
        )
        # DDP's buckets of a step's backward belong to that step: each step all-reduces the
        # gradients once (not a bucket short, not one of the next step's)
        sizes = Counter(b for _, step, b, _, _ in got if step > 0)
        wrong = {b: n for b, n in sizes.items() if not grad_bytes <= b <= grad_bytes * 1.01}
        assert sizes and not wrong, (
            f"rank {rank}: the gradients are {grad_bytes} bytes; bytes all-reduced per step "
            f"(bytes: steps) {dict(sizes.most_common(6))}"
        )
        assert all(d >= 0 for *_, d in got)
    comm = _query(
        stack,
        "SELECT count() FROM spans WHERE job_id = {j:String} AND phase = 'comm'",
        j=job,
    )[0][0]
    assert comm > 0, "no comm spans: DDP's all-reduce is folded into backward"


def test_tensor_parallel_collectives_are_recorded_with_their_sizes(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    """DTensor's tensor parallelism all-reduces through PyTorch's functional collectives, not
    ``torch.distributed``'s functions: each rank's all-reduces of a step (two row-wise outputs
    in forward, an input gradient in backward, all of the batch's activation size) are rows
    with their size and group."""
    job = f"rw-it-tp-{uuid.uuid4().hex[:8]}"
    steps = 40
    _run(stack_env_vars, job, _torchrun(2, "tp.py", "--steps", str(steps), "--seed", "5",
                                        "--truth", str(tmp_path)))  # fmt: skip
    size = _truth(tmp_path)["params"]["out_bytes"]

    def per_step() -> list[tuple[Any, ...]]:
        return _query(
            stack,
            "SELECT rank, step, count(), groupUniqArray(group_size) FROM (SELECT * FROM "
            "collectives WHERE job_id = {j:String} AND op = 'all_reduce' "
            "AND size_bytes = {b:Int64} LIMIT 1 BY event_id, rank, step, duration_ms) "
            "GROUP BY rank, step",
            j=job,
            b=size,
        )

    wait_for(lambda: len(per_step()) >= 2 * steps, 60, f"{steps} steps of collectives a rank")
    rows = per_step()
    for rank in (0, 1):
        counts = {step: n for r, step, n, _ in rows if r == rank}
        assert sorted(counts) == list(range(steps)), f"rank {rank}: steps {sorted(counts)}"
        assert all(n == 3 for n in counts.values()), f"rank {rank}: all-reduces a step {counts}"
    assert {tuple(g) for *_, g in rows} == {(2,)}


def test_a_healthy_ddp_run_gets_no_straggler(
    stack: StackSettings, healthy_ddp: tuple[str, Path]
) -> None:
    job, _ = healthy_ddp
    assert _diagnoses(stack, job, "straggler") == []


def test_threads_are_never_raised_past_a_ranks_cpu_budget(
    stack: StackSettings, healthy_ddp: tuple[str, Path]
) -> None:
    """2 ranks share this machine's CPUs; each set 1 torch thread: its budget is CPUs / 2."""
    job, truth = healthy_ddp
    budget = max(1, CPUS // 2)
    assert _truth(truth)["params"]["world"] == 2
    recs = _query(
        stack,
        "SELECT rank, from_value, to_value, rationale FROM recommendations "
        "WHERE job_id = {j:String} AND knob = 'torch.num_threads'",
        j=job,
    )
    cmds = _query(
        stack,
        "SELECT rank, from_value, value FROM commands WHERE job_id = {j:String} "
        "AND knob = 'torch.num_threads'",
        j=job,
    )
    assert not [c for c in cmds if int(float(c[2])) > budget], f"commands: {cmds}"
    assert not [r for r in recs if int(float(r[2])) > budget], f"recommendations: {recs}"


# -- a straggler by slower compute -----------------------------------------------------------


def test_the_slowed_rank_and_only_it_is_named_a_straggler(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    job = f"rw-it-strag-{uuid.uuid4().hex[:8]}"
    # 14 s slowed after the onset: twice the longest the detector may take to open (15 steps'
    # median lateness, then at most detect.straggler.max_persist_s = 6 s; ~3 s measured)
    cmd = _torchrun(2, "ddp.py", "--fault", "straggler_compute", "--culprit", "1",
                    "--slow-factor", "1.0", "--onset-s", "6", "--seconds", "20", "--seed", "12",
                    "--truth", str(tmp_path))  # fmt: skip
    _run(stack_env_vars, job, cmd)
    assert _truth(tmp_path, 1)["onset_ns"], "rank 1 became slower"
    stream_settled(stack, job, last_step_ns(tmp_path), at_most_s=SETTLE_S)
    rows = _diagnoses(stack, job, "straggler")
    assert rows, "no straggler diagnosis"
    assert _named(rows) == {1}, f"straggler diagnoses name ranks {_named(rows)}: {rows}"


# -- an ended job -------------------------------------------------------------------------------


def test_no_recommendation_and_no_diagnosis_for_an_ended_job(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    """A starving loader (a CPU-bound augmentation, no workers) under tier observe: the
    bottleneck is still open when the job ends; after its end nothing is said about it."""
    from perfloop.schemas import Diagnosis, Recommendation

    job = f"rw-it-ended-{uuid.uuid4().hex[:8]}"
    # diagnosed (and recommended workers) ~1 s into its 10 s; what follows its end is what
    # counts, and the wait below is measured from it
    cmd = [sys.executable, str(JOBS / "single.py"), "--fault", "cpu_loader", "--seconds", "10",
           "--seed", "13", "--truth", str(tmp_path)]  # fmt: skip
    with _Follow(stack, job) as follow:
        _run(stack_env_vars, job, cmd)
        ended = time.time_ns()
        time.sleep(45)  # past the grace, a whole 30 s recommendation period (it repeated)
    said = [(t, e) for t, e in follow.events if isinstance(e, Recommendation | Diagnosis)]
    assert any(isinstance(e, Diagnosis) for _, e in said), "the starving loader was diagnosed"
    grace = 10 * 1_000_000_000  # what was decided on the job's last windows may still come
    late = [
        f"{(t - ended) / 1e9:.0f} s after the end: {type(e).__name__} "
        f"{getattr(e, 'knob', '') or getattr(e, 'bottleneck', '')} "
        f"{getattr(e, 'state', '')}"
        for t, e in said
        if t > ended + grace
        and (isinstance(e, Recommendation) or (isinstance(e, Diagnosis) and e.state == "open"))
    ]
    assert not late, f"{len(late)} for an ended job: {late[:5]}"


# -- trainers ------------------------------------------------------------------------------------


def _phases_plausible(settings: StackSettings, job: str, steps: int) -> None:
    rows = _query(
        settings,
        "SELECT step, any(step_time_ms) FROM steps WHERE job_id = {j:String} AND rank = 0 "
        "GROUP BY step ORDER BY step",
        j=job,
    )
    assert len(rows) == steps, f"{len(rows)} steps in the warehouse, the trainer ran {steps}"
    spans = _query(
        settings,
        "SELECT step, phase, sum(duration_ms) FROM (SELECT * FROM spans WHERE job_id = "
        "{j:String} AND rank = 0 AND depth = 0 LIMIT 1 BY event_id) GROUP BY step, phase",
        j=job,
    )
    by_step: dict[int, dict[str, float]] = {}
    for step, phase, ms in spans:
        by_step.setdefault(step, {})[phase] = ms
    bad = {}
    for step, step_ms in rows[1:]:  # the first step holds the trainer's set-up
        ph = by_step.get(step, {})
        missing = [p for p in ("forward", "backward", "optimizer") if ph.get(p, 0.0) <= 0.0]
        tiled = abs(sum(ph.values()) - step_ms) <= TOLERANCE * step_ms
        if missing or not tiled:
            bad[step] = (round(step_ms, 2), {p: round(v, 2) for p, v in ph.items()})
    assert not bad, (
        f"{len(bad)} of {len(rows) - 1} steps lack forward/backward/optimizer spans or are not "
        f"tiled by them (step → (step ms, depth-0 spans)): {dict(list(bad.items())[:5])}"
    )


@pytest.mark.parametrize("script", ["lightning_job.py", "hf_job.py"])
def test_a_trainer_has_every_step_with_plausible_phases(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path, script: str
) -> None:
    job = f"rw-it-{script.split('_')[0]}-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, str(JOBS / script), "--steps", "40", "--seed", "14",
           "--truth", str(tmp_path)]  # fmt: skip
    _run(stack_env_vars, job, cmd)
    truth = _truth(tmp_path)
    assert truth["exit"] == "ok" and truth["params"]["trainer_steps"] == 40
    wait_for(
        lambda: (
            _query(
                stack, "SELECT count() FROM steps WHERE job_id = {j:String} AND rank = 0", j=job
            )[0][0]
            >= 40
        ),
        60,
        f"the steps of job {job}",
    )
    time.sleep(3)  # their spans land in their own insert
    _phases_plausible(stack, job, 40)
