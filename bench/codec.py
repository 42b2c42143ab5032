"""Batch codec: encode and decode cost per sample, Arrow IPC against JSON, on the same batches.

    python bench/codec.py                  # 2 simulated jobs (2 nodes × 8 ranks), 120 s each
    python bench/codec.py --jobs 1 --sim-s 30

The simulated jobs' telemetry batches (every kind, mixed scenario) are decoded once, then each
batch is encoded and decoded again as JSON (the baseline) and as Arrow, each the best of
``--repeat`` rounds. Reported per kind and in all: µs per sample to encode and to decode
(`decode_batch` checks included), bytes per sample, and the ratio JSON / Arrow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/codec.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import save_result, say


def _batches(args: argparse.Namespace) -> list[Any]:
    from perfloop.producers.scenarios import scenario_config
    from perfloop.producers.simulator import SimulatedJob
    from perfloop.schemas import decode_batch, is_batch

    class Collect:
        def __init__(self) -> None:
            self.values: list[bytes] = []

        def publish(self, topic: str, key: str, value: bytes) -> bool:
            self.values.append(value)
            return True

    out = []
    for j in range(args.jobs):
        cfg = scenario_config(
            "mixed",
            job_id=f"codec-j{j}",
            nodes=args.nodes,
            ranks_per_node=args.ranks,
            duration_s=args.sim_s,
            seed=j,
            t0_ns=time.time_ns(),
            speed=1e9,
        )
        sink = Collect()
        SimulatedJob(cfg, sink).run(args.sim_s)
        out += [decode_batch(v) for v in sink.values if is_batch(v)]
    return out


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--sim-s", type=float, default=120.0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    from perfloop.schemas import decode_batch, encode_batch

    batches = _batches(args)
    kinds = sorted({b.kind for b in batches})
    result: dict[str, Any] = {"bench": "codec", "args": vars(args), "cpus": os.cpu_count()}
    say(
        f"{len(batches):,} batches, {sum(map(len, batches)):,} samples "
        f"({', '.join(kinds)}); best of {args.repeat}"
    )
    for kind in [*kinds, "all"]:
        group = [b for b in batches if kind in ("all", b.kind)]
        n = sum(map(len, group))
        row: dict[str, Any] = {"samples": n}
        for wire in ("json", "arrow"):

            def encode(wire: str = wire, group: list[Any] = group) -> list[bytes]:
                # orjson writes numeric numpy columns itself; strings go as lists
                return [
                    encode_batch(
                        b.kind,
                        {k: v.tolist() if v.dtype == object else v for k, v in b.columns.items()},
                        job_id=b.job_id,
                        node=b.node,
                        wire=wire,
                    )
                    for b in group
                ]

            data = encode()
            enc = _best(encode, args.repeat)
            dec = _best(lambda data=data: [decode_batch(d) for d in data], args.repeat)
            row[wire] = {
                "encode_us": 1e6 * enc / n,
                "decode_us": 1e6 * dec / n,
                "bytes": sum(map(len, data)) / n,
            }
        j, a = row["json"], row["arrow"]
        row["decode_ratio"] = j["decode_us"] / a["decode_us"]
        row["encode_ratio"] = j["encode_us"] / a["encode_us"]
        result[kind] = row
        say(
            f"  {kind:>10}: decode JSON {j['decode_us']:.2f} / Arrow {a['decode_us']:.2f} µs/sample"
            f" ({row['decode_ratio']:.1f}×), encode {j['encode_us']:.2f} / {a['encode_us']:.2f}"
            f" ({row['encode_ratio']:.1f}×), bytes {j['bytes']:.0f} / {a['bytes']:.0f}"
        )
    save_result("codec", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
