"""The job agent inside a traced training process: signed commands change the real torch
knobs between two steps, and the script's loop never notices but for the speed.

The hooks run in this process with their agent; its Kafka clients point at a closed port, so
commands go in through `JobAgent.receive`, as the agent's consumer thread would pass them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from perfloop.actuators import sign
from perfloop.exceptions import ConfigError
from perfloop.producers import hooks, tunable
from perfloop.producers.knobs import TorchKnobs, Tunable
from perfloop.schemas import Command, encode_event
from perfloop.settings import ProducerSettings
from tests.unit.producers.test_hooks import FakePublisher

torch = pytest.importorskip("torch")

KEY = "knobs-test-key"
S = 1_000_000_000


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePublisher]:
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    pub = FakePublisher()
    settings = ProducerSettings(
        job_id="knobs-test", node="n0", stats_interval_s=3600, agent=True, signing_key=KEY
    )
    threads = torch.get_num_threads()
    assert hooks.install(settings, publisher=pub, command="pytest")
    try:
        yield pub
    finally:
        hooks.uninstall()
        torch.set_num_threads(threads)


class Indexed(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        return torch.full((4,), float(i)), i % 2


def _command(seq: int, knob: str, value: Any, from_value: Any = None) -> bytes:
    import time

    now = time.time_ns()
    cmd = Command(ts_ns=now, job_id="knobs-test", node="n0", rank=-1, seq=seq, knob=knob,
                  from_value=from_value, value=value, expires_ts_ns=now + 60 * S)  # fmt: skip
    return encode_event(sign(cmd, KEY.encode()))


def _train(commands: dict[int, list[bytes]]) -> list[int]:
    """One epoch of a plain loop; ``commands[k]`` reach the agent during step k. Returns the
    sample indices in the order the loop got them."""
    gen = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=4, shuffle=True, generator=gen)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[int] = []
    for k, (x, y) in enumerate(loader):
        seen.extend(int(v) for v in x[:, 0])
        for data in commands.get(k, []):
            sess = hooks.session()
            assert sess is not None and sess.agent is not None
            assert sess.agent.receive(data) is None, "the command passes the agent's checks"
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return seen


def test_commands_change_threads_and_workers_mid_epoch_without_changing_the_data(
    traced: FakePublisher,
) -> None:
    threads = torch.get_num_threads()
    expected = _train({})  # the same loop, unchanged (no agent involvement)
    hooks.uninstall()
    traced.messages.clear()
    settings = ProducerSettings(
        job_id="knobs-test", node="n0", stats_interval_s=3600, agent=True, signing_key=KEY
    )
    assert hooks.install(settings, publisher=traced, command="pytest")
    got = _train({
        2: [_command(1, "dataloader.num_workers", 1, from_value=0)],
        3: [_command(2, "torch.num_threads", 1, from_value=threads)],
    })  # fmt: skip
    sess = hooks.session()
    assert sess is not None
    results = [(r.knob, r.status, r.value) for r in sess.agent.results if r.status == "applied"]
    assert results == [("dataloader.num_workers", "applied", 1)]
    # one change at a time: the thread command waits for the workers' verdict (22 steps),
    # which this 16-step epoch does not reach
    assert got == expected, "the loop got the same samples in the same order"
    hooks.uninstall()
    rows = traced.rows("step")
    assert rows["num_workers"][:3] == [0, 0, 0] and set(rows["num_workers"][3:]) == {1}
    infos = traced.events("job_info")
    assert infos[-1].extra["dataloader.num_workers"] == "1", "the job info follows the change"
    cpus = int(infos[-1].extra["cpu_affinity"])
    budget = int(infos[-1].extra["cpu_budget"])
    assert 1 <= budget <= cpus  # one process: its affinity, or its container's quota
    # the job's own ranges, for the actuator to refuse what its hardware cannot take:
    # threads up to its CPU budget; loader workers (which may wait on storage) up to 4×
    assert infos[-1].extra["bounds.torch.num_threads"] == f"1,{budget}"
    assert infos[-1].extra["bounds.dataloader.num_workers"] == f"0,{max(8, 4 * budget)}"


def test_a_command_for_a_knob_out_of_the_jobs_hardware_is_rejected(
    traced: FakePublisher,
) -> None:
    cpus = TorchKnobs(torch, lambda: None).cpus
    _train({})  # the session starts with the first step
    sess = hooks.session()
    assert sess is not None
    reason = sess.agent.receive(_command(1, "torch.num_threads", cpus + 1))
    assert reason == f"torch.num_threads={cpus + 1} is outside [1, {cpus}]"
    assert sess.agent.results[-1].status == "rejected"


def test_threads_are_set_and_read_back() -> None:
    knobs = TorchKnobs(torch, lambda: None)
    before = torch.get_num_threads()
    try:
        knobs.handlers["torch.num_threads"](1)
        assert knobs.value("torch.num_threads") == 1 == torch.get_num_threads()
        with pytest.raises(ConfigError, match="whole number"):
            knobs.handlers["torch.num_threads"](1.5)
    finally:
        torch.set_num_threads(before)


def test_a_loader_knob_without_a_loader_is_refused() -> None:
    knobs = TorchKnobs(torch, lambda: None)
    with pytest.raises(ConfigError, match="no training DataLoader"):
        knobs.handlers["dataloader.num_workers"](2)


def test_a_scripts_tunable_becomes_a_knob() -> None:
    from perfloop.producers import knobs as module

    knobs = TorchKnobs(torch, lambda: None)
    try:
        accum = tunable("train.grad_accum_steps", 4, lo=1, hi=64)
        assert "train.grad_accum_steps" in knobs.handlers
        assert knobs.bounds["train.grad_accum_steps"] == (1, 64)
        knobs.handlers["train.grad_accum_steps"](8)
        assert accum.value == 8 == knobs.value("train.grad_accum_steps")
        with pytest.raises(ConfigError):
            Tunable("x", 0, lo=1, hi=2)
    finally:
        module._TUNABLES.pop("train.grad_accum_steps", None)


def test_the_explicit_monitor_runs_a_job_agent_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A script instrumented with `Monitor` gets commands for its threads and its tunables.
    With no broker to take its result, closing it waits 5 s for one, then drops it and says
    so (closing with the ack still queued waited 9 s more)."""
    from perfloop.producers import knobs as module
    from perfloop.producers.training import Monitor

    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    settings = ProducerSettings(job_id="knobs-test", node="n0", agent=True, signing_key=KEY)
    before = torch.get_num_threads()
    mon = Monitor(settings=settings, publisher=FakePublisher())
    agent = mon.agent
    try:
        accum = tunable("train.grad_accum_steps", 4, lo=1, hi=64)
        assert agent is not None
        assert agent.receive(_command(1, "train.grad_accum_steps", 8, from_value=4)) is None
        with mon.step(batch_size=4):
            assert accum.value == 4, "nothing changes inside a step"
        assert accum.value == 8, "applied at the step boundary"
        assert "dataloader.num_workers" not in agent._handlers, "needs perfloop run's hooks"
    finally:
        mon.close()
        module._TUNABLES.pop("train.grad_accum_steps", None)
        torch.set_num_threads(before)
    assert [r.status for r in agent.results] == ["applied"]
    assert "1 command results not delivered" in caplog.text, "dropped, and said so"
    assert mon.agent is None, "closing the monitor stops its agent"


class _Agent:
    """Stands for the `JobAgent` `start_agent` returns; notes what it is given, in order."""

    def __init__(self, pub: Any, knobs: TorchKnobs, log: list[Any]) -> None:
        self.pub, self.log = pub, log
        self._handlers = knobs.handlers
        spied = knobs.step_boundary
        closed = knobs.close

        def knobs_boundary(step: int) -> None:
            log.append(("knobs.boundary", step))
            spied(step)

        def knobs_close() -> None:
            log.append(("knobs.close",))
            closed()

        knobs.step_boundary, knobs.close = knobs_boundary, knobs_close  # type: ignore[method-assign]

    def observe_step(self, step: int, step_time_ms: float, loss: float | None = None) -> None:
        self.log.append(("observe", step, step_time_ms > 0, loss))

    def step_boundary(self, step: int) -> list[Any]:
        self.log.append(("boundary", step))
        return []

    def stop(self) -> None:
        self.log.append(("stop", [e.state for e in self.pub.events("lifecycle")]))


@pytest.fixture
def fake_agent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """`start_agent` makes an `_Agent`; returns its log, which starts with how it was made."""
    from perfloop.producers import knobs as module

    log: list[Any] = []

    def start_agent(settings: Any, knobs: TorchKnobs, **kw: Any) -> _Agent:
        log.append(("start", kw["job_id"], kw["node"], kw["rank"], kw.get("on_result")))
        return _Agent(pub, knobs, log)

    pub = FakePublisher()
    log.append(pub)
    monkeypatch.setattr(module, "start_agent", start_agent)
    return log


def test_the_monitors_agent_gets_each_step_then_its_boundary_and_stops_before_the_end(
    fake_agent: list[Any],
) -> None:
    """The explicit API's agent: each step's time and reported loss after the script's
    callbacks saw the step, the next step's number at the boundary, and its stop before the
    job's end is published."""
    from perfloop.producers.training import Callback, Monitor, StepRecord

    pub, log = fake_agent[0], fake_agent
    del log[0]

    class Watch(Callback):
        def on_step_end(self, record: StepRecord) -> None:
            log.append(("script", record.step))

    settings = ProducerSettings(job_id="knobs-test", node="n0", agent=True, signing_key=KEY)
    mon = Monitor(settings=settings, publisher=pub, rank=3, callbacks=[Watch()])
    assert mon.agent is not None
    for i, loss in enumerate([0.5, torch.tensor(0.25)]):
        with mon.step():
            mon.report(loss=loss)
        log.append(("loop", i))
    mon.close()
    assert log == [
        ("start", "knobs-test", "n0", 3, None),
        ("script", 0), ("observe", 0, True, 0.5), ("boundary", 1), ("knobs.boundary", 1),
        ("loop", 0),
        # a tensor loss is not read for the agent (it could wait on the GPU)
        ("script", 1), ("observe", 1, True, None), ("boundary", 2), ("knobs.boundary", 2),
        ("loop", 1),
        ("stop", ["started"]), ("knobs.close",),
    ]  # fmt: skip
    assert mon.agent is None and mon.errors == 0


def test_the_hooks_agent_gets_each_step_then_its_boundary_and_stops_before_the_end(
    fake_agent: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`perfloop run`'s agent: each step's time and its last CPU loss as the optimizer step
    ends it, then the boundary, the knobs' own after the agent's (a profiler capture starts or
    ends there); its acks mark the job info for republishing; at the end the agent stops and
    the knobs close before the job's end is published."""
    pub, log = fake_agent[0], fake_agent
    del log[0]
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    settings = ProducerSettings(
        job_id="knobs-test", node="n0", stats_interval_s=3600, agent=True, signing_key=KEY
    )
    assert hooks.install(settings, publisher=pub, command="pytest")
    losses: list[float] = []
    try:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            log.append(("loop", i))
        sess = hooks.session()
        assert sess is not None and sess.agent is not None
        assert log[0] == ("start", "knobs-test", "n0", 0, sess._changed)
    finally:
        hooks.uninstall()
    assert log[1:] == [
        *(
            e
            for i in range(3)
            for e in (
                ("observe", i, True, pytest.approx(losses[i])),
                ("boundary", i + 1),
                ("knobs.boundary", i + 1),
                ("loop", i),
            )
        ),
        ("stop", ["started"]),
        ("knobs.close",),
    ]
