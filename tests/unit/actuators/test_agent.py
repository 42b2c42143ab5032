"""The job agent, without a broker: which commands it applies, when, and what it refuses.

The agent's Kafka clients point at a closed port and `start()` is never called; commands go
in through `receive`, and acks to the unreachable broker must not raise.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from perfloop.actuators import JobAgent, sign
from perfloop.schemas import ActuationResult, Command, KnobValue, encode_event
from perfloop.settings import BaseServiceSettings

KEY = b"agent-test-key"
KNOB = "dataloader.num_workers"
S = 1_000_000_000
NOW = 1_700_000_000 * S


class Recorder:
    """A knob handler that remembers every value it was given."""

    def __init__(self) -> None:
        self.values: list[KnobValue] = []

    def __call__(self, value: KnobValue) -> None:
        self.values.append(value)


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> BaseServiceSettings:
    monkeypatch.delenv("PERFLOOP_KAFKA_BOOTSTRAP", raising=False)
    return BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1")


@pytest.fixture
def handler() -> Recorder:
    return Recorder()


@pytest.fixture
def agent(settings: BaseServiceSettings, handler: Recorder) -> JobAgent:
    return JobAgent(settings, job_id="job-1", node="n0", signing_key=KEY, handlers={KNOB: handler})


def _cmd(seq: int = 1, *, key: bytes = KEY, **kw: Any) -> bytes:
    fields: dict[str, Any] = dict(
        ts_ns=NOW,
        job_id="job-1",
        node="n0",
        rank=-1,
        seq=seq,
        knob=KNOB,
        from_value=2,
        value=5,
        expires_ts_ns=NOW + 60 * S,
    )
    return encode_event(sign(Command(**(fields | kw)), key))


def _rejected(agent: JobAgent, data: bytes, handler: Recorder, expected: str) -> None:
    reason = agent.receive(data, now_ns=NOW)
    assert reason is not None and expected in reason
    assert agent.step_boundary(10) == []
    assert handler.values == []


def test_valid_command_is_applied_only_at_the_step_boundary_and_once(
    agent: JobAgent, handler: Recorder
) -> None:
    assert agent.receive(_cmd(), now_ns=NOW) is None
    assert handler.values == [], "nothing changes between steps"
    (result,) = agent.step_boundary(42)
    assert handler.values == [5]
    assert isinstance(result, ActuationResult)
    assert (result.status, result.knob, result.value, result.step) == ("applied", KNOB, 5, 42)
    assert (result.job_id, result.node) == ("job-1", "n0")
    assert agent.step_boundary(43) == []
    assert handler.values == [5]
    assert agent.results == [result]


def test_ack_names_the_command(agent: JobAgent) -> None:
    data = _cmd()
    agent.receive(data, now_ns=NOW)
    (result,) = agent.step_boundary(1)
    assert result.command_id == orjson.loads(data)["event_id"]


def test_commands_apply_in_arrival_order(settings: BaseServiceSettings, handler: Recorder) -> None:
    # Without verification, all at the next boundary (with it, one per verdict:
    # test_agent_verify.py).
    agent = JobAgent(settings, job_id="job-1", node="n0", signing_key=KEY,
                     handlers={KNOB: handler}, verify_changes=False)  # fmt: skip
    for seq, value in ((1, 4), (2, 8), (3, 6)):
        assert agent.receive(_cmd(seq, value=value), now_ns=NOW) is None
    assert [r.value for r in agent.step_boundary(7)] == [4, 8, 6]
    assert handler.values == [4, 8, 6]


def test_unsigned_command_is_rejected(agent: JobAgent, handler: Recorder) -> None:
    cmd = Command(
        ts_ns=NOW,
        job_id="job-1",
        node="n0",
        rank=-1,
        seq=1,
        knob=KNOB,
        value=5,
        expires_ts_ns=NOW + S,
    )
    _rejected(agent, encode_event(cmd), handler, "signature")


def test_tampered_command_is_rejected(agent: JobAgent, handler: Recorder) -> None:
    doc = orjson.loads(_cmd(value=5))
    doc["value"] = 64
    _rejected(agent, orjson.dumps(doc), handler, "signature")


def test_command_signed_with_another_key_is_rejected(agent: JobAgent, handler: Recorder) -> None:
    _rejected(agent, _cmd(key=b"attacker"), handler, "signature")


@pytest.mark.parametrize("expires", [NOW, NOW - 1, NOW - 5 * S])
def test_expired_command_is_rejected(agent: JobAgent, handler: Recorder, expires: int) -> None:
    _rejected(agent, _cmd(expires_ts_ns=expires), handler, "expired")


def test_replayed_command_is_rejected(agent: JobAgent, handler: Recorder) -> None:
    data = _cmd(5)
    assert agent.receive(data, now_ns=NOW) is None
    agent.step_boundary(1)
    assert handler.values == [5]
    for replay in (data, _cmd(5, value=6), _cmd(4, value=7)):
        reason = agent.receive(replay, now_ns=NOW)
        assert reason is not None and "sequence" in reason
    assert agent.step_boundary(2) == []
    assert handler.values == [5]


def test_replay_before_the_boundary_is_applied_once(agent: JobAgent, handler: Recorder) -> None:
    data = _cmd(3)
    assert agent.receive(data, now_ns=NOW) is None
    assert agent.receive(data, now_ns=NOW) is not None
    agent.step_boundary(1)
    assert handler.values == [5]


def test_rejected_command_does_not_consume_its_sequence(agent: JobAgent, handler: Recorder) -> None:
    assert agent.receive(_cmd(9, key=b"attacker"), now_ns=NOW) is not None
    assert agent.receive(_cmd(2), now_ns=NOW) is None
    agent.step_boundary(1)
    assert handler.values == [5]


def test_command_for_another_job_is_ignored(agent: JobAgent, handler: Recorder) -> None:
    assert agent.receive(_cmd(job_id="job-2"), now_ns=NOW) is None
    assert agent.step_boundary(1) == []
    assert handler.values == []
    assert agent.results == [], "another job's command is not acked by this one"
    # ...and does not move this job's sequence.
    assert agent.receive(_cmd(1), now_ns=NOW) is None


def test_unknown_knob_is_rejected(agent: JobAgent, handler: Recorder) -> None:
    _rejected(agent, _cmd(knob="optimizer.lr", value=0.1), handler, "'optimizer.lr'")


@pytest.mark.parametrize(
    ("value", "why"),
    [(65, "outside"), (-1, "outside"), (1e6, "outside"), ("8", "not a number"),
     (True, "not a number"), (2.5, "not a whole number")],
)  # fmt: skip
def test_out_of_bounds_or_non_numeric_value_is_rejected(
    agent: JobAgent, handler: Recorder, value: KnobValue, why: str
) -> None:
    _rejected(agent, _cmd(value=value), handler, why)


def test_the_jobs_own_bounds_narrow_the_allow_list(settings: BaseServiceSettings) -> None:
    """A 2-CPU job refuses 5 loader workers although the allow-list admits 64."""
    handler = Recorder()
    agent = JobAgent(
        settings, job_id="job-1", node="n0", signing_key=KEY, handlers={KNOB: handler},
        bounds={KNOB: (0, 2)},
    )  # fmt: skip
    _rejected(agent, _cmd(value=5), handler, "outside [0, 2]")
    assert agent.receive(_cmd(2, value=2), now_ns=NOW) is None


def test_a_switch_takes_only_true_or_false(settings: BaseServiceSettings) -> None:
    handler = Recorder()
    pin = "dataloader.pin_memory"
    agent = JobAgent(settings, job_id="job-1", node="n0", signing_key=KEY, handlers={pin: handler})
    _rejected(agent, _cmd(knob=pin, value=1), handler, "true or false")
    assert agent.receive(_cmd(2, knob=pin, value=True), now_ns=NOW) is None
    agent.step_boundary(1)
    assert handler.values == [True]


@pytest.mark.parametrize("data", [b"", b"\x00\xff garbage", b"[]", b'{"kind": "command"}'])
def test_garbage_is_rejected_with_a_reason(agent: JobAgent, handler: Recorder, data: bytes) -> None:
    _rejected(agent, data, handler, "")
    assert agent.results == []


def test_rejections_are_acked_in_results(agent: JobAgent) -> None:
    agent.receive(_cmd(key=b"attacker"), now_ns=NOW)
    agent.receive(_cmd(2, expires_ts_ns=NOW - 1), now_ns=NOW)
    assert [r.status for r in agent.results] == ["rejected", "rejected"]
    assert "signature" in agent.results[0].reason
    assert "expired" in agent.results[1].reason


def test_failing_handler_yields_rejected_and_does_not_raise(settings: BaseServiceSettings) -> None:
    def broken(value: KnobValue) -> None:
        raise RuntimeError("loader cannot restart")

    seen: list[ActuationResult] = []
    agent = JobAgent(
        settings,
        job_id="job-1",
        node="n0",
        signing_key=KEY,
        handlers={KNOB: broken},
        on_result=seen.append,
    )
    assert agent.receive(_cmd(), now_ns=NOW) is None
    (result,) = agent.step_boundary(3)
    assert result.status == "rejected"
    assert "loader cannot restart" in result.reason
    assert result.step == 3
    assert seen == [result] == agent.results


def test_on_result_sees_every_ack(settings: BaseServiceSettings, handler: Recorder) -> None:
    seen: list[ActuationResult] = []
    agent = JobAgent(
        settings,
        job_id="job-1",
        node="n0",
        signing_key=KEY,
        handlers={KNOB: handler},
        on_result=seen.append,
    )
    agent.receive(_cmd(1), now_ns=NOW)
    agent.receive(_cmd(1), now_ns=NOW)  # replay
    agent.step_boundary(9)
    assert [r.status for r in seen] == ["rejected", "applied"]
    assert seen == agent.results


def test_custom_knob_without_bounds_is_applied(settings: BaseServiceSettings) -> None:
    got = Recorder()
    agent = JobAgent(
        settings, job_id="job-1", node="n0", signing_key=KEY, handlers={"trainer.mode": got}
    )
    assert agent.receive(_cmd(knob="trainer.mode", value="fast"), now_ns=NOW) is None
    agent.step_boundary(1)
    assert got.values == ["fast"]
