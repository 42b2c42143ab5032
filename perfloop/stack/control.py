"""Controlling the embedded stack from outside it: `down`, `status`, and the state file the
supervisor (`perfloop.stack.supervisor`, which also has `up_detached`) writes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from perfloop.exceptions import PerfloopError, WarehouseError
from perfloop.kafka import ping
from perfloop.settings import StackSettings
from perfloop.stack._headroom import headroom, rss_bytes
from perfloop.stack.broker import RETENTION_NOTE

__all__ = ["STATE_FILE", "check_external", "down", "read_state", "status"]

STATE_FILE = "stack.json"


def _http_ok(url: str, ca: Path | None = None) -> bool:
    """Whether the warehouse at ``url`` answers its ``/ping`` (over HTTPS: with a certificate
    that ``ca``, or the system's CAs, vouch for)."""
    ctx = (
        ssl.create_default_context(cafile=str(ca) if ca else None) if url[:6] == "https:" else None
    )
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/ping", timeout=2, context=ctx) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(empty log)"


def read_state(settings: StackSettings) -> dict[str, Any] | None:
    """The state file of a running stack, or None."""
    try:
        doc: dict[str, Any] = json.loads((settings.home_dir / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return doc


def check_external(settings: StackSettings) -> None:
    """Fail with one line if an external broker or warehouse is configured but unreachable."""
    if settings.external_kafka:
        ping(settings)
    if settings.external_clickhouse and not _http_ok(
        settings.clickhouse_url, settings.clickhouse_ca
    ):
        raise WarehouseError(f"ClickHouse at {settings.clickhouse_url} is unreachable")


def down(settings: StackSettings) -> bool:
    """Stop the stack that `up` started; return False if none was running."""
    state = read_state(settings)
    if state is None:
        return False
    pid, pgid = state["supervisor_pid"], state["pgid"]
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + settings.stop_timeout_s + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    # Anything left in the stack's own process group is ours: end it.
    if pgid != os.getpgid(0):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for svc in state.get("services", {}).values():
        if svc.get("pid") and _alive(svc["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(svc["pid"], signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (settings.home_dir / STATE_FILE).unlink()
    return True


def status(settings: StackSettings) -> dict[str, Any]:
    """What is running, where, and whether it answers."""
    state = read_state(settings) or {}
    up = bool(state) and _alive(state.get("supervisor_pid", -1))
    services: dict[str, Any] = {}
    for name, svc in (state.get("services") or {}).items() if up else ():
        pid = svc.get("pid")
        alive = bool(pid) and _alive(pid)
        services[name] = {
            "pid": pid,
            "state": svc["state"] if alive else "dead",
            "restarts": svc.get("restarts", 0),
            "rss_bytes": rss_bytes(pid) if alive else None,
            "log": svc.get("log"),
        }
    kafka_ok = True
    try:
        ping(settings, timeout_s=2.0)
    except PerfloopError:
        kafka_ok = False
    doc: dict[str, Any] = {
        "state": state.get("state", "down") if up else "down",
        "home": str(settings.home_dir),
        "kafka_bootstrap": settings.kafka_bootstrap,
        "clickhouse_url": settings.clickhouse_url,
        "kafka_reachable": kafka_ok,
        "clickhouse_reachable": _http_ok(settings.clickhouse_url, settings.clickhouse_ca),
        "services": services,
    }
    if "broker" in services:
        doc["broker_retention"] = RETENTION_NOTE
    if up:
        doc["headroom"] = headroom(settings, state, services)
    return doc
