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
leave as they are read.

>>> from perfloop.producers.replay import default_job_id
>>> default_job_id("traces/sampled_rank-1.json.gz")
'replay-sampled'
"""

from __future__ import annotations

import bisect
import functools
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
    HostComms,
    ProcessGroups,
    Said,
    combine,
    describe_span,
    said_by_args,
    said_by_kernel_name,
    span_kind,
)
from perfloop.producers._kineto import (
    EVENTS_PREFIX,
    GPU_CATS,
    HOST_CATS,
    LAUNCH_CATS,
    PHASES,
    TraceError,
    is_launch,
    iter_events,
    iter_trace,
    kernel_class,
    kernel_rows,
    phase_of,
    tile_step,
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

_STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
_CONTROL = re.compile(r"[\x00-\x1f]+")
_CLASS_CODE = {c: i for i, c in enumerate(KERNEL_CLASSES)}
_PHASE_CODE = {p: i for i, p in enumerate(PHASES)}
_FLUSH_EVERY = 4096  # samples appended before the emitter hands a batch over
_MAX_SAMPLES = 5000  # per message: 5000 spans with 128-character names stay far below 4 MiB


@dataclass(frozen=True, slots=True)
class Step:
    """One ``ProfilerStep#N`` span of the host timeline, in trace microseconds."""

    number: int
    start_us: float
    end_us: float


@dataclass
class TraceIndex:
    """What the first pass learns: metadata, steps, and the step of every GPU launch.

    ``whole_trace`` is set when the trace has no ``ProfilerStep`` span and was indexed with
    ``whole_trace=True``: one step 0 then spans the whole capture and no `StepEvent` is
    published for it. ``comm_source`` says which events become `CollectiveOp` rows, one kind
    per trace so that no collective counts twice: NCCL/RCCL kernels (``kernel``); else the
    backend's work spans, ``nccl:…``/``gloo:…`` (``annotation``: gloo runs its work on its own
    threads, so those spans hold the real time, the API calls only the enqueueing); else
    ``record_param_comms`` ops that name their collective; else ``c10d::`` ops (``c10d``).
    ``comms`` holds the host-side collective calls (what names and sizes every row) and
    ``comm_corr`` the correlation ids of the comm kernels (to find the call that launched one).
    """

    path: Path
    meta: dict[str, Any]
    steps: list[Step]
    whole_trace: bool
    launch_corr: array  # sorted correlation ids of GPU launches
    launch_step: array  # their step's index in `steps`, -1 outside every step
    comm_source: str
    device: int | None
    events: int
    gpu_events: int
    shift_ns: int = 0  # added to every published time (the CLI moves old traces to now)
    comms: HostComms = field(default_factory=HostComms)
    comm_corr: frozenset[int] = frozenset()

    @functools.cached_property
    def groups(self) -> ProcessGroups:
        """Process-group sizes from ``distributedInfo.pg_config``."""
        return ProcessGroups.of(self.meta.get("distributedInfo"))

    @property
    def rank(self) -> int:
        info = self.meta.get("distributedInfo")
        r = info.get("rank") if isinstance(info, dict) else None
        return r if isinstance(r, int) and 0 <= r <= 1 << 20 else 0

    @property
    def world_size(self) -> int:
        info = self.meta.get("distributedInfo")
        w = info.get("world_size") if isinstance(info, dict) else None
        return w if isinstance(w, int) and w >= 1 else 1

    @property
    def base_ns(self) -> int:
        """Offset of the trace's clock from Unix time (``baseTimeNanoseconds``, new Kineto)."""
        b = self.meta.get("baseTimeNanoseconds")
        return b if isinstance(b, int) and b >= 0 else 0

    @property
    def host(self) -> str | None:
        for key in ("host_name", "hostname"):
            h = self.meta.get(key)
            if isinstance(h, str) and 0 < len(h.strip()) <= 255:
                return h.strip()
        return None

    def ns(self, ts_us: float) -> int:
        """Unix nanoseconds of a trace timestamp (µs as a float; the sub-µs part kept),
        plus ``shift_ns``."""
        whole = int(ts_us)
        return max(0, self.base_ns + self.shift_ns + whole * 1000 + round((ts_us - whole) * 1000))

    @property
    def end_ns(self) -> int:
        """Unix nanoseconds of the last step's end, before any shift."""
        return self.ns(self.steps[-1].end_us) - self.shift_ns

    def step_at(self, ts_us: float) -> int | None:
        """Index of the step whose span holds ``ts_us``, if any."""
        i = bisect.bisect_right(self._starts, ts_us) - 1
        if i >= 0 and ts_us <= self.steps[i].end_us:
            return i
        return None

    def launched_in(self, correlation: Any) -> int | None:
        """Index of the step that launched the GPU activity with this correlation id.

        -1 when it was launched outside every step; ``None`` when no launch has this id
        (the trace lost it: then the caller falls back on the activity's own time).
        """
        if type(correlation) is not int:
            return None
        i = bisect.bisect_left(self.launch_corr, correlation)
        if i < len(self.launch_corr) and self.launch_corr[i] == correlation:
            return int(self.launch_step[i])
        return None

    def __post_init__(self) -> None:
        self._starts = [s.start_us for s in self.steps]


def _num(v: Any) -> float | None:
    if type(v) is float or type(v) is int:
        return float(v)
    return None


def _thread(ev: dict[str, Any]) -> tuple[Any, Any]:
    """The (pid, tid) of an event, as a key (a value of another type is no thread)."""
    pid, tid = ev.get("pid"), ev.get("tid")
    return (
        pid if type(pid) in (int, str) else None,
        tid if type(tid) in (int, str) else None,
    )


def index_trace(path: str | Path, *, whole_trace: bool = False) -> TraceIndex:
    """First pass over a trace: metadata, ``ProfilerStep`` spans, GPU launches by step.

    Raises `TraceError` when the trace cannot be read or has no ``ProfilerStep#N`` span
    (unless ``whole_trace``: then one step 0 spans the capture).
    """
    p = Path(path)
    meta: dict[str, Any] = {}
    steps: dict[int, tuple[float, float]] = {}
    corr = array("q")
    launch_ts = array("d")
    lo, hi = float("inf"), float("-inf")
    events = gpu_events = comm_kernels = 0
    comms = HostComms()
    comm_corr: set[int] = set()
    device: int | None = None
    for ev in iter_trace(p, meta):
        events += 1
        if ev.get("ph") != "X":
            continue
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
        if ts is None:
            continue
        dur = dur if dur is not None and dur >= 0 else 0.0
        lo, hi = min(lo, ts), max(hi, ts + dur)
        cat = ev.get("cat")
        cat = cat.lower() if type(cat) is str else ""
        name = ev.get("name")
        if type(name) is not str:
            continue
        args = ev.get("args")
        args = args if type(args) is dict else {}
        if cat in GPU_CATS:
            gpu_events += 1
            if device is None and type(args.get("device")) is int:
                device = args["device"]
            if cat == "kernel" and kernel_class(name, cat) == "comm":
                comm_kernels += 1
                c = args.get("correlation")
                if type(c) is int:
                    comm_corr.add(c)
        elif cat in LAUNCH_CATS:
            c = args.get("correlation")
            if type(c) is int and is_launch(name):
                corr.append(c)
                launch_ts.append(ts)
        elif cat in HOST_CATS:
            m = _STEP_NAME.match(name)
            if m:
                n = int(m.group(1))
                s0, e0 = steps.get(n, (ts, ts + dur))
                steps[n] = (min(s0, ts), max(e0, ts + dur))  # one step seen on two threads
            elif (kind := span_kind(name, args)) is not None:
                comms.add(_thread(ev), ts, ts + dur, kind, describe_span(kind, name, args))
    ordered = [Step(n, s, e) for n, (s, e) in sorted(steps.items(), key=lambda kv: kv[1])]
    if not ordered:
        if not whole_trace:
            raise TraceError(
                f"{p}: no ProfilerStep#N span in {events} events, so no step to attribute "
                "them to (record with torch.profiler.schedule and call prof.step() each step)"
            )
        if hi < lo:
            raise TraceError(f"{p}: no timed ('X') event in {events} events")
        ordered = [Step(0, lo, hi)]
    comms.close()
    if comm_kernels:
        source = "kernel"
    elif comms.has(BACKEND):
        source = "annotation"
    elif comms.has(PARAMS, named=True):
        source = "record_param_comms"
    else:
        source = "c10d" if comms.has(API) else "none"
    launch_corr, launch_step = _launch_table(ordered, corr, launch_ts)
    return TraceIndex(
        p,
        meta,
        ordered,
        whole_trace=not steps,
        launch_corr=launch_corr,
        launch_step=launch_step,
        comm_source=source,
        device=device,
        events=events,
        gpu_events=gpu_events,
        comms=comms,
        comm_corr=frozenset(comm_corr),
    )


def _launch_table(steps: list[Step], corr: array, ts: array) -> tuple[array, array]:
    """Sorted correlation ids of the launches, and their step's index (-1: outside steps)."""
    if not corr:
        return array("q"), array("i")
    c = np.frombuffer(corr, dtype=np.int64)
    t = np.frombuffer(ts, dtype=np.float64)
    starts = np.array([s.start_us for s in steps])
    ends = np.array([s.end_us for s in steps])
    i = np.searchsorted(starts, t, side="right") - 1
    inside = (i >= 0) & (t <= ends[np.clip(i, 0, None)])
    i = np.where(inside, i, -1)
    order = np.argsort(c, kind="stable")
    out_c, out_i = array("q"), array("i")
    out_c.frombytes(c[order].astype(np.int64).tobytes())
    out_i.frombytes(i[order].astype(np.int32).tobytes())
    return out_c, out_i


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
        ts, dur = _num(ev.get("ts")), _num(ev.get("dur"))
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
            if _STEP_NAME.match(name):
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
                call = idx.comms.at(_thread(ev), ts)
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
