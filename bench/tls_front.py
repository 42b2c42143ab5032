"""What the broker's TLS fronts cost (`perfloop up --listen`, `perfloop.stack._tls_front`):
the same telemetry produced to and read back from the Tansu broker directly on loopback
(what `perfloop up` does without ``--listen``) and through the TLS fronts with client
certificates, alternating, in one run.

    python bench/tls_front.py                  # 4 rounds of 2,000 messages of 1,000 step samples
    python bench/tls_front.py --rounds 2 --messages 500

A private Tansu broker on loopback; the fronts run in this process (a bootstrap front and
one for the broker's advertised port, as the supervisor runs them), their thread's CPU read
in it. Each round of each variant: ``--messages`` encoded step batches of ``--samples``
samples (a training node's messages) produced with acks=all and lz4, then read back to the
end by a consumer. Reported per variant (median of the rounds): MB/s and samples/s both ways,
and the fronts' thread CPU per sample (produced once and read once), from which the cores
a listening stack's supervisor spends at a given rate follow (every sample passes the fronts
about three times: the producer, the stream worker's read and the sink's).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/tls_front.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from confluent_kafka.admin import AdminClient, NewTopic

from bench._common import free_port, isolate_env, port_open, raise_on_sigterm, save_result, say

TOPIC = "bench.tls"
OFFSET_BEGINNING = -2  # librdkafka's logical offset


def _message(samples: int) -> bytes:
    from perfloop.schemas import BatchBuilder

    b = BatchBuilder("step", job_id="bench-tls", node="n0", producer_id="bench")
    rng = np.random.default_rng(0)
    t0 = time.time_ns()
    for i in range(samples):
        b.add(ts_ns=t0 + i * 1_000_000, rank=i % 8, step=i // 8,
              step_time_ms=float(100 + rng.normal(0, 5)))  # fmt: skip
    return b.encode()


def _round(
    conf: dict[str, Any], payload: bytes, messages: int, fronts: list[Any]
) -> dict[str, float]:
    from confluent_kafka import Consumer, Producer, TopicPartition

    cpu0 = sum(f.cpu_s() for f in fronts)
    p = Producer(conf | {"acks": "all", "compression.type": "lz4", "linger.ms": 5,
                         "batch.size": 1 << 20, "message.max.bytes": 8 << 20,
                         "log.connection.close": False})  # fmt: skip
    start = time.perf_counter()
    for _ in range(messages):
        while True:
            try:
                p.produce(TOPIC, payload)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(60) == 0, "not every message was acknowledged"
    produced = time.perf_counter() - start
    c = Consumer(conf | {"group.id": f"bench-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "fetch.queue.backoff.ms": 1})  # fmt: skip
    start = time.perf_counter()
    c.assign([TopicPartition(TOPIC, 0, OFFSET_BEGINNING)])  # no group to join: the read only
    got, last = 0, time.perf_counter()
    try:
        while got < messages and time.perf_counter() - last < 30:
            for msg in c.consume(500, 0.5):
                if not msg.error():
                    got += 1
                    last = time.perf_counter()
    finally:
        c.close()
    assert got >= messages, f"read back {got} of {messages} messages"
    cpu = sum(f.cpu_s() for f in fronts) - cpu0
    return {"produce_s": produced, "read_s": last - start, "front_cpu_s": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=1000, help="step samples per message")
    args = ap.parse_args()
    raise_on_sigterm()
    from perfloop.settings import StackSettings
    from perfloop.stack._front import free_port as front_free_port
    from perfloop.stack._tls_front import TlsFront
    from perfloop.stack.broker import broker_argv
    from perfloop.stack.listen import prepare, server_context

    home = Path(tempfile.mkdtemp(prefix="perfloop-bench-tls-"))
    isolate_env(home, free_port(), free_port())
    files = prepare(home, "127.0.0.1", 0, 0)
    ctx = server_context(files)
    settings = StackSettings()
    # the fronts first (they hold their ports), then two brokers at ports none of them has:
    # one as `perfloop up` runs it on loopback, one behind the fronts as with ``--listen``
    # (listening on loopback, advertising the front's port)
    fronts = [TlsFront("127.0.0.1", 0, ctx), TlsFront("127.0.0.1", 0, ctx)]
    bootstrap, advertised = fronts[0].port, fronts[1].port
    plain_port = front_free_port("127.0.0.1", avoid={bootstrap, advertised})
    listen = front_free_port("127.0.0.1", avoid={bootstrap, advertised, plain_port})
    log = open(home / "broker.log", "wb")  # noqa: SIM115
    urls = [(f"tcp://127.0.0.1:{plain_port}", None),
            (f"tcp://127.0.0.1:{listen}", f"tcp://127.0.0.1:{advertised}")]  # fmt: skip
    brokers = [
        subprocess.Popen(broker_argv(settings, *u), stdout=log, stderr=subprocess.STDOUT)
        for u in urls
    ]
    try:
        deadline = time.monotonic() + 30
        while not (port_open(plain_port) and port_open(listen)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the brokers did not start; see {home / 'broker.log'}")
            time.sleep(0.2)
        for f in fronts:
            f.start()
            f.point_at(listen)
        tls = {
            "security.protocol": "SSL",
            "ssl.ca.location": str(files.ca),
            "ssl.certificate.location": str(files.stack_cert),
            "ssl.key.location": str(files.stack_key),
        }
        variants = {
            "loopback, plaintext": {"bootstrap.servers": f"127.0.0.1:{plain_port}"},
            "TLS fronts, client certificate": {"bootstrap.servers": f"127.0.0.1:{bootstrap}"} | tls,
        }
        for conf in variants.values():
            admin = AdminClient(dict(conf))
            for fut in admin.create_topics([NewTopic(TOPIC, 1, 1)]).values():
                fut.result(30)
        payload = _message(args.samples)
        mb = len(payload) * args.messages / 1e6
        samples = args.samples * args.messages
        say(
            f"{args.messages:,} messages of {args.samples:,} step samples "
            f"({len(payload):,} bytes each, {mb:.1f} MB a round), {args.rounds} rounds"
        )
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for r in range(args.rounds):  # alternating, the order swapped every round
            names = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in names:
                got = _round(variants[name], payload, args.messages, fronts)
                runs[name].append(got)
                say(f"  round {r + 1} {name:<32} produce {mb / got['produce_s']:6.1f} MB/s, "
                    f"read {mb / max(got['read_s'], 1e-9):6.1f} MB/s, "
                    f"fronts' CPU {got['front_cpu_s']:.2f} s")  # fmt: skip
        out: dict[str, Any] = {"samples_per_round": samples, "mb_per_round": mb, "variants": {}}
        for name, rows in runs.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            out["variants"][name] = {
                "produce_mb_s": round(mb / med["produce_s"], 1),
                "produce_samples_s": round(samples / med["produce_s"]),
                "read_mb_s": round(mb / max(med["read_s"], 1e-9), 1),
                "fronts_cpu_us_per_sample": round(med["front_cpu_s"] / samples * 1e6, 3),
                "rounds": rows,
            }
            v = out["variants"][name]
            say(f"{name:<32} produce {v['produce_samples_s']:,} samples/s ({v['produce_mb_s']} "
                f"MB/s), read {v['read_mb_s']} MB/s, fronts {v['fronts_cpu_us_per_sample']} "
                "µs CPU per sample (produced and read once)")  # fmt: skip
        save_result("tls_front", out)
    finally:
        for f in fronts:
            f.close()
        for b in brokers:
            b.terminate()
            try:
                b.wait(10)
            except subprocess.TimeoutExpired:
                b.kill()
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
