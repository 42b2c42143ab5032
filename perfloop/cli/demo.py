"""``perfloop demo [--real]``: close the loop on a simulated job (`perfloop.demo`) or on a real
torch job on this machine's CPUs (`perfloop.demo_real`), on the embedded stack."""

from __future__ import annotations

import argparse
import sys

from perfloop.exceptions import ConfigError
from perfloop.settings import load_settings

__all__ = ["demo_command"]


def demo_command(args: argparse.Namespace) -> int:
    from perfloop.demo import format_table, run_demo, verify_in_warehouse
    from perfloop.settings import ActuatorSettings, StackSettings
    from perfloop.stack import read_state, up_detached

    settings = load_settings(StackSettings)
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
    key = load_settings(ActuatorSettings).signing_key.get_secret_value().encode()
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
