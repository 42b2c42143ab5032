"""The notifier: which events are news, the JSON of both formats, delivery with retries against
a loopback HTTP server that fails on purpose, the settings' one-line errors, and the stack
starting it only when a webhook URL is set."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from perfloop.exceptions import ConfigError
from perfloop.notify import Notice, Notices, NotifierService, Webhook, alertmanager_payload, body
from perfloop.notify.service import topics_for
from perfloop.schemas import ActuationResult, Decision, Diagnosis, Prediction
from perfloop.schemas.topics import Topics
from perfloop.settings import (
    DEFAULT_WEBHOOK_KINDS,
    NotifierSettings,
    StackSettings,
    check_environment,
)
from perfloop.stack.supervisor import ACCOUNTANT, NOTIFIER, SERVICES, services_for

NS = 1_000_000_000
T0 = 1_800_000_000 * NS


def diagnosis(state: str = "open", bottleneck: str = "hang", **kw: Any) -> Diagnosis:
    base = {"ts_ns": T0 + 95 * NS, "job_id": "llm-7", "node": "n1", "rank": 3,
            "diagnosis_id": "d-1", "bottleneck": bottleneck, "level": "cluster_health",
            "loop": "product", "state": state, "onset_ns": T0, "step_share": 1.0,
            "confidence": 0.9, "critical_path": True, "ranks": [3], "nodes": ["n1"],
            "summary": "rank 3 reports no step for 95 s"}  # fmt: skip
    return Diagnosis(**{**base, **kw})


# -- what is news ------------------------------------------------------------------------------
def test_a_diagnosis_opens_and_resolves_once_and_updates_are_no_news() -> None:
    n = Notices(DEFAULT_WEBHOOK_KINDS)
    opened = n.notice(diagnosis())
    assert opened is not None and opened.status == "firing" and opened.severity == "critical"
    assert opened.title == "hang in job llm-7: rank 3 on n1"
    assert n.notice(diagnosis()) is None  # read again (a restarted worker's repeat)
    assert n.notice(diagnosis("update")) is None
    done = n.notice(diagnosis("resolved"))
    assert done is not None and done.status == "resolved" and "lasted 1 min 35 s" in done.text
    assert done.ends_ns == T0 + 95 * NS
    assert Notices(["straggler"]).notice(diagnosis()) is None  # not of the kinds


def test_a_rollback_is_news_once_per_command_and_an_approval_until_decided() -> None:
    n = Notices(["rollback", "approval"])
    back = dict(ts_ns=T0, job_id="j", node="n", command_id="c1", status="rolled_back",
                knob="dataloader.num_workers", value=2, reason="made steps slower",
                evidence={"before_ms": 100.0, "after_ms": 130.0})  # fmt: skip
    first = n.notice(ActuationResult(rank=0, **back))
    assert first is not None and "100.0 → 130.0 ms" in first.text
    assert n.notice(ActuationResult(rank=1, **back)) is None  # the other rank's ack
    asked = dict(job_id="j", node="actuator", rank=-1, rec_id="r1", knob="torch.num_threads",
                 from_value=8, to_value=4, tier="approve")  # fmt: skip
    pending = n.notice(Decision(ts_ns=T0, outcome="pending", **asked))
    assert pending is not None and "perfloop approve r1" in pending.text
    assert n.notice(Decision(ts_ns=T0, outcome="pending", **asked)) is None
    done = n.notice(Decision(ts_ns=T0 + NS, outcome="issued", actor="ana", **asked))
    assert done is not None and done.status == "resolved" and "issued by ana" in done.text
    assert n.notice(Decision(ts_ns=T0 + NS, outcome="issued", **asked)) is None


def test_an_oom_warning_is_news_once_per_rank_and_repeat_time() -> None:
    n = Notices(["oom_warning"])

    def warn(at_s: float, rank: int = 0) -> Notice | None:
        return n.notice(Prediction(ts_ns=T0 + int(at_s * NS), job_id="j", node="n", rank=rank,
                                   prediction_id=f"p{at_s}{rank}", model="TimeToOOM",
                                   target="time_to_oom_s", value=75.0))  # fmt: skip

    first = warn(0)
    assert first is not None and "out of memory in ~1 min 15 s" in first.title
    assert warn(30) is None and warn(30, rank=1) is not None
    assert warn(601) is not None


def test_topics_follow_the_kinds() -> None:
    assert topics_for(DEFAULT_WEBHOOK_KINDS) == [
        Topics.DIAGNOSES, Topics.ACTUATIONS, Topics.PREDICTIONS
    ]  # fmt: skip
    assert topics_for(("straggler",)) == [Topics.DIAGNOSES]


# -- the JSON ----------------------------------------------------------------------------------
def test_the_slack_payload_is_text_with_blocks() -> None:
    notice = Notices(["hang"]).notice(diagnosis(summary="a <b> & c"))
    assert notice is not None
    doc = json.loads(body("slack", notice))
    assert doc["text"] == ":rotating_light: hang in job llm-7: rank 3 on n1"
    assert [b["type"] for b in doc["blocks"]] == ["section", "section", "context"]
    assert "a &lt;b&gt; &amp; c" in doc["blocks"][1]["text"]["text"]


def test_the_alertmanager_payload_has_the_webhook_format_of_version_4() -> None:
    notice = Notices(["hang"]).notice(diagnosis())
    assert notice is not None
    doc = json.loads(body("alertmanager", notice))
    assert set(doc) == {"version", "groupKey", "truncatedAlerts", "status", "receiver",
                        "groupLabels", "commonLabels", "commonAnnotations", "externalURL",
                        "alerts"}  # fmt: skip
    assert doc["version"] == "4" and doc["status"] == "firing" and doc["truncatedAlerts"] == 0
    (alert,) = doc["alerts"]
    assert alert["labels"] == {
        "alertname": "PerfloopHang", "job_id": "llm-7", "kind": "hang", "severity": "critical",
        "bottleneck": "hang", "level": "cluster_health", "diagnosis_id": "d-1", "rank": "3",
        "node": "n1",
    }  # fmt: skip
    assert alert["startsAt"] == "2027-01-15T08:00:00Z" and alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["annotations"]["summary"] == notice.title
    assert len(alert["fingerprint"]) == 16 and doc["groupLabels"]["alertname"] == "PerfloopHang"
    resolved = alertmanager_payload(Notices(["hang"]).notice(diagnosis("resolved")))  # type: ignore[arg-type]
    assert resolved["alerts"][0]["endsAt"] == "2027-01-15T08:01:35Z"
    assert resolved["alerts"][0]["fingerprint"] == alert["fingerprint"]  # the same alert


# -- delivery ----------------------------------------------------------------------------------
class _Receiver(ThreadingHTTPServer):
    """A loopback webhook receiver that answers the first ``fail`` POSTs with ``status``."""

    def __init__(self, fail: int = 0, status: int = 500, delay_s: float = 0.0) -> None:
        self.fail, self.status, self.delay_s = fail, status, delay_s
        self.bodies: list[bytes] = []
        self.posts = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        srv = self.server
        with srv.lock:
            srv.posts += 1
            failing = srv.posts <= srv.fail
            if not failing:
                srv.bodies.append(data)
        time.sleep(srv.delay_s)
        self.send_response(srv.status if failing else 200)
        if failing and srv.status == 429:
            self.send_header("Retry-After", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[_Receiver]:
    srv = _Receiver(*getattr(request, "param", ()))
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("receiver", [(2, 503)], indirect=True)
def test_a_failing_endpoint_is_tried_again_with_backoff_until_it_answers(
    receiver: _Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    hook = Webhook(receiver.url, tries=3, backoff_s=0.05)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="perfloop.notify"):
        assert hook.deliver(b'{"text": "x"}')
    assert time.monotonic() - start >= 0.05 + 0.1  # waited 0.05 s, then 0.1 s
    assert receiver.posts == 3 and receiver.bodies == [b'{"text": "x"}']
    assert (hook.sent, hook.failed, hook.retried, hook.failures["HTTP 503"]) == (1, 0, 2, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the failure's kind once, then that it delivers again
    assert "HTTP 503" in lines[0] and "/hook" not in lines[0]  # the path is never logged
    assert "delivers again" in lines[1]


@pytest.mark.parametrize("receiver", [(5, 500)], indirect=True)
def test_an_endpoint_that_keeps_failing_is_given_up_after_the_tries(receiver: _Receiver) -> None:
    hook = Webhook(receiver.url, tries=3, backoff_s=0.01)
    assert not hook.deliver(b"{}")
    assert receiver.posts == 3 and (hook.sent, hook.failed) == (0, 1)


@pytest.mark.parametrize("receiver", [(1, 404), (1, 429)], indirect=True)
def test_a_client_error_is_final_and_a_429_is_tried_again(receiver: _Receiver) -> None:
    hook = Webhook(receiver.url, tries=3, backoff_s=0.01)
    delivered = hook.deliver(b"{}")
    assert delivered == (receiver.status == 429)
    assert receiver.posts == (2 if receiver.status == 429 else 1)


def test_a_refused_connection_and_a_timeout_are_counted_by_kind(receiver: _Receiver) -> None:
    receiver.delay_s = 1.0
    slow = Webhook(receiver.url, tries=1, timeout_s=0.2)
    assert not slow.deliver(b"{}") and slow.failures == {"timeout": 1}
    refused = Webhook("http://127.0.0.1:9/hook", tries=2, backoff_s=0.01)
    assert not refused.deliver(b"{}") and refused.failures == {"connection": 2}


@pytest.mark.parametrize("receiver", [(0, 200, 0.2)], indirect=True)
def test_sending_never_blocks_and_a_full_queue_drops_the_oldest(receiver: _Receiver) -> None:
    hook = Webhook(receiver.url, queue_max=2)
    hook.start()
    start = time.monotonic()
    for i in range(6):
        hook.send(f"{i}".encode())
    assert time.monotonic() - start < 0.1  # queued, not sent, by the caller
    assert hook.wait_idle(10)
    hook.stop()
    assert hook.dropped >= 3 and receiver.bodies[-1] == b"5"
    assert hook.sent + hook.dropped == 6


# -- settings and the stack --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"PERFLOOP_WEBHOOK_URLS": "hooks.example.com/x"}, "is not an http:// or https:// URL"),
        ({"PERFLOOP_WEBHOOK_FORMAT": "teams"}, "must be one of slack, alertmanager"),
        ({"PERFLOOP_WEBHOOK_KINDS": "hang,fire"}, "unknown webhook kind 'fire'; valid: all, hang"),
        ({"PERFLOOP_WEBHOOK_TRIES": "0"}, "PERFLOOP_WEBHOOK_TRIES='0'"),
        ({"PERFLOOP_METRICS_PORT": "70000"}, "PERFLOOP_METRICS_PORT='70000'"),
    ],
)
def test_bad_settings_are_one_line(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_environment(env)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_settings_take_lists_and_all() -> None:
    s = NotifierSettings(webhook_urls='["http://a.example/1", "https://b.example/2"]',
                         webhook_kinds="all")  # fmt: skip
    assert s.webhook_urls == ("http://a.example/1", "https://b.example/2")
    assert {"hang", "oom_warning", "approval", "compute_bound"} <= set(s.webhook_kinds)
    with pytest.raises(ConfigError, match="PERFLOOP_WEBHOOK_URLS"):
        NotifierService(NotifierSettings())


def test_up_starts_the_notifier_only_when_a_webhook_url_is_set() -> None:
    assert services_for(StackSettings()) == (*SERVICES, ACCOUNTANT)
    with_hook = StackSettings(webhook_urls="https://hooks.example.com/x")
    assert services_for(with_hook) == (*SERVICES, ACCOUNTANT, NOTIFIER)
    assert services_for(StackSettings(accounting=False)) == SERVICES
    three = services_for(StackSettings(accounting=False, stream_workers=3))
    assert three == (*SERVICES, "streams-2", "streams-3")


def test_the_notifier_service_without_a_url_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from perfloop.cli.parser import main

    for key in [k for k in os.environ if k.startswith("PERFLOOP_")]:
        monkeypatch.delenv(key)
    assert main(["service", "notifier"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("perfloop: the notifier has no webhook URL: set PERFLOOP_WEBHOOK_URLS")
    assert err.count("\n") == 1
    monkeypatch.setenv("PERFLOOP_WEBHOOK_FORMAT", "teams")
    assert main(["service", "notifier"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
