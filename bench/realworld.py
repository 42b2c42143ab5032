"""Real jobs, real truth: does perfloop diagnose real multi-process training right, and do its
actions help? (issue 21)

    python bench/realworld.py                        # every scenario, 5 rounds (~75-90 min)
    python bench/realworld.py --quick                # 1 round, short runs, for development
    python bench/realworld.py --runs 3 --scenarios io_loader,straggler_compute --seconds 30
    python bench/realworld.py --list                 # the scenarios

One private embedded stack (its own home under /tmp and free ports, as ``perfloop up``
brings it up) for the whole bench. The scenarios (`bench/realworld_jobs/scenarios.py`) are
real training scripts on CPU that do not import perfloop, single processes or ``torchrun``
jobs over gloo with 2-3 ranks; each writes its own ground truth (kind, culprit ranks, the wall
clock at which its fault really began, every step's end). Each round runs every scenario once
per variant, with a seed of its own (the variants of a round share it):

- ``plain``: the command alone (``python script.py`` / ``torchrun …``), the stack up;
- ``observe``: ``perfloop run --tier observe -- COMMAND`` (detection only);
- ``auto``: ``perfloop run --tier auto -- COMMAND`` (perfloop may change the job).

Fault scenarios run under tier observe; the actionable ones (I/O-bound loader, CPU-bound
loader, thread oversubscription) and the healthy single-process (eager, and compiled with
``torch.compile``) and DDP jobs run plain, observe and auto each round, in an order that
rotates with the round; the other healthy
workloads (checkpoints and eval, gradient accumulation, FSDP, Lightning, Hugging Face) run
observe and auto in turn. What happened is measured as it happened: one Kafka consumer,
assigned at the end of the diagnoses, recommendations, control and actuations topics before
the first job starts, records each event's arrival (wall clock) and its Kafka timestamp; the
warehouse is read at the end for the record (diagnoses, actuations with their evidence, steps).

Definitions (per scenario, over all its runs under perfloop, observe and auto alike):

- **counted diagnoses**: every diagnosis opened for the job (a distinct ``diagnosis_id`` with
  an ``open`` message on ``perfloop.diagnoses`` or an ``open`` row in ``diagnoses``), whenever
  it arrives during the bench, less the kinds the scenario lists as follow-ons (``oom`` after
  a memory leak: true, but not the diagnosis under test), and less ``cpu_saturation`` that
  arrives while the machine's CPUs were at least 90 % busy over the 10 s before it, by
  anything (the job itself, the stack, other users of a shared machine; measured by the bench
  from ``/proc/stat`` every second): such a diagnosis is true of the machine, and is reported
  apart. A ``cpu_saturation`` on a machine less busy counts.
- **ranks of a diagnosis**: its ``ranks``; if empty, its ``rank``; if that is -1 (the whole
  job), every rank of the job.
- **match**: a counted diagnosis whose ``bottleneck`` is the truth's kind **and** whose ranks
  are exactly the truth's culprit ranks, that arrives after the fault began (one that
  arrives before the onset was not true when it was made), and whose own ``onset`` is at
  most 3 s before the true one (one that dates the problem earlier was about something else
  that happened to match).
- **precision**: matches / counted diagnoses. **recall**: runs with at least one match / runs
  whose fault began (a run that ended before its onset is left out, and counted).
- **detection latency**: the first match's arrival on the consumer (wall) − the onset the
  script took when its fault began (``time.time_ns()`` in the faulty process); for faults of
  the job itself (loader, threads) the onset is its first step. Median over runs with a match.
- **false diagnoses on healthy runs**: every counted diagnosis of a healthy scenario.
- **steps/s of the second half**: rank 0's step ends (the script's own clock) in the second
  half of its training time, over that half's length: the same measure with and without
  perfloop. Ratios are per round (same seed), auto / plain and observe / plain; reported as
  the median of the per-round ratios.
- **kept change slower than 3 %**: a ``kept`` verdict whose own evidence (``ratio``, median
  step time after / before) exceeds 1.03, or whose step times in the warehouse (the acking
  rank's 30 steps before the change against the 30 after the verifier's 2 settling steps, up
  to the next change) do.
- **recommendations for an ended job**: recommendations for the job arriving more than 10 s
  after its command exited.
- **time to OOM** (scenarios that end out of memory; reported, no target): the first matching
  diagnosis's ``time_to_oom_s`` against the time from its arrival to the end of the rank's
  last step.

Targets (issue 21), each printed PASS or FAIL: precision and recall ≥ 0.9 and median latency
≤ 10 s per fault scenario; 0 false diagnoses per healthy scenario; auto / plain ≥ 2× (I/O
loader), ≥ 1.5× (CPU loader, threads); no kept change slower than 3 %; healthy runs: no change
applied, observe / plain and auto / plain ≥ 0.98; ≥ 5 runs per scenario. Results in
``bench/results/realworld-<time>.json`` (every run with its truth and the loop's timeline: each
diagnosis, recommendation, decision, command and ack with its arrival), each job's output in
``bench/results/realworld-<time>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/realworld.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, embedded_stack, free_port, raise_on_sigterm, save_result, say
from bench.realworld_jobs.scenarios import SCENARIOS, Scenario, perfloop_run

NS = 1_000_000_000
LATE_S = 10.0  # a recommendation this long after the job's end is for an ended job
SLOWER = 1.03  # a kept change with a median step-time ratio above this was slower
BUSY = 0.9  # the machine's CPUs this busy: a cpu_saturation diagnosis is true of it
ONSET_SLACK_S = 3.0  # a match may place the fault's start this much before it really began


@dataclass
class Run:
    """One run of one scenario: what was launched and what its ground truth says."""

    scenario: str
    variant: str
    round: int
    seed: int
    job_id: str
    cmd: list[str]
    drawn: dict[str, Any]
    log: str
    exit_code: int | None = None
    timed_out: bool = False
    t_start_ns: int = 0
    t_end_ns: int = 0
    truth: dict[str, Any] = field(default_factory=dict)
    rate_2nd_half: float | None = None


class Follower:
    """Records every diagnosis, recommendation, command and actuation as it is published:
    ``events[job_id]`` holds ``(arrival_ns, kafka_ts_ns, event)``."""

    def __init__(self, settings: Any) -> None:
        from perfloop.kafka import consumer
        from perfloop.schemas.topics import Topics

        self.topics = [Topics.DIAGNOSES, Topics.RECOMMENDATIONS, Topics.CONTROL, Topics.ACTUATIONS]
        # half a second of fetch wait: a consumer polling every 50 ms costs the embedded
        # broker a noticeable share of a core, which the jobs measured here would pay
        self._c = consumer(
            settings, f"realworld-{uuid.uuid4().hex[:8]}", **{"fetch.wait.max.ms": 500}
        )
        self.events: dict[str, list[tuple[int, int, Any]]] = {}
        self.undecodable = 0
        self._stop, self._assigned = threading.Event(), threading.Event()
        self._t = threading.Thread(target=self._loop, name="realworld-follow", daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        self._t.start()
        if not self._assigned.wait(timeout_s):
            raise RuntimeError("the follower could not reach the broker's topics")

    def stop(self) -> None:
        self._stop.set()
        self._t.join(15)

    def _loop(self) -> None:
        from perfloop.kafka import tail
        from perfloop.schemas import SchemaError, decode_event

        try:
            tail(self._c, self.topics, self._stop, self._assigned)
            while not self._stop.is_set():
                msg = self._c.poll(0.2)
                if msg is None or msg.error():
                    continue
                now = time.time_ns()
                try:
                    ev = decode_event(msg.value() or b"")
                except SchemaError:
                    self.undecodable += 1
                    continue
                job = (msg.key() or b"").decode(errors="replace")
                self.events.setdefault(job, []).append((now, msg.timestamp()[1] * 1_000_000, ev))
        finally:
            self._c.close()


class HostLoad:
    """How busy the machine's CPUs were, second by second (``/proc/stat``: everything but
    idle and iowait, the time a hypervisor gave to others included), while the bench runs."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int, int]] = []  # (wall ns, busy ticks, total ticks)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="realworld-load", daemon=True)

    @staticmethod
    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v) - v[3] - v[4], sum(v)

    def start(self) -> None:
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time_ns(), *self.ticks()))
            self._stop.wait(1.0)

    def busy(self, t_ns: int, before_s: float = 10.0) -> float:
        """The busy share of all CPUs over the ``before_s`` seconds before ``t_ns``."""
        window = [x for x in self.samples if t_ns - before_s * NS <= x[0] <= t_ns]
        if len(window) < 2:
            return 0.0
        (_, b0, t0), (_, b1, t1) = window[0], window[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def mean(self, t0_ns: int, t1_ns: int) -> float:
        return self.busy(t1_ns, (t1_ns - t0_ns) / NS)


# -- running ------------------------------------------------------------------------------------


def job_env(variant: str) -> dict[str, str]:
    """The job's environment: this process's (the bench stack's PERFLOOP_* included under
    perfloop), offline Hugging Face, and no inherited thread counts (torch's defaults)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if variant == "plain":
        env = {k: v for k, v in env.items() if not k.startswith("PERFLOOP_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def read_truth(folder: Path) -> dict[str, Any]:
    """The run's ground truth, merged over its processes' files (rank 0's step clock; the
    earliest onset any process took)."""
    docs = []
    for p in sorted(folder.glob("rank*.json")):
        try:
            docs.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    if not docs:
        return {}
    r0 = next((d for d in docs if d["rank"] == 0), docs[0])
    onsets = [d["onset_ns"] for d in docs if d.get("onset_ns")]
    return {
        "scenario": r0["scenario"],
        "kind": r0["kind"],
        "ranks": r0["ranks"],
        "node": r0["node"],
        "world": max(d["world"] for d in docs),
        "onset_ns": min(onsets) if onsets else None,
        "start_ns": r0["start_ns"],
        "end_ns": r0["end_ns"],
        "steps": len(r0["step_ms"]),
        "step_ms": r0["step_ms"],
        "exits": {str(d["rank"]): d["exit"] for d in docs},
        "params": {str(d["rank"]): d["params"] for d in docs},
    }


def second_half_rate(step_ms: list[float]) -> float | None:
    """Steps/s over the second half of the training time (step ends in ms from its start).

    >>> second_half_rate([100.0 * i for i in range(1, 11)])
    10.0
    """
    if len(step_ms) < 4:
        return None
    end = step_ms[-1]
    n = sum(1 for t in step_ms if t > end / 2)
    return n / (end / 2 / 1000)


def launch(run: Run, timeout_s: float) -> None:
    """Run the command to its end (SIGTERM after ``timeout_s``, SIGKILL 20 s later); then
    kill whatever it started that is still alive (torchrun starts each rank in a session of
    its own, and a rank its CPU burner): only processes seen descending from the command."""
    seen: dict[int, str] = {}  # pid → its start time (a pid reused later is not ours)
    with open(run.log, "w") as out:
        run.t_start_ns = time.time_ns()
        proc = subprocess.Popen(
            run.cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=job_env(run.variant),
            start_new_session=True,
        )
        deadline, signalled = time.monotonic() + timeout_s, False
        while run.exit_code is None:
            try:
                run.exit_code = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                seen |= descendants(proc.pid)
                if time.monotonic() > deadline + 20:
                    os.killpg(proc.pid, signal.SIGKILL)
                elif time.monotonic() > deadline and not signalled:
                    run.timed_out = signalled = True
                    os.killpg(proc.pid, signal.SIGTERM)  # perfloop run forwards it
        run.t_end_ns = time.time_ns()
    now = _processes()
    for pid, started in seen.items():
        if pid in now and now[pid][1] == started and now[pid][2] != "Z":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid → (parent pid, start time, state) of every process, from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d.name)] = (int(f[1]), f[19], f[0])
    return out


def descendants(root: int) -> dict[int, str]:
    """The processes under ``root`` now (pid → start time)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = procs[pid][1]
        todo += children.get(pid, [])
    return out


def plan_runs(scenarios: list[Scenario], rounds: int) -> list[tuple[int, Scenario, str]]:
    """(round, scenario, variant) in the order they run."""
    plan = []
    for r in range(rounds):
        for s in scenarios:
            if s.rotate:
                plan.append((r, s, s.variants[r % len(s.variants)]))
                continue
            k = r % len(s.variants)
            plan += [(r, s, v) for v in (*s.variants[k:], *s.variants[:k])]
    return plan


# -- reading the record ---------------------------------------------------------------------------


def warehouse_record(settings: Any, runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Per perfloop job: opened diagnoses, actuations (with evidence) and steps per rank."""
    from perfloop.warehouse import client

    jobs = [r.job_id for r in runs if r.variant != "plain"]
    out: dict[str, dict[str, Any]] = {
        j: {"diagnoses": [], "actuations": [], "steps": {}} for j in jobs
    }
    ch = client(settings, timeout_s=120)
    try:
        q = ch.query(
            "SELECT job_id, diagnosis_id, bottleneck, ranks, rank, toUnixTimestamp64Nano(ts), "
            "summary, toUnixTimestamp64Nano(onset) FROM diagnoses "
            "WHERE job_id IN {jobs:Array(String)} AND state = 'open'",
            parameters={"jobs": jobs},
        )
        for job, did, kind, ranks, rank, ts, summary, onset in q.result_rows:
            out[job]["diagnoses"].append(
                {
                    "id": did,
                    "bottleneck": kind,
                    "ranks": list(ranks),
                    "rank": rank,
                    "ts_ns": ts,
                    "onset_ns": onset,
                    "summary": summary,
                }
            )
        q = ch.query(
            "SELECT job_id, command_id, status, knob, value, step, rank, reason, evidence, "
            "toUnixTimestamp64Nano(ts) FROM actuations WHERE job_id IN {jobs:Array(String)} "
            "ORDER BY ts",
            parameters={"jobs": jobs},
        )
        for job, cid, status, knob, value, step, rank, reason, ev, ts in q.result_rows:
            out[job]["actuations"].append(
                {
                    "command_id": cid,
                    "status": status,
                    "knob": knob,
                    "value": value,
                    "step": step,
                    "rank": rank,
                    "reason": reason,
                    "evidence": dict(ev),
                    "ts_ns": ts,
                }
            )
        q = ch.query(
            "SELECT job_id, rank, groupArray((step, step_time_ms)) FROM "
            "(SELECT job_id, rank, step, step_time_ms FROM steps "
            "WHERE job_id IN {jobs:Array(String)} ORDER BY step) GROUP BY job_id, rank",
            parameters={"jobs": jobs},
        )
        for job, rank, pairs in q.result_rows:
            out[job]["steps"][rank] = [(int(s), float(ms)) for s, ms in pairs]
    finally:
        ch.close()
    return out


def rank_set(d: dict[str, Any], world: int) -> set[int]:
    """The ranks a diagnosis names (see the module docstring).

    >>> rank_set({"ranks": [], "rank": -1}, 2), rank_set({"ranks": [1], "rank": -1}, 2)
    ({0, 1}, {1})
    """
    if d["ranks"]:
        return set(d["ranks"])
    return {d["rank"]} if d["rank"] >= 0 else set(range(world))


def opened(run: Run, events: list[tuple[int, int, Any]], record: dict[str, Any]) -> list[dict]:
    """The diagnoses opened for the job: from the consumer (with arrival) and the warehouse."""
    from perfloop.schemas import Diagnosis

    seen: dict[str, dict[str, Any]] = {}
    for arrival, kts, ev in events:
        if isinstance(ev, Diagnosis) and ev.state == "open" and ev.diagnosis_id not in seen:
            seen[ev.diagnosis_id] = {
                "id": ev.diagnosis_id,
                "bottleneck": ev.bottleneck,
                "ranks": list(ev.ranks),
                "rank": ev.rank,
                "ts_ns": ev.ts_ns,
                "onset_ns": ev.onset_ns,
                "arrival_ns": arrival,
                "published_ns": kts,
                "summary": ev.summary,
                "evidence": dict(ev.evidence),
            }
    for d in record.get("diagnoses", []):
        if d["id"] not in seen:
            seen[d["id"]] = d | {"arrival_ns": None, "published_ns": None}
    return sorted(seen.values(), key=lambda d: d["arrival_ns"] or d["ts_ns"])


def judge(run: Run, scen: Scenario, diags: list[dict[str, Any]], load: HostLoad) -> dict[str, Any]:
    """Matches, false diagnoses and the detection latency of one run under perfloop."""
    t = run.truth
    world = t.get("world") or max(1, run.drawn.get("nproc") or 1)
    machine = [d for d in diags if d["bottleneck"] == "cpu_saturation"
               and load.busy(d["arrival_ns"] or d["ts_ns"]) >= BUSY]  # fmt: skip
    counted = [d for d in diags if d["bottleneck"] not in scen.follow_on and d not in machine]
    out: dict[str, Any] = {
        "counted": len(counted),
        "matches": 0,
        "false": [],
        "latency_s": None,
        "fault_began": bool(t.get("onset_ns")) or scen.healthy,
        "machine_cpu_saturation": len(machine),
    }
    truth_ranks = set(t.get("ranks") or [])
    onset = t.get("onset_ns")
    first: int | None = None
    first_d: dict[str, Any] | None = None
    for d in counted:
        when = d["arrival_ns"] or d["ts_ns"]
        right = (
            not scen.healthy
            and onset is not None
            and d["bottleneck"] == scen.kind
            and rank_set(d, world) == truth_ranks
            and when >= onset
            and d["onset_ns"] >= onset - ONSET_SLACK_S * NS
        )
        if right:
            out["matches"] += 1
            if d["arrival_ns"] is not None and (first is None or d["arrival_ns"] < first):
                first, first_d = d["arrival_ns"], d
        else:
            out["false"].append(f"{d['bottleneck']}{sorted(rank_set(d, world))}")
    if first is not None and onset is not None:
        out["latency_s"] = (first - onset) / NS
    tto = (first_d or {}).get("evidence", {}).get("time_to_oom_s")
    if first is not None and tto is not None and t.get("end_ns"):
        # the first diagnosis's time to OOM against when the rank's last step ended (its
        # next allocation failed)
        out["oom_predicted_s"], out["oom_actual_s"] = tto, (t["end_ns"] - first) / NS
    return out


def kept_changes(run: Run, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every kept change of the run, with the verdict's evidence and the warehouse's own
    before/after medians of the acking rank's step times."""
    acts = record.get("actuations", [])
    applied = {(a["command_id"]): a for a in acts if a["status"] == "applied"}
    out = []
    for a in acts:
        if a["status"] != "kept":
            continue
        ap = applied.get(a["command_id"])
        row = {
            "job_id": run.job_id,
            "knob": a["knob"],
            "value": a["value"],
            "rank": a["rank"],
            "reason": a["reason"],
            "evidence": a["evidence"],
            "verdict_ratio": a["evidence"].get("ratio"),
        }
        steps = record.get("steps", {}).get(a["rank"], [])
        if ap is not None and steps:
            s0 = ap["step"]
            later = [
                x["step"]
                for x in acts
                if x["status"] == "applied" and x["rank"] == a["rank"] and x["step"] > s0
            ]
            stop = min(later, default=1 << 62)
            before = [ms for s, ms in steps if s0 - 30 <= s < s0]
            after = [ms for s, ms in steps if s0 + 2 < s <= min(s0 + 32, stop - 1)]
            if len(before) >= 5 and len(after) >= 5:
                row["warehouse_ratio"] = statistics.median(after) / statistics.median(before)
                row["warehouse_n"] = [len(before), len(after)]
        worst = max(row.get("verdict_ratio") or 0.0, row.get("warehouse_ratio") or 0.0)
        row["slower_than_3pct"] = worst > SLOWER
        out.append(row)
    return out


# -- scoring and the report -------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _pair_ratios(runs: list[Run], num: str, den: str) -> list[float]:
    by = {(r.round, r.variant): r.rate_2nd_half for r in runs}
    return [
        by[(k, num)] / by[(k, den)]
        for k in sorted({r.round for r in runs})
        if by.get((k, num)) and by.get((k, den))
    ]


def score(
    scen: Scenario, runs: list[Run], follower: Follower, wh: dict, load: HostLoad
) -> dict[str, Any]:
    """The scenario's figures (see the module docstring for the definitions)."""
    from perfloop.schemas import Recommendation

    traced = [r for r in runs if r.variant != "plain"]
    s: dict[str, Any] = {
        "scenario": scen.name,
        "kind": scen.kind,
        "runs": dict(Counter(r.variant for r in runs)),
        "exits": dict(Counter(str(r.exit_code) for r in runs)),
        "timed_out": sum(r.timed_out for r in runs),
        "did_not_start": [r.job_id for r in runs if not r.truth.get("start_ns")],
    }
    judged, kept, applied, late = [], [], [], []
    for r in traced:
        ev = follower.events.get(r.job_id, [])
        rec = wh.get(r.job_id, {})
        j = judge(r, scen, opened(r, ev, rec), load)
        j["job_id"], j["variant"] = r.job_id, r.variant
        judged.append(j)
        kept += kept_changes(r, rec)
        applied += [a for a in rec.get("actuations", []) if a["status"] == "applied"]
        late += [
            (arr - r.t_end_ns) / NS
            for arr, _, e in ev
            if isinstance(e, Recommendation) and arr > r.t_end_ns + LATE_S * NS
        ]
    s["per_run"] = judged
    if scen.healthy:
        s["false_diagnoses"] = sum(j["counted"] for j in judged)
        s["false_kinds"] = dict(Counter(f for j in judged for f in j["false"]))
        s["changes_applied"] = len(applied)
        s["changes_applied_knobs"] = dict(Counter(f"{a['knob']}={a['value']}" for a in applied))
    else:
        began = [j for j in judged if j["fault_began"]]
        counted = sum(j["counted"] for j in began)
        matches = sum(j["matches"] for j in began)
        s["fault_not_reached"] = len(judged) - len(began)
        s["precision"] = matches / counted if counted else None
        s["precision_n"] = [matches, counted]
        s["recall"] = sum(j["matches"] > 0 for j in began) / len(began) if began else None
        s["recall_n"] = [sum(j["matches"] > 0 for j in began), len(began)]
        lat = [j["latency_s"] for j in began if j["latency_s"] is not None]
        s["latency_s_median"], s["latencies_s"] = _median(lat), [round(x, 2) for x in lat]
        oom = [(j["oom_predicted_s"], j["oom_actual_s"]) for j in began if "oom_predicted_s" in j]
        if oom:
            s["time_to_oom_s"] = [[round(p, 1), round(a, 1)] for p, a in oom]
        s["false_kinds"] = dict(Counter(f for j in began for f in j["false"]))
    rates = {
        v: [r.rate_2nd_half for r in runs if r.variant == v and r.rate_2nd_half]
        for v in scen.variants
    }
    s["steps_per_s_2nd_half_median"] = {v: _median(x) for v, x in rates.items()}
    if "plain" in scen.variants:
        for v in ("observe", "auto"):
            pairs = _pair_ratios(runs, v, "plain")
            s[f"{v}_over_plain"] = _median(pairs)
            s[f"{v}_over_plain_pairs"] = [round(x, 3) for x in pairs]
    s["kept_changes"] = kept
    s["recommendations_after_end"] = len(late)
    s["machine_cpu_saturation"] = sum(j["machine_cpu_saturation"] for j in judged)
    s["machine_busy_median"] = _median([load.mean(r.t_start_ns, r.t_end_ns) for r in runs])
    return s


def targets(scores: dict[str, dict[str, Any]], runs_per: dict[str, int]) -> list[tuple]:
    """(target, figure, PASS/FAIL) lines."""
    out: list[tuple[str, str, bool]] = []

    def add(name: str, value: float | None, ok: bool, fmt: str = "{:.2f}") -> None:
        out.append((name, "n/a" if value is None else fmt.format(value), ok))

    for name, s in scores.items():
        scen = SCENARIOS[name]
        add(f"{name}: runs ≥ 5", runs_per[name], runs_per[name] >= 5, "{:.0f}")
        if scen.healthy:
            add(
                f"{name}: false diagnoses = 0",
                s["false_diagnoses"],
                s["false_diagnoses"] == 0,
                "{:.0f}",
            )
            add(
                f"{name}: changes applied = 0",
                s["changes_applied"],
                s["changes_applied"] == 0,
                "{:.0f}",
            )
            for v in ("observe", "auto"):
                x = s.get(f"{v}_over_plain")
                if f"{v}_over_plain" in s:
                    add(f"{name}: {v} / plain ≥ 0.98", x, x is not None and x >= 0.98, "{:.3f}")
        else:
            p, r, lat = s["precision"], s["recall"], s["latency_s_median"]
            add(f"{name}: precision ≥ 0.9", p, p is not None and p >= 0.9)
            add(f"{name}: recall ≥ 0.9", r, r is not None and r >= 0.9)
            add(f"{name}: median latency ≤ 10 s", lat, lat is not None and lat <= 10.0, "{:.1f}")
        if scen.actionable:
            x = s.get("auto_over_plain")
            add(
                f"{name}: auto / plain ≥ {scen.target_speedup:g}×",
                x,
                x is not None and x >= (scen.target_speedup or 0),
            )
    slow = [k for s in scores.values() for k in s["kept_changes"] if k["slower_than_3pct"]]
    add("no kept change slower than 3 %", len(slow), not slow, "{:.0f} slower")
    return out


def timeline(run: Run, events: list[tuple[int, int, Any]]) -> list[str]:
    """What the loop said about the run, one line per event: seconds after the command
    started (arrival), then what it was."""
    from perfloop.schemas import ActuationResult, Command, Decision, Diagnosis, Recommendation

    out = []
    for arrival, _, e in events:
        if isinstance(e, Diagnosis):
            what = f"diagnosis {e.state} {e.bottleneck}{sorted(e.ranks)}: {e.summary[:160]}"
        elif isinstance(e, Recommendation):
            what = f"recommend {e.knob} {e.from_value} → {e.to_value}: {e.rationale[:160]}"
        elif isinstance(e, Decision):
            what = f"actuator {e.outcome} {e.knob} → {e.to_value}: {e.reason[:160]}"
        elif isinstance(e, Command):
            what = f"command {e.knob} = {e.value}"
        elif isinstance(e, ActuationResult):
            what = f"job {e.status} {e.knob} = {e.value} at step {e.step}: {e.reason[:160]}"
        else:
            what = type(e).__name__
        out.append(f"{(arrival - run.t_start_ns) / NS:7.2f} s  {what}")
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def report(scores: dict[str, dict[str, Any]], lines: list[tuple]) -> str:
    """The tables: one block per scenario, a summary table (markdown), the targets."""
    out = []
    for name, s in scores.items():
        scen = SCENARIOS[name]
        runs = ", ".join(f"{v} {n}" for v, n in s["runs"].items())
        out.append(
            f"\n== {name} ({scen.kind}): {scen.description}\n   runs: {runs}; exit "
            f"codes {s['exits']}{'; timed out ' + str(s['timed_out']) if s['timed_out'] else ''}"
        )
        if s["did_not_start"]:
            out.append(f"   did not start (see their logs): {s['did_not_start']}")
        if scen.healthy:
            out.append(
                f"   false diagnoses: {s['false_diagnoses']} {s['false_kinds'] or ''}; "
                f"changes applied: {s['changes_applied']} "
                f"{s['changes_applied_knobs'] or ''}"
            )
        else:
            out.append(
                f"   precision {_f(s['precision'])} ({s['precision_n'][0]}/"
                f"{s['precision_n'][1]}), recall {_f(s['recall'])} ({s['recall_n'][0]}/"
                f"{s['recall_n'][1]} runs), median latency "
                f"{_f(s['latency_s_median'], '{:.1f} s')} {s['latencies_s']}; "
                f"fault not reached: {s['fault_not_reached']}"
            )
            if s["false_kinds"]:
                out.append(f"   not matching: {s['false_kinds']}")
            if s.get("time_to_oom_s"):
                out.append(
                    "   time to OOM at the first diagnosis, [predicted, came] s: "
                    f"{s['time_to_oom_s']}"
                )
        med = s["steps_per_s_2nd_half_median"]
        line = "   steps/s (2nd half, median): " + ", ".join(f"{v} {_f(x)}" for v, x in med.items())
        for v in ("observe", "auto"):
            if f"{v}_over_plain" in s:
                pairs = s[f"{v}_over_plain_pairs"]
                line += f"; {v}/plain {_f(s[f'{v}_over_plain'], '{:.3f}')}× {pairs}"
        out.append(line)
        for k in s["kept_changes"]:
            out.append(
                f"   kept {k['knob']}={k['value']} (rank {k['rank']})"
                f"{' SLOWER' if k['slower_than_3pct'] else ''}: "
                f"verdict ratio {_f(k['verdict_ratio'], '{:.3f}')}, p "
                f"{_f(k['evidence'].get('p_value'), '{:.3g}')}, warehouse "
                f"{_f(k.get('warehouse_ratio'), '{:.3f}')} — {k['reason'][:120]}"
            )
        out.append(
            f"   machine CPUs busy (median over runs): {_f(s['machine_busy_median'], '{:.0%}')}; "
            f"cpu_saturation while ≥ {BUSY:.0%} busy (true of the machine, not counted): "
            f"{s['machine_cpu_saturation']}"
        )
        if s["recommendations_after_end"]:
            out.append(
                f"   recommendations > {LATE_S:g} s after the job ended: "
                f"{s['recommendations_after_end']}"
            )
    out.append(
        "\n| scenario | runs | precision | recall | median latency | false (healthy) "
        "| changes (healthy) | observe/plain | auto/plain | kept >3 % slower |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in scores.items():
        healthy = SCENARIOS[name].healthy
        out.append(
            "| "
            + " | ".join(
                [
                    name,
                    str(sum(s["runs"].values())),
                    "–" if healthy else _f(s["precision"]),
                    "–" if healthy else _f(s["recall"]),
                    "–" if healthy else _f(s["latency_s_median"], "{:.1f} s"),
                    str(s["false_diagnoses"]) if healthy else "–",
                    str(s["changes_applied"]) if healthy else "–",
                    _f(s.get("observe_over_plain"), "{:.3f}×"),
                    _f(s.get("auto_over_plain"), "{:.2f}×"),
                    str(sum(k["slower_than_3pct"] for k in s["kept_changes"])),
                ]
            )
            + " |"
        )
    out.append("")
    out += [f"{'PASS' if ok else 'FAIL'}  {name}: {fig}" for name, fig, ok in lines]
    passed = sum(ok for *_, ok in lines)
    out.append(f"\n{passed} of {len(lines)} targets met")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="rounds: each scenario's runs (default 5)")
    p.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    p.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        help="training time of every run not ended by its fault (default: each "
        "scenario's own, 25-40 s)",
    )
    p.add_argument("--quick", action="store_true", help="1 round of 20 s runs (development)")
    p.add_argument("--seed", type=int, default=1, help="first seed")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause between runs")
    p.add_argument("--linger-s", type=float, default=30.0, help="keep following after the last")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = p.parse_args(argv)
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:22s} {s.kind:24s} {'/'.join(s.variants):18s} {s.description}")
        return 0
    if args.quick:
        args.runs, args.seconds = 1 if args.runs == 5 else args.runs, args.seconds or 20.0
    names = [n for n in args.scenarios.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; valid: {', '.join(SCENARIOS)}")
    scenarios = [SCENARIOS[n] for n in names]
    raise_on_sigterm()
    # never another engineer's stack: free ports unless given
    os.environ.setdefault("PERFLOOP_BENCH_KAFKA_PORT", str(free_port()))
    os.environ.setdefault("PERFLOOP_BENCH_CLICKHOUSE_PORT", str(free_port()))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    logs = RESULTS / f"realworld-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    plan = plan_runs(scenarios, args.runs)
    say(
        f"{len(plan)} runs of {len(scenarios)} scenarios, {args.runs} round(s); job output in "
        f"{logs.relative_to(RESULTS.parent.parent)}"
    )
    runs: list[Run] = []
    from perfloop.settings import StackSettings

    with embedded_stack(say) as home:
        settings = StackSettings()
        follower = Follower(settings)
        follower.start()
        load = HostLoad()
        load.start()
        for i, (rnd, scen, variant) in enumerate(plan):
            seed = args.seed + 1000 * rnd + list(SCENARIOS).index(scen.name)
            job = f"rw-{scen.name}-{variant}-r{rnd}-{uuid.uuid4().hex[:6]}"
            truth_dir = home / "truth" / job
            cmd, drawn = scen.command(
                seed=seed,
                seconds=args.seconds or scen.seconds,
                truth_dir=truth_dir,
                python=sys.executable,
            )
            if variant != "plain":
                cmd = perfloop_run(sys.executable, job, variant, cmd)
            run = Run(scen.name, variant, rnd, seed, job, cmd, drawn, str(logs / f"{job}.log"))
            launch(run, timeout_s=drawn["seconds"] + 150)
            run.truth = read_truth(truth_dir)
            run.rate_2nd_half = second_half_rate(run.truth.get("step_ms", []))
            runs.append(run)
            say(
                f"[{i + 1}/{len(plan)}] {job}: exit {run.exit_code}"
                f"{' (timed out)' if run.timed_out else ''}, {run.truth.get('steps', 0)} steps, "
                f"2nd half {_f(run.rate_2nd_half)} steps/s, "
                f"{len(follower.events.get(job, []))} loop "
                f"events so far ({time.perf_counter() - t0:.0f} s)"
            )
            time.sleep(args.settle_s)
        say(f"following {args.linger_s:g} s more (late diagnoses and recommendations)")
        time.sleep(args.linger_s)
        follower.stop()
        wh = warehouse_record(settings, runs)
    by_scen = {s.name: [r for r in runs if r.scenario == s.name] for s in scenarios}
    load.stop()
    scores = {n: score(SCENARIOS[n], rs, follower, wh, load) for n, rs in by_scen.items()}
    lines = targets(scores, {n: len({r.round for r in rs}) for n, rs in by_scen.items()})
    text = report(scores, lines)
    print(text, flush=True)
    result = {
        "bench": "realworld",
        "args": vars(args),
        "cpus": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
        "scores": scores,
        "targets": [{"target": n, "figure": f, "pass": ok} for n, f, ok in lines],
        "runs": [
            asdict(r)
            | {
                "truth": {k: v for k, v in r.truth.items() if k != "step_ms"},
                "loop": timeline(r, follower.events.get(r.job_id, [])),
            }
            for r in runs
        ],
        "undecodable_events": follower.undecodable,
        "report": text,
    }
    save_result("realworld", result, note=f" ({result['wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
