"""`perfloop run` on unmodified training scripts, against the real embedded stack.

Acceptance: the `steps` table holds exactly the steps each script counted itself; the depth-0
phase spans of every step sum to its step time within 5 %; under torchrun (2 ranks, gloo on
CPU) each rank reports its own rank and the job's world size. Also: gradient accumulation,
evaluation loops, collectives, the job's lifecycle, exit codes and SIGTERM forwarding.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from perfloop.cli._export_trace import check_trace
from perfloop.settings import StackSettings
from tests.helpers import DEVTOOLS_READY, devtools_read

from .conftest import perfloop_cli, wait_for
from .conftest import query as _query

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "scripts"
TOLERANCE = 0.05


def _job() -> str:
    return f"run-it-{uuid.uuid4().hex[:8]}"


def _eventually(
    settings: StackSettings, sql: str, expected: list[tuple[Any, ...]], **params: Any
) -> list[tuple[Any, ...]]:
    """The query's rows once they equal ``expected``, or as they are after 30 s: each table's
    rows land in their own insert, so a job's info or collectives may come a flight after
    the steps and spans `_tiled` waited for."""
    got: list[tuple[Any, ...]] = []

    def check() -> bool:
        got[:] = _query(settings, sql, **params)
        return got == expected

    with contextlib.suppress(AssertionError):
        wait_for(check, 30, sql)
    return got


def _run(env: dict[str, str], job: str, *cmd: str, timeout: float = 240) -> str:
    out = perfloop_cli("run", "--job-id", job, "--no-gpu", "--", *cmd, env=env, timeout=timeout)
    assert out.returncode == 0, f"perfloop run failed ({out.returncode}):\n{out.stderr[-3000:]}"
    assert f"job {job}" in out.stderr
    return out.stdout


def _steps_and_spans(
    settings: StackSettings, job: str
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """(rank, step) → step time, and (rank, step) → sum of its depth-0 spans (deduplicated)."""
    steps = _query(
        settings,
        "SELECT rank, step, any(step_time_ms) FROM steps WHERE job_id = {j:String} "
        "GROUP BY rank, step",
        j=job,
    )
    spans = _query(
        settings,
        "SELECT rank, step, sum(duration_ms) FROM (SELECT rank, step, duration_ms FROM spans "
        "WHERE job_id = {j:String} AND depth = 0 LIMIT 1 BY event_id) GROUP BY rank, step",
        j=job,
    )
    return {(r, s): t for r, s, t in steps}, {(r, s): d for r, s, d in spans}


def _tiled(settings: StackSettings, job: str, expected: dict[int, int]) -> dict[str, Any]:
    """Wait until every rank has its expected steps and every step its spans; return them."""
    state: dict[str, Any] = {}

    def ready() -> bool:
        steps, spans = _steps_and_spans(settings, job)
        state.update(steps=steps, spans=spans)
        per_rank = {r: sum(1 for rk, _ in steps if rk == r) for r in expected}
        return per_rank == expected and all(k in spans for k in steps)

    wait_for(ready, 60, f"steps {expected} and their spans of job {job}")
    bad = {
        k: (t, state["spans"][k])
        for k, t in state["steps"].items()
        if abs(state["spans"][k] - t) > TOLERANCE * t
    }
    assert not bad, f"spans do not sum to the step time (rank, step → (step ms, spans ms)): {bad}"
    return state


def _script_steps(stdout: str) -> int:
    m = re.search(r"steps=(\d+)", stdout)
    assert m, f"the script did not print its step count:\n{stdout}"
    return int(m.group(1))


def test_cnn_steps_match_the_script_and_spans_tile_them(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = _job()
    slurm = {"SLURM_JOB_ID": "7071", "SLURM_JOB_NAME": "cnn", "SLURM_JOB_NODELIST": "gpu[01-02]",
             "SLURM_STEP_ID": "0"}  # fmt: skip
    env = {**stack_env_vars, **slurm}  # as if launched by srun: the job's scheduler identity
    n = _script_steps(_run(env, job, sys.executable, str(SCRIPTS / "mnist_cnn.py")))
    assert n == 20
    _tiled(stack, job, {0: n})

    phases = {
        p
        for (p,) in _query(
            stack, "SELECT DISTINCT phase FROM spans WHERE job_id = {j:String}", j=job
        )
    }
    assert {"data_wait", "forward", "backward", "optimizer"} <= phases
    rows = _query(
        stack,
        "SELECT min(batch_size), max(batch_size), countIf(loss IS NULL), countIf(lr IS NULL), "
        "countIf(grad_norm IS NULL), countIf(rss_bytes = 0), max(epoch), min(step), max(step) "
        "FROM steps WHERE job_id = {j:String}",
        j=job,
    )
    # every step has its batch size, loss, learning rate, clipped gradient norm and RSS;
    # the second epoch is epoch 1; steps are numbered from 0
    assert rows == [(64, 64, 0, 0, 0, 0, 1, 0, n - 1)]

    info = wait_for(
        lambda: _query(
            stack,
            "SELECT rank, model_name, model_params, optimizer, world_size, precision, framework, "
            "batch_size FROM job_info WHERE job_id = {j:String}",
            j=job,
        ),
        30,
        "the job's info",
    )
    assert info[0][:2] == (0, "Net")
    assert info[0][2] > 100_000 and info[0][3:] == ("Adadelta", 1, "fp32", "torch", 64)
    who = _query(
        stack,
        "SELECT DISTINCT scheduler, slurm_job_id, slurm_job_name, slurm_nodelist, slurm_step_id, "
        "k8s_pod FROM job_info WHERE job_id = {j:String} AND rank = 0",
        j=job,
    )
    assert who == [("slurm", "7071", "cnn", "gpu[01-02]", "0", "")], who

    def lifecycle() -> set[tuple[int, str, int | None]]:
        return set(
            _query(
                stack,
                "SELECT rank, state, exit_code FROM job_lifecycle WHERE job_id = {j:String}",
                j=job,
            )
        )

    wait_for(lambda: len(lifecycle()) >= 4, 30, "the lifecycle of the job")
    assert lifecycle() == {(-1, "started", None), (0, "started", None), (0, "finished", None),
                           (-1, "finished", 0)}  # fmt: skip


def test_gradient_accumulation_is_one_step_per_optimizer_step(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = _job()
    out = _run(stack_env_vars, job, sys.executable, str(SCRIPTS / "transformer_lm.py"))
    n = _script_steps(out)
    _tiled(stack, job, {0: n})
    rows = _query(
        stack,
        "SELECT DISTINCT grad_accum_steps, batch_size, samples, tokens FROM steps "
        "WHERE job_id = {j:String}",
        j=job,
    )
    assert rows == [(4, 8, 32, 4 * 8 * 32)]  # 4 micro-batches of 8 sequences of 32 tokens


def test_evaluation_loops_make_eval_spans_not_steps(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = _job()
    out = _run(stack_env_vars, job, sys.executable, str(SCRIPTS / "train_eval.py"))
    n = _script_steps(out)
    assert n == 48 and "eval_batches=12" in out
    state = _tiled(stack, job, {0: n})
    evals = _query(
        stack,
        "SELECT step, count(), sum(duration_ms) FROM spans WHERE job_id = {j:String} "
        "AND phase = 'eval' AND depth = 0 GROUP BY step ORDER BY step",
        j=job,
    )
    # after epochs 1 and 2 the evaluation falls in the next epoch's first step; after
    # epoch 3 it belongs to the step that never finished (no step row)
    assert [(s, c) for s, c, _ in evals] == [(16, 1), (32, 1), (48, 1)]
    for step, _, ms in evals[:2]:
        assert ms < state["steps"][(0, step)]


def test_torchrun_ranks_world_size_and_collectives(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    job = _job()
    out = _run(
        stack_env_vars,
        job,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(SCRIPTS / "ddp.py"),
    )
    found = re.findall(r"rank=(\d) world=(\d) steps=(\d+)", out)
    ranks = {int(r): (int(w), int(s)) for r, w, s in found}
    assert set(ranks) == {0, 1} and {w for w, _ in ranks.values()} == {2}
    _tiled(stack, job, {r: s for r, (_, s) in ranks.items()})

    expected_info = [(r, 2, 2, "gloo", "ddp", "Sequential") for r in (0, 1)]
    info = _eventually(
        stack,
        "SELECT DISTINCT rank, world_size, local_world_size, backend, parallelism, model_name "
        "FROM job_info WHERE job_id = {j:String} ORDER BY rank",
        expected_info,
        j=job,
    )
    assert info == expected_info
    steps = ranks[0][1]
    grads = 4 * (64 * 128 + 128 + 128 * 4 + 4)  # the model's float32 gradients: one bucket
    expected_colls = [
        (0, "all_reduce", 4, steps, 2),  # the logged loss: one float32 per step
        (0, "all_reduce", grads, steps - 1, 2),  # DDP's, timed from the second step on
        (0, "barrier", 0, 1, 2),
        (1, "all_reduce", 4, steps, 2),
        (1, "all_reduce", grads, steps - 1, 2),
        (1, "barrier", 0, 1, 2),
    ]
    colls = _eventually(
        stack,
        "SELECT rank, op, size_bytes, count(), max(group_size) FROM "
        "(SELECT * FROM collectives WHERE job_id = {j:String} LIMIT 1 BY event_id) "
        "GROUP BY rank, op, size_bytes ORDER BY rank, op, size_bytes",
        expected_colls,
        j=job,
    )
    assert colls == expected_colls
    comm = _query(
        stack,
        "SELECT count() FROM spans WHERE job_id = {j:String} AND phase = 'comm' AND depth = 0",
        j=job,
    )
    assert comm[0][0] >= 2 * steps

    # the job as a Chrome trace: every step of both ranks, its spans and collectives
    trace_file = tmp_path / "trace.json"
    out = perfloop_cli("export", job, "-o", str(trace_file), env=stack_env_vars)
    assert out.returncode == 0, out.stderr
    trace = json.loads(trace_file.read_text())
    assert check_trace(trace)["ranks"] == 2
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank, (_, n) in ranks.items():
        got = sorted(e["args"]["step"] for e in xs if e["pid"] == rank and e["cat"] == "step")
        assert got == list(range(n)), f"rank {rank}: steps {got[:5]}… of {n}"
        mine = {e["cat"] for e in xs if e["pid"] == rank}
        assert {"forward", "backward", "optimizer", "comm", "collective"} <= mine, mine
    if DEVTOOLS_READY:  # and as Chrome DevTools' trace engine reads it (`make devtools-trace`)
        read = devtools_read(trace_file)["threads"]
        threads = {(t["pid"], t["name"]): t["entries"] for t in read}
        for rank, (_, n) in ranks.items():
            assert [e[1] for e in threads[(rank, "steps")]] == [f"step {i}" for i in range(n)]
            assert threads[(rank, "phases")] and threads[(rank, "collectives")]
    part = perfloop_cli("export", job, "--steps", "2..4", "-o", str(trace_file), env=stack_env_vars)
    assert part.returncode == 0, part.stderr
    kept = json.loads(trace_file.read_text())["traceEvents"]
    assert sorted(e["args"]["step"] for e in kept if e.get("cat") == "step") == [2, 2, 3, 3, 4, 4]
    nope = perfloop_cli("export", "no-such-job", env=stack_env_vars)
    assert nope.returncode == 1 and nope.stderr.count("\n") == 1 and "no steps" in nope.stderr


def test_exit_code_and_failure_are_reported(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = _job()
    script = (
        "import torch\n"
        "m = torch.nn.Linear(2, 2)\n"
        "m(torch.zeros(1, 2)).sum().backward()\n"
        "raise RuntimeError('boom')\n"
    )
    out = perfloop_cli(
        "run", "--job-id", job, "--no-gpu", "--", sys.executable, "-c", script, env=stack_env_vars
    )
    assert out.returncode == 1 and "RuntimeError: boom" in out.stderr

    def states() -> set[tuple[int, str, int | None]]:
        return set(
            _query(
                stack,
                "SELECT rank, state, exit_code FROM job_lifecycle WHERE job_id = {j:String}",
                j=job,
            )
        )

    wait_for(lambda: {(-1, "failed", 1), (0, "failed", 1)} <= states(), 30, "failed states")
    msg = _query(
        stack,
        "SELECT message FROM job_lifecycle WHERE job_id = {j:String} AND rank = 0 "
        "AND state = 'failed'",
        j=job,
    )
    assert "RuntimeError: boom" in msg[0][0]

    plain = perfloop_cli(
        "run", "--no-gpu", "--", sys.executable, "-c", "raise SystemExit(7)", env=stack_env_vars
    )
    assert plain.returncode == 7


def test_sigterm_is_forwarded_and_the_exit_code_kept(stack_env_vars: dict[str, str]) -> None:
    script = "import time; print('ready', flush=True); time.sleep(60)"
    cli = [sys.executable, "-m", "perfloop.cli", "run", "--no-gpu", "--"]
    proc = subprocess.Popen(
        [*cli, sys.executable, "-c", script],
        env=stack_env_vars,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
