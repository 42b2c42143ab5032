"""The stack's commands: ``up``, ``down``, ``status``, ``migrate``, ``service`` and ``dlq``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
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
    if args.detach:
        state = up_detached(settings)
        print(
            f"perfloop is up: kafka {state['kafka_bootstrap']}, "
            f"clickhouse {state['clickhouse_url']}, home {state['home']}"
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
    return 0 if doc["state"] == "up" else 3


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
    if args.name == "warehouse":
        from perfloop.stack.warehouse_server import main as warehouse_main

        return warehouse_main([]) or 0
    if args.name == "streams":
        from perfloop.settings import StreamsSettings
        from perfloop.streams.app import StreamsService

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
