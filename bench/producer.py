"""The producer transport: samples/s acknowledged by the broker, and publish() latency.

    python bench/producer.py                    # 5M step samples, ~30 s on 2 cores
    python bench/producer.py --samples 300000   # a quick run

One producer process, the way a training job publishes: step samples are appended column by
column with `Emitter.extend` (numpy arrays of ``--chunk`` samples, ``--ranks`` ranks), encoded
into messages of up to ``--batch`` samples by `Emitter.flush`, and handed to the real
`Publisher` (idempotent, acks=all, lz4). Unless ``PERFLOOP_KAFKA_BOOTSTRAP`` or
``PERFLOOP_KAFKA_PORT`` names a running broker, it starts the Tansu broker alone on a free
loopback port (like `bench/broker_growth.py`) and stops it at the end.

1. **Throughput**: from the first sample to the last acknowledgement (``flush`` returned 0),
   encoding included. The loop waits while more than ``--inflight-mib`` are unacknowledged (a
   benchmark may wait; a training loop never does, its overflow goes to the spool), so the
   figure is what the broker acknowledges, not what the spool absorbs. Reported: samples/s,
   messages/s, the process CPU per million samples, and the share of it in the publisher's
   thread + ``publish()`` and in librdkafka's threads.
2. **publish() latency**: every call of the throughput run (large messages, a busy process),
   and a steady run of ``--steady`` small messages (10 samples) at 500 per second (what a
   training step publishes): p50, p99 and max in µs.

Figures go to stdout and to ``bench/results/producer-<time>.json``; the last line is the
result as one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/producer.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench._common import free_port, isolate_env, port_open, raise_on_sigterm, save_result, say

TARGET_SAMPLES_PER_S = 200_000


def _rdkafka_cpu_s() -> float:
    """CPU seconds of librdkafka's threads (named ``rdk:*``) in this process."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("rdk:"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


class _Timed:
    """Between the emitter and the publisher: the duration of every publish() call."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher
        self.ns: list[int] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        t0 = time.perf_counter_ns()
        ok = bool(self.publisher.publish(topic, key, value))
        self.ns.append(time.perf_counter_ns() - t0)
        return ok


def _quantiles_us(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns, dtype=np.float64) / 1000
    return {
        "calls": len(ns),
        "p50_us": round(float(np.percentile(a, 50)), 2),
        "p99_us": round(float(np.percentile(a, 99)), 2),
        "max_us": round(float(a.max()), 2),
    }


def bench_throughput(args: argparse.Namespace, pub: Any, say_stats: bool = True) -> dict[str, Any]:
    from perfloop.producers.emitter import Emitter

    timed = _Timed(pub)
    em = Emitter(timed, job_id="bench-producer", node="node-0", producer_id="bench")
    em.max_samples = args.batch
    rng = np.random.default_rng(0)
    chunk = args.chunk
    ar = np.arange(chunk, dtype=np.int64)
    rank = ar % args.ranks
    step_time = np.abs(rng.normal(100.0, 2.0, chunk)) + 1.0
    data_wait = rng.uniform(0.0, 10.0, chunk)
    limit = args.inflight_mib << 20
    before = pub.stats
    cpu0, rdk0 = time.process_time(), _rdkafka_cpu_s()
    t_ns = time.time_ns()
    waited = 0.0
    t0 = time.perf_counter()
    sent = 0
    while sent < args.samples:
        n = ar + sent
        em.extend(
            "step",
            ts_ns=t_ns + n * 1000,
            rank=rank,
            step=n // args.ranks,
            step_time_ms=step_time,
            data_wait_ms=data_wait,
            batch_size=np.full(chunk, 32),
        )
        sent += chunk
        if em.pending() >= args.batch:
            em.flush()
            if pub.pending_bytes() > limit:
                tw = time.perf_counter()
                while pub.pending_bytes() > limit:
                    time.sleep(0.0005)
                waited += time.perf_counter() - tw
    em.flush()
    queued_s = time.perf_counter() - t0
    left = pub.flush(120)
    elapsed = time.perf_counter() - t0
    cpu, rdk = time.process_time() - cpu0, _rdkafka_cpu_s() - rdk0
    st = pub.stats
    own = st.cpu_time_s - before.cpu_time_s
    msgs = st.published - before.published
    rate = sent / elapsed
    result = {
        "samples": sent,
        "messages": msgs,
        "samples_per_message": args.batch,
        "elapsed_s": round(elapsed, 3),
        "handed_over_s": round(queued_s, 3),
        "backpressure_wait_s": round(waited, 3),
        "samples_per_s": round(rate),
        "messages_per_s": round(msgs / elapsed, 1),
        "target_samples_per_s": TARGET_SAMPLES_PER_S,
        "meets_target": rate >= TARGET_SAMPLES_PER_S,
        "outstanding_after_flush": left,
        "spooled": st.spooled - before.spooled,
        "failed": st.failed - before.failed,
        "process_cpu_s_per_million": round(cpu / sent * 1e6, 3),
        "publisher_cpu_s_per_million": round(own / sent * 1e6, 3),
        "librdkafka_cpu_s_per_million": round(rdk / sent * 1e6, 3),
        "publish_latency": _quantiles_us(timed.ns),
    }
    if say_stats:
        say(
            f"  {sent:,} samples in {msgs:,} messages, all acknowledged in {elapsed:.2f} s → "
            f"{rate:,.0f} samples/s ({msgs / elapsed:,.1f} messages/s; target "
            f"{TARGET_SAMPLES_PER_S:,}: {'met' if rate >= TARGET_SAMPLES_PER_S else 'NOT met'})"
        )
        say(
            f"  handed over in {queued_s:.2f} s (waited {waited:.2f} s on > "
            f"{args.inflight_mib} MiB unacknowledged); outstanding after flush {left}; "
            f"spooled {result['spooled']}, failed {result['failed']}"
        )
        say(
            f"  CPU per million samples: process {result['process_cpu_s_per_million']:.2f} s "
            f"(encoding included), publisher thread + publish() "
            f"{result['publisher_cpu_s_per_million']:.3f} s, librdkafka threads "
            f"{result['librdkafka_cpu_s_per_million']:.2f} s"
        )
        q = result["publish_latency"]
        say(
            f"  publish() of {args.batch:,}-sample messages: p50 {q['p50_us']:.1f} µs, "
            f"p99 {q['p99_us']:.1f} µs, max {q['max_us']:.1f} µs ({q['calls']:,} calls)"
        )
    return result


def bench_steady(args: argparse.Namespace, pub: Any) -> dict[str, Any]:
    from perfloop.schemas import encode_batch
    from perfloop.schemas.topics import Topics

    cols = {
        "ts_ns": np.arange(10, dtype=np.int64) + time.time_ns(),
        "rank": np.zeros(10, dtype=np.int64),
        "step": np.arange(10, dtype=np.int64),
        "step_time_ms": np.full(10, 100.0),
    }
    msgs = [
        encode_batch("step", cols, job_id="bench-steady", node="node-0", producer_id="b", seq=i)
        for i in range(1, args.steady + 1)
    ]
    ns: list[int] = []
    period = 1 / 500
    nxt = time.perf_counter()
    for m in msgs:
        t0 = time.perf_counter_ns()
        pub.publish(Topics.STEP, "bench-steady", m)
        ns.append(time.perf_counter_ns() - t0)
        nxt += period
        delay = nxt - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    left = pub.flush(30)
    q = _quantiles_us(ns)
    say(
        f"  publish() of {len(msgs[0])}-byte messages at 500/s: p50 {q['p50_us']:.1f} µs, "
        f"p99 {q['p99_us']:.1f} µs, max {q['max_us']:.1f} µs ({q['calls']:,} calls); "
        f"outstanding after flush {left}"
    )
    return q | {"message_bytes": len(msgs[0]), "outstanding_after_flush": left}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=5_000_000, help="step samples to publish")
    p.add_argument("--batch", type=int, default=20_000, help="samples per message (Emitter)")
    p.add_argument("--chunk", type=int, default=1000, help="samples per Emitter.extend call")
    p.add_argument("--ranks", type=int, default=8, help="ranks (samples per step)")
    p.add_argument("--inflight-mib", type=int, default=24, help="wait above this backlog")
    p.add_argument("--steady", type=int, default=2000, help="small messages at 500/s")
    args = p.parse_args(argv)
    raise_on_sigterm()

    reuse = bool(
        os.environ.get("PERFLOOP_KAFKA_BOOTSTRAP") or os.environ.get("PERFLOOP_KAFKA_PORT")
    )
    home = Path(tempfile.mkdtemp(prefix="perfloop-bench-producer-"))
    broker: subprocess.Popen[bytes] | None = None
    if not reuse:
        isolate_env(home, free_port(), free_port())  # this process is the entry point

    from perfloop.kafka import ensure_topics
    from perfloop.producers.publisher import Publisher
    from perfloop.schemas.topics import Topics
    from perfloop.settings import ProducerSettings
    from perfloop.stack.broker import broker_argv

    settings = ProducerSettings(spool_dir=home / "spool")
    log_path = home / "broker.log"
    result: dict[str, Any] = {"bench": "producer", "args": vars(args)}
    try:
        if reuse:
            say(f"using the broker at {settings.kafka_bootstrap} (PERFLOOP_* is set)")
        else:
            say(f"starting the tansu broker alone on {settings.kafka_bootstrap} (log {log_path})")
            with open(log_path, "ab") as log:
                broker = subprocess.Popen(
                    broker_argv(settings),
                    cwd=home,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            deadline = time.monotonic() + 30
            while not port_open(settings.kafka_port):
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the broker did not start; see {log_path}")
                time.sleep(0.1)
        ensure_topics(settings, [Topics.STEP])
        pub = Publisher(settings, producer_id="bench")
        warm = argparse.Namespace(**(vars(args) | {"samples": 2 * args.batch}))
        bench_throughput(warm, pub, say_stats=False)  # connection, metadata, producer id
        say(
            f"\n[1] throughput: Emitter.extend → Publisher → broker acks ({args.samples:,} samples)"
        )
        result["throughput"] = bench_throughput(args, pub)
        say(f"\n[2] publish() latency, steady small messages ({args.steady:,})")
        result["steady"] = bench_steady(args, pub)
        st = pub.stats
        pub.close()
        result["publisher_stats"] = vars(st)
        result["samples_per_s"] = result["throughput"]["samples_per_s"]
        result["publish_p50_us"] = result["steady"]["p50_us"]
        result["publish_p99_us"] = result["steady"]["p99_us"]
    finally:
        if broker is not None:
            broker.terminate()
            try:
                broker.wait(10)
            except subprocess.TimeoutExpired:
                broker.kill()
                broker.wait()
        with contextlib.suppress(OSError):
            shutil.rmtree(home)
    save_result("producer", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
