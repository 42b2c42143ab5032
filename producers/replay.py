"""Trace import: replay PyTorch-profiler (Kineto) traces as perfloop telemetry.

`replay_trace` reads one trace file per rank (``perfloop replay [--job-id ID] [--node N]
TRACE…``, `perfloop.cli.replay`) (``.json``
or ``.json.gz``, any Kineto schema version, events in any order) and publishes, per
``ProfilerStep#N`` span of the trace:

- a `StepEvent` (``step=N``, ``ts_ns`` = the step's end, ``step_time_ms``, ``data_wait_ms``);
- `PhaseSpan` rows: depth 0 tiles the step with the phases its host spans mark (data wait,
  forward, backward, comm, optimizer …; time nothing marks is phase ``user`` named ``other``),
  depth 1 is every user annotation (``record_function``) as it was recorded;
- `KernelSummary` rows: GPU busy time (union of intervals, overlaps once) and activity counts
  per stream and kernel class, per class over all streams (``stream=-1``), and the step's GPU
  busy time (``stream=-1``, ``kernel_class="all"``);
- `CollectiveOp` rows: one per NCCL/RCCL kernel (or, in a trace without comm kernels, per
  backend work span, ``record_param_comms`` or ``c10d::`` op), named, sized and grouped from
  every event of its call: the kernel's own arguments and name, and the host spans of the call
  that launched it (see `perfloop.producers._collectives`);
- and once per trace a `JobInfo` (world size, backend, GPU name and count).

Memory stays bounded by the steps, not the file: a first streaming pass keeps only the
metadata, the ``ProfilerStep`` spans, per GPU launch its correlation id and step (12 bytes),
and the few host spans of each collective call; the second pass attributes each event to its
step — a GPU activity to the step that *launched* it (the GPU may run tens of milliseconds
behind the host), a host event to the step whose span holds its start — and keeps per step
only GPU intervals (25 bytes each) and the few host spans that mark a phase, and the comm
kernels until the end (each is joined to the call whose thread launched it). Depth-1 spans
leave as they are read. The first pass, `index_trace` and the `TraceIndex` it returns, lives in
`perfloop.producers._trace_index` and is re-exported here; the second pass and the rows it
publishes are here.

>>> from perfloop.producers.replay import default_job_id
>>> default_job_id("traces/sampled_rank-1.json.gz")
'replay-sampled'
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perfloop.deprecation import moved
from perfloop.producers._collectives import (
    API,
    BACKEND,
    PARAMS,
    Collective,
    Said,
    combine,
    said_by_args,
    said_by_kernel_name,
)
from perfloop.producers._kineto import (
    EVENTS_PREFIX,
    GPU_CATS,
    HOST_CATS,
    LAUNCH_CATS,
    PHASES,
    TraceError,
    iter_events,
    kernel_class,
    kernel_rows,
    phase_of,
    tile_step,
)
from perfloop.producers._trace_index import (
    STEP_NAME,
    Step,
    TraceIndex,
    index_trace,
    json_number,
    thread_of,
)
from perfloop.producers.emitter import Emitter, Sends
from perfloop.schemas import JobInfo
from perfloop.schemas.telemetry import KERNEL_CLASSES

__all__ = [
    "ReplayResult",
    "Step",
    "TraceError",
    "TraceIndex",
    "default_job_id",
    "index_trace",
    "replay_trace",
]

__getattr__ = moved(__name__, {"replay_command": "perfloop.cli.replay"})

_CONTROL = re.compile(r"[\x00-\x1f]+")
_CLASS_CODE = {c: i for i, c in enumerate(KERNEL_CLASSES)}
_PHASE_CODE = {p: i for i, p in enumerate(PHASES)}
_FLUSH_EVERY = 4096  # samples appended before the emitter hands a batch over
_MAX_SAMPLES = 5000  # per message: 5000 spans with 128-character names stay far below 4 MiB


class _StepState:
    """What one step keeps until the end of the second pass: GPU intervals, phase marks."""

    __slots__ = ("g_cls", "g_end", "g_start", "g_stream", "m_end", "m_phase", "m_start")

    def __init__(self) -> None:
        self.g_start, self.g_end = array("d"), array("d")
        self.g_stream, self.g_cls = array("q"), array("b")
        self.m_start, self.m_end, self.m_phase = array("d"), array("d"), array("b")


@dataclass
class ReplayResult:
    """What one trace published."""

    path: Path
    job_id: str
    node: str
    rank: int
    steps: int = 0
    spans: int = 0
    kernel_rows: int = 0
    collectives: int = 0
    gpu_events: int = 0
    unattributed_gpu_events: int = 0
    whole_trace: bool = False
    comm_source: str = "none"
    messages: int = 0
    step_numbers: list[int] = field(default_factory=list)


def _clean(name: str) -> str:
    return _CONTROL.sub(" ", name).strip()[:128]


def replay_trace(
    path: str | Path,
    publisher: Sends,
    *,
    job_id: str,
    node: str | None = None,
    whole_trace: bool = False,
    index: TraceIndex | None = None,
) -> ReplayResult:
    """Replay one trace file (one rank) through ``publisher``; return what was published.

    ``node`` defaults to the trace's ``host_name``, else ``"replay"``. Raises `TraceError`
    for a trace that cannot be replayed; nothing of it has been published then, except when
    the file breaks off in the middle of the second pass (it was read whole once before).
    """
    idx = index or index_trace(path, whole_trace=whole_trace)
    node = node or idx.host or "replay"
    rank = idx.rank
    em = Emitter(
        publisher, job_id=job_id, node=node, producer_id="replay", max_samples=_MAX_SAMPLES
    )
    res = ReplayResult(
        idx.path, job_id, node, rank, whole_trace=idx.whole_trace, comm_source=idx.comm_source
    )
    em.event(_job_info(idx, job_id, node))
    states: list[_StepState | None] = [None] * len(idx.steps)
    pending = 0

    def state(i: int) -> _StepState:
        s = states[i]
        if s is None:
            s = states[i] = _StepState()
        return s

    steps = idx.steps
    source = idx.comm_source
    comm_corr = idx.comm_corr
    launched: dict[int, int] = {}  # a comm kernel's correlation id -> the call that launched it
    kernels: list[_Kernel] = []
    for ev in iter_events(idx.path, idx.meta[EVENTS_PREFIX]):
        if ev.get("ph") != "X":
            continue
        ts, dur = json_number(ev.get("ts")), json_number(ev.get("dur"))
        name = ev.get("name")
        if ts is None or type(name) is not str:
            continue
        dur = dur if dur is not None and dur >= 0 else 0.0
        cat = ev.get("cat")
        cat = cat.lower() if type(cat) is str else ""
        args = ev.get("args")
        args = args if type(args) is dict else {}
        if cat in GPU_CATS:
            res.gpu_events += 1
            i = idx.launched_in(args.get("correlation"))
            if i is None:
                i = idx.step_at(ts)
            if i is None or i < 0:
                res.unattributed_gpu_events += 1
                continue
            cls = kernel_class(name, cat)
            stream = args.get("stream", ev.get("tid"))
            st = state(i)
            st.g_start.append(ts)
            st.g_end.append(ts + dur)
            st.g_stream.append(stream if type(stream) is int and stream >= 0 else 0)
            st.g_cls.append(_CLASS_CODE[cls])
            if cls == "comm" and source == "kernel" and cat == "kernel":
                kernels.append(_Kernel(i, ts, ts + dur, name, args))
        elif cat in HOST_CATS:
            if STEP_NAME.match(name):
                continue
            i = idx.step_at(ts)
            if i is None:
                continue
            phase = phase_of(name)
            if phase is not None:
                st = state(i)
                st.m_start.append(ts)
                st.m_end.append(ts + dur)
                st.m_phase.append(_PHASE_CODE[phase])
            if cat == "user_annotation" and (label := _clean(name)):
                em.add(
                    "span",
                    ts_ns=idx.ns(ts),
                    rank=rank,
                    step=steps[i].number,
                    phase=phase or "user",
                    name=label,
                    duration_ms=dur / 1000.0,
                    depth=1,
                )
                res.spans += 1
                pending += 1
        elif comm_corr and cat in LAUNCH_CATS:
            c = args.get("correlation")
            if type(c) is int and c in comm_corr:
                call = idx.comms.at(thread_of(ev), ts)
                if call is not None:
                    launched[c] = call
        if pending >= _FLUSH_EVERY:
            em.flush()
            pending = 0
    pending += _emit_collectives(em, idx, kernels, launched, res)
    for i, step in enumerate(steps):
        pending += _emit_step(em, idx, step, states[i], rank, res)
        states[i] = None
        if pending >= _FLUSH_EVERY:
            em.flush()
            pending = 0
    em.close()
    res.messages = em.messages
    return res


def _job_info(idx: TraceIndex, job_id: str, node: str) -> JobInfo:
    info = idx.meta.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    props = idx.meta.get("deviceProperties")
    props = [d for d in props if isinstance(d, dict)] if isinstance(props, list) else []
    mine = next((d for d in props if d.get("id") == idx.device), props[0] if props else {})
    name, mem = mine.get("name"), mine.get("totalGlobalMem")
    backend = info.get("backend")
    extra = {"source": "trace_replay", "trace": idx.path.name[:256]}
    if idx.whole_trace:
        extra["steps"] = "whole trace (no ProfilerStep spans)"
    if idx.shift_ns:
        extra["time_shift_ns"] = str(idx.shift_ns)
        extra["trace_start_unix_ns"] = str(idx.ns(idx.steps[0].start_us) - idx.shift_ns)
    if isinstance(idx.meta.get("schemaVersion"), int):
        extra["kineto_schema_version"] = str(idx.meta["schemaVersion"])
    return JobInfo(
        ts_ns=idx.ns(idx.steps[0].start_us),
        job_id=job_id,
        node=node,
        rank=idx.rank,
        world_size=idx.world_size,
        backend=backend[:256] if isinstance(backend, str) else "",
        gpu_name=name[:256] if isinstance(name, str) else "",
        gpu_count=len(props),
        gpu_mem_bytes=mem if isinstance(mem, int) and mem >= 0 else 0,
        framework="pytorch",
        extra=extra,
    )


@dataclass(frozen=True, slots=True)
class _Kernel:
    """A comm kernel of the second pass: its step's index, times, name and arguments."""

    step: int
    start: float
    end: float
    name: str
    args: dict[str, Any]


_HOST_SOURCES = {"annotation": BACKEND, "record_param_comms": PARAMS, "c10d": API}


def _emit_collectives(
    em: Emitter,
    idx: TraceIndex,
    kernels: list[_Kernel],
    launched: dict[int, int],
    res: ReplayResult,
) -> int:
    """Publish the trace's collectives, in time order; return how many.

    From comm kernels: the kernels one call launched make one collective, from the first's
    start to the last's end, described by the call's host spans (API op and
    ``record_param_comms`` first), the kernel's own arguments, the call's backend span and last
    the kernel's name; a kernel no call launched by its own arguments and name. From host
    spans: one collective per call with a span of the trace's source kind, timed by those spans.
    """
    rows: list[tuple[int, float, float, Collective]] = []
    calls = idx.comms.calls
    if idx.comm_source == "kernel":
        by_call: dict[int, list[_Kernel]] = {}
        for k in kernels:
            c = k.args.get("correlation")
            call = launched.get(c) if type(c) is int else None
            if call is None:
                parts = [said_by_args(k.args), said_by_kernel_name(k.name)]
                rows.append((k.step, k.start, k.end, combine(parts, idx.groups)))
            else:
                by_call.setdefault(call, []).append(k)
        for call, ks in by_call.items():
            first = min(ks, key=lambda k: k.start)
            own: list[Said] = [said_by_args(first.args)]
            parts = [*calls[call].parts(after_params=own), said_by_kernel_name(first.name)]
            end = max(k.end for k in ks)
            rows.append((first.step, first.start, end, combine(parts, idx.groups)))
    elif (kind := _HOST_SOURCES.get(idx.comm_source)) is not None:
        for call in calls:
            if not call.has(kind, named=kind == PARAMS):
                continue
            start, end = call.extent(kind)
            i = idx.step_at(start)
            if i is not None:
                rows.append((i, start, end, combine(call.parts(), idx.groups)))
    if not rows:
        return 0
    rows.sort(key=lambda r: r[1])
    em.extend(
        "collective",
        ts_ns=[idx.ns(start) for _, start, _, _ in rows],
        rank=[idx.rank] * len(rows),
        step=[idx.steps[i].number for i, _, _, _ in rows],
        op=[c.op for _, _, _, c in rows],
        size_bytes=[c.size_bytes for _, _, _, c in rows],
        group=[c.group for _, _, _, c in rows],
        group_size=[c.group_size for _, _, _, c in rows],
        duration_ms=[(end - start) / 1000.0 for _, start, end, _ in rows],
        dtype=[c.dtype for _, _, _, c in rows],
    )
    res.collectives += len(rows)
    return len(rows)


def _emit_step(
    em: Emitter, idx: TraceIndex, step: Step, st: _StepState | None, rank: int, res: ReplayResult
) -> int:
    """Publish a step's event, its depth-0 phase tiling and its kernel summaries."""
    added = 0
    empty = _StepState()
    st = st or empty
    tiles = tile_step(
        step.start_us,
        step.end_us,
        np.frombuffer(st.m_start, dtype=np.float64),
        np.frombuffer(st.m_end, dtype=np.float64),
        np.frombuffer(st.m_phase, dtype=np.int8),
    )
    data_wait_us = sum(e - s for s, e, phase, _ in tiles if phase == "data_wait")
    if not idx.whole_trace and step.end_us > step.start_us:
        em.add(
            "step",
            ts_ns=idx.ns(step.end_us),
            rank=rank,
            step=step.number,
            step_time_ms=(step.end_us - step.start_us) / 1000.0,
            data_wait_ms=data_wait_us / 1000.0,
        )
        res.steps += 1
        res.step_numbers.append(step.number)
        added += 1
    if tiles:
        em.extend(
            "span",
            ts_ns=[idx.ns(s) for s, _, _, _ in tiles],
            rank=[rank] * len(tiles),
            step=[step.number] * len(tiles),
            phase=[phase for _, _, phase, _ in tiles],
            name=[name for _, _, _, name in tiles],
            duration_ms=[(e - s) / 1000.0 for s, e, _, _ in tiles],
            depth=[0] * len(tiles),
        )
        res.spans += len(tiles)
        added += len(tiles)
    if idx.gpu_events:
        rows = kernel_rows(
            np.frombuffer(st.g_start, dtype=np.float64),
            np.frombuffer(st.g_end, dtype=np.float64),
            np.frombuffer(st.g_stream, dtype=np.int64),
            np.frombuffer(st.g_cls, dtype=np.int8),
        )
        em.extend(
            "kernel",
            ts_ns=[idx.ns(step.start_us)] * len(rows),
            rank=[rank] * len(rows),
            step=[step.number] * len(rows),
            stream=[r[0] for r in rows],
            kernel_class=[r[1] for r in rows],
            count=[r[2] for r in rows],
            busy_ms=[r[3] / 1000.0 for r in rows],
        )
        res.kernel_rows += len(rows)
        added += len(rows)
    return added


# --- the command line -------------------------------------------------------------------------

_SUFFIXES = (".gz", ".json", ".trace", ".pt")
_RANK_MARK = re.compile(r"[_.-]?rank[_-]?\d+", re.IGNORECASE)


def default_job_id(path: str | Path) -> str:
    """A job id from a trace's file name: its stem without extensions and rank marker.

    >>> default_job_id("rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz")
    'replay-Apr_03_18_51_38.1102'
    >>> default_job_id("/tmp/rank0.json")
    'replay-trace'
    """
    name = Path(path).name
    changed = True
    while changed:
        changed = False
        for suffix in _SUFFIXES:
            if name.lower().endswith(suffix) and len(name) > len(suffix):
                name, changed = name[: -len(suffix)], True
    name = _RANK_MARK.sub("", name)
    name = re.sub(r"[^A-Za-z0-9._:/@+-]+", "_", name).strip("._-") or "trace"
    return f"replay-{name}"[:128]
