"""The loop end to end on the real embedded stack: telemetry → windows → recommendation →
signed command → the job applies it → ack, all of it queryable with SQL."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Producer

from perfloop.actuators import JobAgent
from perfloop.actuators.agent import keyring_for
from perfloop.kafka import consumer
from perfloop.producers import Fault, Publisher, SimConfig, SimulatedJob
from perfloop.schemas import BatchBuilder
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings, StackSettings
from perfloop.stack import read_state, status
from perfloop.streams import KNOB_NUM_WORKERS
from perfloop.warehouse import client

from .conftest import perfloop_cli, wait_for

pytestmark = pytest.mark.integration


def _count(settings: StackSettings, sql: str, **params: object) -> int:
    ch = client(settings)
    try:
        return int(ch.query(sql, parameters=params).result_rows[0][0])
    finally:
        ch.close()


def test_status_reports_every_service(stack: StackSettings) -> None:
    doc = status(stack)
    assert doc["state"] == "up"
    assert doc["kafka_bootstrap"] == f"127.0.0.1:{stack.kafka_port}"
    assert doc["clickhouse_url"] == f"http://127.0.0.1:{stack.clickhouse_port}"
    assert doc["kafka_reachable"] and doc["clickhouse_reachable"]
    assert set(doc["services"]) == {
        "broker",
        "warehouse",
        "streams",
        "sink",
        "actuator",
        "accountant",
    }
    assert all(s["state"] == "running" for s in doc["services"].values())
    assert "no retention" in doc["broker_retention"]
    # the headroom: the broker's memory (sampled by the supervisor from its start on; a
    # growth rate only after 5 min of samples) and the warehouse's disk
    mem, dk = doc["headroom"]["broker_memory"], doc["headroom"]["warehouse_disk"]
    assert mem["rss_bytes"] == doc["services"]["broker"]["rss_bytes"] > 0
    assert mem["available_bytes"] > 0
    assert dk["warehouse_bytes"] > 0 and dk["free_bytes"] > 0
    assert dk["path"] == str(stack.home / "warehouse")
    assert read_state(stack)["broker_rss"], "the supervisor samples the broker's RSS at once"


def test_status_json_from_the_cli(stack_env_vars: dict[str, str]) -> None:
    out = perfloop_cli("status", "--json", env=stack_env_vars)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"kafka_bootstrap", "clickhouse_url", "services", "headroom"} <= set(doc)
    text = perfloop_cli("status", env=stack_env_vars).stdout
    assert "  headroom: broker memory " in text and "  headroom: warehouse " in text, text


def test_telemetry_is_queryable_and_windowed(stack: StackSettings) -> None:
    job = f"it-{uuid.uuid4().hex[:8]}"
    steps = BatchBuilder("step", job_id=job, node="n0", producer_id="test")
    gpu = BatchBuilder("gpu", job_id=job, node="n0", producer_id="test")
    # 30 s of history for 2 ranks at 10 steps/s: the first windows are closed at once.
    t0 = (time.time_ns() - 30 * 10**9) // 10**10 * 10**10
    for i in range(300):
        for rank in (0, 1):
            ts = t0 + i * 100_000_000
            steps.add(
                ts_ns=ts,
                rank=rank,
                step=i,
                step_time_ms=100.0 + rank,
                data_wait_ms=10.0,
                num_workers=2,
            )
            gpu.add(ts_ns=ts, rank=rank, device=rank, sm_util_pct=90.0, power_w=500.0)
    pub = Publisher(stack)
    assert pub.publish(Topics.STEP, job, steps.encode())
    assert pub.publish(Topics.GPU, job, gpu.encode())
    assert pub.flush(10) == 0
    assert pub.stats.delivered == 2

    # The two tables are inserted one after the other: wait for both.
    wait_for(
        lambda: (
            _count(stack, "SELECT count() FROM steps WHERE job_id = {j:String}", j=job) == 600
            and _count(stack, "SELECT count() FROM gpu_samples WHERE job_id = {j:String}", j=job)
            == 600
        ),
        30,
        "600 step rows and 600 GPU rows",
    )
    ch = client(stack)
    try:
        r = ch.query(
            "SELECT rank, avg(step_time_ms), min(ts), max(ts) FROM steps "
            "WHERE job_id = {j:String} GROUP BY rank ORDER BY rank",
            parameters={"j": job},
        )
        (r0, mean0, lo, _), (r1, mean1, _, hi) = r.result_rows
        assert (
            (r0, r1) == (0, 1) and mean0 == pytest.approx(100.0) and mean1 == pytest.approx(101.0)
        )
        assert lo.timestamp() == pytest.approx(t0 / 1e9)
        assert hi.timestamp() == pytest.approx((t0 + 299 * 100_000_000) / 1e9)
        wait_for(
            lambda: (
                _count(
                    stack,
                    "SELECT count() FROM windows WHERE job_id = {j:String} "
                    "AND metric = 'step_time_ms' AND window_s = 10 AND hop_s = 10",
                    j=job,
                )
                >= 4
            ),
            30,
            "closed windows",
        )
        w = ch.query(
            "SELECT rank, count, mean, p50, window_s FROM windows "
            "WHERE job_id = {j:String} AND metric = 'step_time_ms' "
            "AND window_s = 10 AND hop_s = 10 "
            "ORDER BY ts, rank LIMIT 2",
            parameters={"j": job},
        ).result_rows
        assert [row[0] for row in w] == [0, 1]
        assert all(row[1] == 100 and row[4] == 10.0 for row in w)
        assert np.allclose([row[2] for row in w], [100.0, 101.0])
    finally:
        ch.close()


def test_command_reaches_the_job_and_is_acked(stack: StackSettings) -> None:
    job = f"it-loop-{uuid.uuid4().hex[:8]}"
    pub = Publisher(stack)
    cfg = SimConfig(
        job_id=job,
        ranks_per_node=2,
        faults=(Fault("dataloader_starvation", onset_s=2.0),),
        speed=4.0,
    )
    sim = SimulatedJob(cfg, pub)
    key = ActuatorSettings().signing_key.get_secret_value().encode()
    agent = JobAgent(
        stack,
        job_id=job,
        node=sim.cfg.node,
        signing_key=key,
        keyring=keyring_for(stack),  # the stack's actuator key signs commands
        handlers={KNOB_NUM_WORKERS: sim.set_num_workers},
    )
    assert agent.start(20.0), "control topic never assigned"
    applied_at: list[int] = []

    def stop() -> bool:
        if not applied_at and any(r.status == "applied" for r in agent.results):
            applied_at.append(sim.step)
        return bool(applied_at) and sim.step >= applied_at[0] + 20 and not agent.verifying

    try:
        sim.run(
            120.0,
            step_boundary=agent.step_boundary,
            on_step=lambda rep: agent.observe_step(rep.step, rep.step_time_ms),
            stop=stop,
        )
    finally:
        pub.flush(10)
        agent.stop()
    assert applied_at, f"no command applied; results: {agent.results}"
    result = next(r for r in agent.results if r.status == "applied")
    assert result.knob == KNOB_NUM_WORKERS
    assert sim.num_workers == result.value > 2

    # The agent compared the steps after the change with those before: it helped, it stays.
    verdict = next(r for r in agent.results if r.status in ("kept", "rolled_back"))
    assert verdict.status == "kept" and verdict.reason.startswith("it helped")
    assert verdict.evidence["ratio"] < 1 and verdict.evidence["p_value"] < 0.05
    q = {"j": job}
    wait_for(
        lambda: _count(stack, "SELECT count() FROM actuations WHERE job_id = {j:String}", **q) == 2,
        30,
        "the ack and the verdict in the warehouse",
    )
    for table in ("recommendations", "commands"):  # each table lands on its own flush
        wait_for(
            lambda t=table: (
                _count(stack, f"SELECT count() FROM {t} WHERE job_id = {{j:String}}", **q) > 0
            ),
            30,
            f"the job's row in {table}",
        )
    ch = client(stack)
    try:
        rec_id, to_value = ch.query(
            "SELECT rec_id, to_value FROM recommendations WHERE job_id = {j:String}", parameters=q
        ).result_rows[0]
        cmd_id, cmd_rec, value, sig = ch.query(
            "SELECT command_id, rec_id, value, signature FROM commands WHERE job_id = {j:String}",
            parameters=q,
        ).result_rows[0]
        ack_cmd, ack_status = ch.query(
            "SELECT command_id, status FROM actuations WHERE job_id = {j:String} "
            "AND status = 'applied'",
            parameters=q,
        ).result_rows[0]
        kept = ch.query(
            "SELECT command_id, evidence['ratio'], evidence['p_value'] FROM actuations "
            "WHERE job_id = {j:String} AND status = 'kept'",
            parameters=q,
        ).result_rows
    finally:
        ch.close()
    assert kept == [(cmd_id, verdict.evidence["ratio"], verdict.evidence["p_value"])]
    assert cmd_rec == rec_id and value == to_value == str(result.value)
    # signed with the stack's actuator key, which the job checked it against (`_keys`)
    assert sig.startswith("ed25519:") and ack_cmd == cmd_id == result.command_id
    assert ack_status == "applied"


def test_poison_messages_go_to_the_dlq_and_workers_live_on(stack: StackSettings) -> None:
    key = f"poison-{uuid.uuid4().hex[:8]}".encode()
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    p.produce(Topics.STEP, key=key, value=b"\x00not json")
    p.produce(Topics.ACTUATIONS, key=key, value=b'{"kind": "actuation", "status": "maybe"}')
    assert p.flush(10) == 0
    c = consumer(stack, f"it-dlq-{key.decode()}")
    c.subscribe([Topics.DLQ])
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 40
    try:
        while len(seen) < 2 and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error() or msg.key() != key:
                continue
            headers = {k: v.decode() for k, v in msg.headers() or []}
            seen[headers["perfloop.source.topic"]] = headers["perfloop.reason"]
    finally:
        c.close()
    assert "not valid JSON" in seen.get(Topics.STEP, "")
    assert "actuation event" in seen.get(Topics.ACTUATIONS, "")
    doc = status(stack)
    assert all(s["state"] == "running" and s["restarts"] == 0 for s in doc["services"].values())
