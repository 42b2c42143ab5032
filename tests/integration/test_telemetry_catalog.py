"""Every event family lands in its table; bad telemetry is dead-lettered with its reason."""

from __future__ import annotations

import json
import random
import string
import time
import uuid

import orjson
import pytest
from confluent_kafka import Producer

from perfloop.kafka import consumer
from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher
from perfloop.schemas import (
    CapabilityReport,
    GroundTruth,
    JobInfo,
    JobLifecycle,
    ProducerStats,
    RankProgress,
    encode_batch,
)
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.warehouse import client
from perfloop.warehouse.tables import KIND_TABLES

from .conftest import perfloop_cli, wait_for

pytestmark = pytest.mark.integration


def _rows(settings: StackSettings, sql: str, **params: object) -> list[tuple[object, ...]]:
    ch = client(settings)
    try:
        return list(ch.query(sql, parameters=params).result_rows)
    finally:
        ch.close()


def test_every_family_lands_in_its_table(stack: StackSettings) -> None:
    job = f"cat-{uuid.uuid4().hex[:8]}"
    pub = Publisher(stack)
    em = Emitter(pub, job_id=job, node="n0", producer_id="it")
    t = time.time_ns()
    em.add("gpu", ts_ns=t, rank=0, device=1, power_w=300.0, power_limit_w=700.0, energy_mj=5)
    em.add("host", ts_ns=t, rank=0, pid=42, proc_cpu_pct=150.0, loader_workers=4)
    em.add("step", ts_ns=t, rank=0, step=3, step_time_ms=80.0, loss=1.25, tokens=4096)
    em.add("step", ts_ns=t + 1, rank=0, step=4, step_time_ms=81.0)  # loss not reported
    em.add("span", ts_ns=t, rank=0, step=3, phase="user", name="tokenize", duration_ms=2.0)
    em.add(
        "collective",
        ts_ns=t,
        rank=0,
        step=3,
        op="all_reduce",
        size_bytes=1 << 20,
        group="0,1",
        group_size=2,
        duration_ms=1.5,
    )
    em.add("kernel", ts_ns=t, rank=0, step=3, stream=-1, kernel_class="all", count=9, busy_ms=7.0)
    common = {"ts_ns": t, "job_id": job, "node": "n0"}
    for ev in (
        JobInfo(**common, rank=0, world_size=2, optimizer="AdamW", extra={"k": "v"}),
        JobLifecycle(**common, rank=0, state="started"),
        CapabilityReport(**common, rank=-1, component="nvml", available=False, missing=["gpu"]),
        ProducerStats(**common, rank=0, producer_id="it", published=7, rates_hz={"gpu": 10.0}),
        RankProgress(**common, rank=0, step=3, phase="comm", since_ns=t, step_start_ns=t),
        GroundTruth(**common, rank=-1, scenario="s", fault="hang", onset_ns=t, ranks=[1]),
    ):
        em.event(ev)
    em.flush()
    assert pub.flush(10) == 0

    expected = {table: 1 for table in set(KIND_TABLES.values())} | {"steps": 2}
    # made by the stream tier, the actuator, `perfloop config` or `perfloop approve`, each
    # tested on its own (test_approvals: approvals and audit)
    derived = (
        "windows",
        "recommendations",
        "commands",
        "actuations",
        "approvals",
        "audit",
        "phases",
        "diagnoses",
        "predictions",
    )
    for skip in (*derived, "config_changes"):
        expected.pop(skip, None)

    def landed() -> bool:
        return all(
            _rows(stack, f"SELECT count() FROM {table} WHERE job_id = {{j:String}}", j=job)[0][0]
            == n
            for table, n in expected.items()
        )

    wait_for(landed, 40, "one row per family in every table")
    assert _rows(
        stack, "SELECT step, loss, tokens FROM steps WHERE job_id = {j:String} ORDER BY step", j=job
    ) == [(3, 1.25, 4096), (4, None, 0)]
    assert _rows(stack, "SELECT phase, name FROM spans WHERE job_id = {j:String}", j=job) == [
        ("user", "tokenize")
    ]
    assert _rows(
        stack, "SELECT available, missing FROM capabilities WHERE job_id = {j:String}", j=job
    ) == [(False, ["gpu"])]
    ((onset, end, ranks),) = _rows(
        stack,
        "SELECT toUnixTimestamp64Nano(onset), end, ranks FROM ground_truth "
        "WHERE job_id = {j:String}",
        j=job,
    )
    assert (onset, end, ranks) == (t, None, [1])


def test_a_message_sent_twice_lands_once(stack: StackSettings) -> None:
    job = f"dup-{uuid.uuid4().hex[:8]}"
    data = encode_batch(
        "step",
        {
            "ts_ns": [time.time_ns()] * 3,
            "rank": [0, 1, 2],
            "step": [1, 1, 1],
            "step_time_ms": [9.0] * 3,
        },
        job_id=job,
        node="n0",
    )
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    p.produce(Topics.STEP, key=job.encode(), value=data)
    assert p.flush(10) == 0
    p.produce(Topics.STEP, key=job.encode(), value=data)  # a producer's resend
    marker = encode_batch(
        "step",
        {"ts_ns": [time.time_ns()], "rank": [9], "step": [2], "step_time_ms": [9.0]},
        job_id=job,
        node="n0",
    )
    p.produce(Topics.STEP, key=job.encode(), value=marker)
    assert p.flush(10) == 0
    q = "SELECT count() FROM steps WHERE job_id = {j:String}"
    wait_for(lambda: _rows(stack, q + " AND rank = 9", j=job)[0][0] == 1, 40, "the marker")
    assert _rows(stack, q, j=job)[0][0] == 4


def test_bad_telemetry_is_dead_lettered_with_a_reason(stack: StackSettings) -> None:
    key = f"bad-{uuid.uuid4().hex[:8]}".encode()
    good_cols = {"ts_ns": [1], "rank": [0], "step": [1], "step_time_ms": [5.0]}
    doc = orjson.loads(encode_batch("step", good_cols, job_id="j", node="n", wire="json"))
    sent = {
        "unknown version": (Topics.STEP, orjson.dumps(doc | {"schema_version": 99})),
        "oversized": (Topics.HOST, b'{"kind": "host", "pad": "' + b"x" * (5 << 20) + b'"}'),
        "wrong topic": (Topics.GPU, encode_batch("step", good_cols, job_id="j", node="n")),
        "bad string": (
            Topics.SPAN,
            encode_batch(
                "span",
                {
                    "ts_ns": [1],
                    "rank": [0],
                    "step": [1],
                    "phase": ["x"],
                    "name": [""],
                    "duration_ms": [1.0],
                },
                job_id="j",
                node="n",
            ),
        ),
    }
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap, "message.max.bytes": 8 << 20})
    for topic, value in sent.values():
        p.produce(topic, key=key, value=value)
    assert p.flush(10) == 0
    c = consumer(stack, f"it-bad-{key.decode()}")
    c.subscribe([Topics.DLQ])
    reasons: dict[str, str] = {}
    deadline = time.monotonic() + 40
    try:
        while len(reasons) < len(sent) and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error() or msg.key() != key:
                continue
            h = {k: v.decode() for k, v in msg.headers() or []}
            reasons.setdefault(h["perfloop.source.topic"], h["perfloop.reason"])
    finally:
        c.close()
    assert "schema_version 99" in reasons[Topics.STEP] and "supported: 1..2" in reasons[Topics.STEP]
    assert "exceeds the" in reasons[Topics.HOST]
    assert "does not belong on" in reasons[Topics.GPU]
    assert "'name'" in reasons[Topics.SPAN] and "empty" in reasons[Topics.SPAN]
    assert all("\n" not in r for r in reasons.values())


def test_dlq_command_counts_dead_letters_by_reason(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    p = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    marker = "mk" + "".join(random.choices(string.ascii_lowercase, k=8))  # no digits: unmasked
    for _ in range(3):  # three of one kind of bad input count as one line with count 3
        p.produce(Topics.HOST, value=f'{{"kind": "{marker}"}}'.encode())
    assert p.flush(10) == 0

    def counted() -> int:
        out = perfloop_cli("dlq", "--json", env=stack_env_vars)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        return sum(r["count"] for r in rows if r["topic"] == Topics.HOST and marker in r["reason"])

    wait_for(lambda: counted() >= 3, 40, "three dead letters counted")
    time.sleep(6)  # the stream worker and the sink both read the topic: no second copy comes
    assert counted() == 3, "a bad message is one dead letter"
    out = perfloop_cli("dlq", env=stack_env_vars)
    assert out.returncode == 0 and "dead letters" in out.stdout.splitlines()[0]
