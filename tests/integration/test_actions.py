"""What the user sees and decides, and the straggler's action hook, on a real embedded stack.

The stack here is this module's own (`private_stack`): its actuator has an action hook, a small
script that records each call's arguments to a file (and fails for a node whose name starts
with "bad"). Each test uses its own job:

- the hook for a straggler's node: tier ``auto`` runs it once with the right arguments,
  ``observe`` does not, ``approve`` runs it after ``perfloop approve``, and a failing hook is
  audited as failed; every decision is in ``audit``;
- ``perfloop run --pin torch.num_threads`` on a real torch script: its agent refuses a signed
  command for the pinned knob (acked rejected, "pinned by the user"), applies one for another
  knob, and says each on the job's stderr; the actuator refuses a recommendation for the
  pinned knob; once the job has ended, the actuator refuses its recommendations ("job ended").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfloop.actuators import sign
from perfloop.identity import PrivateKey
from perfloop.kafka import producer
from perfloop.schemas import Command, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from tests.helpers import recommendation

from .conftest import perfloop_cli, private_stack, stack_signed, wait_for
from .conftest import query as _query

pytestmark = pytest.mark.integration

DRAIN = "cluster.drain_node"
HOOK = """\
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
node = sys.argv[2]
if node.startswith("bad"):
    print(f"scontrol: error: Invalid node name specified: {node}")
    sys.exit(3)
print(f"node {node} drained")
"""
TRAIN = """\
import pathlib, sys, time
import torch
from perfloop.producers import tunable

torch.set_num_threads(1)
accum = tunable("train.grad_accum_steps", 4, lo=1, hi=64)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
stop, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + 150
while not stop.exists() and time.monotonic() < deadline:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    time.sleep(0.02)
"""


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hook") / "calls.jsonl"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, calls: Path) -> Iterator[StackSettings]:
    script = calls.parent / "drain.py"
    script.write_text(HOOK)
    hook = f"{sys.executable} {script} {calls} {{node}} job={{job}} ranks={{ranks}} "
    hook += "rec={rec_id} 'reason=perfloop: {reason}'"
    home = tmp_path_factory.mktemp("perfloop-home")
    with private_stack(home, PERFLOOP_STRAGGLER_HOOK=hook) as settings:
        yield settings


@pytest.fixture(scope="module")
def env(stack: StackSettings) -> dict[str, str]:
    import os

    out = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    out.update(
        PERFLOOP_HOME=str(stack.home),
        PERFLOOP_KAFKA_PORT=str(stack.kafka_port),
        PERFLOOP_CLICKHOUSE_PORT=str(stack.clickhouse_port),
    )
    return out


def _publish(settings: StackSettings, topic: str, event: Any) -> None:
    """Publish ``event``: a recommendation signed as the stack's stream tier signs them."""
    event = stack_signed(settings, event)
    p = producer(settings)
    p.produce(topic, key=event.job_id.encode(), value=encode_event(event))
    assert p.flush(10) == 0


def _job(stack: StackSettings, env: dict[str, str], tier: str) -> str:
    job = f"it-act-{tier}-{uuid.uuid4().hex[:6]}"
    out = perfloop_cli("config", "set", "actuator.tier", tier, "--job", job, env=env)
    assert out.returncode == 0, out.stderr
    log = stack.home / "logs" / "actuator.log"
    wait_for(lambda: f"actuator.tier for job {job}: 'auto' -> '{tier}'" in log.read_text(), 30,
             "the actuator to take the job's tier")  # fmt: skip
    return job


def _straggler(job: str, node: str) -> Any:
    return recommendation(
        ts_ns=time.time_ns(), job_id=job, node=node, knob=DRAIN, from_value="", to_value=node,
        loop="slow", rationale=f"rank 1 on host {node} is 40 ms late to every all-reduce",
        evidence={"rank": 1.0, "lateness_ms": 40.0, "score": 6.2, "steps": 120.0},
    )  # fmt: skip


def _audit(stack: StackSettings, rec_id: str, n: int = 1) -> list[tuple[Any, ...]]:
    sql = ("SELECT outcome, actor, tier, reason, to_value FROM audit WHERE rec_id = {r:String} "
           "ORDER BY ts LIMIT 1 BY event_id")  # fmt: skip
    return wait_for(
        lambda: (rows := _query(stack, sql, r=rec_id)) and len(rows) >= n and rows,
        45,
        f"{n} decisions about {rec_id} in audit",
    )


def _calls(calls: Path, job: str) -> list[list[str]]:
    if not calls.exists():
        return []
    return [c for c in map(json.loads, calls.read_text().splitlines()) if f"job={job}" in c]


# -- the action hook ------------------------------------------------------------------------


def test_auto_runs_the_hook_once_with_the_right_arguments(
    stack: StackSettings, env: dict[str, str], calls: Path
) -> None:
    job = _job(stack, env, "auto")
    rec = _straggler(job, "node-7")
    _publish(stack, Topics.RECOMMENDATIONS, rec)
    [(outcome, actor, tier, reason, node)] = _audit(stack, rec.event_id)
    assert (outcome, actor, tier, node) == ("issued", "actuator", "auto", "node-7")
    assert reason == "action hook ran for cluster.drain_node = node-7: exit 0: node node-7 drained"
    assert _calls(calls, job) == [[
        "node-7", f"job={job}", "ranks=1", f"rec={rec.event_id}",
        "reason=perfloop: rank 1 on host node-7 is 40 ms late to every all-reduce",
    ]]  # fmt: skip
    again = _straggler(job, "node-7")
    _publish(stack, Topics.RECOMMENDATIONS, again)
    [(outcome, *_, reason, _)] = _audit(stack, again.event_id)
    assert outcome == "refused" and "already ran for node node-7" in reason
    assert len(_calls(calls, job)) == 1, "at most once per job and node"
    commands = _query(stack, "SELECT count() FROM commands WHERE job_id = {j:String}", j=job)
    assert commands == [(0,)], "nothing is sent to the job"


def test_observe_records_the_straggler_and_runs_nothing(
    stack: StackSettings, env: dict[str, str], calls: Path
) -> None:
    job = _job(stack, env, "observe")
    rec = _straggler(job, "node-8")
    _publish(stack, Topics.RECOMMENDATIONS, rec)
    [(outcome, _, tier, reason, _)] = _audit(stack, rec.event_id)
    assert (outcome, tier, reason) == ("observed", "observe", "tier observe: recorded")
    time.sleep(1)
    assert _calls(calls, job) == []


def test_approve_runs_the_hook_after_the_approval(
    stack: StackSettings, env: dict[str, str], calls: Path
) -> None:
    job = _job(stack, env, "approve")
    rec = _straggler(job, "node-9")
    _publish(stack, Topics.RECOMMENDATIONS, rec)
    [(outcome, *_, reason, _)] = _audit(stack, rec.event_id)
    assert outcome == "pending" and "then the action hook runs" in reason
    assert _calls(calls, job) == []
    out = perfloop_cli("approve", rec.event_id, "--reason", "drain it", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "actuator: issued: action hook ran for cluster.drain_node = node-9: exit 0" in out.stdout
    [call] = _calls(calls, job)
    assert call[:4] == ["node-9", f"job={job}", "ranks=1", f"rec={rec.event_id}"]
    outcome, actor, *_ = _audit(stack, rec.event_id, 2)[-1]
    assert outcome == "issued" and "@" in actor, "decided by the person who approved"


def test_a_failing_hook_is_audited_as_failed(
    stack: StackSettings, env: dict[str, str], calls: Path
) -> None:
    job = _job(stack, env, "auto")
    rec = _straggler(job, "bad-node-3")
    _publish(stack, Topics.RECOMMENDATIONS, rec)
    [(outcome, *_, reason, _)] = _audit(stack, rec.event_id)
    assert outcome == "refused"
    assert reason == (
        "action hook failed for cluster.drain_node = bad-node-3: exit 3: "
        "scontrol: error: Invalid node name specified: bad-node-3"
    )
    assert len(_calls(calls, job)) == 1


# -- pins, the job's stderr, and the end of a job --------------------------------------------


def _command(stack: StackSettings, job: str, seq: int, knob: str, value: Any) -> Command:
    """Signed as the stack's actuator signs: with its key (`perfloop.stack._keys`), which the
    jobs of its machine check commands against."""
    now = time.time_ns()
    cmd = Command(ts_ns=now, job_id=job, node="it", rank=-1, seq=seq, knob=knob, value=value,
                  expires_ts_ns=now + 60 * 1_000_000_000)  # fmt: skip
    return sign(cmd, PrivateKey.load(stack.home_dir / "keys" / "actuator.key"))


def _acks(stack: StackSettings, command_id: str, n: int) -> list[tuple[Any, ...]]:
    sql = ("SELECT status, reason, value FROM actuations WHERE command_id = {c:String} "
           "ORDER BY ts LIMIT 1 BY event_id")  # fmt: skip
    return wait_for(
        lambda: (rows := _query(stack, sql, c=command_id)) and len(rows) >= n and rows,
        60,
        f"{n} acks of {command_id}",
    )


def test_a_pinned_knob_is_left_alone_and_the_job_says_what_changed(
    stack: StackSettings, env: dict[str, str], tmp_path: Path
) -> None:
    job = f"it-pin-{uuid.uuid4().hex[:6]}"
    script, stop, err = tmp_path / "train.py", tmp_path / "stop", tmp_path / "stderr.txt"
    script.write_text(TRAIN)
    argv = [sys.executable, "-m", "perfloop.cli", "run", "--job-id", job, "--no-gpu",
            "--tier", "observe", "--pin", "torch.num_threads", "--",
            sys.executable, str(script), str(stop)]  # fmt: skip
    with err.open("w") as f:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=f)
    try:
        steps = "SELECT count() FROM steps WHERE job_id = {j:String}"
        wait_for(lambda: _query(stack, steps, j=job)[0][0] >= 20, 120, "the job's first steps")
        assert f"perfloop: job {job}: pinned torch.num_threads" in err.read_text()
        pinned, other = (_command(stack, job, 1, "torch.num_threads", 2),
                         _command(stack, job, 2, "train.grad_accum_steps", 8))  # fmt: skip
        for cmd in (pinned, other):
            _publish(stack, Topics.CONTROL, cmd)
        [(status, reason, _)] = _acks(stack, pinned.event_id, 1)
        assert status == "rejected"
        assert reason == "pinned by the user (perfloop run --pin, PERFLOOP_PINNED_KNOBS)"
        applied, verdict = _acks(stack, other.event_id, 2)[:2]
        assert applied[0] == "applied" and verdict[0] in ("kept", "rolled_back")
        # the actuator was told too: it refuses a recommendation for the pinned knob
        rec = recommendation(ts_ns=time.time_ns(), job_id=job, knob="torch.num_threads",
                             from_value=1, to_value=2)  # fmt: skip
        _publish(stack, Topics.RECOMMENDATIONS, rec)
        [(outcome, *_, reason, _)] = _audit(stack, rec.event_id)
        assert (outcome, reason) == (
            "refused", "torch.num_threads is pinned by the user (actuator.pinned)"
        )  # fmt: skip
    finally:
        stop.touch()
        code = proc.wait(60)
    assert code == 0, err.read_text()[-3000:]
    lines = [ln for ln in err.read_text().splitlines() if ln.startswith("perfloop[rank ")]
    short = pinned.event_id[:12]
    assert (
        f"perfloop[rank 0]: rejected torch.num_threads = 2 (command {short}): pinned by the user"
        in "\n".join(lines)
    ), lines
    assert any(
        ln.startswith("perfloop[rank 0]: applied train.grad_accum_steps 4 → 8 at step ")
        for ln in lines
    ), lines
    assert any(
        ln.startswith(("perfloop[rank 0]: kept train.grad_accum_steps = 8: ",
                       "perfloop[rank 0]: rolled back train.grad_accum_steps 8 → 4: "))
        for ln in lines
    ), lines  # fmt: skip

    # The job has ended (its launcher said so): nothing more for it, audited with the reason.
    late = recommendation(ts_ns=time.time_ns(), job_id=job, to_value=3)
    wait_for(
        lambda: _query(stack, "SELECT count() FROM job_lifecycle WHERE job_id = {j:String} "
                       "AND rank = -1 AND state = 'finished'", j=job)[0][0],
        30, "the job's end in the warehouse",
    )  # fmt: skip
    _publish(stack, Topics.RECOMMENDATIONS, late)
    [(outcome, *_, reason, _)] = _audit(stack, late.event_id)
    assert (outcome, reason) == ("refused", "job ended (finished, exit code 0)")
