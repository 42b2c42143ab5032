"""Shared helpers of the benchmarks: an isolated embedded stack, waiting, RSS, results."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_KAFKA_PORT = 29092
DEFAULT_CLICKHOUSE_PORT = 28123


def isolate_env(home: Path, kafka_port: int, clickhouse_port: int) -> dict[str, str]:
    """Point this process (an entry point) and its children at a private stack.

    Every inherited ``PERFLOOP_*`` variable is dropped first, so a developer's
    ``PERFLOOP_KAFKA_BOOTSTRAP`` or ports cannot make the bench touch their stack.
    """
    for name in [n for n in os.environ if n.startswith("PERFLOOP_")]:
        del os.environ[name]
    os.environ.update(
        PERFLOOP_HOME=str(home),
        PERFLOOP_KAFKA_PORT=str(kafka_port),
        PERFLOOP_CLICKHOUSE_PORT=str(clickhouse_port),
    )
    return dict(os.environ)


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    """Whether something accepts connections on loopback ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def bench_ports() -> tuple[int, int]:
    """Ports of the bench's own stack: ``PERFLOOP_BENCH_KAFKA_PORT`` / ``..._CLICKHOUSE_PORT``."""
    return (
        int(os.environ.get("PERFLOOP_BENCH_KAFKA_PORT", DEFAULT_KAFKA_PORT)),
        int(os.environ.get("PERFLOOP_BENCH_CLICKHOUSE_PORT", DEFAULT_CLICKHOUSE_PORT)),
    )


def raise_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that ``finally`` blocks tear the stack down."""

    def _exit(*_: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, _exit)


@contextlib.contextmanager
def embedded_stack(
    log: Callable[[str], None], settings: dict[str, str] | None = None
) -> Iterator[Path]:
    """`perfloop up --detach` on a temporary home and the bench ports (and ``settings``,
    ``PERFLOOP_*`` variables); `down` on exit."""
    kafka_port, ch_port = bench_ports()
    given = os.environ.get("PERFLOOP_BENCH_HOME")
    home = Path(given or tempfile.mkdtemp(prefix="perfloop-bench-"))
    env = isolate_env(home, kafka_port, ch_port)
    os.environ.update(settings or {})
    env.update(settings or {})
    cli = [sys.executable, "-m", "perfloop.cli"]
    log(f"bringing up a private stack: home {home}, kafka :{kafka_port}, clickhouse :{ch_port}")
    t0 = time.monotonic()
    ok = False
    try:
        subprocess.run([*cli, "up", "--detach"], env=env, check=True, cwd=home.parent)
        log(f"stack up in {time.monotonic() - t0:.1f} s")
        yield home
        ok = True
    finally:
        subprocess.run([*cli, "down"], env=env, check=False, cwd=home.parent)
        log("stack down")
        if ok and not given:
            shutil.rmtree(home, ignore_errors=True)
        elif not ok:
            log(f"failed; logs kept in {home / 'logs'}")


def wait_for(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> bool:
    """Poll ``pred`` until it is true or ``timeout_s`` passes; return the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def service_cpu_s(home: Path) -> dict[str, float]:
    """CPU seconds (user + system, children included) each stack service has used so far."""
    try:
        services = json.loads((home / "stack.json").read_text()).get("services", {})
    except (OSError, ValueError):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, svc in services.items():
        try:
            with open(f"/proc/{svc['pid']}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, KeyError, TypeError):
            continue
        # fields[11:15] are utime, stime, cutime, cstime (stat fields 14-17)
        out[name] = sum(int(v) for v in fields[11:15]) / tick
    return out


def host_cpu_ticks() -> tuple[int, int]:
    """(steal, total) clock ticks of the whole machine so far, from /proc/stat: the share of
    its time a virtual machine's host gave to others (0 on bare metal or where unknown)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    steal = fields[7] if len(fields) > 7 else 0
    return steal, sum(fields[:8])


def save_result(name: str, doc: dict[str, Any], note: str = "") -> Path:
    """Write ``bench/results/<name>-<utc time>.json``, say where, and end stdout with the
    result as one JSON line (so ``… | tail -n 1`` is the result)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    say(f"saved {path.relative_to(REPO)}{note}")
    print(json.dumps(doc, default=str, separators=(",", ":")), flush=True)
    return path


def say(line: str) -> None:
    print(line, flush=True)
