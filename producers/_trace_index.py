"""The first pass of trace replay: a trace's metadata, its steps, and the step of every launch.

Private to `perfloop.producers.replay`, which re-exports `index_trace`, `TraceIndex` and `Step`.
`index_trace` streams a trace once and keeps only what the second pass needs to attribute each
event to its step: the metadata, the ``ProfilerStep#N`` spans, per GPU launch its correlation
id and step (12 bytes), the host spans of each collective call, and the correlation ids of the
comm kernels. It also settles which events become the trace's `CollectiveOp` rows
(`TraceIndex.comm_source`).
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

from perfloop.producers._collectives import (
    API,
    BACKEND,
    PARAMS,
    HostComms,
    ProcessGroups,
    describe_span,
    span_kind,
)
from perfloop.producers._kineto import (
    GPU_CATS,
    HOST_CATS,
    LAUNCH_CATS,
    TraceError,
    is_launch,
    iter_trace,
    kernel_class,
)

__all__ = ["STEP_NAME", "Step", "TraceIndex", "index_trace", "json_number", "thread_of"]

STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")
"""The name of a step's host span; its group is the step's number."""


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


def json_number(v: Any) -> float | None:
    """A JSON number as a float; ``None`` for any other value (a bool too)."""
    if type(v) is float or type(v) is int:
        return float(v)
    return None


def thread_of(ev: dict[str, Any]) -> tuple[Any, Any]:
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
        ts, dur = json_number(ev.get("ts")), json_number(ev.get("dur"))
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
            m = STEP_NAME.match(name)
            if m:
                n = int(m.group(1))
                s0, e0 = steps.get(n, (ts, ts + dur))
                steps[n] = (min(s0, ts), max(e0, ts + dur))  # one step seen on two threads
            elif (kind := span_kind(name, args)) is not None:
                comms.add(thread_of(ev), ts, ts + dur, kind, describe_span(kind, name, args))
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
