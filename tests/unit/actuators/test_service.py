"""The actuator service: it signs what it issues, publishes a decision for each message, takes
its live settings, and survives what it cannot read (the decisions themselves: test_policy)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from perfloop.actuators import ActuatorService, verify
from perfloop.bad_input import dead_letter_policy
from perfloop.schemas import Command, ConfigChange, JobLifecycle, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings
from tests.helpers import recommendation

KNOB = "dataloader.num_workers"
S = 1_000_000_000
T0 = 1_700_000_000 * S


_rec = recommendation


@pytest.fixture
def unreachable_settings(monkeypatch: pytest.MonkeyPatch) -> ActuatorSettings:
    for name in ("PERFLOOP_TIER", "PERFLOOP_SIGNING_KEY", "PERFLOOP_COOLDOWN_S"):
        monkeypatch.delenv(name, raising=False)
    return ActuatorSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1", signing_key="k", tier="auto")


def test_service_signs_the_commands_it_issues(unreachable_settings: ActuatorSettings) -> None:
    service = ActuatorService(unreachable_settings)
    cmd = service.handle(encode_event(_rec()))
    assert cmd is not None
    assert verify(cmd, b"k")
    assert (service.issued, service.decisions) == (1, 1)


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        b"{}",
        orjson.dumps({"kind": "recommendation", "job_id": "j"}),
    ],
)
def test_service_ignores_unreadable_recommendations(
    unreachable_settings: ActuatorSettings, data: bytes
) -> None:
    service = ActuatorService(unreachable_settings)
    assert service.handle(data) is None
    assert service.issued == 0


def test_a_message_that_does_not_decode_is_skipped_or_dead_lettered_as_told(
    unreachable_settings: ActuatorSettings,
) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    class Producer:
        def produce(self, topic: str, **kw: Any) -> None:
            sent.append((topic, kw))

    skipping = ActuatorService(unreachable_settings)  # the sink reports it: skipped
    skipping._producer = Producer()
    assert skipping.handle(b"garbage", partition=1, offset=5, key=b"j") is None
    assert sent == []
    telling = ActuatorService(unreachable_settings, on_error=dead_letter_policy)
    telling._producer = Producer()
    assert telling.handle(b"garbage", partition=1, offset=5, key=b"j") is None
    ((topic, kw),) = sent
    headers = dict(kw["headers"])
    assert (topic, kw["value"], kw["key"]) == (Topics.DLQ, b"garbage", b"j")
    assert headers["perfloop.source.offset"] == b"5" and headers["perfloop.reason"]
    assert telling.issued == 0


def test_service_ignores_other_event_kinds(unreachable_settings: ActuatorSettings) -> None:
    service = ActuatorService(unreachable_settings)
    cmd = Command(
        ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob=KNOB, value=3, expires_ts_ns=2
    )
    assert service.handle(encode_event(cmd)) is None
    assert service.issued == 0


def test_service_takes_its_live_settings_from_the_control_topic(
    unreachable_settings: ActuatorSettings,
) -> None:
    service = ActuatorService(unreachable_settings)

    def change(target: str, key: str, value: Any) -> bytes:
        return encode_event(
            ConfigChange(ts_ns=1, job_id="job-1", node="cli", rank=-1, target=target,
                         applies_to="job-1", key=key, value=value)
        )  # fmt: skip

    assert service.handle(change("actuator", "actuator.tier", "approve"), Topics.CONTROL) is None
    assert service.policy.rules("job-1").tier == "approve"
    # A bad value, or a change for someone else, changes nothing and stops nothing.
    service.handle(change("actuator", "actuator.tier", "sometimes"), Topics.CONTROL)
    service.handle(change("producers", "sampling.gpu_interval_ms", 50), Topics.CONTROL)
    assert service.policy.rules("job-1").tier == "approve"
    assert service.handle(encode_event(_rec())) is None, "pending approval"
    # the bad value's refusal and the recommendation's decision, both for audit
    assert (service.issued, service.decisions) == (0, 2)


def test_a_job_with_its_own_key_gets_commands_only_it_can_verify(
    unreachable_settings: ActuatorSettings,
) -> None:
    settings = ActuatorSettings(
        PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1", signing_key="k", job_signing_keys={"job-1": "own"}
    )
    service = ActuatorService(settings)
    mine = service.handle(encode_event(_rec()))
    other = service.handle(encode_event(_rec(job_id="job-2")))
    assert mine is not None and other is not None
    assert (mine.key_id, other.key_id) == ("job:job-1", "default")
    assert verify(mine, b"own") and not verify(mine, b"k")
    assert verify(other, b"k") and not verify(other, b"own")


def test_job_keys_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_JOB_SIGNING_KEYS", '{"llm-7": "s3cret"}')
    keys = ActuatorSettings().job_signing_keys
    assert {j: k.get_secret_value() for j, k in keys.items()} == {"llm-7": "s3cret"}


def test_a_job_that_ended_is_refused_and_its_state_freed_later(
    unreachable_settings: ActuatorSettings,
) -> None:
    settings = unreachable_settings.model_copy(update={"ended_job_retention_s": 0.2})
    service = ActuatorService(settings)
    published: list[Any] = []
    service._publish = lambda topic, event: published.append((topic, event)) or True  # type: ignore[method-assign]
    end = JobLifecycle(ts_ns=time.time_ns(), job_id="job-1", node="n0", rank=-1,
                       state="failed", exit_code=1)  # fmt: skip
    assert service.handle(encode_event(end), Topics.JOB) is None
    assert service.handle(encode_event(_rec())) is None, "no command for a job that ended"
    assert [(t, e.outcome, e.reason) for t, e in published] == [
        (Topics.ACTUATIONS, "refused", "job ended (failed, exit code 1)")
    ]
    assert service.handle(encode_event(_rec(job_id="job-2"))) is not None, "others go on"
    time.sleep(0.3)
    service.handle(encode_event(_rec(job_id="job-3")))  # any message frees what is due
    assert "job-1" not in service.policy._free_at and service.policy.ended("job-1")


@pytest.mark.parametrize("scheme", ["shared key", "ed25519"])
def test_a_command_on_the_topic_counts_as_acted_on_only_when_signed_here(
    unreachable_settings: ActuatorSettings, tmp_path: Any, scheme: str
) -> None:
    """A command someone else put on ``perfloop.control`` — a forgery the job refuses anyway,
    here with a sequence number near the top of the range — neither marks its recommendation
    acted on nor moves the job's sequence numbers; one signed here does both."""
    from perfloop.actuators import sign
    from perfloop.identity import PrivateKey

    settings = unreachable_settings
    own: bytes | PrivateKey = b"k"
    if scheme == "ed25519":
        own = PrivateKey.generate()
        own.save(tmp_path / "a.key")
        settings = settings.model_copy(update={"signing_private_key": tmp_path / "a.key"})
    service = ActuatorService(settings)
    rec = _rec(job_id="j1")

    def command(rec_id: str, seq: int, key: bytes | PrivateKey) -> bytes:
        cmd = Command(ts_ns=T0, job_id="j1", node="n0", rank=-1, rec_id=rec_id, seq=seq,
                      knob=KNOB, from_value=2, value=4, expires_ts_ns=T0 + 60 * S)  # fmt: skip
        return encode_event(sign(cmd, key))

    for forger in (b"someone-else", PrivateKey.generate()):
        assert service.handle(command(rec.event_id, 2**62, forger)) is None
    issued = service.handle(encode_event(rec))
    assert issued is not None, "the forgeries marked the recommendation acted on"
    assert issued.seq < 2**62, "a forgery moved the job's sequence numbers"
    again = _rec(job_id="j1", knob="torch.num_threads", from_value=8, to_value=4)
    assert service.handle(command(again.event_id, issued.seq + 5, own)) is None
    assert service.handle(encode_event(again)) is None  # acted on here before: refused
