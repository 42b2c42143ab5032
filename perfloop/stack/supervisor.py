"""The embedded stack's supervisor: `perfloop up`, in the foreground or detached (`down` and
`status` are in `perfloop.stack.control`).

`Supervisor` starts, watches and restarts perfloop's processes — the Tansu broker and the chDB
warehouse server (embedded mode only), then the topics and migrations, then the stream
workers, the sink, the actuator service and the accountant (`perfloop.report.accountant`;
and the notifier, `perfloop.notify`, when ``PERFLOOP_WEBHOOK_URLS`` is set) — and records
them in ``$PERFLOOP_HOME/stack.json``.
`down` stops exactly what `up` started and nothing else: the supervisor's process group and
the services it recorded. Logs are ``$PERFLOOP_HOME/logs/<service>.log``.

The embedded stack shares its machine with the training job it watches, and a job that keeps
every CPU busy would pay for its own monitoring. With ``stack_priority`` "idle" (the default)
the stack yields to the job (Linux):

- Where the supervisor may make CPU control groups (`perfloop._cpugroup`), its services run in
  two idle ones (``cpu.idle``): the loop (broker, stream workers, actuator) and history
  (warehouse, sink). To the kernel an idle group is a group of ``SCHED_IDLE`` tasks: any
  ordinary thread that wakes up takes its CPU at once, and it weighs 3 against a rank's 1024.
  A stream worker that falls behind its input more than a second (a job that leaves no CPU
  idle) makes the loop's group an ordinary one of weight 110 until it has kept up for 30 s
  (`perfloop.autogroup.CatchUp`): late diagnoses are no use to the job.
- Every service also runs in a session of its own, and the supervisor sets that session's
  scheduling group to nice 19 (``/proc/<pid>/autogroup``): what orders the stack behind the
  job where there are no control groups to make. Linux's autogroups (on in most
  distributions; they apply only to processes in the root control group) make a group of each
  session and share a CPU between groups first, by their weights, whatever the threads inside
  have asked for; ``torchrun`` starts each rank in a session of its own. A service in a group
  at nice 0 meets a rank as an equal: two busy loops in sessions of their own on 2 CPUs ran at
  ~73 % of their speed while a third loop, under ``SCHED_IDLE`` but in a third session, ran;
  with that session's group at nice 19 they kept ~98 %. But a rank that wakes up where such a
  group runs waits for its time slice to end; the catch-up raises the worker's and the
  broker's groups to nice 10.
- Inside that group, the services that keep history (the warehouse and the sink) run under
  ``SCHED_IDLE`` and the loop (broker, stream workers, actuator) under ``SCHED_BATCH``: a
  service that wakes up (a batch of telemetry came) waits for the running thread's slice to
  end, or for it to block, instead of preempting it. Where there are neither control groups
  nor autogroups these policies are what orders the stack behind the job.

Measured on a healthy 2-rank DDP job that keeps two CPUs ~85 % busy, the loop still diagnosed
within seconds (bench/README.md). ``PERFLOOP_STACK_PRIORITY=normal`` runs every service like
any other process, in the supervisor's session.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfloop._cpugroup import StackGroups, set_idle
from perfloop.autogroup import CATCH_UP_NICE, set_autogroup_nice
from perfloop.exceptions import PerfloopError, StackError
from perfloop.kafka import ensure_topics
from perfloop.settings import StackSettings
from perfloop.stack._fronts import BrokerFronts
from perfloop.stack._headroom import SAMPLE_S, SAMPLES, rss_bytes
from perfloop.stack._keys import stack_key_settings
from perfloop.stack._recycle import Recycler
from perfloop.stack.broker import broker_argv
from perfloop.stack.control import (
    STATE_FILE,
    _alive,
    _http_ok,
    _last_line,
    check_external,
    read_state,
)
from perfloop.stack.listen import listen_settings
from perfloop.warehouse import migrate

__all__ = [
    "ACCOUNTANT",
    "NOTIFIER",
    "OPTIONAL_SERVICES",
    "SERVICES",
    "Supervisor",
    "services_for",
    "up_detached",
]

SERVICES = ("streams", "sink", "actuator")
ACCOUNTANT = "accountant"
"""Started after `SERVICES` unless ``accounting`` is off (`perfloop.report.accountant`)."""
NOTIFIER = "notifier"
"""Started after `SERVICES` when webhook URLs are set (`perfloop.notify`)."""
OPTIONAL_SERVICES = (ACCOUNTANT, NOTIFIER)
IDLE_SERVICES = frozenset({"warehouse", "sink", ACCOUNTANT})
"""What runs under ``SCHED_IDLE`` with ``stack_priority`` "idle": history, not the loop (which
runs under ``SCHED_BATCH``)."""


AUTOGROUP_NICE = 19
"""The nice value of each service's scheduling group with ``stack_priority`` "idle"."""


def _policy_for(name: str, stack_priority: str) -> str:
    """The policy service ``name`` starts under: "idle", "batch" or "normal"."""
    if stack_priority != "idle":
        return "normal"
    return "idle" if name in IDLE_SERVICES else "batch"


def _at_priority(priority: str, start: Callable[[], subprocess.Popen[bytes]]) -> Any:
    """``start()`` on a thread whose scheduling policy is ``SCHED_IDLE`` when ``priority`` is
    "idle" and ``SCHED_BATCH`` when it is "batch": a process it forks inherits the policy, and
    so does every thread of it, from its first instruction (no window in which a service runs
    under the ordinary policy). Where the policy does not exist or may not be set, the
    process starts under the ordinary one."""
    policy = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH"}.get(priority)
    chosen = getattr(os, policy, None) if policy else None
    if chosen is None:
        return start()
    out: dict[str, Any] = {}

    def run() -> None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, chosen, os.sched_param(0))
        try:
            out["proc"] = start()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, name="perfloop-spawn", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["proc"]


def services_for(settings: StackSettings) -> tuple[str, ...]:
    """The perfloop services `up` starts: `SERVICES` (and ``streams-2``… up to
    ``stream_workers`` stream workers), the accountant unless ``accounting`` is
    off (``PERFLOOP_ACCOUNTING=0``), and the notifier when a webhook URL is set
    (``PERFLOOP_WEBHOOK_URLS``)."""
    more = tuple(f"streams-{i}" for i in range(2, settings.stream_workers + 1))
    return (
        *SERVICES,
        *more,
        *((ACCOUNTANT,) if settings.accounting else ()),
        *((NOTIFIER,) if settings.webhook_urls else ()),
    )


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _require_free(host: str, port: int, setting: str) -> None:
    if not _port_free(host, port):
        raise StackError(f"port {port} on {host} is in use; stop what holds it or set {setting}")


@dataclass
class _Child:
    name: str
    argv: list[str]
    ready: Callable[[], bool] | None  # None: running once spawned
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    state: str = "stopped"
    log: Path = field(default_factory=Path)


class Supervisor:
    """Runs the stack in the foreground until `stop()` (SIGTERM/SIGINT call it)."""

    def __init__(self, settings: StackSettings) -> None:
        self.home = settings.home_dir
        # beyond loopback: TLS and a password everywhere, the services' settings say so
        self._listen = listen_settings(settings)
        settings = self.settings = settings.model_copy(update=self._listen.fields)
        self.logs = self.home / "logs"
        self._stop = threading.Event()
        self._children: list[_Child] = []
        self._broker_rss: collections.deque[list[float]] = collections.deque(maxlen=SAMPLES)
        self._fronts: BrokerFronts | None = None  # where clients reach the broker (`._fronts`)
        self._groups: StackGroups | None = None  # idle CPU control groups, where they can be
        self._keys: dict[str, str] = {}  # the settings naming the stack's keys (`_keys`)
        self._recycler = Recycler(
            settings, services=self._services, replace=self._replace_broker, say=self._say
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def preflight(self) -> None:
        """Fail with one line before starting anything: already up, port taken, no broker."""
        s = self.settings
        existing = read_state(s)
        if existing and _alive(existing["supervisor_pid"]):
            raise StackError(
                f"the stack is already up (supervisor pid {existing['supervisor_pid']}, "
                f"home {self.home}); run `perfloop down` first"
            )
        self._listen.check(s)
        if not s.external_kafka:
            broker_argv(s)  # raises if the tansu binary is missing
            _require_free(s.host, s.kafka_port, "PERFLOOP_KAFKA_PORT")
        if not s.external_clickhouse:
            _require_free(s.host, s.clickhouse_port, "PERFLOOP_CLICKHOUSE_PORT")
        check_external(s)

    def start(self) -> None:
        """Check the environment, then start every service in dependency order."""
        s = self.settings
        self.preflight()
        self.logs.mkdir(parents=True, exist_ok=True)
        self._keys = stack_key_settings(self.home)  # made at the first start (`_keys`)
        self._listen.running(os.getpid())
        if s.stack_priority == "idle":
            groups = StackGroups()
            if groups.ok:
                self._groups = groups
            else:
                print(
                    "perfloop supervisor: no idle CPU control group for the services "
                    f"({groups.error}); they yield through autogroups only",
                    flush=True,
                )
        py = sys.executable
        if not s.external_kafka:
            self._fronts = BrokerFronts(s.host, s.kafka_port, self._listen.context(), self._say)
            self._fronts.start()
            self._children.append(
                self._child("broker", self._broker_argv(), lambda: self._broker_ready())
            )
        if not s.external_clickhouse:
            self._children.append(
                self._child(
                    "warehouse",
                    [py, "-m", "perfloop.stack.warehouse_server"],
                    lambda: _http_ok(s.clickhouse_url, s.clickhouse_ca),
                )
            )
        for child in self._children:
            self._spawn(child)
        self._await_ready(self._children)
        if self._fronts is not None:  # its topics first: clients reach it through the front
            port = self._fronts.advertised[-1]
            ensure_topics(s.model_copy(update={"kafka_port": port}))
            self._fronts.point_at(port)
        else:
            ensure_topics(s)
        migrate(s)
        services = [
            self._child(name, [py, "-m", "perfloop.cli", "service", name.split("-")[0]])
            for name in services_for(s)
        ]
        self._children.extend(services)
        for child in services:
            self._spawn(child)
            child.state = "running"
        self._sample_broker(write=False)  # the first of the broker's memory samples
        if (broker := self._broker()) is not None and broker.proc is not None:
            self._recycler.broker_started(broker.proc.pid)
        self._write_state("up")

    def run(self) -> None:
        """Start, then watch the children and restart any that exits, until stopped."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        try:
            self.start()
            sampled = time.monotonic()
            while not self._stop.wait(0.5):
                for child in self._children:
                    if child.proc is not None and child.proc.poll() is not None:
                        self._restart(child)
                if time.monotonic() - sampled >= SAMPLE_S:
                    sampled = time.monotonic()
                    self._sample_broker()
                broker = self._broker()
                if broker is not None and broker.proc is not None and broker.state == "running":
                    recycles = self._recycler.stats.recycles
                    self._recycler.step(broker.proc.pid)
                    if self._recycler.stats.recycles != recycles:
                        self._write_state("up")
        finally:
            self.stop()

    def _broker(self) -> _Child | None:
        return next((c for c in self._children if c.name == "broker"), None)

    def _services(self) -> dict[str, int]:
        """The running services (not the broker or the warehouse), by name: their pids."""
        return {
            c.name: c.proc.pid
            for c in self._children
            if c.name not in ("broker", "warehouse")
            and c.proc is not None
            and c.proc.poll() is None
        }

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError), open(self.logs / "supervisor.log", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} perfloop supervisor: {line}\n")

    def _replace_broker(self) -> None:
        """Kill the broker and start an empty one with its topics (a recycle)."""
        broker = self._broker()
        assert broker is not None and broker.proc is not None
        broker.state = "restarting"
        if self._fronts is not None:
            self._fronts.point_at(None)  # new connections wait for the next broker
        broker.proc.kill()
        broker.proc.wait()
        self._start_broker_again(broker)
        broker.state = "running"

    def _start_broker_again(self, child: _Child) -> None:
        """An empty log: a cluster of its own (a new cluster id) at a port of its own, its
        topics made before the front relays to it (`perfloop.stack._front`)."""
        if self._fronts is not None:
            self._fronts.point_at(None)
        child.argv = self._broker_argv()
        assert self._fronts is not None
        port = self._fronts.advertised[-1]
        self._broker_rss.clear()  # a new process: its growth starts again
        self._spawn(child)
        self._await_ready([child])
        ensure_topics(self.settings.model_copy(update={"kafka_port": port}))
        self._fronts.point_at(port)
        assert child.proc is not None
        self._recycler.broker_started(child.proc.pid)

    def _broker_argv(self) -> list[str]:
        """The next broker process's command line, at ports no broker of this stack had, so
        a client that knew an earlier one is refused there (`perfloop.stack._fronts`)."""
        assert self._fronts is not None
        return broker_argv(self.settings, *self._fronts.next_broker())

    def _broker_ready(self) -> bool:
        return self._fronts is not None and self._fronts.broker_ready()

    def _sample_broker(self, *, write: bool = True) -> None:
        """The broker's RSS, once a minute, into the state file (`perfloop.stack._headroom`)."""
        broker = self._broker()
        if broker is None or broker.proc is None:
            return
        rss = rss_bytes(broker.proc.pid)
        if rss is not None:
            self._broker_rss.append([round(time.time(), 1), rss])
        if rss is not None and write:
            self._write_state("up" if all(c.state == "running" for c in self._children)
                              else "degraded")  # fmt: skip

    def stop(self) -> None:
        """Stop the services first and the broker and warehouse after them, so that what the
        services do on SIGTERM (the sink's last insert and commit, the stream worker's last
        outputs and snapshot) still reaches both: SIGTERM, then SIGKILL once
        ``stop_timeout_s`` has passed since the stop began."""
        self._stop.set()
        self._recycler.resume()  # a service a recycle left stopped takes its SIGTERM
        deadline = time.monotonic() + self.settings.stop_timeout_s
        services = [c for c in self._children if c.name in (*SERVICES, *OPTIONAL_SERVICES)]
        rest = [c for c in self._children if c.name not in (*SERVICES, *OPTIONAL_SERVICES)]
        for wave in (services, rest):
            for child in reversed(wave):
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.terminate()
            for child in reversed(wave):
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
                child.state = "stopped"
        self._children.clear()
        if self._fronts is not None:
            self._fronts.close()
            self._fronts = None
        if self._groups is not None:
            self._groups.remove()
        self._listen.running(None)
        with contextlib.suppress(FileNotFoundError):
            (self.home / STATE_FILE).unlink()

    # -- internals ---------------------------------------------------------------------------
    def _child(self, name: str, argv: list[str], ready: Callable[[], bool] | None = None) -> _Child:
        return _Child(name=name, argv=argv, ready=ready, log=self.logs / f"{name}.log")

    def _env(self) -> dict[str, str]:
        s = self.settings
        env = dict(os.environ)
        env.update(
            PERFLOOP_HOME=str(self.home),
            PERFLOOP_KAFKA_BOOTSTRAP=s.kafka_bootstrap,
            PERFLOOP_CLICKHOUSE_URL=s.clickhouse_url,
            PERFLOOP_HOST=s.host,
            PERFLOOP_KAFKA_PORT=str(s.kafka_port),
            PERFLOOP_CLICKHOUSE_PORT=str(s.clickhouse_port),
            PYTHONUNBUFFERED="1",
        )
        if not s.external_kafka:  # the embedded broker restarts empty (`perfloop.kafka.producer`)
            env["PERFLOOP_BROKER_KEEPS_LOG"] = "false"
        for name, value in self._keys.items():
            env.setdefault(name, value)  # the environment's own keys come first
        env.update(self._listen.env)
        # glibc gives each thread that allocates its own heap arena (up to 8 per core), and
        # memory freed in one is not reused by another: two keep the services' RSS flat.
        env.setdefault("MALLOC_ARENA_MAX", "2")
        return env

    def _spawn(self, child: _Child) -> None:
        log = open(child.log, "ab")  # noqa: SIM115 - handed to the child, closed below
        policy = _policy_for(child.name, self.settings.stack_priority)
        env = self._env()
        if child.name.startswith("streams-"):  # another stream worker: a name and a port
            k = int(child.name.split("-")[1])
            env["PERFLOOP_WORKER_NAME"] = str(k - 1)
            port = int(env.get("PERFLOOP_METRICS_PORT") or 19464)
            env["PERFLOOP_METRICS_PORT"] = str(port + k - 1 if port else 0)
        if policy != "normal" and child.name.split("-")[0] == "streams":
            # it raises its group, and the broker's, while it is behind (`perfloop.autogroup`),
            # and it starts behind: raised until it has kept up
            env["PERFLOOP_GROUP_NICE"] = str(AUTOGROUP_NICE)
            env["PERFLOOP_GROUP_RAISED"] = "1"
            broker = next((c for c in self._children if c.name == "broker" and c.proc), None)
            if broker is not None and broker.proc is not None:
                env["PERFLOOP_BROKER_PID"] = str(broker.proc.pid)
            if self._groups is not None:
                loop = self._groups.groups["loop"]
                env["PERFLOOP_CPU_GROUP"] = str(loop)
                set_idle(loop, idle=False)  # raised while it starts (it lowers it, caught up)
        try:
            child.proc = _at_priority(
                policy,
                lambda: subprocess.Popen(
                    child.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.home,
                    start_new_session=policy != "normal",  # a scheduling group of its own
                ),
            )
        except OSError as e:
            raise StackError(f"cannot start {child.name}: {e}") from e
        finally:
            log.close()
        if policy != "normal" and self._groups is not None:
            group = "history" if child.name in IDLE_SERVICES else "loop"
            if not self._groups.add(group, child.proc.pid):
                with contextlib.suppress(OSError), open(child.log, "a") as f:
                    f.write(f"perfloop supervisor: {child.name} not moved to an idle CPU group\n")
        streams = child.name.split("-")[0] == "streams"
        nice = CATCH_UP_NICE if streams else AUTOGROUP_NICE  # starts raised
        if policy != "normal" and not set_autogroup_nice(child.proc.pid, nice):
            with contextlib.suppress(OSError), open(child.log, "a") as f:
                f.write(
                    f"perfloop supervisor: {child.name}'s scheduling group was not set to nice "
                    f"{nice} (no autogroups in this kernel?): it competes with the job "
                    "as an equal\n"
                )
        child.started_at = time.time()
        child.state = "starting"

    def _await_ready(self, children: list[_Child]) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        for child in children:
            while child.ready is not None and not child.ready():
                assert child.proc is not None
                if child.proc.poll() is not None:
                    raise StackError(
                        f"{child.name} exited with code {child.proc.returncode} while starting; "
                        f"last log line: {_last_line(child.log)}"
                    )
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{child.name} was not ready after "
                        f"{self.settings.start_timeout_s:.0f} s; see {child.log}"
                    )
                time.sleep(0.1)
            child.state = "running"

    def _restart(self, child: _Child) -> None:
        assert child.proc is not None
        code = child.proc.returncode
        child.restarts += 1
        child.state = "restarting"
        with open(child.log, "a") as f:
            f.write(f"perfloop supervisor: {child.name} exited with code {code}; restarting\n")
        self._write_state("degraded")
        if self._stop.wait(self.settings.restart_backoff_s * min(child.restarts, 5)):
            return
        if child.name == "broker":  # the memory engine restarts empty
            try:
                self._start_broker_again(child)
            except PerfloopError as e:
                with open(child.log, "a") as f:
                    f.write(f"perfloop supervisor: broker restart incomplete: {e}\n")
        else:
            self._spawn(child)
        child.state = "running"
        self._write_state("up")

    def _write_state(self, overall: str) -> None:
        s = self.settings
        doc = {
            "state": overall,
            "supervisor_pid": os.getpid(),
            "pgid": os.getpgid(0),
            "home": str(self.home),
            "kafka_bootstrap": s.kafka_bootstrap,
            "clickhouse_url": s.clickhouse_url,
            "embedded": {"kafka": not s.external_kafka, "clickhouse": not s.external_clickhouse},
            "services": {
                c.name: {
                    "pid": c.proc.pid if c.proc else None,
                    "state": c.state,
                    "restarts": c.restarts,
                    "started_at": c.started_at,
                    "log": str(c.log),
                }
                for c in self._children
            },
            "broker_rss": list(self._broker_rss),
            "broker_recycling": self._recycler.stats.as_dict() | {"every_mb": s.broker_recycle_mb},
        }
        tmp = self.home / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(self.home / STATE_FILE)


def up_detached(settings: StackSettings) -> dict[str, Any]:
    """Start a supervisor in the background and wait until the stack is up."""
    state = read_state(settings)
    if state and _alive(state["supervisor_pid"]):
        return state
    Supervisor(settings).preflight()
    home = settings.home_dir
    (home / "logs").mkdir(parents=True, exist_ok=True)
    log_path = home / "logs" / "supervisor.log"
    env = dict(os.environ, PERFLOOP_HOME=str(home))
    if settings.listen:
        env["PERFLOOP_LISTEN"] = settings.listen
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "perfloop.cli", "up"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + settings.start_timeout_s + 10
    while time.monotonic() < deadline:
        state = read_state(settings)
        if state and state.get("supervisor_pid") == proc.pid and state.get("state") == "up":
            return state
        if proc.poll() is not None:
            raise StackError(f"perfloop up failed: {_last_line(log_path)}")
        time.sleep(0.2)
    proc.terminate()
    raise StackError(f"the stack did not come up in time; see {log_path}")
