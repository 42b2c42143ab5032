"""Live configuration against the real embedded stack: ``perfloop config set`` puts a
`ConfigChange` on perfloop.control, samplers follow it without a restart, and the sink
records it in ``config_changes`` where ``perfloop config history`` reads it back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from perfloop.actuators.agent import ConfigListener
from perfloop.actuators.trust import signed_by
from perfloop.cli.config import build_change
from perfloop.identity import PrivateKey
from perfloop.kafka import consumer, producer
from perfloop.producers.node_sampler import NodeSampler
from perfloop.schemas import ConfigChange, decode_event, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ProducerSettings, StackSettings
from perfloop.testing import FakeGpuBackend
from perfloop.warehouse import client

from .conftest import perfloop_cli, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def control(stack: StackSettings) -> Iterator[Consumer]:
    """A consumer positioned at the current end of every partition of perfloop.control."""
    c = consumer(stack, f"it-config-{uuid.uuid4().hex[:8]}")
    parts = c.list_topics(Topics.CONTROL, timeout=10).topics[Topics.CONTROL].partitions
    ends = []
    for p in parts:
        _, high = c.get_watermark_offsets(TopicPartition(Topics.CONTROL, p), timeout=10)
        ends.append(TopicPartition(Topics.CONTROL, p, high))
    c.assign(ends)
    yield c
    c.close()


def _next_change(c: Consumer, key: bytes, timeout_s: float) -> ConfigChange:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = c.poll(0.5)
        if msg is None or msg.error() or msg.key() != key:
            continue
        event = decode_event(msg.value())
        assert isinstance(event, ConfigChange), event
        return event
    raise AssertionError(f"no message keyed {key!r} on {Topics.CONTROL} in {timeout_s:.0f} s")


def _history(env: dict[str, str], job: str) -> list[dict[str, Any]]:
    out = perfloop_cli("config", "history", "--job", job, "--json", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_config_set_publishes_a_config_change(
    control: Consumer, stack_env_vars: dict[str, str]
) -> None:
    job = f"cfg-{uuid.uuid4().hex[:8]}"
    out = perfloop_cli(
        "config", "set", "sampling.host_interval_ms", "250", "--job", job,
        "--reason", "finer host view while debugging",
        env=stack_env_vars,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    change = _next_change(control, job.encode(), 30)
    assert change.event_id in out.stdout
    assert (change.target, change.applies_to, change.job_id) == ("producers", job, job)
    assert (change.key, change.value, type(change.value)) == ("sampling.host_interval_ms", 250, int)
    assert change.reason == "finer host view while debugging"
    assert change.author.count("@") == 1 and change.rank == -1

    out = perfloop_cli(
        "config", "set", "windows.specs", "1,10,60,60/10", env=stack_env_vars
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    every = _next_change(control, b"*", 30)
    assert (every.target, every.applies_to, every.value) == ("streams", "*", "1,10,60,60/10")


def test_every_change_is_recorded_in_the_warehouse(stack_env_vars: dict[str, str]) -> None:
    job = f"cfg-{uuid.uuid4().hex[:8]}"
    sent = []
    for key, value in (("sampling.overhead_budget_pct", "2.5"), ("sampling.adaptive", "false")):
        out = perfloop_cli(
            "config", "set", key, value, "--job", job, "--reason", "it",
            env=stack_env_vars,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        sent.append((key, value, out.stdout.split()[2].rstrip(":")))

    def own() -> list[dict[str, Any]]:  # history also lists changes for every job ("*")
        return [r for r in _history(stack_env_vars, job) if r["applies_to"] == job]

    mine = wait_for(lambda: (r := own()) and len(r) >= 2 and r, 45, "both changes landed")
    assert [(r["key"], r["event_id"]) for r in mine] == [(k, e) for k, _, e in sent]
    assert [json.loads(r["value"]) for r in mine] == [2.5, False]  # stored as JSON
    for r in mine:
        assert (r["target"], r["job_id"], r["reason"]) == ("producers", job, "it")
        assert "@" in r["author"]


def test_a_sampler_follows_changes_for_its_job_and_for_every_job(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = f"cfg-{uuid.uuid4().hex[:8]}"

    class Drop:
        def add(self, kind: str, **values: Any) -> None:
            pass

        def extend(self, kind: str, **columns: Any) -> None:
            pass

        def event(self, event: Any) -> bool:
            return True

    settings = ProducerSettings(host_interval_ms=1000, overhead_budget_pct=0.5)
    sampler = NodeSampler(settings, Drop(), job_id=job, node="n0", gpu_backend=FakeGpuBackend())
    listener = ConfigListener(stack, job_id=job, on_config=sampler.configure)
    assert listener.start(wait_assigned_s=30), "perfloop.control never assigned"
    try:
        out = perfloop_cli(
            "config", "set", "sampling.host_interval_ms", "100", "--job", job,
            env=stack_env_vars,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        wait_for(lambda: sampler.controller.interval("host") == 0.1, 30, "the new host interval")
        assert sampler.settings.host_interval_ms == 100.0

        # unsigned (the job's roster is the stack's: the owner's signature counts): refused,
        # as the owner's change sent after it on the same partition shows
        p = producer(stack, **{"linger.ms": 0})
        forged = build_change("sampling.host_interval_ms", 40, job=job, reason="forged")
        p.produce(Topics.CONTROL, key=job.encode(), value=encode_event(forged))
        assert p.flush(10) == 0
        out = perfloop_cli(
            "config", "set", "sampling.overhead_budget_pct", "4", "--job", job,
            env=stack_env_vars,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        wait_for(lambda: sampler.controller.budget_pct == 4.0, 30, "the owner's budget")
        assert sampler.settings.host_interval_ms == 100.0, "the unsigned change was applied"

        out = perfloop_cli(
            "config", "set", "sampling.overhead_budget_pct", "3", env=stack_env_vars
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        wait_for(lambda: sampler.controller.budget_pct == 3.0, 30, "the budget for every job")
    finally:
        listener.stop()


def test_perfloop_sample_follows_a_live_change(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = f"cfg-{uuid.uuid4().hex[:8]}"
    # stats every second; a budget that never stretches the interval on a busy test machine
    env = stack_env_vars | {"PERFLOOP_STATS_INTERVAL_S": "1", "PERFLOOP_OVERHEAD_BUDGET_PCT": "100"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "perfloop.cli", "sample", "--job-id", job, "--duration", "90"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    stop = threading.Event()
    owner = PrivateKey.load(stack.home / "keys" / "owner.key")  # the stack's roster trusts it
    p = producer(stack, **{"linger.ms": 0})

    def resend() -> None:  # the sampler's listener counts from when it is assigned
        while not stop.wait(1.0):
            change = build_change("sampling.host_interval_ms", 200, job=job, reason="it")
            p.produce(Topics.CONTROL, key=job.encode(),
                      value=encode_event(signed_by(change, owner)))  # fmt: skip
            p.flush(5)

    sender = threading.Thread(target=resend, daemon=True)
    sender.start()

    def host_rate() -> float | None:
        ch = client(stack)
        try:
            rows = ch.query(
                "SELECT rates_hz['host'] FROM producer_stats WHERE job_id = {job:String} "
                "ORDER BY ts DESC LIMIT 1",
                parameters={"job": job},
            ).result_rows
        finally:
            ch.close()
        return rows[0][0] if rows and rows[0][0] == pytest.approx(5.0) else None

    try:
        assert wait_for(host_rate, 60, "the sampler's stats at 5 Hz host sampling")
    finally:
        stop.set()
        sender.join(5)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"sampling job {job}" in out and "sampled" in out
