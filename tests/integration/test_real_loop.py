"""The loop closed on a real torch training job: `perfloop run --tier auto` on the unmodified
example script (no DataLoader workers for a costly augmentation, 4× more threads than CPUs),
against the real embedded stack.

What must hold whatever the machine's speed: the stream tier recommends loader workers and
fewer threads; the actuator's signed commands reach the job; its agent applies them between
steps (the DataLoader's workers really change mid-epoch, and torch's threads) and gives each a
verdict; the steps, acks and decisions are in the warehouse; the job ends normally. How much
faster it got is measured in bench/real_job.py, not asserted here.
"""

from __future__ import annotations

import os
import uuid

import pytest

from perfloop.demo_real import run_real_job
from perfloop.settings import StackSettings

from .conftest import query as _query

pytestmark = [pytest.mark.integration, pytest.mark.slow]

torch = pytest.importorskip("torch")


def test_a_real_job_is_diagnosed_changed_between_steps_and_verified(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = f"real-it-{uuid.uuid4().hex[:8]}"
    run = run_real_job(
        stack, job_id=job, seconds=45, show=lambda _: None, env={**os.environ, **stack_env_vars}
    )
    out = "\n".join(run.output)
    assert run.exit_code == 0, out[-3000:]
    assert "done:" in out, "the script ran to its end"
    applied = {a.knob: a for a in run.acks if a.status == "applied"}
    assert applied.get("dataloader.num_workers") is not None, out[-3000:]
    # 1 (the CPUs less one) when the job's info reached the stream tier before the diagnosis;
    # on a loaded stack it can come later, and the stream worker's own CPUs bound it (≤ 2×)
    workers_now = applied["dataloader.num_workers"].value
    assert isinstance(workers_now, int) and 1 <= workers_now <= 2 * (os.cpu_count() or 1)
    verdicts = {a.command_id: a.status for a in run.acks if a.status in ("kept", "rolled_back")}
    assert all(a.command_id in verdicts for a in applied.values()), "every change was judged"
    assert not [a for a in run.acks if a.status == "rejected"], run.acks
    # The DataLoader really ran with the workers from the step the last change was applied at.
    at = applied["dataloader.num_workers"].step
    workers = _query(
        stack,
        "SELECT DISTINCT num_workers FROM steps WHERE job_id = {j:String} AND rank = 0 "
        "AND step >= {s:UInt64} AND step < {s:UInt64} + 20",
        j=job,
        s=at,
    )
    assert workers == [(workers_now,)]
    # an I/O-bound loader may get more workers one verified change at a time: before the
    # first, the job ran the script's none
    first = min(
        a.step for a in run.acks if a.status == "applied" and a.knob == "dataloader.num_workers"
    )
    before = _query(
        stack,
        "SELECT DISTINCT num_workers FROM steps WHERE job_id = {j:String} AND step < {s:UInt64}",
        j=job,
        s=first,
    )
    assert before == [(0,)]
    # The threads: the job info published after the change says what the job runs.
    if "torch.num_threads" in applied:
        infos = _query(
            stack,
            "SELECT extra['torch.num_threads'] FROM job_info WHERE job_id = {j:String} "
            "ORDER BY ts DESC LIMIT 1",
            j=job,
        )
        # the value the change set (the rank's budget: 1 or 2 on 2 CPUs, as many loader
        # workers run beside it), when it was kept
        change = applied["torch.num_threads"]
        expected = str(change.value) if verdicts[change.command_id] == "kept" else None
        assert expected is None or infos == [(expected,)], (infos, change)
    # Every step of the job is there, and every decision and ack. How many steps are left after
    # the last verdict depends on how many changes were verified one after the other (an
    # I/O-bound loader's workers grow one verified change at a time; 24-48 on a loaded
    # machine): at least a verification window's worth (the agent's 20 steps).
    assert run.before and run.after and run.after["steps"] >= 20, (run.before, run.after)
    rows = _query(
        stack,
        "SELECT status, knob FROM actuations WHERE job_id = {j:String} ORDER BY ts",
        j=job,
    )
    assert ("applied", "dataloader.num_workers") in rows
    issued = _query(
        stack,
        "SELECT knob FROM audit WHERE job_id = {j:String} AND outcome = 'issued'",
        j=job,
    )
    assert ("dataloader.num_workers",) in issued
