"""The actuator service runs its action hook for a straggler's node, apart from its loop, and
audits how it went. No broker: what the service publishes is kept here."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from perfloop.actuators import ActuatorService, sign
from perfloop.schemas import Approval, Command, Decision, JobLifecycle, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings
from tests.helpers import recommendation

S = 1_000_000_000
DRAIN = "cluster.drain_node"

RECORDER = """\
import json, sys, time
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
print("node", sys.argv[2], "drained")
sys.exit(int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 0)
"""


def _service(tmp_path: Path, tier: str = "auto", hook: str | None = None, **kw: Any) -> Any:
    script = tmp_path / "hook.py"
    script.write_text(RECORDER)
    calls = tmp_path / "calls.jsonl"
    if hook is None:
        hook = f"{sys.executable} {script} {calls} {{node}} job={{job}} ranks={{ranks}} "
        hook += "rec={rec_id} 'reason=perfloop: {reason}'"
    settings = ActuatorSettings(
        PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1", signing_key="k", tier=tier,
        straggler_hook=hook, **kw,
    )  # fmt: skip
    service = ActuatorService(settings)
    published: list[Any] = []

    def publish(topic: str, event: Any) -> bool:
        published.append((topic, event))
        return True

    service._publish = publish  # type: ignore[method-assign]
    service.published = published
    service.calls = calls
    return service


def _decisions(service: Any) -> list[Decision]:
    return [e for t, e in service.published if t == Topics.ACTUATIONS]


def _calls(service: Any) -> list[list[str]]:
    path = service.calls
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _straggler(**kw: Any) -> Any:
    fields: dict[str, Any] = dict(
        ts_ns=time.time_ns(), knob=DRAIN, from_value="", to_value="n3", loop="slow",
        rationale="rank 1 on host n3 is 40 ms late to every all-reduce (score 6.2)",
        evidence={"rank": 1.0, "lateness_ms": 40.0, "score": 6.2, "steps": 120.0},
    )  # fmt: skip
    return recommendation(**(fields | kw))


def test_auto_runs_the_hook_once_with_the_right_arguments(tmp_path: Path) -> None:
    service = _service(tmp_path, tier="auto")
    rec = _straggler()
    assert service.handle(encode_event(rec)) is None, "nothing goes to the job"
    assert service.wait_actions(30)
    assert _calls(service) == [[
        "n3", "job=job-1", "ranks=1", f"rec={rec.event_id}",
        "reason=perfloop: rank 1 on host n3 is 40 ms late to every all-reduce (score 6.2)",
    ]]  # fmt: skip
    [decision] = _decisions(service)
    assert (decision.outcome, decision.rec_id, decision.knob, decision.to_value) == (
        "issued",
        rec.event_id,
        DRAIN,
        "n3",
    )
    assert decision.reason == "action hook ran for cluster.drain_node = n3: exit 0: node n3 drained"
    assert not [e for t, e in service.published if t == Topics.CONTROL], "no command to the job"
    # the same straggler again: at most once per job and node
    service.handle(encode_event(_straggler()))
    assert service.wait_actions(30) and len(_calls(service)) == 1
    assert "already ran for node n3" in _decisions(service)[-1].reason


def test_observe_records_and_runs_nothing(tmp_path: Path) -> None:
    service = _service(tmp_path, tier="observe")
    service.handle(encode_event(_straggler()))
    assert service.wait_actions(5)
    assert _calls(service) == []
    assert [d.outcome for d in _decisions(service)] == ["observed"]


def test_approve_runs_the_hook_after_the_approval(tmp_path: Path) -> None:
    service = _service(tmp_path, tier="approve")
    rec = _straggler()
    service.handle(encode_event(rec))
    assert _decisions(service)[-1].outcome == "pending" and _calls(service) == []
    appr = Approval(
        ts_ns=time.time_ns(), job_id="job-1", node="cli", rank=-1, rec_id=rec.event_id,
        verdict="approve", author="ana@host", knob=DRAIN, to_value="n3", loop="slow",
        rec_ts_ns=rec.ts_ns,
    )  # fmt: skip
    service.handle(encode_event(sign(appr, b"k")), Topics.RECOMMENDATIONS)
    assert service.wait_actions(30)
    [call] = _calls(service)
    assert call[:3] == ["n3", "job=job-1", "ranks=1"], "the recommendation's own evidence"
    decision = _decisions(service)[-1]
    assert (decision.outcome, decision.actor) == ("issued", "ana@host")
    assert "exit 0" in decision.reason


def test_a_failing_hook_is_audited_as_failed(tmp_path: Path) -> None:
    script = tmp_path / "hook.py"
    hook = f"{sys.executable} {script} {tmp_path / 'calls.jsonl'} {{node}} 3"
    service = _service(tmp_path, tier="auto", hook=hook)
    service.handle(encode_event(_straggler()))
    assert service.wait_actions(30)
    assert len(_calls(service)) == 1
    [decision] = _decisions(service)
    assert decision.outcome == "refused"
    assert decision.reason == (
        "action hook failed for cluster.drain_node = n3: exit 3: node n3 drained"
    )


def test_a_hook_that_hangs_does_not_hold_up_the_other_jobs(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import time; time.sleep(30)")
    service = _service(tmp_path, hook=f"{sys.executable} {script} {{node}}",
                       straggler_hook_timeout_s=2)  # fmt: skip
    service.handle(encode_event(_straggler()))
    cmd = service.handle(encode_event(recommendation(job_id="job-2")))
    assert cmd is not None, "the next message is decided while the hook runs"
    assert [d.knob for d in _decisions(service)] == ["dataloader.num_workers"]
    assert service.wait_actions(30)
    hook = [d for d in _decisions(service) if d.knob == DRAIN]
    assert hook[-1].outcome == "refused" and "timed out after 2 s" in hook[-1].reason


def test_without_a_hook_the_straggler_is_recorded_with_the_reason(tmp_path: Path) -> None:
    service = _service(tmp_path, tier="auto", hook="")
    service.handle(encode_event(_straggler()))
    [decision] = _decisions(service)
    assert (decision.outcome, decision.reason) == (
        "recommended", "no action hook configured (PERFLOOP_STRAGGLER_HOOK)"
    )  # fmt: skip


def test_a_straggler_of_a_job_that_ended_never_reaches_the_hook(tmp_path: Path) -> None:
    service = _service(tmp_path, tier="auto")
    end = JobLifecycle(ts_ns=time.time_ns(), job_id="job-1", node="n0", rank=-1,
                       state="killed", exit_code=137)  # fmt: skip
    service.handle(encode_event(end), Topics.JOB)
    service.handle(encode_event(_straggler()))
    assert service.wait_actions(5) and _calls(service) == []
    assert [(d.outcome, d.reason) for d in _decisions(service)] == [
        ("refused", "job ended (killed, exit code 137)")
    ]


@pytest.mark.parametrize("node", ["--all", "n3;reboot"])
def test_a_node_that_could_be_an_option_never_reaches_the_hook(tmp_path: Path, node: str) -> None:
    service = _service(tmp_path, tier="auto")
    service.handle(encode_event(_straggler(to_value=node)))
    assert service.wait_actions(5) and _calls(service) == []
    assert _decisions(service)[-1].outcome == "refused"


def test_commands_are_still_signed_and_published(tmp_path: Path) -> None:
    service = _service(tmp_path, tier="auto")
    cmd = service.handle(encode_event(recommendation()))
    assert isinstance(cmd, Command)
    assert [t for t, _ in service.published] == [Topics.CONTROL, Topics.ACTUATIONS]
