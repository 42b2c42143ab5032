"""End-to-end benchmark on a private embedded stack: throughput, a naive baseline, loop latency.

    python bench/e2e.py                 # 8 simulated jobs (~3.9M samples), 20k naive events, loop
    python bench/e2e.py --jobs 2 --sim-s 200 --naive 5000 --skip-loop   # a quick run

It brings up its own stack (a temporary ``PERFLOOP_HOME``, Kafka on 29092 and ClickHouse on
28123, or ``PERFLOOP_BENCH_KAFKA_PORT`` / ``PERFLOOP_BENCH_CLICKHOUSE_PORT``) and takes it down
at the end, also on error or SIGTERM. Three measurements, in this order:

1. **Batched throughput.** Simulated jobs (``--jobs`` × ``--nodes`` × ``--ranks``, scenario
   ``--scenario``, ``--sim-s`` seconds each, generated beforehand with event times ending 30 s
   ago) publish every message — GPU, host, step, span and collective batches and job events —
   through the real `Publisher`, interleaved in event-time order. Reported: the producer's
   rate, the time until every raw table holds every row and until the 1 s ``step_time_ms``
   windows cover every step sample (the end-to-end rate), window and diagnosis rows, and the
   stream tier's pure core (`StreamEngine`) in-process on the same messages.
2. **Naive baseline.** One JSON message per step sample, consumed by a plain per-event Faust
   agent (`bench.naive_app`) that decodes each message and updates one dict. Reported: its
   events/s (publish start → last event handled) and the ratio batched / naive.
3. **Fault onset → ack.** `perfloop.demo.run_demo` (simulated job, data-loader starvation,
   job agent). Seconds from the fault's onset (in the job's event time, which runs at wall
   speed) to the recommendation's window end, to the recommendation's publication (its Kafka
   timestamp), to the command and to the applied ack.

The figures go to stdout, to ``bench/results/e2e-<time>.json``, and as one final JSON line.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/e2e.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import orjson

from bench._common import (
    REPO,
    embedded_stack,
    raise_on_sigterm,
    save_result,
    say,
    service_cpu_s,
    wait_for,
)

NS = 1_000_000_000
E2E_PACE = 220_000.0
"""Samples/s the in-process core's clock goes at when the bench publishes unpaced."""


# -- 1. batched throughput -------------------------------------------------------------------
TABLE_OF_KIND = {
    "gpu": "gpu_samples",
    "host": "host_samples",
    "step": "steps",
    "span": "spans",
    "collective": "collectives",
    "kernel": "kernel_summaries",
}


def _simulated_messages(
    args: argparse.Namespace, run_id: str, now_ns: int
) -> tuple[list[tuple[int, str, str, bytes, int]], dict[str, int]]:
    """Every message of ``--jobs`` simulated jobs (scenario ``--scenario``), in event-time order.

    The jobs ran ``--sim-s`` seconds ending 30 s ago, so their windows can all close. Returns
    ``(first ts, topic, key, value, samples)`` per message and the samples per table.
    """
    from perfloop.producers.scenarios import scenario_config
    from perfloop.producers.simulator import SimulatedJob
    from perfloop.schemas import decode_batch

    class Collect:
        def __init__(self) -> None:
            self.msgs: list[tuple[str, str, bytes]] = []

        def publish(self, topic: str, key: str, value: bytes) -> bool:
            self.msgs.append((topic, key, value))
            return True

    out: list[tuple[int, str, str, bytes, int]] = []
    per_table: dict[str, int] = {}
    t0_ns = now_ns - int((args.sim_s + 30) * NS)
    for j in range(args.jobs):
        cfg = scenario_config(
            args.scenario,
            job_id=f"bench-{run_id}-j{j}",
            nodes=args.nodes,
            ranks_per_node=args.ranks,
            duration_s=args.sim_s,
            seed=j,
            t0_ns=t0_ns,
            speed=1e9,
        )
        sink = Collect()
        SimulatedJob(cfg, sink).run(args.sim_s)
        last = t0_ns
        for topic, key, value in sink.msgs:
            n = 0
            if topic.startswith("perfloop.telemetry.") and not topic.endswith(".job"):
                b = decode_batch(value)
                n = len(b)
                per_table[TABLE_OF_KIND[b.kind]] = per_table.get(TABLE_OF_KIND[b.kind], 0) + n
                last = int(b.columns["ts_ns"][0])
            out.append((last, topic, key, value, n))
    out.sort(key=lambda m: m[0])
    return out, per_table


def _count(ch: Any, sql: str, jobs: list[str]) -> tuple[Any, ...]:
    return tuple(ch.query(sql, parameters={"jobs": jobs}).result_rows[0])


def _stream_crashes(home: Path) -> list[str]:
    """Agent crashes and internal errors the stream worker logged."""
    try:
        lines = (home / "logs" / "streams.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    bad = ("Crashed reason=", "internal error on", "tick failed")
    return [ln.strip()[:400] for ln in lines if any(b in ln for b in bad)]


class _Progress:
    """Polls the warehouse every ``EVERY_S`` while the bench publishes: how many of the samples
    published so far have landed (raw rows of the bench's jobs) and how many step samples the
    closed 1 s windows in the warehouse cover, to show whether the tiers keep up."""

    EVERY_S = 2.0

    def __init__(self, settings: Any, jobs: list[str], tables: list[str], published: Any) -> None:
        self._settings, self._jobs, self._published = settings, jobs, published
        self._sql = (
            "SELECT "
            + " + ".join(
                f"(SELECT count() FROM {t} WHERE job_id IN {{jobs:Array(String)}})" for t in tables
            )
            + ", (SELECT sum(count) FROM windows WHERE job_id IN {jobs:Array(String)} "
            "AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1)"
        )
        self.trace: list[tuple[float, int, int, int]] = []  # (s, published, landed, covered)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-progress", daemon=True)
        self._t0 = 0.0

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._thread.start()

    def _run(self) -> None:
        from perfloop.warehouse import client

        ch = client(self._settings)  # one client per thread
        try:
            while not self._stop.wait(self.EVERY_S):
                published = self._published()
                landed, covered = _count(ch, self._sql, self._jobs)
                now = time.perf_counter() - self._t0
                self.trace.append((now, published, int(landed), int(covered or 0)))
        finally:
            ch.close()

    def stop(self) -> list[tuple[float, int, int, int]]:
        self._stop.set()
        self._thread.join(30)
        return self.trace


def sustained(
    trace: list[tuple[float, int, int, int]],
    sent: list[tuple[float, int, int]],
    publish_s: float,
    warmup_s: float,
) -> dict[str, Any] | None:
    """The rate the windows keep up with while the bench publishes, from `_Progress`'s polls.

    ``sent``: ``(seconds, samples, step samples)`` published so far, after each message. A poll's
    covered step samples mean the windows have taken every sample published up to the message
    that brought the covered-th step sample (messages go out in event-time order, and a job's
    1 s windows close in event-time order). The sustained rate is the slope of those samples
    between the first poll after ``warmup_s`` and the last poll before the last publish; the
    lag is how long before each poll those samples were published. A stack that keeps up has
    the offered rate and a flat lag; one that falls behind, a lower rate and a growing lag.
    """
    if not sent:
        return None
    t_sent = np.array([s[0] for s in sent])
    all_sent = np.array([s[1] for s in sent])
    steps_sent = np.array([s[2] for s in sent])
    polls = [p for p in trace if warmup_s <= p[0] <= publish_s]
    if len(polls) < 2:
        return None
    points = []
    for t, _, _, covered in polls:
        k = int(np.searchsorted(steps_sent, covered, side="left"))
        if k >= len(sent):
            k = len(sent) - 1
        done = int(all_sent[k]) if covered > 0 else 0
        points.append((t, done, t - float(t_sent[k]) if covered > 0 else t))
    (ta, na, lag_a), (tb, nb, lag_b) = points[0], points[-1]
    return {
        "from_s": ta,
        "to_s": tb,
        "samples_per_s": (nb - na) / (tb - ta),
        "lag_s": [round(p[2], 3) for p in points],
        "lag_first_s": lag_a,
        "lag_last_s": lag_b,
    }


def _window_latency(ch: Any, jobs: list[str]) -> dict[str, float]:
    """Seconds from each window's close in the stream worker to its row being inserted."""
    rows = ch.query(
        "SELECT quantiles(0.5, 0.99)(d), max(d) FROM (SELECT "
        "(toUnixTimestamp64Nano(inserted) - toUnixTimestamp64Nano(closed)) / 1e9 AS d "
        "FROM windows WHERE job_id IN {jobs:Array(String)})",
        parameters={"jobs": jobs},
    ).result_rows
    (p50, p99), top = rows[0]
    return {"p50": float(p50), "p99": float(p99), "max": float(top)} if top else {}


def bench_engine(payloads: list[tuple[str, bytes, int]], rate: float) -> dict[str, Any]:
    """The stream tier's pure core (`StreamEngine`) in this process, on the same messages
    (``(topic, value, samples)``), its wall clock going on as the stack's would at ``rate``
    samples/s, so windows close along the way as they do there."""
    from perfloop.settings import StreamsSettings
    from perfloop.streams.engine import StreamEngine

    engine = StreamEngine(StreamsSettings())
    rows = diagnoses = 0
    # As the worker reads them: one partition per topic, each message caught up with only at
    # the topic's last one (so no source counts as silent before its input is read).
    last = {topic: i for i, (topic, _, _) in enumerate(payloads)}
    offsets: dict[str, int] = {}
    wall0 = wall = time.time_ns()
    fed = 0
    t0 = time.perf_counter()
    for i, (topic, data, n) in enumerate(payloads):
        fed += n
        wall = wall0 + int(fed / rate * NS)
        offset = offsets[topic] = offsets.get(topic, -1) + 1
        engine.ingest(topic, data, wall_ns=wall, offset=offset, caught_up=last[topic] == i)
        if i % 20 == 19:
            o = engine.tick(wall)
            rows += o.window_rows
            diagnoses += len(o.diagnoses)
    o = engine.tick(wall + 3600 * NS)
    rows += o.window_rows
    diagnoses += len(o.diagnoses)
    elapsed = time.perf_counter() - t0
    n = engine.stats["samples"]
    say(
        f"  stream core in-process (StreamEngine, no Kafka): {n / elapsed:,.0f} samples/s "
        f"({1e6 * elapsed / n:.2f} µs/sample, {elapsed:.2f} s), {rows:,} window rows, "
        f"{diagnoses} diagnosis events"
    )
    return {
        "samples": n,
        "elapsed_s": elapsed,
        "samples_per_s": n / elapsed,
        "us_per_sample": 1e6 * elapsed / n,
        "window_rows": rows,
        "diagnoses": diagnoses,
    }


def bench_batched(args: argparse.Namespace, settings: Any, home: Path) -> dict[str, Any]:
    from perfloop.producers import Publisher
    from perfloop.schemas.topics import Topics
    from perfloop.settings import StreamsSettings
    from perfloop.warehouse import client

    run_id = uuid.uuid4().hex[:6]
    tg = time.perf_counter()
    msgs, per_table = _simulated_messages(args, run_id, time.time_ns())
    gen_s = time.perf_counter() - tg
    jobs = sorted({m[2] for m in msgs})
    if args.rate and not args.sim_s:
        raise SystemExit("--rate needs --sim-s")
    n_all = sum(per_table.values())
    n_step = per_table.get("steps", 0)
    say(
        f"\n[1] batched: {len(jobs)} simulated jobs ({args.scenario}, {args.nodes} nodes × "
        f"{args.ranks} ranks, {args.sim_s:g} s each): {n_all:,} samples in {len(msgs):,} messages "
        f"(generated beforehand in {gen_s:.1f} s); per table "
        + ", ".join(f"{t} {n:,}" for t, n in sorted(per_table.items()))
    )
    pub = Publisher(settings)
    wire_bytes = published = published_steps = 0
    sent: list[tuple[float, int, int]] = []  # after each message: (seconds, samples, steps)
    watch = _Progress(settings, jobs, list(per_table), lambda: published)
    cpu0 = service_cpu_s(home)
    t0 = time.perf_counter()
    watch.start(t0)
    first_ts = msgs[0][0] if msgs else 0
    for ts, topic, key, value, n in msgs:
        if args.rate:  # paced: no sample leaves before its time at --rate
            ahead = published / args.rate - (time.perf_counter() - t0)
        elif args.live:  # as the jobs ran: event time goes at wall speed, a constant delay
            ahead = (ts - first_ts) / NS - (time.perf_counter() - t0)
        else:
            ahead = 0.0
        if ahead > 0:
            time.sleep(ahead)
        wire_bytes += len(value)
        while not pub.publish(topic, key, value):  # local queue full: wait, do not drop
            pub.flush(1.0)
        published += n
        if topic == Topics.STEP:
            published_steps += n
        sent.append((time.perf_counter() - t0, published, published_steps))
    queued_s = time.perf_counter() - t0
    left = pub.flush(120)
    publish_s = time.perf_counter() - t0
    stats = pub.stats
    say(
        f"  producer: {n_all / publish_s:,.0f} samples/s ({publish_s:.2f} s incl. broker acks; "
        f"{n_all / queued_s:,.0f} samples/s handed to the client"
        + (f", paced at {args.rate:,.0f}" if args.rate else "")
        + (", paced by event time" if args.live else "")
        + f"), {wire_bytes / n_all:.1f} JSON bytes/sample, delivered {stats.delivered}/"
        f"{len(msgs)}, failed {stats.failed}, outstanding {left}"
    )

    ch = client(settings)
    landed: dict[str, float] = {}
    progress: dict[str, Any] = {}
    count_sql = ", ".join(
        f"(SELECT count() FROM {t} WHERE job_id IN {{jobs:Array(String)}})" for t in per_table
    )
    try:

        def all_landed() -> bool:
            got = dict(zip(per_table, _count(ch, f"SELECT {count_sql}", jobs), strict=True))
            now = time.perf_counter() - t0
            for t, n in per_table.items():
                if got[t] >= n and t not in landed:
                    landed[t] = now
            progress["rows"] = sum(got.values())
            return len(landed) == len(per_table)

        ok = wait_for(all_landed, args.land_timeout_s)
        rows_s = max(landed.values()) if ok else math.inf

        def windows_done() -> bool:
            covered, rows, diag = _count(
                ch,
                "SELECT (SELECT sum(count) FROM windows WHERE job_id IN {jobs:Array(String)} "
                "AND metric = 'step_time_ms' AND window_s = 1 AND hop_s = 1), "
                "(SELECT count() FROM windows WHERE job_id IN {jobs:Array(String)}), "
                "(SELECT count() FROM diagnoses WHERE job_id IN {jobs:Array(String)})",
                jobs,
            )
            progress.update(covered=covered, windows=rows, diagnoses=diag)
            progress["at"] = time.perf_counter() - t0
            return covered >= n_step

        wdone = wait_for(windows_done, args.windows_timeout_s, 0.25)
        e2e_s = max(rows_s, progress["at"]) if ok and wdone else math.inf
        trace = watch.stop()
        cpu1 = service_cpu_s(home)
        cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
        cpu["producer"] = stats.cpu_time_s
        say(
            f"  warehouse: {progress['rows']:,}/{n_all:,} raw rows landed "
            f"{rows_s:.2f} s after the first publish; 1 s windows cover "
            f"{progress['covered']:,}/{n_step:,} step samples at {progress['at']:.2f} s "
            f"({progress['windows']:,} window rows, {progress['diagnoses']:,} diagnosis rows)"
        )
        if ok and wdone:
            say(
                f"  → end to end {n_all / e2e_s:,.0f} samples/s (producer → windows → warehouse)"
                f"; done {e2e_s - publish_s:.2f} s after the last publish"
            )
        lag = max((p - r for _, p, r, _ in trace), default=0)
        say(
            f"  keeping up: at most {lag:,} published samples not yet in the warehouse "
            f"(polled every {_Progress.EVERY_S:g} s: "
            + ", ".join(f"{t:.0f} s {p - r:,}" for t, p, r, _ in trace[:: max(1, len(trace) // 8)])
            + ")"
        )
        # The new-job grace holds every window for its first seconds; measure after it.
        held = StreamsSettings().new_job_grace_s
        steady = sustained(trace, sent, publish_s, warmup_s=max(held + 2.0, 0.25 * publish_s))
        if steady:
            say(
                f"  sustained: the 1 s windows in the warehouse took "
                f"{steady['samples_per_s']:,.0f} samples/s from {steady['from_s']:.0f} s to "
                f"{steady['to_s']:.0f} s of publishing; their lag behind the producer "
                f"{steady['lag_first_s']:.1f} s → {steady['lag_last_s']:.1f} s"
            )
        else:
            say("  sustained: publishing too short to measure (needs two polls past the grace)")
        latency = _window_latency(ch, jobs)
        if latency:
            say(
                "  window closed → its row in the warehouse: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in latency.items())
            )
        say(
            "  CPU seconds until then: "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
            + f" (µs/sample: {1e6 * sum(cpu.values()) / n_all:.1f} in all)"
        )
    finally:
        ch.close()
        pub.close()  # before the stack goes down, or its thread reports the broker lost
    crashes = _stream_crashes(home)
    if crashes:
        say(f"  ! the stream worker logged {len(crashes)} errors (streams.log): {crashes[0][:300]}")
    engine = bench_engine([(m[1], m[3], m[4]) for m in msgs], args.rate or E2E_PACE)
    return {
        "stream_errors": crashes,
        "engine_in_process": engine,
        "run_id": run_id,
        "jobs": len(jobs),
        "scenario": args.scenario,
        "nodes_per_job": args.nodes,
        "ranks_per_node": args.ranks,
        "messages": len(msgs),
        "samples": n_all,
        "samples_per_table": per_table,
        "json_bytes_per_sample": wire_bytes / n_all,
        "producer_publish_s": publish_s,
        "producer_samples_per_s": n_all / publish_s,
        "publisher_stats": vars(stats),
        "landed": ok,
        "rows_landed_s": rows_s if ok else None,
        "windows_complete": wdone,
        "windows_done_s": progress.get("at"),
        "window_rows": progress.get("windows"),
        "diagnosis_rows": progress.get("diagnoses"),
        "e2e_s": e2e_s if ok and wdone else None,
        "rate": args.rate or None,
        "live": args.live,
        "done_after_last_publish_s": e2e_s - publish_s if ok and wdone else None,
        "max_unlanded_samples": lag,
        "progress": trace,
        "window_close_to_row_s": latency,
        "cpu_s": cpu,
        "e2e_samples_per_s": n_all / e2e_s if ok and wdone else None,
        "sustained": steady,
    }


# -- 2. naive per-event baseline ---------------------------------------------------------------
def bench_naive(args: argparse.Namespace, settings: Any, home: Path) -> dict[str, Any]:
    from bench.naive_app import TOPIC
    from perfloop.kafka import ensure_topics
    from perfloop.producers import Publisher

    n = args.naive
    say(f"\n[2] naive baseline: {n:,} samples, one JSON message each, per-event Faust agent")
    ensure_topics(settings, [TOPIC])
    status = home / "naive-status.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        PERFLOOP_BENCH_NAIVE_STATUS=str(status),
    )
    log_path = home / "logs" / "bench-naive.log"

    def count() -> tuple[int, int | None]:
        try:
            doc = orjson.loads(status.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return 0, None
        return doc["count"], doc["last_wall_ns"]

    pub = Publisher(settings)
    jobs = [f"naive-j{j}" for j in range(args.jobs)]
    with open(log_path, "ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "bench.naive_app", "worker", "-l", "warn"],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        t_start = time.perf_counter()
        pub.publish(
            TOPIC, jobs[0], orjson.dumps({"job_id": jobs[0], "rank": 0, "step_time_ms": 1.0})
        )
        pub.flush(10)
        if not wait_for(lambda: count()[0] >= 1 or worker.poll() is not None, 90) or (
            worker.poll() is not None
        ):
            raise RuntimeError(f"the naive Faust worker did not start; see {log_path}")
        say(f"  worker ready (warm-up event handled) after {time.perf_counter() - t_start:.1f} s")
        base = count()[0]
        rng = np.random.default_rng(1)
        st = rng.normal(100.0, 2.0, n)
        t0_ns = time.time_ns()
        t0 = time.perf_counter()
        for i in range(n):
            job = jobs[i % len(jobs)]
            doc = {
                "ts_ns": t0_ns + i,
                "job_id": job,
                "node": "node-0",
                "rank": i % args.ranks,
                "step": i,
                "step_time_ms": float(st[i]),
                "data_wait_ms": 5.0,
                "batch_size": 32,
                "num_workers": 8,
            }
            while not pub.publish(TOPIC, job, orjson.dumps(doc)):
                pub.flush(1.0)
        pub.flush(60)
        publish_s = time.perf_counter() - t0
        ok = wait_for(lambda: count()[0] >= base + n, args.naive_timeout_s, 0.1)
        handled, last_ns = count()
        handled -= base
        e2e_s = (last_ns - t0_ns) / NS if last_ns else math.inf
        rate = handled / e2e_s
        say(
            f"  producer {n / publish_s:,.0f} events/s; agent handled {handled:,}/{n:,} events "
            f"in {e2e_s:.2f} s → {rate:,.0f} events/s end to end"
        )
    finally:
        pub.close()
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return {
        "events": n,
        "handled": handled,
        "complete": ok,
        "producer_events_per_s": n / publish_s,
        "e2e_s": e2e_s,
        "events_per_s": rate,
    }


# -- 3. fault onset → ack --------------------------------------------------------------------
def _published_ms(settings: Any, topic: str, event_id: str, timeout_s: float = 15.0) -> int | None:
    """The Kafka timestamp (ms) of the message on ``topic`` carrying ``event_id``."""
    from perfloop.kafka import consumer

    c = consumer(settings, f"bench-{uuid.uuid4().hex[:8]}")
    c.subscribe([topic])
    needle = event_id.encode()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            if needle in (msg.value() or b""):
                return int(msg.timestamp()[1])
    finally:
        c.close()
    return None


def bench_loop(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from perfloop.demo import run_demo
    from perfloop.schemas.topics import Topics
    from perfloop.settings import ActuatorSettings
    from perfloop.warehouse import client

    say(f"\n[3] closed loop: perfloop.demo.run_demo, fault at {args.fault_at_s:g} s of the job")
    key = ActuatorSettings().signing_key.get_secret_value().encode()
    res = run_demo(settings, signing_key=key, fault_at_s=args.fault_at_s, out=sys.stdout)
    wall_end_ns = time.time_ns()
    ch = client(settings)
    try:

        def first_step() -> tuple[int, float] | None:
            rows = ch.query(
                "SELECT toUnixTimestamp64Nano(ts), step_time_ms FROM steps "
                "WHERE job_id = {job:String} AND rank = 0 AND step = 0 LIMIT 1",
                parameters={"job": res.job_id},
            ).result_rows
            return (int(rows[0][0]), float(rows[0][1])) if rows else None

        wait_for(lambda: first_step() is not None, 15)
        first = first_step()
        last_ts = ch.query(
            "SELECT toUnixTimestamp64Nano(max(ts)) FROM steps WHERE job_id = {job:String}",
            parameters={"job": res.job_id},
        ).result_rows[0][0]
    finally:
        ch.close()
    if first is None:
        raise RuntimeError(f"no steps of {res.job_id} reached the warehouse")
    # The simulator stamps step k's end at t0 + the sum of step times 0..k, so step 0 ends at
    # t0 + its step time; the fault starts at t0 + fault_at_s in that same event time.
    sim_t0_ns = first[0] - int(first[1] * 1e6)
    fault_ns = sim_t0_ns + int(args.fault_at_s * NS)
    rec, cmd, ack = res.recommendation, res.command, res.result
    rec_pub_ms = _published_ms(settings, Topics.RECOMMENDATIONS, rec.event_id) if rec else None

    def since_fault(ts_ns: int | None) -> float | None:
        return None if ts_ns is None else (ts_ns - fault_ns) / NS

    out = {
        "job_id": res.job_id,
        "closed": res.closed,
        "fault_at_s": args.fault_at_s,
        "fault_onset_ns": fault_ns,
        "recommendation_window_end_s": since_fault(rec.ts_ns if rec else None),
        "recommendation_published_s": since_fault(rec_pub_ms * 1_000_000 if rec_pub_ms else None),
        "command_s": since_fault(cmd.ts_ns if cmd else None),
        "ack_s": since_fault(ack.ts_ns if ack else None),
        "ack_status": ack.status if ack else None,
        "applied_step": res.applied_step,
        "step_ms_before_median": float(np.median(res.before_ms)) if res.before_ms else None,
        "step_ms_after_median": float(np.median(res.after_ms)) if res.after_ms else None,
        "sim_lag_at_end_s": (wall_end_ns - int(last_ts)) / NS,
    }
    if rec_pub_ms and ack:
        out["recommendation_to_ack_s"] = (ack.ts_ns - rec_pub_ms * 1_000_000) / NS

    def fmt(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f} s"

    say(
        f"  fault onset → recommendation window end {fmt(out['recommendation_window_end_s'])}, "
        f"→ recommendation published {fmt(out['recommendation_published_s'])}, "
        f"→ command {fmt(out['command_s'])}, → {out['ack_status']} ack {fmt(out['ack_s'])}"
    )
    say(
        f"  fast loop (recommendation published → ack): {fmt(out.get('recommendation_to_ack_s'))}"
        f"; loop closed: {res.closed}; step time {out['step_ms_before_median']} → "
        f"{out['step_ms_after_median']} ms (medians); sim clock lag at the end "
        f"{out['sim_lag_at_end_s']:.2f} s"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=8, help="simulated jobs")
    p.add_argument("--nodes", type=int, default=2, help="nodes per job")
    p.add_argument("--ranks", type=int, default=8, help="ranks (GPUs) per node")
    p.add_argument("--sim-s", type=float, default=600.0, help="simulated seconds per job")
    p.add_argument("--scenario", default="mixed", help="simulator scenario of every job")
    p.add_argument(
        "--rate", type=float, default=0.0, help="publish at this many samples/s (0: at once)"
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="publish each message when its job would have (event time at wall speed)",
    )
    p.add_argument("--naive", type=int, default=20_000, help="events for the naive baseline")
    p.add_argument("--fault-at-s", type=float, default=12.0)
    p.add_argument("--land-timeout-s", type=float, default=240.0)
    p.add_argument("--windows-timeout-s", type=float, default=90.0)
    p.add_argument("--windows-stall-s", type=float, default=20.0)
    p.add_argument("--naive-timeout-s", type=float, default=120.0)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--skip-loop", action="store_true")
    args = p.parse_args(argv)
    raise_on_sigterm()
    t0 = time.perf_counter()
    result: dict[str, Any] = {"bench": "e2e", "args": vars(args), "cpus": os.cpu_count()}
    with embedded_stack(say) as home:
        from perfloop.settings import StackSettings

        settings = StackSettings()
        result["batched"] = bench_batched(args, settings, home)
        if not args.skip_naive:
            result["naive"] = bench_naive(args, settings, home)
            batched = result["batched"]["e2e_samples_per_s"]
            if batched:
                result["ratio_batched_over_naive"] = batched / result["naive"]["events_per_s"]
                say(
                    f"  ratio: batched end to end / naive = "
                    f"{result['ratio_batched_over_naive']:.1f}×"
                )
        if not args.skip_loop:
            result["loop"] = bench_loop(args, settings)
    result["wall_s"] = time.perf_counter() - t0
    save_result("e2e", result, note=f" ({result['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
