"""Acceptance for the Grafana dashboards (`docker/grafana/dashboards`): every variable's and
every panel's SQL returns rows on the embedded warehouse.

The data is made the way users make it, on the real embedded stack: a simulated job with a
starving data loader and its job agent (the loop closes: diagnosis, recommendation, signed
command, applied, kept; the models' predictions), a job in tier ``approve`` with a Slurm
identity whose recommendations are left pending or rejected with ``perfloop reject``, a job in
dry run with a Kubernetes identity (a dry run and a refusal) and a poison message that goes to
the dead-letter topic; the simulated job's end is accounted for by the stack's accountant.
Each dashboard's SQL is then expanded the way Grafana and the ClickHouse
data source plugin expand it (`_Grafana`) and run as the plugin would send it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from perfloop.actuators import JobAgent
from perfloop.actuators.agent import keyring_for
from perfloop.kafka import producer
from perfloop.producers import Fault, Publisher, SimConfig, SimulatedJob
from perfloop.schemas import JobInfo, JobLifecycle, Recommendation, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import ActuatorSettings, StackSettings
from perfloop.warehouse import client

from .conftest import query, stack_signed, wait_for

pytestmark = pytest.mark.integration

DASHBOARDS = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards"
KNOB = "dataloader.num_workers"
ALL = "$__all"
"""The value Grafana gives a variable whose *All* option is selected."""


# --- what Grafana and the plugin do to a query before ClickHouse sees it ----------------------

_CONDITIONAL_ALL = "$__conditionalAll("
_VARIABLE_ARG = re.compile(r"(?<=\$\{)[\w\d]+(?=\})|(?<=\$)[\w\d]+")
_TEMPLATE = re.compile(
    r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^\}]+))?(?::([^\}]+))?\}"
)
"""Grafana's template-variable syntax: ``$var``, ``[[var:format]]``, ``${var.path:format}``."""


def _macro_args(sql: str, at: int) -> list[str]:
    """The arguments of the macro whose ``(`` is at ``at``: split at top-level commas, as the
    plugin's ``getMacroArgs`` does (string literals are not special)."""
    args: list[str] = []
    depth, last, rest = 0, 1, sql[at:]
    for m in re.finditer(r"\(|\)|,", rest):
        depth += {"(": 1, ")": -1}.get(m[0], 0)
        if m[0] == "," and depth == 1:
            args.append(rest[last : m.end() - 1])
            last = m.end()
        if depth == 0:
            args.append(rest[last : m.end() - 1])
            return args
    return []


def _macro_matches(sql: str, name: str) -> list[tuple[str, str]]:
    """Each use of ``$__name`` with its argument text, found as the plugin SDK's
    ``sqlutil.getMacroMatches`` finds it: from the macro to the bracket that closes the first
    ``(`` after it, unless a ``)`` comes first. A bare macro (``$__interval_s``) followed later
    by a ``(`` before any ``)`` swallows the text up to that bracket's close, so the dashboards
    only use bare macros right before a ``)``; expanding them like this keeps that honest."""
    out = []
    for m in re.finditer(rf"\$__{name}\b", sql):
        rest = sql[m.start() :]
        depth = arg_start = end = 0
        for i, ch in enumerate(rest):
            if depth == 0 and end > 0:
                break
            if ch == "(":
                depth += 1
                arg_start = arg_start or i + 1
            elif ch == ")":
                if depth == 0:
                    end = 0
                    break
                depth -= 1
                end = i + 1
        end = end or m.end() - m.start()
        out.append((rest[:end], rest[arg_start : end - 1] if arg_start else ""))
    return out


@dataclass
class _Grafana:
    """Expands a dashboard query the way Grafana 12 and the ClickHouse data source plugin
    (``grafana-clickhouse-datasource`` 4.x) do, in their order:

    1. the plugin's frontend resolves ``$__conditionalAll(condition, $var)``: the condition,
       or ``1=1`` when the variable is *All* (or empty);
    2. Grafana's template service substitutes ``$var`` / ``${var:format}`` (``singlequote``,
       ``csv``, ``raw``; without a format the plugin's own: ``'a','b'`` for several values, the
       bare value for one); *All* without a custom all-value stands for every option;
    3. the plugin's backend expands its macros against the time range and the interval:
       ``$__timeFilter(col)``, ``$__timeInterval(col)``, ``$__interval_s``, ``$__fromTime``…
       (the plugin's documented expansions, `macros`).
    """

    start: datetime
    end: datetime
    interval_s: int
    current: dict[str, str | list[str]] = field(default_factory=dict)
    options: dict[str, list[str]] = field(default_factory=dict)

    def macros(self) -> dict[str, Callable[[list[str]], str]]:
        """The plugin's macros (its documented table), by name, for this range and interval."""
        frm, to = int(self.start.timestamp()), int(self.end.timestamp())
        frm_ms, to_ms = int(self.start.timestamp() * 1000), int(self.end.timestamp() * 1000)
        day = "toDate('{:%Y-%m-%d}')"
        return {
            "timeFilter": lambda a: f"{a[0]} >= toDateTime({frm}) AND {a[0]} <= toDateTime({to})",
            "timeFilter_ms": lambda a: (
                f"{a[0]} >= fromUnixTimestamp64Milli({frm_ms}) AND "
                f"{a[0]} <= fromUnixTimestamp64Milli({to_ms})"
            ),
            "dateFilter": lambda a: (
                f"{a[0]} >= {day.format(self.start)} AND {a[0]} <= {day.format(self.end)}"
            ),
            "timeInterval": lambda a: (
                f"toStartOfInterval(toDateTime({a[0]}), INTERVAL {self.interval_s} second)"
            ),
            "timeInterval_ms": lambda a: (
                f"toStartOfInterval(toDateTime64({a[0]}, 3), "
                f"INTERVAL {self.interval_s * 1000} millisecond)"
            ),
            "interval_s": lambda a: str(self.interval_s),
            "fromTime": lambda a: f"toDateTime({frm})",
            "toTime": lambda a: f"toDateTime({to})",
            "fromTime_ms": lambda a: f"fromUnixTimestamp64Milli({frm_ms})",
            "toTime_ms": lambda a: f"fromUnixTimestamp64Milli({to_ms})",
        }

    def expand(self, sql: str) -> str:
        out = self._macros(self._template(self._conditional_all(sql)), reverse=False)
        # The backend walks its macros in map order (random in Go): any order must give the same.
        again = self._macros(self._template(self._conditional_all(sql)), reverse=True)
        assert out == again, f"the expansion depends on the order of the macros:\n{out}\n{again}"
        assert "$" not in out, f"unexpanded macro or variable:\n{out}"
        return out

    def _text(self, name: str) -> str | None:
        value = self.current.get(name)
        return ",".join(value) if isinstance(value, list) else value

    def _conditional_all(self, sql: str) -> str:
        at = sql.rfind(_CONDITIONAL_ALL)
        while at != -1:
            args = _macro_args(sql, at + len(_CONDITIONAL_ALL) - 1)
            if len(args) != 2:
                return sql
            phrase = args[0]
            ref = _VARIABLE_ARG.search(args[1].strip())
            if ref and ref[0] in self.current and self._text(ref[0]) in ("", ALL):
                phrase = "1=1"
            sql = sql.replace(f"{_CONDITIONAL_ALL}{args[0]},{args[1]})", phrase, 1)
            at = sql.rfind(_CONDITIONAL_ALL)
        return sql

    def _template(self, sql: str) -> str:
        def sub(m: re.Match[str]) -> str:
            name = m[1] or m[2] or m[4]
            fmt = m[3] or m[6]
            if name not in self.current:
                return m[0]  # not a variable: a macro, left to the backend
            value = self.current[name]
            if value == ALL or value == [ALL]:
                value = self.options[name]
            return _format(value, fmt)

        return _TEMPLATE.sub(sub, sql)

    def _macros(self, sql: str, *, reverse: bool) -> str:
        macros = self.macros()
        for name in sorted(macros, reverse=reverse):
            for text, args in _macro_matches(sql, name):
                sql = sql.replace(text, macros[name]([a.strip() for a in args.split(",")]))
        return sql


def _format(value: str | list[str], fmt: str | None) -> str:
    values = value if isinstance(value, list) else [value]
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt in ("csv", "raw"):
        return ",".join(values)
    if fmt is None:  # the plugin's own format
        return "'" + "','".join(values) + "'" if isinstance(value, list) else value
    raise AssertionError(f"variable format {fmt!r} is not one the dashboards may use")


# --- the data -----------------------------------------------------------------------------


@dataclass
class _Made:
    sim_job: str
    approve_job: str
    dry_job: str
    pending_rec: str
    rejected_rec: str
    start: datetime


def _publish(settings: StackSettings, *events: Any, topic: str) -> None:
    """Publish ``events`` (recommendations signed as the stack's stream tier signs them)."""
    p = producer(settings)
    for ev in events:
        ev = stack_signed(settings, ev)
        p.produce(topic, key=ev.job_id.encode(), value=encode_event(ev))
    assert p.flush(10) == 0


def _cli(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`perfloop ARGS` started in the background (the CLI as a user runs it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "perfloop.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def _done(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{proc.args}: {out}{err}"
    return out


def _rec(job: str, to_value: int, gain: float) -> Recommendation:
    return Recommendation(
        ts_ns=time.time_ns(), job_id=job, node=f"{job}-node-0", rank=-1, knob=KNOB,
        from_value=2, to_value=to_value, loop="fast", expected_gain_pct=gain, confidence=0.8,
        rationale="the loader starves the step",
    )  # fmt: skip


def _run_looped_job(stack: StackSettings, job: str) -> Callable[[], None]:
    """Start a simulated 2-rank job whose data loader starves from its 2nd second, with its job
    agent, in a thread that ends once the agent has judged the change the loop made; return
    the function that waits for it."""
    pub = Publisher(stack)
    sim = SimulatedJob(
        SimConfig(
            job_id=job,
            ranks_per_node=2,
            speed=4.0,
            scenario="dataloader_starvation",
            faults=(Fault("dataloader_starvation", onset_s=2.0),),
        ),
        pub,
    )
    key = ActuatorSettings().signing_key.get_secret_value().encode()
    agent = JobAgent(stack, job_id=job, node=sim.cfg.node, signing_key=key,
                     keyring=keyring_for(stack),  # the stack's actuator key signs commands
                     handlers=sim.knob_handlers(), read=sim.knob_value)  # fmt: skip
    assert agent.start(20.0), "the control topic was never assigned"
    failed: list[BaseException] = []

    def judged() -> bool:
        return any(r.status in ("kept", "rolled_back") for r in agent.results)

    def run() -> None:
        try:
            sim.run(
                120.0,
                step_boundary=agent.step_boundary,
                on_step=lambda rep: agent.observe_step(rep.step, rep.step_time_ms),
                stop=lambda: judged() and not agent.verifying,
            )
        except BaseException as e:
            failed.append(e)
        finally:
            pub.flush(10)
            agent.stop()

    thread = threading.Thread(target=run, name=f"sim-{job}", daemon=True)
    thread.start()

    def join() -> None:
        thread.join(90)
        assert not thread.is_alive(), "the simulated job did not end"
        if failed:
            raise failed[0]
        assert judged(), f"the loop did not close; the agent's results: {agent.results}"

    return join


def _identity(job: str, **scheduler: str) -> list[Any]:
    """What a job's ranks publish when they start: its job info (with its scheduler identity)
    and its lifecycle."""
    now = time.time_ns()
    info = JobInfo(ts_ns=now, job_id=job, node=f"{job}-node-0", rank=0, model_name="llama-8b",
                   parallelism="fsdp", world_size=8, local_world_size=8, gpu_name="NVIDIA H100",
                   gpu_count=8, cpu_count=64, **scheduler)  # fmt: skip
    started = JobLifecycle(ts_ns=now, job_id=job, node=f"{job}-node-0", rank=-1, state="started")
    return [info, started]


def _wait_ready(stack: StackSettings, made: _Made) -> None:
    """Until every table the dashboards read holds what the scenario made."""
    checks = {
        "the simulated job's verdict": (
            "SELECT count() FROM actuations WHERE job_id = {a:String} "
            "AND status IN ('kept', 'rolled_back')"
        ),
        "its realised predictions": (
            "SELECT count() FROM prediction_accuracy WHERE job_id = {a:String}"
        ),
        "its end": (  # stopped once the loop closed: "killed", "stopped before the end"
            "SELECT count() FROM job_lifecycle WHERE job_id = {a:String} AND rank = -1 "
            "AND state != 'started'"
        ),
        "its diagnoses": "SELECT count() FROM diagnoses WHERE job_id = {a:String}",
        "the decisions": (
            "SELECT uniqExact(outcome) = 5 FROM audit WHERE job_id IN ({a:String}, {b:String}, "
            "{c:String}) AND outcome IN ('issued', 'pending', 'rejected', 'dry_run', 'refused')"
        ),
        "the rejection": "SELECT count() FROM approvals WHERE rec_id = {r:String}",
        "the tiers": (
            "SELECT count() FROM config_changes WHERE target = 'actuator' "
            "AND applies_to IN ({b:String}, {c:String})"
        ),
        "the scheduler identities": (
            "SELECT uniqExact(scheduler) = 2 FROM job_info WHERE job_id IN ({b:String}, {c:String})"
        ),
        "the dead letter": "SELECT count() FROM dead_letters WHERE key = {a:String}",
        "the ended job's accounting": (
            "SELECT count() FROM job_accounting WHERE job_id = {a:String}"
        ),
    }
    params = {"a": made.sim_job, "b": made.approve_job, "c": made.dry_job, "r": made.rejected_rec}

    def missing() -> list[str]:
        return [what for what, sql in checks.items() if not query(stack, sql, **params)[0][0]]

    try:
        wait_for(lambda: not missing(), 60, "the dashboards' data")
    except AssertionError as e:
        raise AssertionError(f"{e}; still missing: {missing()}") from None


@pytest.fixture(scope="module")
def made(stack: StackSettings, stack_env_vars: dict[str, str]) -> _Made:
    run = uuid.uuid4().hex[:8]
    start = datetime.now(UTC)
    sim_job, approve_job, dry_job = f"it-gf-sim-{run}", f"it-gf-approve-{run}", f"it-gf-dry-{run}"
    env = stack_env_vars
    tiers = [
        _cli(env, "config", "set", "actuator.tier", "approve", "--job", approve_job,
             "--reason", "changes to this job need a person"),
        _cli(env, "config", "set", "actuator.dry_run", "true", "--job", dry_job,
             "--reason", "watch what the loop would do first"),
    ]  # fmt: skip
    join = _run_looped_job(stack, sim_job)
    _publish(stack, *_identity(approve_job, scheduler="slurm", slurm_job_id="4242",
                               slurm_job_name="pretrain", slurm_nodelist="gpu[01-02]"),
             *_identity(dry_job, scheduler="kubernetes", k8s_pod="train-0",
                        k8s_namespace="ml", k8s_node="node-7"),
             topic=Topics.JOB)  # fmt: skip
    poison = Producer({"bootstrap.servers": stack.kafka_bootstrap})
    poison.produce(Topics.STEP, key=sim_job.encode(), value=b"\x00not a batch")
    assert poison.flush(10) == 0

    for proc in tiers:
        _done(proc)
    log = stack.home / "logs" / "actuator.log"
    wait_for(
        lambda: all(f"for job {j}:" in log.read_text() for j in (approve_job, dry_job)),
        30,
        "the actuator to take the jobs' tier and dry run",
    )
    pending, rejected = _rec(approve_job, 6, 30.0), _rec(approve_job, 8, 25.0)
    dry, too_small = _rec(dry_job, 6, 30.0), _rec(dry_job, 3, 1.0)  # below min_gain_pct: refused
    _publish(stack, pending, rejected, dry, too_small, topic=Topics.RECOMMENDATIONS)
    wait_for(
        lambda: query(stack, "SELECT count() FROM audit WHERE rec_id = {r:String} AND "
                      "outcome = 'pending'", r=rejected.event_id)[0][0]
        # the audit row and the recommendation come through different topics: wait for both
        and query(stack, "SELECT count() FROM recommendations WHERE rec_id = {r:String}",
                  r=rejected.event_id)[0][0],
        30,
        "the recommendation to reject, and its pending decision, in the warehouse",
    )  # fmt: skip
    out = _done(_cli(env, "reject", rejected.event_id, "--reason", "an eval is running"))
    assert "actuator: rejected" in out, out
    join()
    made = _Made(sim_job, approve_job, dry_job, pending.event_id, rejected.event_id, start)
    _wait_ready(stack, made)
    return made


# --- the dashboards -----------------------------------------------------------------------


def _dashboard(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / f"{name}.json").read_text())


def _panels(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in doc["panels"]:
        yield from panel.get("panels", [])  # a collapsed row keeps its panels
        if panel["type"] != "row":
            yield panel


def _variable_sql(var: dict[str, Any]) -> str:
    q = var["query"]
    return q if isinstance(q, str) else q["rawSql"]


def _rows(ch: Any, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in ch.query(sql).result_rows]


def _resolve_variables(
    ch: Any, doc: dict[str, Any], grafana: _Grafana, chosen: dict[str, str | list[str]]
) -> list[str]:
    """Fill ``grafana`` with the dashboard's variables in their order, each query variable's
    options from its SQL; what ``chosen`` names is selected, else All where it is offered,
    else the first option (what Grafana selects). Returns the variables whose SQL gave no rows."""
    empty = []
    for var in doc["templating"]["list"]:
        name = var["name"]
        if var["type"] == "constant":
            grafana.current[name] = var["query"]
            continue
        assert var["type"] == "query", f"{name}: variable type {var['type']} is not expected"
        rows = _rows(ch, grafana.expand(_variable_sql(var)))
        if not rows:
            empty.append(name)
        grafana.options[name] = [str(r[0]) for r in rows]
        if name in chosen:
            grafana.current[name] = chosen[name]
        elif var.get("includeAll"):
            grafana.current[name] = [ALL] if var.get("multi") else ALL
        else:
            grafana.current[name] = grafana.options[name][0] if rows else ""
    return empty


def _window(made: _Made) -> tuple[datetime, datetime]:
    # The simulated job runs 4x faster than the wall clock, so its event times run ahead of it.
    return made.start - timedelta(minutes=2), datetime.now(UTC) + timedelta(minutes=5)


CHOSEN: dict[str, Callable[[_Made], dict[str, str | list[str]]]] = {
    "job": lambda m: {"job": m.sim_job},
    "cluster": lambda m: {},
    "control-loop": lambda m: {},
    "audit": lambda m: {},
}


@pytest.mark.parametrize("name", sorted(CHOSEN))
def test_every_variable_and_panel_returns_rows_on_the_embedded_warehouse(
    stack: StackSettings, made: _Made, name: str
) -> None:
    doc = _dashboard(name)
    start, end = _window(made)
    grafana = _Grafana(start, end, interval_s=5)
    ch = client(stack)
    try:
        empty = _resolve_variables(ch, doc, grafana, CHOSEN[name](made))
        assert not empty, f"{name}: variables whose SQL returns no rows: {empty}"
        failures, results = [], {}
        for panel in _panels(doc):
            for target in panel["targets"]:
                sql = grafana.expand(target["rawSql"])
                try:
                    rows = _rows(ch, sql)
                except Exception as e:
                    failures.append(f"{panel['title']!r} fails: {e}\n{sql}")
                    continue
                if not rows:
                    failures.append(f"{panel['title']!r} returns no rows:\n{sql}")
                results[panel["title"]] = rows
    finally:
        ch.close()
    assert not failures, f"{name}: " + "\n\n".join(failures)
    _check_content(name, grafana, results, made)


def _check_content(
    name: str, grafana: _Grafana, results: dict[str, list[tuple[Any, ...]]], made: _Made
) -> None:
    """What the scenario made shows where a user looks for it."""
    cells = {t: {str(c) for row in rows for c in row} for t, rows in results.items()}
    if name == "job":
        assert {"kept", "issued", "applied"} <= cells["Recommendations and what became of them"]
        assert "dataloader_starvation" in cells["Diagnoses, open first"]
        assert "dataloader_starvation" in cells["What each diagnosis cost"]
        assert "productive" in cells["Where the wall time went"]
    elif name == "cluster":
        assert {"slurm", "kubernetes"} <= set(grafana.options["scheduler"])
        assert {made.approve_job, made.dry_job} <= cells[
            "Jobs: running first, then those that ended in the time range"
        ]
        assert made.sim_job in cells["Ended jobs: goodput, badput by cause, throughput and cost"]
    elif name == "control-loop":
        assert made.pending_rec in " ".join(cells["Pending approvals"])
        assert "kept" in cells["Expected vs measured gain of each change"]
    elif name == "audit":
        assert {"dry_run", "refused", "rejected"} <= cells["Dry runs, refusals and rejections"]
        assert made.rejected_rec in cells["Approvals and rejections by people"]
        assert {"approve", "true"} <= cells["Changes to the actuator's policy"]


@pytest.mark.parametrize("name", sorted(CHOSEN))
def test_every_query_runs_with_one_value_chosen_per_variable(
    stack: StackSettings, made: _Made, name: str
) -> None:
    """With a value picked in each variable instead of All, the conditions that All short-cuts
    to ``1=1`` are in the SQL: it must still run."""
    doc = _dashboard(name)
    start, end = _window(made)
    probe = _Grafana(start, end, interval_s=5)
    ch = client(stack)
    try:
        _resolve_variables(ch, doc, probe, CHOSEN[name](made))
        one: dict[str, str | list[str]] = {
            v["name"]: [probe.options[v["name"]][0]]
            if v.get("multi")
            else probe.options[v["name"]][0]
            for v in doc["templating"]["list"]
            if v["type"] == "query" and probe.options[v["name"]]
        }
        one.update(CHOSEN[name](made))
        grafana = _Grafana(start, end, interval_s=5)
        _resolve_variables(ch, doc, grafana, one)
        for panel in _panels(doc):
            for target in panel["targets"]:
                _rows(ch, grafana.expand(target["rawSql"]))  # raises on a bad query
    finally:
        ch.close()


def test_the_expansion_matches_the_plugins_documented_output() -> None:
    """The plugin's macro table (docs/sources/query-editor.md of grafana/clickhouse-datasource)
    and its conditional-All and template rules, on this module's expander."""
    g = _Grafana(
        datetime.fromtimestamp(1415792726, UTC),
        datetime.fromtimestamp(1447328726, UTC),
        interval_s=20,
        current={"node": [ALL], "rank": ["0", "1"], "job": "o'brien"},
        options={"node": ["a", "b"]},
    )
    assert g.expand("$__timeFilter(time)") == (
        "time >= toDateTime(1415792726) AND time <= toDateTime(1447328726)"
    )
    assert g.expand("$__timeInterval(column)") == (
        "toStartOfInterval(toDateTime(column), INTERVAL 20 second)"
    )
    assert g.expand("SELECT (count() / $__interval_s) AS x") == "SELECT (count() / 20) AS x"
    assert g.expand("$__conditionalAll(node IN (${node:singlequote}), $node)") == "1=1"
    assert g.expand("$__conditionalAll(rank IN (${rank:csv}), $rank)") == "rank IN (0,1)"
    assert g.expand("job = ${job:singlequote} AND n IN ($node)") == (
        "job = 'o\\'brien' AND n IN ('a','b')"
    )
    # A bare macro before a later "(" swallows up to that bracket's close, as the SDK does.
    assert _macro_matches("$__interval_s AS x FROM t WHERE f(y)", "interval_s") == [
        ("$__interval_s AS x FROM t WHERE f(y)", "y")
    ]
