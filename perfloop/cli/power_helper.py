"""``perfloop power-helper --socket PATH --keyring FILE [--group NAME]``: the node's GPU
power-limit helper (`perfloop.producers.power_helper`), run as root by the node's service
manager, so that training processes set power limits without privilege. It answers on the
Unix socket ``PATH`` (mode 0660, owned by group ``NAME`` when given: the training users'),
applies only ``gpu.power_limit_w`` commands signed by a key of ``FILE`` (the actuator's public
keys, `perfloop keys`), and runs until SIGTERM or SIGINT. Jobs use it with
``PERFLOOP_POWER_HELPER=PATH``.
"""

from __future__ import annotations

import argparse
import grp
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from perfloop.exceptions import ConfigError

__all__ = ["add_power_helper", "power_helper_command"]


def add_power_helper(sub: Any) -> None:
    p = sub.add_parser(
        "power-helper",
        help="the node's privileged GPU power-limit helper (run as root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--socket", required=True, type=Path, help="the Unix socket to answer on")
    p.add_argument(
        "--keyring", required=True, type=Path,
        help="the public keys commands must be signed with (the actuator's)",
    )  # fmt: skip
    p.add_argument("--group", default=None, help="the group that may use the socket")


def power_helper_command(args: argparse.Namespace) -> int:
    from perfloop.identity import Keyring, KeyringFile
    from perfloop.producers.gpu import NvmlBackend
    from perfloop.producers.power_helper import PowerHelper, serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    Keyring.load(args.keyring)  # a keyring that cannot be read is one line, before anything
    gid = None
    if args.group:
        try:
            gid = grp.getgrnam(args.group).gr_gid
        except KeyError:
            raise ConfigError(f"no group {args.group!r} on this node") from None
    backend = NvmlBackend()
    backend.init()  # no NVML here: GpuUnavailableError, one line
    backend.open()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(args.socket, PowerHelper(backend, KeyringFile(args.keyring)), stop, gid=gid)
    finally:
        backend.close()
    return 0
