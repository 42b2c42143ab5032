"""Prometheus in the production topology: the alert rules' shape, every metric their expressions
name is one the stream worker exports, the scrape config reaches the stream workers where they
serve, and compose runs Prometheus and the notifier as documented. No Prometheus is needed;
``promtool check`` runs too when it is on the PATH."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from perfloop.notify.notices import alertname
from perfloop.settings import DEFAULT_WEBHOOK_KINDS, NotifierSettings, StreamsSettings
from perfloop.streams.metrics import EXPORTED_NAMES

yaml = pytest.importorskip("yaml", reason="pyyaml (dev extra) is needed to read the rules")

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "docker" / "prometheus"
RULES = PROM / "rules" / "perfloop.yml"
CONFIG = PROM / "prometheus.yml"
COMPOSE = ROOT / "docker" / "compose.yaml"

PROMQL_WORDS = {
    # aggregations, their modifiers, operators and functions the rules may use
    *("sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev"),
    *("by", "without", "on", "ignoring", "group_left", "group_right", "bool"),
    *("and", "or", "unless", "offset"),
}
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
"""Series Prometheus makes for every target itself."""
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert isinstance(doc, dict) and set(doc) == {"groups"}
    out = []
    names = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"] not in names
        names.add(group["name"])
        out.extend(group["rules"])
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions (a
    "(" follows), keywords, label names inside ``{…}`` or ``by (…)`` lists, strings or
    durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    out = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = m.group(), text[m.end() :].lstrip()
        if rest.startswith("(") or word in PROMQL_WORDS or re.fullmatch(r"\d.*", word):
            continue
        out.add(word)
    return out


def test_metric_names_are_read_out_of_expressions() -> None:
    expr = 'sum by (job_id) (rate(perfloop_x_total{a="b c"}[5m])) > on(job_id) max(up) * 2'
    assert metric_names(expr) == {"perfloop_x_total", "up"}


def test_every_rule_is_an_alert_with_a_severity_and_a_summary(rules: list[dict[str, Any]]) -> None:
    assert len(rules) >= 8
    seen = set()
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Perfloop[A-Z][A-Za-z]+", rule["alert"]) and rule["alert"] not in seen
        seen.add(rule["alert"])
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]
        assert "for" not in rule or DURATION.match(rule["for"]), rule["for"]
        assert rule["expr"].count("(") == rule["expr"].count(")")


def test_the_rules_use_only_what_the_stream_worker_exports(rules: list[dict[str, Any]]) -> None:
    used: set[str] = set()
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = names - EXPORTED_NAMES - PROMETHEUS_OWN
        assert not unknown, f"{rule['alert']}: no such metric {sorted(unknown)}"
        used |= names
        # the job label of perfloop's series is job_id: `job` is Prometheus's scrape job
        for m in re.finditer(r"\{([^}]*)\}", rule["expr"]):
            labels = set(re.findall(r"(\w+)\s*=~?", m.group(1)))
            assert "job" not in labels or "up" in names, rule["alert"]
    assert {"perfloop_diagnosis_open", "perfloop_rollbacks_total"} <= used
    assert {"perfloop_pending_approval_age_seconds", "perfloop_time_to_oom_seconds"} <= used


def test_the_rules_cover_the_issues_conditions_under_the_notifiers_names(
    rules: list[dict[str, Any]],
) -> None:
    names = {r["alert"] for r in rules}
    for kind in DEFAULT_WEBHOOK_KINDS:  # the webhooks' alertnames are the rules' names
        assert alertname(kind) in names, kind


def test_prometheus_scrapes_the_stream_workers_where_they_serve() -> None:
    doc = yaml.safe_load(CONFIG.read_text())
    (job,) = doc["scrape_configs"]
    assert job["job_name"] == "perfloop-streams"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["streams"] and sd["port"] == StreamsSettings().metrics_port
    assert doc["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    assert DURATION.match(doc["global"]["scrape_interval"])


def test_compose_runs_prometheus_and_the_notifier() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    prom = services["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"])
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    streams_env = services["streams"]["environment"]
    assert streams_env["PERFLOOP_METRICS_HOST"] == "0.0.0.0"
    assert "PERFLOOP_KAFKA_BOOTSTRAP" in streams_env  # the shared environment merged in
    notifier = services["notifier"]
    assert notifier["command"] == ["service", "notifier"] and notifier["profiles"] == ["alerts"]
    fields = {f"PERFLOOP_{f}".upper() for f in NotifierSettings.model_fields}
    assert {k for k in notifier["environment"] if k.startswith("PERFLOOP_WEBHOOK")} <= fields
    assert notifier["environment"]["PERFLOOP_KAFKA_BOOTSTRAP"] == "kafka:19092"


PROMTOOL = pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool on the PATH")


def promtool(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        ["promtool", *args], input=stdin, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


@PROMTOOL
def test_promtool_accepts_the_rules_and_the_config() -> None:
    promtool("check", "rules", str(RULES))
    promtool("check", "config", "--syntax-only", str(CONFIG))


@PROMTOOL
def test_promtool_finds_nothing_to_lint_in_what_the_worker_exposes() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from perfloop.schemas import Diagnosis
    from perfloop.streams.engine import Outputs
    from perfloop.streams.metrics import StreamMetrics, prometheus_families

    m = StreamMetrics()
    d = Diagnosis(ts_ns=1, job_id="j", node="n", rank=-1, diagnosis_id="d", bottleneck="hang",
                  level="cluster_health", loop="product", state="open", onset_ns=1,
                  step_share=1.0, confidence=1.0, critical_path=True)  # fmt: skip
    m.observe(Outputs(diagnoses=[d]), 10**18)
    m.worker(samples=10, dead_letters={"perfloop.telemetry.step": 1})

    class Snapshot:
        def collect(self) -> Any:
            return prometheus_families(m.snapshot(10**18))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    promtool("check", "metrics", stdin=generate_latest(registry).decode())


RULE_TESTS = """
rule_files: [%s]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - series: 'perfloop_diagnosis_open{job_id="llm-7", bottleneck="hang", level="cluster_health"}'
        values: '_ _ 1x10'
      - series: 'perfloop_rollbacks_total{job_id="llm-7"}'
        values: '0 0 0 1 1 1'
      - series: 'perfloop_pending_approval_age_seconds{job_id="llm-7"}'
        values: '200+15x20'
    alert_rule_test:
      - eval_time: 2m
        alertname: PerfloopHang
        exp_alerts:
          - exp_labels: {severity: critical, job_id: llm-7}
            exp_annotations:
              summary: Job llm-7 is hung
              description: >-
                The stream tier diagnosed a hang (no rank made progress past its pause
                allowance). `perfloop jobs` and the diagnoses table name the rank the others
                wait for.
      - eval_time: 1m
        alertname: PerfloopRollback
        exp_alerts:
          - exp_labels: {severity: info, job_id: llm-7}
            exp_annotations:
              summary: A change to job llm-7 was rolled back
              description: >-
                The job's agent verified a change against the steps before it and undid it
                (slower, or no gain); the actuations table has the evidence.
      - eval_time: 1m
        alertname: PerfloopPendingApproval
        exp_alerts: []
"""


@PROMTOOL
def test_the_alerts_fire_on_the_series_they_watch(tmp_path: Path) -> None:
    tests = tmp_path / "rules_test.yml"
    tests.write_text(RULE_TESTS % RULES)
    promtool("test", "rules", str(tests))
