"""The `perfloop` command line's parser and dispatch: every command's body is in the module of
its group (`perfloop.cli.stack`, `.run`, `.config`, …). Every failure is one line on stderr
and a non-zero exit."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from perfloop import __version__
from perfloop.cli.capture import capture_command, capture_steps
from perfloop.cli.config import config_command
from perfloop.cli.demo import demo_command
from perfloop.cli.export import export_command, step_range
from perfloop.cli.jobs import duration_arg, jobs_command
from perfloop.cli.keys import add_keys, keys_command
from perfloop.cli.plan import plan_command
from perfloop.cli.power_helper import add_power_helper, power_helper_command
from perfloop.cli.query import schemas_command, sql_command
from perfloop.cli.recs import approve_command, recs_command
from perfloop.cli.replay import replay_command
from perfloop.cli.report import positive_float, report_command
from perfloop.cli.run import run_command
from perfloop.cli.sample import sample_command
from perfloop.cli.simulate import simulate_command
from perfloop.cli.stack import (
    SERVICE_NAMES,
    dlq_command,
    down_command,
    migrate_command,
    service_command,
    status_command,
    up_command,
)
from perfloop.cli.top import top_command
from perfloop.cli.watch import watch_command
from perfloop.exceptions import PerfloopError
from perfloop.settings import check_environment

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"perfloop: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="perfloop", description="Predictive performance intelligence for AI training.")
    p.add_argument("--version", action="version", version=f"perfloop {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    up = sub.add_parser("up", help="bring the stack up (embedded broker and warehouse by default)")
    up.add_argument("--detach", action="store_true", help="run in the background and return")
    up.add_argument(
        "--listen",
        metavar="ADDR",
        help="serve the broker and warehouse at ADDR (the address other nodes reach) with TLS "
        "and authentication, not on loopback (PERFLOOP_LISTEN)",
    )
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

    _add_config(sub, _Parser)
    _add_plan(sub)
    _add_recs(sub)
    _add_jobs(sub)
    _add_report(sub)
    add_keys(sub)
    add_power_helper(sub)
    _add_watch(sub)
    _add_export(sub)
    _add_capture(sub)
    return p


def _add_config(sub: Any, parser_class: type[argparse.ArgumentParser]) -> None:
    """Register ``config set`` and ``config history`` on the CLI's subparsers."""
    cfg = sub.add_parser("config", help="change thresholds, windows or sampling live; history")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, parser_class=parser_class)
    st = cfg_sub.add_parser("set", help="publish a live change on perfloop.control")
    st.add_argument("key", metavar="KEY", help="e.g. detect.straggler.score_threshold")
    st.add_argument("value", metavar="VALUE", help="int, float, true/false, or text")
    st.add_argument(
        "--target",
        choices=("streams", "producers", "actuator"),
        help="who applies it (default: producers for sampling.* keys, actuator for "
        "actuator.* keys, else streams)",
    )
    st.add_argument("--job", default="*", metavar="JOB", help="job id, or * for every job")
    st.add_argument("--reason", default="", metavar="TEXT", help="why (kept in the history)")
    hist = cfg_sub.add_parser("history", help="live changes recorded in the warehouse")
    hist.add_argument("--job", metavar="JOB", help="changes for this job (and for every job)")
    hist.add_argument("--limit", type=int, default=100, metavar="N", help="newest N (100)")
    hist.add_argument("--json", action="store_true", help="print JSON")


def _add_plan(sub: Any) -> None:
    """Register ``plan`` on the CLI's subparsers."""
    p = sub.add_parser(
        "plan",
        help="memory per GPU and communication of DDP, ZeRO-1/2/3 and FSDP; the one to use",
        description="Model states, activations and communication per GPU for each strategy "
        "(ZeRO, Rajbhandari et al. SC'20; activations, Korthikanti et al. 2022), and the "
        "recommended one: the least communication among those that fit, else the least memory.",
    )
    p.add_argument("--params", required=True, metavar="N", help="parameters: 7e9, 7B, 350M, …")
    p.add_argument("--world", required=True, type=int, metavar="W", help="data-parallel GPUs")
    p.add_argument("--optimizer", required=True, metavar="adam|adamw|sgd")
    p.add_argument("--precision", required=True, metavar="fp32|bf16|fp16")
    p.add_argument("--momentum", type=float, default=0.0, metavar="M", help="SGD momentum (0)")
    p.add_argument(
        "--param-tensors",
        type=int,
        default=0,
        metavar="T",
        help="parameter tensors, for Adam's 4-byte step counters (default 0: not counted)",
    )
    p.add_argument("--gpu", metavar="NAME", help="device for the memory limit: h100, a100-80gb, …")
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        metavar="B",
        help="per-GPU, one-direction bandwidth in GB/s (1e9 bytes/s), e.g. the inter-node "
        "link per GPU for multi-node jobs (default: the --gpu interconnect)",
    )
    p.add_argument("--headroom", type=float, metavar="F", help="share of memory kept free")
    p.add_argument(
        "--fsdp-unit-params", metavar="N", help="largest FSDP unit (default: params / layers)"
    )
    acts = p.add_argument_group("activations (all five, for an estimate)")
    acts.add_argument("--layers", type=int, metavar="L")
    acts.add_argument("--hidden", type=int, metavar="H")
    acts.add_argument("--heads", type=int, metavar="A")
    acts.add_argument("--seq-len", type=int, metavar="S")
    acts.add_argument("--micro-batch", type=int, metavar="B")
    acts.add_argument("--recompute", default="none", metavar="none|selective|full")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_jobs(sub: Any) -> None:
    """Register ``jobs`` and ``top`` on the CLI's subparsers."""
    j = sub.add_parser("jobs", help="running and recent jobs: state, step time, diagnoses, changes")
    j.add_argument("--all", action="store_true", help="every job the warehouse holds")
    j.add_argument(
        "--since", type=duration_arg, default=86400.0, metavar="T",
        help="jobs seen in the last T: 30m, 12h, 1d, 1w (default 1d)",
    )  # fmt: skip
    j.add_argument("--json", action="store_true", help="print JSON")
    j.add_argument("--slurm-job", metavar="ID", help="only the job of this Slurm job id")
    j.add_argument("--namespace", metavar="NS", help="only jobs in this Kubernetes namespace")
    t = sub.add_parser("top", help="a live terminal view of a job's ranks, diagnoses and changes")
    t.add_argument("--job", metavar="J", help="show this job at start (default: the latest)")


def _add_recs(sub: Any) -> None:
    """Register ``recs``, ``approve`` and ``reject`` on the CLI's subparsers."""
    recs = sub.add_parser("recs", help="recommendations pending approval (--all: every one)")
    recs.add_argument("--job", metavar="JOB", help="this job's only")
    recs.add_argument("--all", action="store_true", help="every recommendation and its state")
    recs.add_argument("--limit", type=int, default=50, metavar="N", help="newest N (50)")
    recs.add_argument("--json", action="store_true", help="print JSON")
    for verb, what in (("approve", "issue its command"), ("reject", "drop it")):
        p = sub.add_parser(verb, help=f"{verb} a pending recommendation: {what}")
        p.add_argument("rec_id", metavar="REC_ID", help="from `perfloop recs`")
        p.add_argument("--reason", default="", metavar="TEXT", help="why (kept in the audit)")
        p.add_argument(
            "--wait-s", type=float, default=15.0, metavar="S",
            help="wait this long for the actuator's decision (15; 0: do not wait)",
        )  # fmt: skip


def _add_capture(sub: Any) -> None:
    """Register ``capture`` on the CLI's subparsers."""
    c = sub.add_parser("capture", help="ask a running job for a profiler capture of N steps")
    c.add_argument("job", metavar="JOB", help="the job's id")
    c.add_argument(
        "--steps", type=capture_steps, default=3, metavar="N", help="steps to capture (3)"
    )
    c.add_argument(
        "--wait", dest="wait_s", type=float, default=60.0, metavar="S",
        help="wait up to S seconds for the actuator and the capture (0: send and return)",
    )  # fmt: skip


def _add_export(sub: Any) -> None:
    """Register ``export`` on the CLI's subparsers."""
    e = sub.add_parser("export", help="a job's steps, spans and collectives as a Chrome trace")
    e.add_argument("job", metavar="JOB", help="the job's id")
    e.add_argument(
        "--steps", type=step_range, metavar="A..B", help="only these steps (A..B, A.., or N)"
    )
    e.add_argument(
        "-o", "--output", metavar="FILE", help="where (default perfloop-trace-<job>.json; .gz ok)"
    )


def _add_watch(sub: Any) -> None:
    """Register ``watch`` on the CLI's subparsers."""
    w = sub.add_parser("watch", help="follow diagnoses, recommendations, commands… as published")
    w.add_argument("--job", action="append", metavar="J", help="this job's only (repeatable)")
    w.add_argument(
        "--kind", action="append", metavar="K",
        help="these event kinds only (repeatable, or K1,K2): diagnosis, recommendation, …",
    )  # fmt: skip
    w.add_argument("--since", metavar="T", help="from 30s/10m/2h/1d ago or an ISO time (now)")
    w.add_argument("--json", action="store_true", help="one JSON object per line")


def _add_report(sub: Any) -> None:
    """Register ``report`` on the CLI's subparsers."""
    r = sub.add_parser("report", help="one self-contained HTML page of a job: plots, accounting")
    r.add_argument("job", metavar="JOB", help="the job id")
    r.add_argument(
        "-o", "--output", metavar="FILE.html",
        help="where to write it (default: perfloop-report-<job>.html here)",
    )  # fmt: skip
    r.add_argument(
        "--flops-per-step", type=positive_float, metavar="N",
        help="FLOPs of one step of one rank, for MFU (default: the job info's flops_per_step)",
    )  # fmt: skip


_COMMANDS = {
    "up": up_command,
    "down": down_command,
    "status": status_command,
    "migrate": migrate_command,
    "demo": demo_command,
    "sql": sql_command,
    "schemas": schemas_command,
    "run": run_command,
    "replay": replay_command,
    "simulate": simulate_command,
    "sample": sample_command,
    "dlq": dlq_command,
    "service": service_command,
    "config": config_command,
    "plan": plan_command,
    "recs": recs_command,
    "approve": approve_command,
    "reject": approve_command,
    "jobs": jobs_command,
    "top": top_command,
    "report": report_command,
    "watch": watch_command,
    "export": export_command,
    "capture": capture_command,
    "keys": keys_command,
    "power-helper": power_helper_command,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "service":
        # Client libraries log their retries; a command's answer is its own one line.
        logging.getLogger().addHandler(logging.NullHandler())
    try:
        check_environment()  # every PERFLOOP_* variable, whichever service will read it
        return _COMMANDS[args.command](args)
    except PerfloopError as e:
        print(f"perfloop: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`perfloop … | head`): stop, quietly
        with contextlib.suppress(Exception):  # and nothing more at exit's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe ended


if __name__ == "__main__":
    sys.exit(main())
