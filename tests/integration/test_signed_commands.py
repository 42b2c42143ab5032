"""Acceptance (issue 25), on the real embedded stack: commands signed with the actuator's
Ed25519 key, checked by a job holding only its public key; what the job's host could sign is
refused; the key rotated mid-run loses no command, and the old key is refused after its
overlap.

Actuator A (``perfloop service actuator``, its own group, ``PERFLOOP_SIGNING_PRIVATE_KEY``)
acts on the recommendations the test publishes; the job is a `JobAgent` in the test process
with ``PERFLOOP_COMMAND_KEYRING``-style keyring file and the shared development key its settings
hold. The session stack's own actuator refuses these recommendations (their expected gain is
under its minimum) and signs nothing for this job.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from perfloop.actuators import JobAgent, sign
from perfloop.identity import Keyring, KeyringFile, PrivateKey, TrustedKey
from perfloop.schemas import Command, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import DEV_SIGNING_KEY, StackSettings

from .conftest import wait_for
from .test_actuator_failover import _position, _publish, _rec

pytestmark = pytest.mark.integration

NS = 1_000_000_000
OVERLAP_S = 6.0


def test_ed25519_commands_forgeries_and_a_rotation(
    stack: StackSettings, stack_env_vars: dict[str, str], tmp_path: Path
) -> None:
    job = f"it-signed-{uuid.uuid4().hex[:8]}"
    old, new = PrivateKey.generate(), PrivateKey.generate()
    for name, key in (("old", old), ("new", new)):
        key.save(tmp_path / f"{name}.key")
    ring_path = tmp_path / "ring.json"
    Keyring([TrustedKey.of(old.public_bytes(), "actuator")]).save(ring_path)

    applied: list[tuple[str, Any]] = []
    agent = JobAgent(
        stack, job_id=job, node="n0", signing_key=DEV_SIGNING_KEY.encode(),
        keyring=KeyringFile(ring_path), verify_changes=False,
        handlers={k: (lambda v, k=k: applied.append((k, v)))
                  for k in ("dataloader.num_workers", "torch.num_threads")},
    )  # fmt: skip
    assert agent.start(wait_assigned_s=30), "the agent reads the control topic"
    env = stack_env_vars | {"PERFLOOP_MIN_GAIN_PCT": "0"}
    procs: list[subprocess.Popen[bytes]] = []

    def actuator(name: str, key: Path) -> subprocess.Popen[bytes]:
        group = f"it-actuator-{job}-{name}"
        _position(stack, group)
        log = (tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "perfloop.cli", "service", "actuator"],
            env=env | {"PERFLOOP_GROUP_ID": group, "PERFLOOP_SIGNING_PRIVATE_KEY": str(key)},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        procs.append(proc)
        wait_for(lambda: "assigned" in (tmp_path / f"{name}.log").read_text(), 60, f"{name}")
        return proc

    def applied_after(rec_knob: str, n: int, what: str) -> None:
        def done() -> bool:
            agent.step_boundary(int(time.monotonic() * 10))
            return sum(k == rec_knob for k, _ in applied) >= n

        try:
            wait_for(done, 30, what)
        except AssertionError:
            raise AssertionError(
                f"{what}: {[(r.status, r.knob, r.reason) for r in agent.results]}"
            ) from None

    def forged(cmd: Command) -> str:
        """Publish a command as it comes, and return the job's answer to it."""
        seen = len(agent.results)
        p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
        p.produce(Topics.CONTROL, key=job.encode(), value=encode_event(cmd))
        assert p.flush(10) == 0
        got = wait_for(
            lambda: [r for r in agent.results[seen:] if r.command_id == cmd.event_id], 30, "its ack"
        )
        assert got[0].status == "rejected", got
        return str(got[0].reason)

    now = time.time_ns()

    def cmd(seq: int, **kw: Any) -> Command:
        fields: dict[str, Any] = dict(ts_ns=now, job_id=job, node="n0", rank=-1, seq=seq,
                                      knob="dataloader.num_workers", from_value=2, value=3,
                                      expires_ts_ns=time.time_ns() + 60 * NS)  # fmt: skip
        return Command(**(fields | kw))

    try:
        a = actuator("a", tmp_path / "old.key")
        _publish(stack, _rec(job, "dataloader.num_workers", 0, 2))
        applied_after("dataloader.num_workers", 1, "the old key's command applied")

        # what the job's host could sign: nothing it makes is taken
        far = 2**62  # a sequence past anything the actuator issued
        shared = forged(sign(cmd(far + 1), DEV_SIGNING_KEY.encode()))
        assert shared.startswith("signed with a shared key"), shared
        mine = PrivateKey.generate()
        posed = sign(cmd(far + 2), mine).model_copy(update={"key_id": old.key_id})
        assert forged(posed).startswith("signature does not verify under key"), posed.key_id
        assert forged(sign(cmd(far + 3), mine)).endswith("is not in the keyring")

        # rotation mid-run: the new key trusted, the actuator switched, the old key's overlap
        ring = Keyring.load(ring_path)
        ring.keys[new.key_id] = TrustedKey.of(new.public_bytes(), "actuator")
        ring.save(ring_path)
        a.send_signal(signal.SIGTERM)
        a.wait(30)
        actuator("b", tmp_path / "new.key")
        _publish(stack, _rec(job, "torch.num_threads", 4, 2))
        applied_after("torch.num_threads", 1, "the new key's command applied")
        until = time.time_ns() + int(OVERLAP_S * NS)
        ring = Keyring.load(ring_path)
        k = ring.keys[old.key_id]
        ring.keys[old.key_id] = TrustedKey(k.key_id, k.principal, k.public, until)
        ring.save(ring_path)
        # within the overlap, the old key still verifies: its command is applied
        p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "linger.ms": 0})
        p.produce(Topics.CONTROL, key=job.encode(), value=encode_event(sign(cmd(far + 4), old)))
        assert p.flush(10) == 0
        applied_after("dataloader.num_workers", 2, "the old key's command within the overlap")
        time.sleep(max(0.0, (until - time.time_ns()) / NS) + 0.5)
        late = forged(sign(cmd(far + 5), old))
        assert "is no longer trusted" in late, late
    finally:
        agent.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    assert [k for k, _ in applied] == [
        "dataloader.num_workers", "torch.num_threads", "dataloader.num_workers",
    ], applied  # fmt: skip
    rejected = [r for r in agent.results if r.status == "rejected"]
    assert len(rejected) == 4, [r.reason for r in rejected]  # the four forgeries, once each
    for name in ("a", "b"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()
