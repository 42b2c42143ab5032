"""The `perfloop` command line. Every failure is one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pydantic import ValidationError

from perfloop import __version__
from perfloop._config_cli import add_config_parser, config_command
from perfloop._plan_cli import add_plan_parser, plan_command
from perfloop._recs_cli import add_recs_parsers, approve_command, recs_command
from perfloop.exceptions import ConfigError, PerfloopError

__all__ = ["build_parser", "main"]

SERVICE_NAMES = ("warehouse", "streams", "sink", "actuator")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"perfloop: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="perfloop", description="Predictive performance intelligence for AI training.")
    p.add_argument("--version", action="version", version=f"perfloop {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    up = sub.add_parser("up", help="bring the stack up (embedded broker and warehouse by default)")
    up.add_argument("--detach", action="store_true", help="run in the background and return")
    sub.add_parser("down", help="stop everything `up` started")
    st = sub.add_parser("status", help="what is running and whether it answers")
    st.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("migrate", help="create the topics and apply warehouse migrations")

    demo = sub.add_parser("demo", help="close the loop on a simulated job with a data-loader fault")
    demo.add_argument(
        "--real",
        action="store_true",
        help="close it on a real torch training job on this machine's CPUs instead (needs torch)",
    )
    demo.add_argument(
        "--seconds", type=float, default=60.0, metavar="S", help="--real: train S seconds (60)"
    )
    demo.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    demo.add_argument(
        "--fault-at",
        type=float,
        default=12.0,
        metavar="S",
        help="seconds into the run when starvation starts (default 12)",
    )

    sql = sub.add_parser("sql", help="run a SQL query against the warehouse")
    sql.add_argument("query")
    sql.add_argument("--format", choices=("table", "json"), default="table")

    sch = sub.add_parser("schemas", help="the event schemas")
    sch_sub = sch.add_subparsers(dest="schemas_command", required=True, parser_class=_Parser)
    exp = sch_sub.add_parser("export", help="write JSON Schema of every event family to DIR")
    exp.add_argument("dir", metavar="DIR")

    run = sub.add_parser(
        "run",
        help="run a training script with perfloop's hooks installed (no code change)",
        usage="perfloop run [--job-id ID] [--node NAME] [--tier TIER] [--pin KNOB]... "
        "-- COMMAND [ARGS...]",
    )
    run.add_argument("--job-id", help="job id (default: generated, printed at start)")
    run.add_argument("--node", help="node name (default: the host name)")
    run.add_argument("--no-gpu", action="store_true", help="do not start the NVML sampler")
    run.add_argument(
        "--tier",
        choices=("observe", "recommend", "approve", "auto"),
        help="the job's automation tier (default: the actuator's, auto unless configured)",
    )
    run.add_argument(
        "--pin",
        action="append",
        metavar="KNOB",
        help="keep KNOB as the script set it (repeatable): the job's agents refuse commands "
        "for it and the actuator does not issue them, e.g. torch.num_threads",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND")

    rep = sub.add_parser("replay", help="stream PyTorch-profiler traces as perfloop telemetry")
    rep.add_argument("--job-id", help="job id (default: derived from the first trace's name)")
    rep.add_argument("--node", help="node name (default: from the trace, else 'replay')")
    rep.add_argument(
        "--require-steps",
        action="store_true",
        help="refuse a trace without ProfilerStep spans (by default it replays as one step 0)",
    )
    rep.add_argument(
        "--keep-time",
        action="store_true",
        help="keep the trace's own times even if it is older than a week",
    )
    rep.add_argument("traces", nargs="+", metavar="TRACE", help=".json or .json.gz, one per rank")

    sim = sub.add_parser("simulate", help="run a simulated multi-node job with a chosen fault")
    sim.add_argument("--scenario", required=True, help="healthy, dataloader_starvation, …")
    sim.add_argument("--nodes", type=int, default=1)
    sim.add_argument("--ranks-per-node", type=int, default=8)
    sim.add_argument("--duration", type=float, default=60.0, metavar="S")
    sim.add_argument("--rate", type=float, metavar="HZ", help="target samples/s (benchmarks)")
    sim.add_argument("--job-id")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--speed", type=float, default=1.0, help="simulated seconds per second")
    sim.add_argument("--ground-truth", metavar="FILE", help="also write ground truth here")

    smp = sub.add_parser("sample", help="run the node samplers (NVML, host) in the foreground")
    smp.add_argument("--job-id", required=True)
    smp.add_argument("--node")
    smp.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    smp.add_argument("--pid", type=int, action="append", help="training process(es) to watch")

    dlq = sub.add_parser("dlq", help="count dead letters by source topic and reason")
    dlq.add_argument("--json", action="store_true", help="print JSON")
    dlq.add_argument("--timeout", type=float, default=10.0, metavar="S", help="read for at most S")

    svc = sub.add_parser("service", help="run one perfloop service in the foreground")
    svc.add_argument("name", choices=SERVICE_NAMES)

    add_config_parser(sub, _Parser)
    add_plan_parser(sub)
    add_recs_parsers(sub)
    return p


def _settings(cls: type[Any]) -> Any:
    try:
        return cls()
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(
            f"invalid setting PERFLOOP_{str(err['loc'][0]).upper()}: {err['msg']}"
        ) from None


def _up(args: argparse.Namespace) -> int:
    from perfloop.settings import StackSettings
    from perfloop.stack import Supervisor, up_detached

    settings = _settings(StackSettings)
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


def _down(_: argparse.Namespace) -> int:
    from perfloop.settings import StackSettings
    from perfloop.stack import down

    print("perfloop stopped" if down(_settings(StackSettings)) else "perfloop was not running")
    return 0


def _status(args: argparse.Namespace) -> int:
    from perfloop.settings import StackSettings
    from perfloop.stack import status

    doc = status(_settings(StackSettings))
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


def _migrate(_: argparse.Namespace) -> int:
    from perfloop.kafka import ensure_topics
    from perfloop.settings import StackSettings
    from perfloop.warehouse import migrate

    settings = _settings(StackSettings)
    topics = ensure_topics(settings)
    versions = migrate(settings)
    print(f"topics created: {len(topics)}; migrations applied: {versions or 'none pending'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from perfloop.demo import format_table, run_demo, verify_in_warehouse
    from perfloop.settings import ActuatorSettings, StackSettings
    from perfloop.stack import read_state, up_detached

    settings = _settings(StackSettings)
    if args.real:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ConfigError(
                "perfloop demo --real trains a torch model: pip install torch==2.13.0 "
                "(or `make demo`, which installs it)"
            ) from None
    if read_state(settings) is None:
        print("bringing the embedded stack up…", flush=True)
        up_detached(settings)
    if args.real:
        from perfloop.demo_real import real_demo

        return real_demo(settings, seconds=args.seconds)
    key = _settings(ActuatorSettings).signing_key.get_secret_value().encode()
    res = run_demo(settings, signing_key=key, ranks=args.ranks, fault_at_s=args.fault_at)
    verify_in_warehouse(settings, res)
    print("\nwhat the warehouse holds (perfloop sql …):")
    for sql, cols, rows in res.queries:
        print(f"\n» {sql}\n{format_table(cols, rows)}")
    if res.closed:
        print(
            "\nloop closed: detected → recommended → commanded → applied → acked → verified "
            "→ faster"
        )
        return 0
    print(
        "\nloop NOT closed: see `perfloop status` and the logs under $PERFLOOP_HOME/logs",
        file=sys.stderr,
    )
    return 1


def _sql(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from perfloop.demo import format_table
    from perfloop.settings import StackSettings
    from perfloop.warehouse import client

    ch = client(_settings(StackSettings))
    try:
        r = ch.query(args.query)
    except ClickHouseError as e:
        raise PerfloopError(" ".join(str(e).split())[:500]) from e
    finally:
        ch.close()
    if args.format == "json":
        for row in r.result_rows:
            print(json.dumps(dict(zip(r.column_names, row, strict=True)), default=str))
    else:
        print(format_table(list(r.column_names), r.result_rows))
    return 0


def _schemas(args: argparse.Namespace) -> int:
    from perfloop.schemas import export_json_schemas

    try:
        files = export_json_schemas(args.dir)
    except OSError as e:
        raise ConfigError(f"cannot write schemas to {args.dir}: {e.strerror or e}") from e
    print(f"wrote {len(files)} JSON Schema files to {args.dir}")
    return 0


def _producer_settings() -> Any:
    from perfloop.settings import ProducerSettings

    return _settings(ProducerSettings)


def _run(args: argparse.Namespace) -> int:
    from perfloop.producers.launch import run_command

    if not [a for a in args.cmd if a != "--"]:
        print(
            "perfloop: error: run needs a command, e.g. `perfloop run -- python train.py`",
            file=sys.stderr,
        )
        return 2
    if args.pin:
        from perfloop.actuators.allowlist import pinned_knobs

        try:
            pinned_knobs(args.pin)
        except ConfigError as e:
            print(f"perfloop: error: argument --pin: {e} (see `perfloop run --help`)",
                  file=sys.stderr)  # fmt: skip
            return 2
    return run_command(args, _producer_settings())


def _replay(args: argparse.Namespace) -> int:
    from perfloop.producers.replay import replay_command

    return replay_command(args, _producer_settings())


def _simulate(args: argparse.Namespace) -> int:
    from perfloop.producers.scenarios import simulate_command
    from perfloop.settings import ActuatorSettings

    key = _settings(ActuatorSettings).signing_key.get_secret_value().encode()
    return simulate_command(args, _producer_settings(), signing_key=key)


def _sample(args: argparse.Namespace) -> int:
    from perfloop.producers.node import sample_command

    return sample_command(args, _producer_settings())


def _dlq(args: argparse.Namespace) -> int:
    from perfloop.kafka import dead_letter_counts
    from perfloop.settings import StackSettings

    counts = dead_letter_counts(_settings(StackSettings), timeout_s=args.timeout)
    if args.json:
        rows = [{"topic": t, "reason": r, "count": n} for (t, r), n in counts.items()]
        print(json.dumps(rows, indent=2))
        return 0
    total = sum(counts.values())
    print(f"{total} dead letters")
    for (topic, reason), n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:>8}  {topic}  {reason}")
    return 0


def _service(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.name == "warehouse":
        from perfloop.chserver import main as warehouse_main

        return warehouse_main([]) or 0
    if args.name == "streams":
        from perfloop.settings import StreamsSettings
        from perfloop.streams.app import StreamsService

        StreamsService(_settings(StreamsSettings)).run()
        return 0
    service: Any
    if args.name == "sink":
        from perfloop.settings import SinkSettings
        from perfloop.streams.sink import Sink

        service = Sink(_settings(SinkSettings))
    else:
        from perfloop.actuators.service import ActuatorService
        from perfloop.settings import ActuatorSettings

        service = ActuatorService(_settings(ActuatorSettings))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
    service.run()
    return 0


_COMMANDS = {
    "up": _up,
    "down": _down,
    "status": _status,
    "migrate": _migrate,
    "demo": _demo,
    "sql": _sql,
    "schemas": _schemas,
    "run": _run,
    "replay": _replay,
    "simulate": _simulate,
    "sample": _sample,
    "dlq": _dlq,
    "service": _service,
    "config": config_command,
    "plan": plan_command,
    "recs": recs_command,
    "approve": approve_command,
    "reject": approve_command,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "service":
        # Client libraries log their retries; a command's answer is its own one line.
        logging.getLogger().addHandler(logging.NullHandler())
    try:
        return _COMMANDS[args.command](args)
    except PerfloopError as e:
        print(f"perfloop: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
