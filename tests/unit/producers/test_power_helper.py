"""The GPU power-limit helper (`perfloop.producers.power_helper`): the privileged process sets
a power limit only for a ``gpu.power_limit_w`` command the actuator signed (Ed25519), fresh,
not seen before and within every GPU's range, and undoes only what it applied, for the same
user. Over its real Unix socket, with a job agent whose handler goes through it; the GPUs are
`perfloop.testing.FakeGpuBackend` (no GPU on this machine; the NVML calls are the agent's own,
tested in test_power_knob)."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfloop.actuators import JobAgent, sign
from perfloop.actuators.agent import applying
from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, KeyringFile, PrivateKey, TrustedKey
from perfloop.producers.power_helper import PowerHelper, helper_handler, helper_range, serve
from perfloop.schemas import Command, encode_event
from perfloop.settings import BaseServiceSettings
from perfloop.testing import FakeGpuBackend

S = 1_000_000_000
NOW = 1_700_000_000 * S
KNOB = "gpu.power_limit_w"
ACTUATOR = PrivateKey.generate()


def _command(**kw: Any) -> Command:
    fields: dict[str, Any] = dict(
        ts_ns=NOW, job_id="job-1", node="n0", rank=0, rec_id="rec-1", seq=1, knob=KNOB,
        from_value=700, value=450, expires_ts_ns=NOW + 60 * S,
    )  # fmt: skip
    return Command(**(fields | kw))


class Rig:
    def __init__(self, tmp: Path, **gpu: Any) -> None:
        ring = tmp / "ring.json"
        Keyring([TrustedKey.of(ACTUATOR.public_bytes(), "actuator")]).save(ring)
        self.gpu = FakeGpuBackend(devices=2, **gpu)
        self.gpu.open()
        self.helper = PowerHelper(self.gpu, KeyringFile(ring), clock=lambda: NOW)
        self.path = tmp / "power.sock"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=serve, args=(self.path, self.helper, self.stop))
        self.thread.start()
        for _ in range(500):  # until it listens
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                if s.connect_ex(str(self.path)) == 0:
                    break
            threading.Event().wait(0.01)

    def ask(self, request: Any) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.path))
            s.sendall(
                (request if isinstance(request, bytes) else json.dumps(request).encode()) + b"\n"
            )
            return json.loads(s.recv(1 << 16))

    def apply(self, cmd: Command, devices: list[int] | None = None) -> dict[str, Any]:
        raw = encode_event(cmd).decode()
        return self.ask({"op": "apply", "command": raw, "devices": devices or [0, 1]})


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.stop.set()
    r.thread.join(5)


def test_a_signed_fresh_command_sets_every_gpu_and_says_what_was_before(rig: Rig) -> None:
    assert rig.ask({"op": "range", "devices": [0, 1]}) == {"ok": True, "range": [100.0, 700.0]}
    reply = rig.apply(sign(_command(), ACTUATOR))
    assert reply == {"ok": True, "before": {"0": 700.0, "1": 700.0}}
    assert rig.gpu.power_limits_w == {0: 450.0, 1: 450.0}


@pytest.mark.parametrize(
    ("what", "cmd", "why"),
    [
        ("unsigned", _command(), "unsigned"),
        ("a shared key (any job host has one)", sign(_command(), b"dev-key"), "shared key"),
        ("a key not in its keyring", sign(_command(), PrivateKey.generate()), "not in the keyring"),
        ("tampered after signing", sign(_command(), ACTUATOR).model_copy(update={"value": 150}),
         "does not verify"),
        ("expired", sign(_command(expires_ts_ns=NOW - S), ACTUATOR), "expired"),
        ("another knob", sign(_command(knob="torch.num_threads", value=2), ACTUATOR),
         "sets gpu.power_limit_w only"),
        ("outside a GPU's range", sign(_command(value=900), ACTUATOR), "outside GPU 0's range"),
        ("not a number", sign(_command(value="max"), ACTUATOR), "not a number of watts"),
    ],
)  # fmt: skip
def test_what_it_refuses_changes_no_gpu(rig: Rig, what: str, cmd: Command, why: str) -> None:
    reply = rig.apply(cmd)
    assert reply["ok"] is False and why in reply["error"], (what, reply)
    assert rig.gpu.power_limits_w == {}, what


def test_a_replay_is_refused_by_id_and_by_sequence(rig: Rig) -> None:
    first = sign(_command(seq=5), ACTUATOR)
    assert rig.apply(first)["ok"]
    again = rig.apply(first)
    assert not again["ok"] and "replayed" in again["error"]
    older = rig.apply(sign(_command(seq=4, value=300), ACTUATOR))
    assert not older["ok"] and "not after 5" in older["error"]
    assert rig.gpu.power_limits_w == {0: 450.0, 1: 450.0}


def test_a_gpu_that_refuses_leaves_every_gpu_as_it_was(tmp_path: Path) -> None:
    r = Rig(tmp_path, deny_power_limit={1})
    try:
        reply = r.apply(sign(_command(), ACTUATOR))
        assert not reply["ok"] and "GPU 1" in reply["error"] and "put back" in reply["error"]
        assert r.gpu.power_limits_w.get(0, 700.0) == 700.0 and 1 not in r.gpu.power_limits_w
    finally:
        r.stop.set()
        r.thread.join(5)


def test_it_undoes_only_what_it_applied_for_the_same_user(rig: Rig) -> None:
    cmd = sign(_command(), ACTUATOR)
    assert rig.apply(cmd)["ok"]
    other = rig.helper.handle({"op": "restore", "command_id": cmd.event_id, "devices": [0, 1]},
                              uid=os.getuid() + 1)  # fmt: skip
    assert not other["ok"] and "another user" in other["error"]
    unknown = rig.ask({"op": "restore", "command_id": "nope", "devices": [0, 1]})
    assert not unknown["ok"] and "not applied here" in unknown["error"]
    assert rig.ask({"op": "restore", "command_id": cmd.event_id, "devices": [0, 1]})["ok"]
    assert rig.gpu.power_limits_w == {0: 700.0, 1: 700.0}
    twice = rig.ask({"op": "restore", "command_id": cmd.event_id, "devices": [0, 1]})
    assert not twice["ok"], "undone once"


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "a JSON object"),
        ({"op": "format", "devices": [0]}, "unknown op"),
        ({"op": "range", "devices": []}, "devices"),
        ({"op": "range", "devices": [True]}, "devices"),
        ({"op": "apply", "command": {"knob": KNOB}, "devices": [0]}, "JSON string"),
        ({"op": "apply", "command": "{}", "devices": [0]}, "not a command"),
        (b"x" * (70 << 10), "bytes"),
    ],
)
def test_bad_requests_get_one_line_and_the_helper_goes_on(
    rig: Rig, request_: Any, why: str
) -> None:
    reply = rig.ask(request_)
    assert reply["ok"] is False and why in reply["error"] and "\n" not in reply["error"]
    assert rig.ask({"op": "range", "devices": [0]})["ok"]  # still answering


def test_the_job_agent_applies_and_rolls_back_through_the_helper(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The agent verifies the command, its handler hands the helper the command itself; a
    change that made the steps slower is rolled back by the helper undoing it."""
    monkeypatch.delenv("PERFLOOP_KAFKA_BOOTSTRAP", raising=False)
    ring = tmp_path / "job-ring.json"
    Keyring([TrustedKey.of(ACTUATOR.public_bytes(), "actuator")]).save(ring)
    assert helper_range(rig.path, [0, 1]) == (100.0, 700.0)
    agent = JobAgent(
        BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1"),
        job_id="job-1", node="n0", signing_key=b"dev-key", keyring=KeyringFile(ring),
        handlers={KNOB: helper_handler(rig.path, [0, 1])}, read=lambda knob: 700.0,
        settle_steps=0, verify_steps=5,
    )  # fmt: skip
    for i in range(10):
        agent.observe_step(i, 100.0)
    assert agent.receive(encode_event(sign(_command(seq=7), ACTUATOR)), now_ns=NOW) is None
    (applied,) = agent.step_boundary(10)
    assert applied.status == "applied", applied
    assert rig.gpu.power_limits_w == {0: 450.0, 1: 450.0}
    for i in range(11, 40):  # 30 % slower: rolled back
        agent.observe_step(i, 130.0)
        if agent._undo is not None:
            break
    (undone,) = agent.step_boundary(40)
    assert undone.status == "rolled_back", undone
    assert rig.gpu.power_limits_w == {0: 700.0, 1: 700.0}


def test_the_handler_sets_nothing_outside_a_verified_command(rig: Rig) -> None:
    handler = helper_handler(rig.path, [0, 1])
    with pytest.raises(ConfigError, match="only for a command the job agent verified"):
        handler(450)
    with applying(_command(seq=9)), pytest.raises(ConfigError, match="unsigned"):
        handler(450)  # an unsigned command slipped into the agent's hands is still refused
    assert rig.gpu.power_limits_w == {}


def test_a_helper_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not answer"):
        helper_range(tmp_path / "none.sock", [0])
