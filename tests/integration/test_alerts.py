"""Prometheus metrics and webhooks on the real embedded stack: the stream worker's /metrics,
scraped over HTTP while telemetry flows, read by the Prometheus text parser; and a diagnosis
published on its topic reaching a loopback webhook receiver through the notifier, in Slack's
and in Alertmanager's format."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from perfloop.kafka import producer
from perfloop.notify import NotifierService
from perfloop.producers import Publisher
from perfloop.schemas import BatchBuilder, Diagnosis, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import NotifierSettings, StackSettings

from .conftest import wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The stream worker's /metrics, parsed: sample name → labels → value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_stream_workers_metrics_show_a_job_while_its_telemetry_flows(
    stack: StackSettings, stack_metrics_port: int
) -> None:
    job = f"it-metrics-{uuid.uuid4().hex[:8]}"
    pub = Publisher(stack)
    step = {"i": 0}
    t0 = time.time_ns() - 20 * NS  # 20 s of history first: its 10 s windows close at once

    def publish(until_ns: int) -> None:
        steps = BatchBuilder("step", job_id=job, node="n0", producer_id="it-metrics")
        gpu = BatchBuilder("gpu", job_id=job, node="n0", producer_id="it-metrics")
        while (ts := t0 + step["i"] * 100_000_000) < until_ns:
            for rank in (0, 1):
                steps.add(ts_ns=ts, rank=rank, step=step["i"], step_time_ms=100.0 + rank,
                          data_wait_ms=10.0)  # fmt: skip
                gpu.add(ts_ns=ts, rank=rank, device=rank, sm_util_pct=90.0, power_w=300.0)
            step["i"] += 1
        assert pub.publish(Topics.STEP, job, steps.encode())
        assert pub.publish(Topics.GPU, job, gpu.encode())
        assert pub.flush(10) == 0

    def seen() -> dict[str, Any] | None:
        publish(time.time_ns())  # telemetry keeps flowing while we look
        try:
            got = scrape(stack_metrics_port)
        except OSError:  # the worker is still starting: not serving yet
            return None
        ranks = {
            dict(k)["rank"]
            for k in got.get("perfloop_step_time_seconds", {})
            if dict(k)["job_id"] == job
        }
        return got if ranks == {"0", "1"} else None

    got = wait_for(seen, 45, f"job {job}'s per-rank series on /metrics")
    pub.close()

    def of_job(name: str) -> dict[str, float]:
        return {dict(k)["rank"]: v for k, v in got[name].items() if dict(k)["job_id"] == job}

    step_s = of_job("perfloop_step_time_seconds")
    assert step_s == {"0": pytest.approx(0.100, rel=0.02), "1": pytest.approx(0.101, rel=0.02)}
    assert of_job("perfloop_steps_per_second") == {"0": pytest.approx(10.0, rel=0.05),
                                                   "1": pytest.approx(10.0, rel=0.05)}  # fmt: skip
    assert of_job("perfloop_gpu_sm_utilization_ratio") == {"0": 0.9, "1": 0.9}
    wait = pytest.approx(0.1, rel=0.02)
    assert of_job("perfloop_data_wait_share") == {"0": wait, "1": wait}
    assert got["perfloop_job_ranks"][(("job_id", job),)] == 2
    assert got["perfloop_rollbacks_total"][(("job_id", job),)] == 0
    assert got["perfloop_worker_samples_total"][()] >= 2 * 2 * 200
    assert 0 < got["perfloop_metrics_series"][()] <= got["perfloop_metrics_max_series"][()]
    assert "process_resident_memory_bytes" in got


# -- webhooks ------------------------------------------------------------------------------------
class _Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(doc)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def notifiers(stack: StackSettings) -> Iterator[dict[str, tuple[_Receiver, NotifierService]]]:
    """A loopback receiver and a notifier (a consumer group of its own) per format."""
    out = {}
    threads = []
    for fmt in ("slack", "alertmanager"):
        receiver = _Receiver()
        threading.Thread(target=receiver.serve_forever, args=(0.05,), daemon=True).start()
        settings = NotifierSettings(
            home=stack.home, kafka_port=stack.kafka_port, clickhouse_port=stack.clickhouse_port,
            webhook_urls=receiver.url, webhook_format=fmt, webhook_kinds="hang",
            notifier_group_id=f"it-notifier-{fmt}-{uuid.uuid4().hex[:8]}",
        )  # fmt: skip
        service = NotifierService(settings, drain_s=2)
        t = threading.Thread(target=service.run, name=f"notifier-{fmt}", daemon=True)
        t.start()
        threads.append(t)
        out[fmt] = (receiver, service)
    try:
        for _, service in out.values():
            assert service.ready.wait(30), "the notifier got its partitions"
        yield out
    finally:
        for _, service in out.values():
            service.stop()
        for t in threads:
            t.join(15)
        for receiver, _ in out.values():
            receiver.shutdown()
            receiver.server_close()


def test_a_published_diagnosis_reaches_a_webhook_in_both_formats(
    stack: StackSettings, notifiers: dict[str, tuple[_Receiver, NotifierService]]
) -> None:
    job = f"it-hang-{uuid.uuid4().hex[:8]}"
    now = time.time_ns()
    opened = Diagnosis(
        ts_ns=now, job_id=job, node="n1", rank=3, diagnosis_id=f"{job}-hang",
        bottleneck="hang", level="cluster_health", loop="product", state="open",
        onset_ns=now - 95 * NS, step_share=1.0, confidence=0.9, critical_path=True,
        ranks=[3], nodes=["n1"], summary="rank 3 reports no step for 95 s",
    )  # fmt: skip
    p = producer(stack)

    def told(state: str) -> bool:
        """Publish the diagnosis as the stream worker would (again until it is told: a
        notifier told once of it ignores a repeat) and say whether both receivers have it."""
        event = opened if state == "open" else opened.model_copy(
            update={"state": "resolved", "ts_ns": now + 5 * NS, "critical_path": False}
        )  # fmt: skip
        p.produce(Topics.DIAGNOSES, key=job.encode(), value=encode_event(event))
        p.flush(10)
        time.sleep(0.5)
        return all(len(_mine(r.bodies, job)) >= (1 if state == "open" else 2)
                   for r, _ in notifiers.values())  # fmt: skip

    wait_for(lambda: told("open"), 30, "the open hang's webhooks")
    wait_for(lambda: told("resolved"), 30, "the resolved hang's webhooks")

    slack = _mine(notifiers["slack"][0].bodies, job)
    assert [b["text"] for b in slack] == [
        f":rotating_light: hang in job {job}: rank 3 on n1",
        f":white_check_mark: resolved: hang in job {job}",
    ]
    assert "rank 3 reports no step for 95 s" in slack[0]["blocks"][1]["text"]["text"]
    am = _mine(notifiers["alertmanager"][0].bodies, job)
    assert [(d["version"], d["status"]) for d in am] == [("4", "firing"), ("4", "resolved")]
    first, last = am[0]["alerts"][0], am[1]["alerts"][0]
    assert first["labels"]["alertname"] == "PerfloopHang" and first["labels"]["rank"] == "3"
    assert first["endsAt"] == "0001-01-01T00:00:00Z" and last["endsAt"] != first["endsAt"]
    assert first["fingerprint"] == last["fingerprint"]
    for _, service in notifiers.values():
        (hook,) = service.hooks
        assert hook.sent >= 2 and hook.failed == 0


def _mine(bodies: list[dict[str, Any]], job: str) -> list[dict[str, Any]]:
    """The bodies about ``job`` (other tests' jobs may be diagnosed meanwhile)."""
    return [b for b in bodies if job in json.dumps(b)]
