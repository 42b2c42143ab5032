"""`Supervisor.stop`: the services stop before the broker and the warehouse, so what they do
on SIGTERM (the sink's last insert and commit) still reaches both; a child that ignores
SIGTERM is killed once the stop timeout has passed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from perfloop.settings import StackSettings
from perfloop.stack.supervisor import SERVICES, Supervisor, _Child

# A child that, on SIGTERM, takes 0.3 s to finish (a last flush), then writes when it ended.
_CHILD = """
import signal, sys, time
out = sys.argv[1]
def end(*_):
    time.sleep(0.3)
    with open(out, "w") as f:
        f.write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, end)
open(out + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""

_STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""


def _spawn(tmp: Path, name: str, code: str = _CHILD) -> _Child:
    out = tmp / name
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)])
    child = _Child(name=name, argv=[], ready=None, proc=proc, state="running")
    deadline = time.monotonic() + 10
    while not (tmp / f"{name}.ready").exists():
        assert time.monotonic() < deadline, f"{name} did not start"
        time.sleep(0.02)
    return child


def test_services_stop_before_the_broker_and_the_warehouse(tmp_path: Path) -> None:
    sup = Supervisor(StackSettings(home=tmp_path / "home", stop_timeout_s=10))
    names = ["broker", "warehouse", *SERVICES]
    sup._children = [_spawn(tmp_path, n) for n in names]
    sup.stop()
    ended = {n: float((tmp_path / n).read_text()) for n in names}
    last_service = max(ended[n] for n in SERVICES)
    # each took 0.3 s from its SIGTERM: the broker and warehouse got theirs after the last
    # service had ended (terminated all at once, they would end within a few ms of it)
    assert min(ended["broker"], ended["warehouse"]) >= last_service + 0.25
    assert sup._children == []


def test_a_child_that_ignores_sigterm_is_killed_at_the_timeout(tmp_path: Path) -> None:
    sup = Supervisor(StackSettings(home=tmp_path / "home", stop_timeout_s=1.0))
    stubborn = _spawn(tmp_path, "sink", _STUBBORN)
    broker = _spawn(tmp_path, "broker")
    sup._children = [broker, stubborn]
    t0 = time.monotonic()
    sup.stop()
    took = time.monotonic() - t0
    assert stubborn.proc is not None and stubborn.proc.returncode == -9  # SIGKILL
    assert broker.proc is not None and broker.proc.poll() is not None
    assert 1.0 <= took < 5.0
