"""Per-job detector state: recent steps per rank, the latest readings per GPU and per node.

`JobState` takes decoded telemetry batches (vectorised: a handful of numpy operations per
batch) into compact, bounded arrays:

* a ring of the last steps x ranks (`ring_depth` of the job's world: 64 to 512 steps; step
  time, data wait, compute and comm from depth-0 phase spans, comm nested in them, checkpoint
  and eval time, collective time, GPU busy from kernel summaries, memory) and each
  collective's wait (`ArrivalRing`);
* per GPU (node, device): the latest clock, temperature, utilisation, memory, error counters,
  its clock baseline and throttle episodes (`episodes_update`);
* per node: CPU, IO wait and memory, with a CPU-saturation episode;
* per rank: its process and loader CPU, loader workers, job info (threads, CPU budget), its
  latest progress report, whether it ended.

The GPU, host and job-event handlers are `Feeds` (`perfloop.streams.detection._feeds`); the
array specs, `Finding` and `episodes_update` live in `perfloop.streams.detection._state_parts`.

Everything is a dict of numpy arrays or plain numbers, so a snapshot is a copy of it.
A step is *complete* once every rank that reports steps has sent it (and its spans and
collectives when the job publishes them); detectors read complete steps only.

Public through `perfloop.streams.detection`: the funnel keeps one `JobState` per job.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from perfloop.schemas import P2P_OPS
from perfloop.streams._spans import comm_inside_compute
from perfloop.streams.detection._arrival import ArrivalRing
from perfloop.streams.detection._feeds import Feeds
from perfloop.streams.detection._state_parts import (
    _DEV,
    _NODE,
    _RANK,
    _RING,
    COMPUTE_CLASSES,
    COMPUTE_PHASES,
    MEMORY_CLASSES,
    NS,
    POWER_BITS,
    SLOWDOWN_BITS,
    STEPS,
    THERMAL_BITS,
    WAIT_S,
    Finding,
    alloc,
    episodes_update,
    grow,
    ring_depth,
)

__all__ = [
    "COMPUTE_CLASSES",
    "COMPUTE_PHASES",
    "MEMORY_CLASSES",
    "NS",
    "POWER_BITS",
    "SLOWDOWN_BITS",
    "STEPS",
    "THERMAL_BITS",
    "Finding",
    "JobState",
    "episodes_update",
]


class JobState(Feeds):
    """Bounded state of one job, fed batch by batch (see the module docstring)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.declared_world = 0
        self.gpu_mem_bytes = 0.0
        self.gpus = 0  # GPUs per rank, from job info
        self.nodes: list[str] = []
        depth = ring_depth(0)
        self.ring = alloc(_RING, (depth, 0))
        self.arrival = ArrivalRing(depth)  # waits at each collective of a step, per rank
        self.step_no = np.full(depth, -1, dtype=np.int64)
        self.done = np.zeros(depth, dtype=bool)  # evaluated, or dropped as incomplete
        self.usable = np.zeros(depth, dtype=bool)  # complete and evaluated
        self.rank = alloc(_RANK, (0,))
        self.dev = alloc(_DEV, (0,))
        self.dev_lookup: dict[int, np.ndarray] = {}  # node index → device → slot
        self.node = alloc(_NODE, (0,))
        self.flags = {
            "spans": False,
            "comm_spans": False,
            "coll": False,
            "arrivals": False,  # collectives of the job's whole group: lateness per rank
            "kernels": False,
            "throttled": False,  # a GPU reported a slowdown reason once: track episodes
        }
        self.kernel_busy: dict[str, float] = {}
        self.gpu_stats = np.zeros(3)  # busy samples, their SM util sum, their memory util sum
        self.gpu_batches = 0
        self._newest = 0  # newest event time of the batch being folded in
        self.newest_step = -1
        self.last_eval_step = -1
        self.step_ms = 0.0  # the job's recent step time (0: none yet), for `horizon`
        self.watermark_ns = 0
        self.last_step_ns = 0
        self.lag_ns = -1.0
        self.last_wall_ns = 0
        self.clock_ns = 0  # the job's event-time clock (`now`)
        self.ended = False
        self.findings: dict[str, Finding] = {}
        self.det: dict[str, Any] = {}  # detectors' own state (baselines, hysteresis)
        # Input folded in so far (batches and events): the funnel runs the step and device
        # detectors again only when it changed (or their settings did). Not in snapshots: a
        # restored job is evaluated at its first tick.
        self.version = 0
        self.evaluated: tuple[int, Any] | None = None

    def now(self, wall_ns: int) -> int:
        """The job's event-time clock at receive time ``wall_ns`` (never going back): its newest
        event time, moved on by the receive clock less the job's usual transport lag."""
        lag = max(0, int(self.lag_ns))
        self.clock_ns = max(self.clock_ns, self.watermark_ns, wall_ns - lag)
        return self.clock_ns

    # -- shape -------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return int(self.ring["st"].shape[1])

    @property
    def depth(self) -> int:
        """Steps the ring keeps (at most half of it behind the newest is waited for)."""
        return len(self.step_no)

    def horizon(self) -> int:
        """How many steps behind the newest a step, and a rank that reports steps, are waited
        for: `WAIT_S` of the job's steps (its ranks' batches come a publish interval apart),
        at least half of `STEPS`, at most half the ring. Beyond it an incomplete step is given
        up and a silent rank no longer holds the others' steps back."""
        n = int(WAIT_S * 1000.0 / self.step_ms) if self.step_ms > 0 else 0
        return min(self.depth // 2, max(STEPS // 2, n))

    def _ensure_ranks(self, n: int) -> None:
        if n > self.world:
            grow(self.ring, _RING, n, 1)
            grow(self.rank, _RANK, n, 0)
            self.arrival.grow(n)
            if ring_depth(n) < self.depth:
                self._resize(ring_depth(n))

    def _resize(self, depth: int) -> None:
        """A ring of ``depth`` steps holding the newest steps of this one (more ranks came)."""
        keep = np.flatnonzero((self.step_no >= 0) & (self.step_no > self.newest_step - depth))
        to = self.step_no[keep] % depth  # consecutive steps: one slot each
        ring = alloc(_RING, (depth, self.world))
        for k, a in self.ring.items():
            ring[k][to] = a[keep]
        self.ring = ring
        self.arrival = self.arrival.moved(keep, to, depth)
        for k, fill in (("step_no", -1), ("done", False), ("usable", False)):
            old = getattr(self, k)
            new = np.full(depth, fill, dtype=old.dtype)
            new[to] = old[keep]
            setattr(self, k, new)

    def node_index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            self.nodes.append(node)
            grow(self.node, _NODE, len(self.nodes), 0)
            return len(self.nodes) - 1

    # -- steps -------------------------------------------------------------------------------
    def _slots(self, step: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Ring slot of each sample's step, and which samples are recent enough to keep
        (None: all of them)."""
        newest, depth = max(self.newest_step, int(step.max())), self.depth
        ok = None if int(step.min()) > newest - depth else step > newest - depth
        slot = step % depth
        stale = self.step_no[slot] != step
        if ok is not None:
            stale &= ok
        if stale.any():
            rows = slot[stale]
            for k, (_, fill) in _RING.items():
                self.ring[k][rows] = fill
            self.arrival.reset(rows)
            self.step_no[rows] = step[stale]
            self.done[rows] = False
            self.usable[rows] = False
        self.newest_step = newest
        return slot, ok

    _HANDLERS: ClassVar[dict[str, str]] = {
        "step": "_step",
        "span": "_span",
        "collective": "_collective",
        "kernel": "_kernel",
        "gpu": "_gpu",
        "host": "_host",
    }

    def ingest(self, kind: str, node: str, cols: dict[str, np.ndarray], wall_ns: int) -> None:
        """Fold one decoded batch (``Batch.columns``) of ``kind`` from ``node`` in."""
        handler = self._HANDLERS.get(kind)
        ts = cols["ts_ns"]
        if handler is None or not len(ts):
            return
        newest = self._newest = int(ts.max())  # (a span's start: it ends a few ms later)
        if newest > self.watermark_ns:
            self.watermark_ns = newest
        lag = float(wall_ns - newest)
        self.lag_ns = max(0.0, lag if self.lag_ns < 0 else self.lag_ns + 0.1 * (lag - self.lag_ns))
        if wall_ns > self.last_wall_ns:
            self.last_wall_ns = wall_ns
        self.version += 1
        getattr(self, handler)(self.node_index(node), cols)

    def _per_step(
        self, cols: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        rank, step = cols["rank"], cols["step"]
        try:
            self.rank["last_step"][rank] = np.maximum(self.rank["last_step"][rank], step)
        except IndexError:
            self._ensure_ranks(int(rank.max()) + 1)
            self.rank["last_step"][rank] = np.maximum(self.rank["last_step"][rank], step)
        slot, ok = self._slots(step)
        if ok is None:
            return slot, rank, None
        return slot[ok], rank[ok], ok

    def _step(self, node: int, cols: dict[str, np.ndarray]) -> None:
        slot, rank, ok = self._per_step(cols)
        r = self.ring

        def pick(a: np.ndarray) -> np.ndarray:
            return a if ok is None else a[ok]

        st = pick(cols["step_time_ms"])
        r["st"][slot, rank] = st
        if len(st):
            ms = float(np.median(st))
            if ms > 0:
                self.step_ms = ms if self.step_ms <= 0 else self.step_ms + 0.2 * (ms - self.step_ms)
        r["wait"][slot, rank] = pick(cols["data_wait_ms"])
        r["end"][slot, rank] = pick(cols["ts_ns"])
        # the CUDA allocator's figures; 0: not reported (a CPU job: its process's RSS)
        alloc, reserved = cols["mem_allocated_bytes"], cols["mem_reserved_bytes"]
        if alloc.any():
            mem = alloc
        elif reserved.any():
            mem = reserved
        else:
            mem = cols.get("rss_bytes", reserved)
            self.flags["rss"] = bool(mem.any()) or self.flags.get("rss", False)
        r["mem"][slot, rank] = pick(mem)
        r["peak"][slot, rank] = pick(cols["mem_peak_bytes"])
        self.rank["node"][rank] = node
        if "num_workers" in cols:
            self.rank["num_workers"][rank] = pick(cols["num_workers"])
        self.last_step_ns = max(self.last_step_ns, self._newest)

    def _span(self, node: int, cols: dict[str, np.ndarray]) -> None:
        depth, phase = cols["depth"], cols["phase"]
        depth0 = depth == 0
        comp = depth0 & ((phase == "forward") | (phase == "backward") | (phase == "optimizer"))
        is_comm = phase == "comm"
        comm = depth0 & is_comm
        inner = comm_inside_compute(cols)  # DDP's all-reduce in flight inside backward
        aside = depth0 & ((phase == "checkpoint") | (phase == "eval"))
        use = comp | comm | inner | aside
        if not use.any():
            return
        name = cols.get("name")  # point-to-point (a pipeline's sends and receives): by name
        p2p = comm & np.isin(name, P2P_OPS) if name is not None else np.zeros_like(comm)
        sub = {k: cols[k][use] for k in ("rank", "step", "duration_ms")}
        slot, rank, ok = self._per_step(sub)
        dur, c, m, i, a, p = (x[use] for x in (cols["duration_ms"], comp, comm, inner, aside, p2p))
        if ok is not None:
            dur, c, m, i, a, p = dur[ok], c[ok], m[ok], i[ok], a[ok], p[ok]
        r = self.ring
        if c.any():
            self.flags["spans"] = True
            np.add.at(r["compute"], (slot[c], rank[c]), dur[c])
            r["n_compute"][slot[c], rank[c]] = 1
        if m.any():
            self.flags["comm_spans"] = True
            np.add.at(r["comm"], (slot[m], rank[m]), dur[m])
            r["n_comm"][slot[m], rank[m]] = 1
            if p.any():
                np.add.at(r["p2p"], (slot[p], rank[p]), dur[p])
        if i.any():
            self.flags["comm_spans"] = True
            np.add.at(r["incomm"], (slot[i], rank[i]), dur[i])
            r["n_comm"][slot[i], rank[i]] = 1
        if a.any():
            np.add.at(r["aside"], (slot[a], rank[a]), dur[a])

    def _collective(self, node: int, cols: dict[str, np.ndarray]) -> None:
        slot, rank, ok = self._per_step(cols)
        self.flags["coll"] = True
        pick = (lambda a: a) if ok is None else (lambda a: a[ok])
        dur = pick(cols["duration_ms"])
        np.add.at(self.ring["coll"], (slot, rank), dur)
        self.ring["n_coll"][slot, rank] = 1
        # lateness only from collectives of the whole job (a subgroup's ranks meet apart; a
        # send meets its receive, not the k-th op of every rank, and waits out a pipeline's
        # bubble)
        size = pick(cols["group_size"])
        whole = (size == 0) | (size >= max(2, self.declared_world, self.world))
        p2p = np.isin(pick(cols["op"]), P2P_OPS)
        if p2p.any():  # steps that sent or received: a pipeline's (`_detect_steps.pipeline`)
            steps = len(np.unique(pick(cols["step"])[p2p]))
            self.det["p2p_steps"] = self.det.get("p2p_steps", 0) + steps
        whole &= ~p2p
        if whole.any():
            self.flags["arrivals"] = True
            self.arrival.add(slot[whole], rank[whole], pick(cols["ts_ns"])[whole], dur[whole])

    def _kernel(self, node: int, cols: dict[str, np.ndarray]) -> None:
        slot, rank, ok = self._per_step(cols)
        cls, stream, busy = cols["kernel_class"], cols["stream"], cols["busy_ms"]
        if ok is not None:
            cls, stream, busy = cls[ok], stream[ok], busy[ok]
        total = (stream == -1) & (cls == "all")
        if total.any():
            self.flags["kernels"] = True
            self.ring["busy"][slot[total], rank[total]] = busy[total]
        for name in (*COMPUTE_CLASSES, *MEMORY_CLASSES):
            m = ~total & (cls == name)
            if m.any():
                self.kernel_busy[name] = self.kernel_busy.get(name, 0.0) + float(busy[m].sum())

    # -- complete steps ----------------------------------------------------------------------
    def complete_steps(self) -> int:
        """Mark newly complete steps usable; return how many there are since the last call."""
        pending = (self.step_no >= 0) & ~self.done
        if not pending.any() or not self.world:
            return 0
        rows = np.flatnonzero(pending)
        half = self.newest_step - self.horizon()
        need = self.rank["last_step"] > half  # ranks that report
        r = self.ring
        ok = ~np.isnan(r["st"][rows][:, need])
        if self.flags["spans"]:
            ok &= r["n_compute"][rows][:, need] > 0
        if self.flags["coll"]:
            ok &= r["n_coll"][rows][:, need] > 0
        complete = ok.all(axis=1)
        old = self.step_no[rows] <= half
        self.done[rows[complete | old]] = True
        self.usable[rows[complete]] = True
        return int(complete.sum())

    def window(self, n: int) -> dict[str, np.ndarray]:
        """The last ``n`` complete steps in step order: each ring array as (steps, ranks)."""
        rows = np.flatnonzero(self.usable)
        rows = rows[np.argsort(self.step_no[rows], kind="stable")][-n:]
        need = self.rank["last_step"] > self.newest_step - self.horizon()
        out = {k: v[rows] for k, v in self.ring.items()}
        out["step"] = self.step_no[rows]
        out["slot"] = rows
        out["need"] = need
        return out

    # -- snapshots ---------------------------------------------------------------------------
    _ARRAYS = ("ring", "rank", "dev", "node")
    _SCALARS = (
        "job_id",
        "declared_world",
        "gpu_mem_bytes",
        "gpus",
        "newest_step",
        "last_eval_step",
        "step_ms",
        "watermark_ns",
        "last_step_ns",
        "lag_ns",
        "last_wall_ns",
        "clock_ns",
        "gpu_batches",
        "ended",
    )

    def to_state(self) -> dict[str, Any]:
        doc: dict[str, Any] = {k: getattr(self, k) for k in self._SCALARS}
        for k in self._ARRAYS:
            doc[k] = {n: a.copy() for n, a in getattr(self, k).items()}
        doc.update(
            nodes=list(self.nodes),
            step_no=self.step_no.copy(),
            done=self.done.copy(),
            usable=self.usable.copy(),
            dev_lookup={n: a.copy() for n, a in self.dev_lookup.items()},
            flags=dict(self.flags),
            kernel_busy=dict(self.kernel_busy),
            gpu_stats=self.gpu_stats.copy(),
            findings={k: f.to_dict() for k, f in self.findings.items()},
            arrival=self.arrival.to_state(),
            det=_copy(self.det),
        )
        return doc

    @classmethod
    def from_state(cls, doc: dict[str, Any]) -> JobState:
        job = cls(doc["job_id"])
        for k in cls._SCALARS:
            setattr(job, k, doc.get(k, getattr(job, k)))  # (clock_ns is newer than some snapshots)
        for k in cls._ARRAYS:
            setattr(job, k, {n: a.copy() for n, a in doc[k].items()})
        job.nodes = list(doc["nodes"])
        for arrs, spec, shape in (  # arrays newer than the snapshot start empty
            (job.ring, _RING, job.ring["st"].shape),
            (job.rank, _RANK, (len(job.rank["node"]),)),
            (job.node, _NODE, (len(job.nodes),)),
        ):
            for k, (dt, fill) in spec.items():
                arrs.setdefault(k, np.full(shape, fill, dtype=dt))
        job.step_no, job.done, job.usable = (doc[k].copy() for k in ("step_no", "done", "usable"))
        depth = len(job.step_no)  # (64 in snapshots before the depth followed the world)
        job.dev_lookup = {int(n): a.copy() for n, a in doc["dev_lookup"].items()}
        job.flags = dict(doc["flags"])
        job.kernel_busy = dict(doc["kernel_busy"])
        job.gpu_stats = doc["gpu_stats"].copy()
        job.findings = {k: Finding(**f) for k, f in doc["findings"].items()}
        job.arrival = ArrivalRing.from_state(doc.get("arrival"), depth, job.world)
        job.det = _copy(doc["det"])
        return job


def _copy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.copy()
    return x
