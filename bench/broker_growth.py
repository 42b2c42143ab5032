"""How fast the embedded broker's memory grows: RSS per million samples published.

    python bench/broker_growth.py               # 5M step samples in batches of 5,000
    python bench/broker_growth.py --samples 1000000

The Tansu broker (memory storage) keeps every record until it stops: no retention, no
DeleteRecords (see `perfloop.stack.broker`). This starts just the broker binary
(`perfloop.stack.broker.broker_argv`) on a free loopback port, publishes step batches built with the
real `BatchBuilder` through the real `Publisher` (idempotent, lz4), and reads the broker's
VmRSS from /proc before, after each ``--report-every`` samples, and at the end. It prints MiB
per million samples and bytes per sample, next to the JSON bytes and the lz4-compressed bytes
per sample of the messages themselves, and ends with one JSON line (also saved under
``bench/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/broker_growth.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cramjam
import numpy as np

from bench._common import (
    free_port,
    isolate_env,
    port_open,
    raise_on_sigterm,
    rss_bytes,
    save_result,
    say,
)

MIB = 1 << 20


def _settled_rss(pid: int, settle_s: float) -> int:
    """RSS after the broker has had ``settle_s`` to finish handling what it received."""
    time.sleep(settle_s)
    return rss_bytes(pid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=5_000_000, help="step samples to publish")
    p.add_argument("--batch", type=int, default=5000, help="samples per message")
    p.add_argument("--ranks", type=int, default=8, help="ranks per node (samples per step)")
    p.add_argument("--report-every", type=int, default=1_000_000, help="RSS reading interval")
    p.add_argument("--settle-s", type=float, default=2.0, help="wait before each RSS reading")
    args = p.parse_args(argv)
    raise_on_sigterm()

    home = Path(tempfile.mkdtemp(prefix="perfloop-bench-broker-"))
    port = free_port()
    isolate_env(home, port, free_port())  # this process is the entry point

    from perfloop.kafka import ensure_topics
    from perfloop.producers import Publisher
    from perfloop.schemas import BatchBuilder
    from perfloop.schemas.topics import Topics
    from perfloop.settings import BaseServiceSettings
    from perfloop.stack.broker import broker_argv

    settings = BaseServiceSettings()
    log_path = home / "broker.log"
    say(f"starting the tansu broker alone on 127.0.0.1:{port} (log {log_path})")
    with open(log_path, "ab") as log:
        broker = subprocess.Popen(
            broker_argv(settings), cwd=home, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    result: dict[str, Any] = {"bench": "broker_growth", "args": vars(args)}
    try:
        deadline = time.monotonic() + 30
        while not port_open(port):
            if broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start; see {log_path}")
            time.sleep(0.1)
        ensure_topics(settings, [Topics.STEP])
        pub = Publisher(settings)
        builder = BatchBuilder("step", job_id="bench-growth", node="node-0", producer_id="bench")
        rng = np.random.default_rng(0)

        def one_batch(first_step: int, n: int) -> bytes:
            steps = n // args.ranks
            st = (np.abs(rng.normal(100.0, 2.0, n)) + 1.0).tolist()
            wait = (rng.uniform(0.0, 10.0, n)).tolist()
            t0 = time.time_ns()
            i = 0
            for s in range(first_step, first_step + steps):
                for r in range(args.ranks):
                    builder.add(
                        ts_ns=t0 + s * 100_000_000,
                        rank=r,
                        step=s,
                        step_time_ms=st[i],
                        data_wait_ms=wait[i],
                        batch_size=32,
                        num_workers=8,
                    )
                    i += 1
            return builder.encode()

        # Warm up: connection, topic metadata and the producer id, then the baseline.
        pub.publish(Topics.STEP, "bench-growth", one_batch(0, args.batch))
        pub.flush(30)
        warm = args.batch
        rss0 = _settled_rss(broker.pid, args.settle_s)
        say(f"broker RSS after warm-up ({warm:,} samples): {rss0 / MIB:.1f} MiB")

        published = 0
        json_bytes = lz4_bytes = 0
        readings: list[tuple[int, int]] = [(0, rss0)]
        step = args.batch // args.ranks
        t0 = time.perf_counter()
        while published < args.samples:
            data = one_batch(step, args.batch)
            step += args.batch // args.ranks
            json_bytes += len(data)
            lz4_bytes += len(cramjam.lz4.compress(data))
            while not pub.publish(Topics.STEP, "bench-growth", data):
                pub.flush(1.0)
            published += args.batch
            if published % args.report_every == 0 or published >= args.samples:
                left = pub.flush(60)
                if left:
                    raise RuntimeError(f"{left} messages still undelivered after 60 s")
                rss = _settled_rss(broker.pid, args.settle_s)
                readings.append((published, rss))
                say(
                    f"  {published:>10,} samples  broker RSS {rss / MIB:8.1f} MiB  "
                    f"(+{(rss - rss0) / MIB:.1f} MiB)"
                )
        elapsed = time.perf_counter() - t0
        stats = pub.stats
        if stats.failed:
            raise RuntimeError(f"{stats.failed} messages failed to deliver")
        xs = np.array([r[0] for r in readings], dtype=float)
        ys = np.array([r[1] for r in readings], dtype=float)
        slope = float(np.polyfit(xs, ys, 1)[0])  # bytes per sample, least squares
        growth = readings[-1][1] - rss0
        result.update(
            samples=published,
            messages=published // args.batch,
            publish_s=elapsed,
            rss_before_bytes=rss0,
            rss_after_bytes=readings[-1][1],
            rss_growth_bytes=growth,
            rss_mib_per_million_samples=growth / MIB / (published / 1e6),
            rss_bytes_per_sample=growth / published,
            rss_bytes_per_sample_fit=slope,
            json_bytes_per_sample=json_bytes / published,
            lz4_bytes_per_sample=lz4_bytes / published,
            readings=readings,
            publisher_stats=vars(stats),
        )
        say(
            f"\npublished {published:,} samples in {published // args.batch:,} messages in "
            f"{elapsed:.1f} s ({published / elapsed:,.0f} samples/s incl. building batches)"
        )
        say(
            f"broker RSS {rss0 / MIB:.1f} → {readings[-1][1] / MIB:.1f} MiB: "
            f"{result['rss_mib_per_million_samples']:.1f} MiB per million samples, "
            f"{result['rss_bytes_per_sample']:.1f} bytes/sample "
            f"(least-squares slope {slope:.1f} bytes/sample)"
        )
        per = result["rss_bytes_per_sample"]
        say(
            f"messages: {result['json_bytes_per_sample']:.1f} JSON bytes/sample, "
            f"{result['lz4_bytes_per_sample']:.1f} lz4 bytes/sample (each message compressed "
            f"alone; the producer compresses whole record batches) → the broker holds "
            f"{per / result['lz4_bytes_per_sample']:.2f}× the compressed size, "
            f"{per / result['json_bytes_per_sample']:.2f}× the JSON size"
        )
    finally:
        broker.terminate()
        try:
            broker.wait(10)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()
        with contextlib.suppress(OSError):
            log_path.unlink()
            shutil.rmtree(home)
    save_result("broker_growth", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
