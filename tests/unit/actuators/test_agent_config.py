"""Live config changes reaching a job's samplers through the job agent and the config listener.

No broker: the Kafka clients point at a closed port and are never started; control messages
go in through ``receive``. The handler is a real `NodeSampler`'s ``configure``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from perfloop.actuators.agent import ConfigListener, JobAgent
from perfloop.exceptions import ConfigError
from perfloop.producers.node_sampler import NodeSampler
from perfloop.schemas import Command, ConfigChange, encode_event
from perfloop.settings import BaseServiceSettings, ProducerSettings
from perfloop.testing import FakeGpuBackend

JOB = "job-1"


class Null:
    """An emitter that drops everything (the sampler is never started here)."""

    def add(self, kind: str, **values: Any) -> None:
        pass

    def extend(self, kind: str, **columns: Any) -> None:
        pass

    def event(self, event: Any) -> bool:
        return True


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> BaseServiceSettings:
    monkeypatch.delenv("PERFLOOP_KAFKA_BOOTSTRAP", raising=False)
    return BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1")


@pytest.fixture
def sampler() -> NodeSampler:
    st = ProducerSettings(host_interval_ms=1000, gpu_interval_ms=100, adaptive_sampling=False)
    return NodeSampler(st, Null(), job_id=JOB, node="n0", gpu_backend=FakeGpuBackend())


@pytest.fixture
def agent(settings: BaseServiceSettings, sampler: NodeSampler) -> JobAgent:
    return JobAgent(
        settings,
        job_id=JOB,
        node="n0",
        signing_key=b"k",
        handlers={},
        on_config=sampler.configure,
    )


def _change(key: str = "sampling.host_interval_ms", value: Any = 250, **kw: Any) -> bytes:
    fields: dict[str, Any] = dict(
        ts_ns=1, job_id="ops", node="cli", rank=-1, target="producers", key=key, value=value
    )
    return encode_event(ConfigChange(**(fields | kw)))


def _state(s: NodeSampler) -> tuple[Any, ...]:
    return s.settings, s.controller.intervals(), dict(s.controller.specs), s.controller.enabled


def test_a_change_for_every_job_changes_the_interval(agent: JobAgent, sampler: NodeSampler) -> None:
    assert agent.receive(_change(value=250, author="ana@n1")) is None
    assert sampler.settings.host_interval_ms == 250
    assert sampler.controller.interval("host") == 0.25


def test_a_change_for_this_job_changes_the_interval(agent: JobAgent, sampler: NodeSampler) -> None:
    agent.receive(_change("sampling.gpu_interval_ms", 40, job_id=JOB, applies_to=JOB))
    assert sampler.controller.interval("gpu.power") == 0.04
    agent.receive(_change("sampling.adaptive", True, applies_to=JOB))
    assert sampler.controller.enabled


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("sampling.gpu_rate_hz", 10, "unknown sampling setting 'sampling.gpu_rate_hz'"),
        ("sampling.host_interval_ms", 1, "sampling.host_interval_ms=1 is outside [10, 600000]"),
        ("sampling.adaptive", "sometimes", "must be true or false"),
        ("sampling.overhead_budget_pct", [[1.0, 2.0]], "must be a number"),
    ],
)
def test_a_bad_change_is_one_warning_and_changes_nothing(
    agent: JobAgent,
    sampler: NodeSampler,
    caplog: pytest.LogCaptureFixture,
    key: str,
    value: Any,
    expected: str,
) -> None:
    before = _state(sampler)
    with caplog.at_level(logging.INFO, logger="perfloop"):
        reason = agent.receive(_change(key, value))
    assert reason is not None and expected in reason
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    line = warnings[0].getMessage()
    assert "\n" not in line and key in line and JOB in line and expected in line
    assert _state(sampler) == before


@pytest.mark.parametrize(
    "fields",
    [
        {"applies_to": "job-2"},  # another job
        {"target": "streams", "key": "detect.hang.after_s"},  # the stream workers'
    ],
)
def test_a_change_for_someone_else_is_ignored_silently(
    agent: JobAgent, sampler: NodeSampler, caplog: pytest.LogCaptureFixture, fields: dict
) -> None:
    before = _state(sampler)
    with caplog.at_level(logging.INFO, logger="perfloop"):
        assert agent.receive(_change(**fields)) is None
    assert caplog.records == []
    assert _state(sampler) == before


def test_a_failing_handler_never_raises(
    settings: BaseServiceSettings, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(key: str, value: Any) -> tuple[Any, Any]:
        raise RuntimeError("boom")

    agent = JobAgent(
        settings, job_id=JOB, node="n0", signing_key=b"k", handlers={}, on_config=broken
    )
    reason = agent.receive(_change())
    assert reason is not None and "boom" in reason
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1


def test_without_a_handler_a_change_is_reported_not_applied(
    settings: BaseServiceSettings, caplog: pytest.LogCaptureFixture
) -> None:
    agent = JobAgent(settings, job_id=JOB, node="n0", signing_key=b"k", handlers={})
    reason = agent.receive(_change())
    assert reason is not None and "no sampling control" in reason
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1
    agent.on_config = lambda key, value: (None, value)  # registered later
    assert agent.receive(_change()) is None


def test_a_config_change_is_not_queued_as_a_command(agent: JobAgent) -> None:
    agent.receive(_change())
    assert agent.step_boundary(3) == [] and agent.results == []


def test_the_listener_applies_changes_and_leaves_commands_alone(
    settings: BaseServiceSettings, sampler: NodeSampler, caplog: pytest.LogCaptureFixture
) -> None:
    listener = ConfigListener(settings, job_id=JOB, on_config=sampler.configure)
    try:
        assert listener.receive(_change(value=500)) == (1000.0, 500.0)
        assert sampler.controller.interval("host") == 0.5
        cmd = Command(
            ts_ns=1, job_id=JOB, node="n", rank=-1, seq=1, knob="k", value=1, expires_ts_ns=2
        )
        assert listener.receive(encode_event(cmd)) is None
        assert listener.receive(b"not json") is None
        assert isinstance(listener.receive(_change(value=-5)), str)
        assert sampler.controller.interval("host") == 0.5
        assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1
    finally:
        listener.close()


def test_the_sampler_refuses_what_the_agent_reports(sampler: NodeSampler) -> None:
    with pytest.raises(ConfigError, match="unknown sampling setting"):
        sampler.configure("detect.hang.after_s", 5)
