"""The stack's commands: ``up``, ``down``, ``status``, ``migrate``, ``service`` and ``dlq``."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import logging
import signal
import time
from typing import Any

from perfloop.settings import load_settings

__all__ = [
    "SERVICE_NAMES",
    "dlq_command",
    "down_command",
    "migrate_command",
    "service_command",
    "status_command",
    "up_command",
]

SERVICE_NAMES = ("warehouse", "streams", "sink", "actuator", "notifier", "accountant")
"""What ``perfloop service NAME`` runs in the foreground."""


def up_command(args: argparse.Namespace) -> int:
    from perfloop.settings import StackSettings
    from perfloop.stack import Supervisor, up_detached

    settings = load_settings(StackSettings)
    if getattr(args, "listen", None):
        settings = settings.model_copy(update={"listen": args.listen})
    if args.detach:
        state = up_detached(settings)
        print(
            f"perfloop is up: kafka {state['kafka_bootstrap']}, "
            f"clickhouse {state['clickhouse_url']}, home {state['home']}"
        )
        if settings.listen:
            print(
                "  beyond loopback: mutual TLS at the broker, HTTPS and a password at the "
                "warehouse; a node's settings: `perfloop keys client NAME`"
            )
        return 0
    supervisor = Supervisor(settings)
    supervisor.preflight()  # one-line errors before anything starts
    supervisor.run()
    return 0


def down_command(_: argparse.Namespace) -> int:
    from perfloop.settings import StackSettings
    from perfloop.stack import down

    print("perfloop stopped" if down(load_settings(StackSettings)) else "perfloop was not running")
    return 0


def status_command(args: argparse.Namespace) -> int:
    from perfloop.settings import StackSettings
    from perfloop.stack import status

    doc = status(load_settings(StackSettings))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"perfloop {doc['state']}  (home {doc['home']})")
        print(
            f"  kafka      {doc['kafka_bootstrap']}  "
            f"{'reachable' if doc['kafka_reachable'] else 'UNREACHABLE'}"
        )
        print(
            f"  clickhouse {doc['clickhouse_url']}  "
            f"{'reachable' if doc['clickhouse_reachable'] else 'UNREACHABLE'}"
        )
        for name, svc in doc["services"].items():
            rss = f"{svc['rss_bytes'] / 2**20:.0f} MiB" if svc["rss_bytes"] else "-"
            print(
                f"  {name:<10} {svc['state']:<10} pid {svc['pid']}  rss {rss}  "
                f"restarts {svc['restarts']}"
            )
        if "broker_retention" in doc:
            print(f"  note: {doc['broker_retention']}")
        for line in headroom_lines(doc.get("headroom") or {}):
            print(f"  headroom: {line}")
    return 0 if doc["state"] == "up" else 3


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def headroom_lines(headroom: dict[str, Any]) -> list[str]:
    """`perfloop status`' words for its ``headroom``: the broker's memory and the warehouse's
    disk.

    >>> for line in headroom_lines({"broker_memory": {"rss_bytes": 300 << 20,
    ...     "available_bytes": 8 << 30, "growth_bytes_per_h": 100 << 20, "over_s": 3600,
    ...     "hours_left": 81.9}, "warehouse_disk": {"warehouse_bytes": 2 << 30,
    ...     "free_bytes": 40 << 30}}):
    ...     print(line)
    broker memory 300 MiB, +100 MiB/h (last 60 min); 8.0 GiB available: ~82 h at this rate
    warehouse 2.0 GiB on disk, 40.0 GiB free
    >>> headroom_lines({"broker_recycling": {"every_mb": 256, "recycles": 0, "last_at": None,
    ...     "waiting": "records still arriving"}})
    ['broker recycled every 256 MiB of growth: 0 so far; due, waiting: records still arriving']
    """
    out = []
    mem = headroom.get("broker_memory")
    if mem:
        line = f"broker memory {_size(mem['rss_bytes'])}"
        if mem["growth_bytes_per_h"] is not None:
            line += f", +{_size(mem['growth_bytes_per_h'])}/h (last {mem['over_s'] / 60:.0f} min)"
            if mem["hours_left"] is not None:
                line += (
                    f"; {_size(mem['available_bytes'])} available: "
                    f"~{mem['hours_left']:.0f} h at this rate"
                )
        elif mem["over_s"] is not None:
            line += f", not growing over the last {mem['over_s'] / 60:.0f} min"
        else:
            line += ", growth not known yet (sampled once a minute, needs 5 min)"
        out.append(line)
    rec = headroom.get("broker_recycling")
    if rec:
        line = f"broker recycled every {rec['every_mb']:g} MiB of growth: {rec['recycles']} so far"
        if rec.get("last_at"):
            ago = max(0.0, time.time() - rec["last_at"]) / 60
            line += f", the last {ago:.0f} min ago (stream tier paused {rec['last_pause_s']} s"
            if rec.get("last_carried") is not None:
                line += f"; {rec['last_carried']} unread record(s) carried over"
            line += ")"
        if rec.get("waiting"):
            line += f"; due, waiting: {rec['waiting']}"
        out.append(line)
    dk = headroom.get("warehouse_disk")
    if dk and dk.get("warehouse_bytes") is not None:
        out.append(
            f"warehouse {_size(dk['warehouse_bytes'])} on disk, {_size(dk['free_bytes'])} free"
        )
    return out


def migrate_command(_: argparse.Namespace) -> int:
    from perfloop.kafka import ensure_topics
    from perfloop.settings import StackSettings
    from perfloop.warehouse import migrate

    settings = load_settings(StackSettings)
    topics = ensure_topics(settings)
    versions = migrate(settings)
    print(f"topics created: {len(topics)}; migrations applied: {versions or 'none pending'}")
    return 0


def service_command(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A crash in native code (librdkafka, chDB) leaves every thread's Python stack in the
    # service's log, where a bare "exited with code -11" said nothing of where it happened.
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.enable()  # not where stderr is no file (an embedding, a test's capture)
    if args.name == "warehouse":
        from perfloop.stack.warehouse_server import main as warehouse_main

        return warehouse_main([]) or 0
    if args.name == "streams":
        from perfloop.settings import StreamsSettings
        from perfloop.streams.app import StreamsService
        from perfloop.streams.reconnect import rebootstrap_when_lost

        rebootstrap_when_lost()  # the embedded broker moves at a recycle
        StreamsService(load_settings(StreamsSettings)).run()
        return 0
    service: Any
    if args.name == "sink":
        from perfloop.settings import SinkSettings
        from perfloop.warehouse.sink import Sink

        service = Sink(load_settings(SinkSettings))
    elif args.name == "notifier":
        from perfloop.notify import NotifierService
        from perfloop.settings import NotifierSettings

        service = NotifierService(load_settings(NotifierSettings))
    elif args.name == "accountant":
        from perfloop.report.accountant import Accountant
        from perfloop.settings import AccountantSettings

        service = Accountant(load_settings(AccountantSettings))
    else:
        from perfloop.actuators.service import ActuatorService
        from perfloop.settings import ActuatorSettings

        service = ActuatorService(load_settings(ActuatorSettings))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
    service.run()
    return 0


def dlq_command(args: argparse.Namespace) -> int:
    from perfloop.kafka import dead_letter_counts
    from perfloop.settings import StackSettings

    counts = dead_letter_counts(load_settings(StackSettings), timeout_s=args.timeout)
    if args.json:
        rows = [{"topic": t, "reason": r, "count": n} for (t, r), n in counts.items()]
        print(json.dumps(rows, indent=2))
        return 0
    total = sum(counts.values())
    print(f"{total} dead letters")
    for (topic, reason), n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:>8}  {topic}  {reason}")
    return 0
