"""Helpers several test modules share: the shared traces and their independent reading, the
simulator run in-process, and the CLI's one-line errors. Import as ``tests.helpers``."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from perfloop.producers.scenarios import scenario_config
from perfloop.producers.simulator import SimulatedJob
from perfloop.schemas import decode_batch, decode_event
from perfloop.schemas.topics import Topics

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
"""The real PyTorch-profiler traces, beside the repository (``../shared/data/traces``)."""
ALL_TRACES = sorted(TRACES.rglob("*.json.gz")) + sorted(TRACES.rglob("*.json"))
SIM_T0 = 1_700_000_000_000_000_000


# -- traces, read without the replay code -------------------------------------------------------
def load_trace(path: Path) -> dict[str, Any]:
    """A trace file as JSON (a bare event list becomes ``{"traceEvents": [...]}``)."""
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as f:
        doc = json.load(f)
    return doc if isinstance(doc, dict) else {"traceEvents": doc}


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Length of a union of intervals, by sweeping sorted boundaries with a depth counter."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    depth, last, total = 0, 0.0, 0.0
    for t, d in points:
        if depth > 0:
            total += t - last
        depth += d
        last = t
    return total


# -- the simulator, in-process ------------------------------------------------------------------
class Collect:
    """A publisher that keeps every message."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, bytes]] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.messages.append((topic, key, value))
        return True

    def flush(self, timeout_s: float = 10.0) -> int:
        return 0


def simulate(scenario: str, duration_s: float, **kw: Any) -> tuple[Any, list[Any]]:
    """Run a scenario in-process, about 250 ms of samples per message as a live producer
    sends; return its config and its messages decoded, in order."""
    cfg = scenario_config(
        scenario,
        job_id=kw.pop("job_id", f"sim-{scenario}"),
        nodes=kw.pop("nodes", 1),
        ranks_per_node=kw.pop("ranks_per_node", 4),
        duration_s=duration_s,
        seed=kw.pop("seed", 3),
        t0_ns=SIM_T0,
        speed=1e6,
        chunk_steps=2,
        publish_interval_ms=1e-3,
        **kw,
    )
    pub = Collect()
    SimulatedJob(cfg, pub).run(duration_s)
    out = [decode_event(v) if t == Topics.JOB else decode_batch(v) for t, _, v in pub.messages]
    return cfg, out


# -- the CLI --------------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No inherited ``PERFLOOP_*`` variable reaches the test (use with ``usefixtures``)."""
    for name in list(os.environ):
        if name.startswith("PERFLOOP_"):
            monkeypatch.delenv(name)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line(text: str) -> str:
    """The only line of ``text`` (fails the test if there are more)."""
    lines = text.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line, got {text!r}"
    return lines[0]


# -- the control loop ---------------------------------------------------------------------------
def recommendation(**kw: Any) -> Any:
    """A recommendation for ``job-1`` to raise the loader workers 2 → 5 (fields overridable)."""
    from perfloop.schemas import Recommendation

    fields: dict[str, Any] = dict(
        ts_ns=1_700_000_000 * 1_000_000_000,
        job_id="job-1",
        node="n0",
        rank=-1,
        knob="dataloader.num_workers",
        from_value=2,
        to_value=5,
        loop="fast",
        expected_gain_pct=40.0,
        confidence=0.9,
        rationale="waits for input",
    )
    return Recommendation(**(fields | kw))


# -- Chrome DevTools' trace engine, an independent reader of the traces perfloop exports ------
DEVTOOLS_TRACE = Path(__file__).resolve().parent / "tools" / "devtools_trace"
"""A Node package pinning Chrome DevTools' trace engine (`@paulirish/trace_engine`, the
Performance panel's parser) and ``parse.mjs``, which prints what it read; ``make
devtools-trace`` installs it (npm)."""
DEVTOOLS_READY = shutil.which("node") is not None and (DEVTOOLS_TRACE / "node_modules").is_dir()
needs_devtools = pytest.mark.skipif(
    not DEVTOOLS_READY,
    reason="Chrome DevTools' trace engine is not installed (`make devtools-trace`: node and npm)",
)


def devtools_read(path: Path) -> dict[str, Any]:
    """What Chrome DevTools' trace engine makes of the trace at ``path``: ``threads``, one per
    process (``pid``) and thread (``tid``) it found, each with its ``name`` and ``entries``
    ([category, name, ts_us, dur_us] of every event it draws on the thread)."""
    out = subprocess.run(
        ["node", str(DEVTOOLS_TRACE / "parse.mjs"), str(path)],
        capture_output=True, text=True, timeout=120, cwd=DEVTOOLS_TRACE,
    )  # fmt: skip
    assert out.returncode == 0, f"DevTools' trace engine could not read {path}: {out.stderr}"
    return json.loads(out.stdout)  # type: ignore[no-any-return]


class Echo:
    """A server that answers each line with its name and the line: which process answered."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(self.name + b":" + data)

    def close(self) -> None:
        self.sock.close()
