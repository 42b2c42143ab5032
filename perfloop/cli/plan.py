"""``perfloop plan``: memory per GPU and communication per step of each data-parallel strategy.

``perfloop plan --params N --world W --optimizer adam|adamw|sgd --precision fp32|bf16|fp16
[--gpu NAME] [--bandwidth-gbps B] [--json]`` evaluates ddp, zero1, zero2, zero3 and fsdp with
the analytical model `perfloop.models.memory` and names the recommended one. ``--gpu`` takes the
memory limit and, unless ``--bandwidth-gbps`` is given, the one-direction interconnect bandwidth
from the device catalog (`perfloop.models.devices`). Give ``--layers --hidden --heads --seq-len
--micro-batch`` together for an activation estimate. Bad input is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import TextIO

from perfloop.exceptions import ConfigError

__all__ = ["parse_count", "plan_command"]

_COUNT = re.compile(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kmbgtKMBGT]?)\s*")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_SHAPE_FLAGS = ("layers", "hidden", "heads", "seq_len", "micro_batch")


def parse_count(text: str, flag: str = "--params") -> int:
    """A positive count such as ``7e9``, ``7B``, ``1.3b``, ``350M`` or ``7_000_000``.

    Suffixes are decimal: k = 1e3, M = 1e6, B (or G) = 1e9, T = 1e12, any case.

    >>> [parse_count(t) for t in ("7e9", "7B", "1.3b", "350M", "125m", "1,024")]
    [7000000000, 7000000000, 1300000000, 350000000, 125000000, 1024]
    """
    m = _COUNT.fullmatch(text)
    try:
        if m is None:
            raise InvalidOperation
        value = Decimal(m.group(1).replace("_", "").replace(",", "")) * _SUFFIX[m.group(2).lower()]
        count = int(value.to_integral_value(ROUND_HALF_EVEN))
    except (InvalidOperation, OverflowError):
        count = 0
    if count < 1:
        raise ConfigError(f"{flag} {text!r} is not a positive count; e.g. 7e9, 7B, 1.3b, 350M")
    return count


def plan_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """``perfloop plan``: 0, or 2 with one line on stderr for bad input."""
    try:
        return _plan(args, out or sys.stdout)
    except ConfigError as e:
        print(f"perfloop: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    from perfloop.models.memory import TransformerShape, plan

    params = parse_count(args.params)
    unit = (
        None
        if args.fsdp_unit_params is None
        else parse_count(args.fsdp_unit_params, "--fsdp-unit-params")
    )
    given = {f: getattr(args, f) for f in _SHAPE_FLAGS if getattr(args, f) is not None}
    shape = None
    if given:
        missing = [f"--{f.replace('_', '-')}" for f in _SHAPE_FLAGS if f not in given]
        if missing:
            raise ConfigError(f"activations need {', '.join(missing)} as well")
        shape = TransformerShape(**given, recompute=args.recompute)
    memory, bandwidth, dev = None, None, None
    if args.gpu is not None:
        from perfloop.models.devices import device

        dev = device(args.gpu)
        memory, bandwidth = dev.memory_bytes, dev.interconnect_unidirectional_bytes_per_s
    if args.bandwidth_gbps is not None:
        bandwidth = args.bandwidth_gbps * 1e9
    result = plan(
        params,
        args.world,
        args.optimizer,
        args.precision,
        gpu_memory_bytes=memory,
        bandwidth_bytes_per_s=bandwidth,
        param_tensors=args.param_tensors,
        momentum=args.momentum,
        shape=shape,
        fsdp_unit_params=unit,
        headroom=args.headroom,
    )
    if args.json:
        print(json.dumps(result.as_dict(), indent=2), file=out)
        return 0

    where = f"{dev.full_name}, " if dev is not None else ""
    limit = (
        f"usable {_gib(result.usable_memory_bytes)} of {_gib(memory)} "
        f"({1 - result.usable_memory_bytes / memory:.0%} headroom)"
        if memory is not None and result.usable_memory_bytes is not None
        else "no memory limit"
    )
    link = f", {bandwidth / 1e9:g} GB/s per GPU each way" if bandwidth is not None else ""
    print(
        f"{_count(params)} parameters on {args.world} GPUs, {args.optimizer.lower()}, "
        f"{args.precision.lower()}: {where}{limit}{link}",
        file=out,
    )
    memory_cols = ("params", "grads", "optimizer", "master", "model state", "activations")
    rows = [("strategy", *memory_cols, "comm/step", "comm time", "fits")]
    for name, e in result.strategies.items():
        rows.append(
            (
                name,
                _gib(e.parameter_bytes),
                _gib(e.gradient_bytes),
                _gib(e.optimizer_state_bytes),
                _gib(e.master_weight_bytes),
                _gib(e.model_state_bytes_per_gpu),
                "-" if e.activation_bytes is None else _gib(e.activation_bytes),
                f"{e.comm_bytes_per_step / 1e9:.2f} GB",
                "-" if e.comm_time_s is None else f"{e.comm_time_s * 1e3:.0f} ms",
                {True: "yes", False: "no", None: "-"}[e.fits],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells), file=out)
    flag = "" if result.fits is not False else " (does NOT fit)"
    print(f"recommended: {result.recommended}{flag}, {result.reason}", file=out)
    return 0


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _count(n: int) -> str:
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= size:
            return f"{n / size:g}{suffix}"
    return str(n)
