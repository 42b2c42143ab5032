"""``perfloop sample --job-id ID [--node N] [--duration S] [--pid PID …]``: run the node
samplers (`perfloop.producers.node_sampler.NodeSampler`: NVML, host) in the foreground."""

from __future__ import annotations

import argparse
import logging
import math
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

from perfloop.exceptions import BrokerError, ConfigError
from perfloop.producers.node_sampler import NodeSampler, config_listener
from perfloop.schemas.base import JOB_ID_PATTERN
from perfloop.settings import ProducerSettings, load_settings

__all__ = ["sample_command"]


def sample_command(args: argparse.Namespace, settings: ProducerSettings | None = None) -> int:
    """``perfloop sample --job-id ID [--node N] [--duration S] [--pid PID ...]``."""
    import psutil

    if settings is None:
        settings = load_settings(ProducerSettings)

    from perfloop.producers.emitter import Emitter
    from perfloop.producers.publisher import Publisher

    job_id = args.job_id
    if not re.fullmatch(JOB_ID_PATTERN, job_id or ""):
        raise ConfigError(
            f"invalid --job-id {job_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ : / @ + -"
        )
    node = args.node or settings.node or socket.gethostname()
    if not 0 < len(node) <= 255:
        raise ConfigError(f"invalid --node {node!r}: use 1-255 characters")
    if args.duration is not None and not (args.duration > 0 and math.isfinite(args.duration)):
        raise ConfigError(f"--duration must be a positive number of seconds, got {args.duration}")
    pids = list(dict.fromkeys(args.pid or []))
    for pid in pids:
        if pid <= 0 or not psutil.pid_exists(pid):
            raise ConfigError(f"--pid {pid}: no such process")

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("perfloop sample: %(levelname)s %(message)s"))
    plog = logging.getLogger("perfloop.producers")
    plog.addHandler(handler)
    old_level = plog.level
    plog.setLevel(logging.INFO)
    old_handlers: dict[signal.Signals, Any] = {}
    try:
        publisher = Publisher(settings)
        emitter = Emitter(publisher, job_id=job_id, node=node, producer_id=f"sample-{node}")
        sampler = NodeSampler(
            settings,
            emitter,
            pids=pids,
            flush=True,
            producer_id=f"sample-{node}",
            stop_when_pids_exit=bool(pids),
        )
        listener = config_listener(settings, job_id, sampler)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old_handlers[sig] = signal.signal(sig, lambda *_: sampler.stop())
        watched = f"pids {','.join(map(str, pids))}" if pids else "node-level"
        until = f"for {args.duration:g} s" if args.duration else "until Ctrl-C"
        print(f"sampling job {job_id} on {node} ({watched}) {until}", flush=True)
        t0 = time.monotonic()
        try:
            sampler.run(duration_s=args.duration)
        finally:
            if listener is not None:
                listener.stop(timeout_s=2.0)
        left = publisher.flush(10.0)
        if left:
            raise BrokerError(
                f"{left} messages were not delivered to {settings.kafka_bootstrap} "
                "(is the broker up? see `perfloop status`)"
            )
        gpu = sampler.capabilities.get(sampler.backend.name)
        devices = f"{gpu.devices} devices" if gpu and gpu.available else "unavailable"
        print(
            f"sampled {sampler.samples} samples in {time.monotonic() - t0:.1f} s "
            f"(GPU: {devices}, "
            f"overhead {sampler.meter.overhead_pct():.3f}%)",
            flush=True,
        )
        return 0
    finally:
        for sig, old in old_handlers.items():
            signal.signal(sig, old)
        plog.removeHandler(handler)
        plog.setLevel(old_level)
