"""Per-job detector state: recent steps per rank, the latest readings per GPU and per node.

`JobState` takes decoded telemetry batches (vectorised: a handful of numpy operations per
batch) into compact, bounded arrays:

* a ring of the last `STEPS` steps x ranks (step time, data wait, compute and comm from
  depth-0 phase spans, collective time, GPU busy from kernel summaries, memory);
* per GPU (node, device): the latest clock, temperature, utilisation, memory, error counters,
  its clock baseline and throttle episodes (`episodes_update`);
* per node: CPU and IO wait, with a CPU-saturation episode.

Everything is a dict of numpy arrays or plain numbers, so a snapshot is a copy of it.
A step is *complete* once every rank that reports steps has sent it (and its spans and
collectives when the job publishes them); detectors read complete steps only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np

from perfloop.schemas.job import PROGRESS_PHASES, JobInfo, JobLifecycle, RankProgress
from perfloop.streams._detect_arrival import ArrivalRing

__all__ = [
    "STEPS",
    "Finding",
    "JobState",
    "episodes_update",
]

STEPS = 64  # steps kept per rank (the ring)
NS = 1_000_000_000

THERMAL_BITS = 0x20 | 0x40  # NVML SwThermalSlowdown | HwThermalSlowdown
POWER_BITS = 0x4 | 0x80  # NVML SwPowerCap | HwPowerBrakeSlowdown
SLOWDOWN_BITS = THERMAL_BITS | POWER_BITS | 0x8  # | HwSlowdown
COMPUTE_PHASES = ("forward", "backward", "optimizer")

_RING: dict[str, tuple[Any, Any]] = {  # name: (dtype, fill)
    "st": (np.float64, np.nan),  # step time, ms
    "wait": (np.float64, np.nan),  # data wait, ms
    "end": (np.int64, 0),  # step end, event time
    "mem": (np.float64, np.nan),  # allocated (else reserved) bytes at step end
    "peak": (np.float64, np.nan),
    "compute": (np.float64, 0.0),  # forward + backward + optimizer spans, ms
    "n_compute": (np.int8, 0),  # 1: spans of this kind arrived
    "comm": (np.float64, 0.0),  # comm spans, ms
    "n_comm": (np.int8, 0),
    "coll": (np.float64, 0.0),  # collectives, ms
    "n_coll": (np.int8, 0),
    "aside": (np.float64, 0.0),  # checkpoint and eval spans (depth 0): not compute, ms
    "incomm": (np.float64, 0.0),  # comm spans inside forward/backward/optimizer (depth 1), ms
    "busy": (np.float64, np.nan),  # GPU busy (kernel summary stream -1), ms
}
_RANK: dict[str, tuple[Any, Any]] = {
    "node": (np.int64, -1),
    "last_step": (np.int64, -1),
    "proc_cpu": (np.float64, np.nan),
    # host samples: loader workers, their CPU (100 = one core; smoothed) and memory
    "loader_workers": (np.float64, np.nan),
    "loader_cpu": (np.float64, np.nan),
    "loader_rss": (np.float64, np.nan),
    # job info: intra-op threads, the CPUs the rank may use, whether the script set threads
    "threads": (np.float64, np.nan),
    "budget": (np.float64, np.nan),
    "by_script": (np.int8, 0),
    # the rank's latest RankProgress: when, its step, phase (`PROGRESS_PHASES` index), since
    "p_ts": (np.int64, 0),
    "p_step": (np.int64, -1),
    "p_phase": (np.int64, -1),
    "p_since": (np.int64, 0),
    "ended": (np.int8, 0),  # its lifecycle says it finished, failed or was killed
}
_EPISODE = {"start": (np.int64, 0), "on": (np.int64, 0), "off": (np.int64, 0)}
_DEV: dict[str, tuple[Any, Any]] = {
    "node": (np.int64, -1),
    "device": (np.int64, -1),
    "rank": (np.int64, -1),
    "ts": (np.int64, 0),
    "clock": (np.float64, np.nan),
    "base": (np.float64, 0.0),  # highest unthrottled SM clock seen
    "temp": (np.float64, np.nan),
    "util": (np.float64, np.nan),  # mean SM util of the latest batch
    "reasons": (np.int64, 0),
    "mem_total": (np.float64, 0.0),
    "dbe": (np.int64, np.iinfo(np.int64).max),  # latest ECC DBE count; max: none seen yet
    "xid": (np.int64, 0),
    "last_xid": (np.int64, 0),
    "err_ns": (np.int64, 0),
    **{f"th_{k}": v for k, v in _EPISODE.items()},
    **{f"pw_{k}": v for k, v in _EPISODE.items()},
}
_NODE: dict[str, tuple[Any, Any]] = {
    "cpu": (np.float64, np.nan),
    "iowait": (np.float64, np.nan),
    "mem_used": (np.float64, np.nan),
    "mem_total": (np.float64, np.nan),
    "ts": (np.int64, 0),
    **{f"cpu_{k}": v for k, v in _EPISODE.items()},
}
MEMORY_CLASSES = ("elementwise", "reduction", "norm", "memcpy", "memset")
COMPUTE_CLASSES = ("gemm", "conv", "attention")


@dataclass
class Finding:
    """One condition a detector holds active now (the funnel turns it into a diagnosis)."""

    key: str
    bottleneck: str
    onset_ns: int
    step_share: float
    confidence: float
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    rank: int = -1
    step: int = 0
    evidence: dict[str, float] = field(default_factory=dict)
    summary: str = ""
    mark: str = ""  # what, when it changes, is worth an update at once (not after update_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _alloc(spec: dict[str, tuple[Any, Any]], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {k: np.full(shape, fill, dtype=dt) for k, (dt, fill) in spec.items()}


def _grow(arrs: dict[str, np.ndarray], spec: dict[str, tuple[Any, Any]], n: int, axis: int) -> None:
    for k, (dt, fill) in spec.items():
        a = arrs[k]
        if a.shape[axis] >= n:
            continue
        pad = list(a.shape)
        pad[axis] = n - a.shape[axis]
        arrs[k] = np.concatenate([a, np.full(pad, fill, dtype=dt)], axis=axis)


def episodes_update(
    arrs: dict[str, np.ndarray], prefix: str, idx: np.ndarray, ts: np.ndarray, on: np.ndarray
) -> None:
    """Fold samples into per-slot episodes: ``<prefix>start`` is the first "on" sample after
    the latest "off" one (0: none), ``<prefix>on`` / ``<prefix>off`` the latest of each.

    An episode is unbroken "on" samples; callers open on its length and resolve on how long
    "off" has lasted, so a flickering signal keeps an open episode but cannot open a new one.

    >>> a = {"x_start": np.zeros(1, np.int64), "x_on": np.zeros(1, np.int64),
    ...      "x_off": np.zeros(1, np.int64)}
    >>> episodes_update(a, "x_", np.zeros(4, np.int64), np.array([1, 2, 3, 4]),
    ...                 np.array([False, True, True, True]))
    >>> int(a["x_start"][0]), int(a["x_on"][0]), int(a["x_off"][0])
    (2, 4, 1)
    """
    start, last_on, last_off = arrs[prefix + "start"], arrs[prefix + "on"], arrs[prefix + "off"]
    off = ~on
    if off.any():
        np.maximum.at(last_off, idx[off], ts[off])
    if on.any():
        np.maximum.at(last_on, idx[on], ts[on])
        after = on & (ts > last_off[idx])
        cand = np.full(len(start), np.iinfo(np.int64).max)
        np.minimum.at(cand, idx[after], ts[after])
        keep = start > last_off
        start[:] = np.where(keep, start, np.where(cand < np.iinfo(np.int64).max, cand, 0))
    else:
        start[start <= last_off] = 0


class JobState:
    """Bounded state of one job, fed batch by batch (see the module docstring)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.declared_world = 0
        self.gpu_mem_bytes = 0.0
        self.gpus = 0  # GPUs per rank, from job info
        self.nodes: list[str] = []
        self.ring = _alloc(_RING, (STEPS, 0))
        self.arrival = ArrivalRing(STEPS)  # waits at each collective of a step, per rank
        self.step_no = np.full(STEPS, -1, dtype=np.int64)
        self.done = np.zeros(STEPS, dtype=bool)  # evaluated, or dropped as incomplete
        self.usable = np.zeros(STEPS, dtype=bool)  # complete and evaluated
        self.rank = _alloc(_RANK, (0,))
        self.dev = _alloc(_DEV, (0,))
        self.dev_lookup: dict[int, np.ndarray] = {}  # node index → device → slot
        self.node = _alloc(_NODE, (0,))
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

    def _ensure_ranks(self, n: int) -> None:
        if n > self.world:
            _grow(self.ring, _RING, n, 1)
            _grow(self.rank, _RANK, n, 0)
            self.arrival.grow(n)

    def node_index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            self.nodes.append(node)
            _grow(self.node, _NODE, len(self.nodes), 0)
            return len(self.nodes) - 1

    def _dev_slots(self, node: int, device: np.ndarray, rank: np.ndarray) -> np.ndarray:
        lut = self.dev_lookup.get(node)
        try:
            slot = lut[device]  # type: ignore[index]
        except (IndexError, TypeError):  # a device beyond the table (or the node's first)
            old = lut if lut is not None else np.full(0, -1, dtype=np.int64)
            top = int(device.max()) + 1
            lut = np.concatenate([old, np.full(max(0, top - len(old)), -1, dtype=np.int64)])
            self.dev_lookup[node] = lut
            slot = lut[device]
        if (slot < 0).any():
            new = np.unique(device[slot < 0])
            first = len(self.dev["node"])
            _grow(self.dev, _DEV, first + len(new), 0)
            lut[new] = np.arange(first, first + len(new))  # type: ignore[index]
            self.dev["node"][first:] = node
            self.dev["device"][first:] = new
            slot = lut[device]  # type: ignore[index]
        self.dev["rank"][slot] = rank
        return slot

    # -- steps -------------------------------------------------------------------------------
    def _slots(self, step: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Ring slot of each sample's step, and which samples are recent enough to keep
        (None: all of them)."""
        newest = max(self.newest_step, int(step.max()))
        ok = None if int(step.min()) > newest - STEPS else step > newest - STEPS
        slot = step % STEPS
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

        r["st"][slot, rank] = pick(cols["step_time_ms"])
        r["wait"][slot, rank] = pick(cols["data_wait_ms"])
        r["end"][slot, rank] = pick(cols["ts_ns"])
        alloc = cols["mem_allocated_bytes"]  # 0: not reported (then the reserved figure)
        r["mem"][slot, rank] = pick(alloc if alloc.any() else cols["mem_reserved_bytes"])
        r["peak"][slot, rank] = pick(cols["mem_peak_bytes"])
        self.rank["node"][rank] = node
        self.last_step_ns = max(self.last_step_ns, self._newest)

    def _span(self, node: int, cols: dict[str, np.ndarray]) -> None:
        depth, phase = cols["depth"], cols["phase"]
        depth0 = depth == 0
        comp = depth0 & ((phase == "forward") | (phase == "backward") | (phase == "optimizer"))
        is_comm = phase == "comm"
        comm = depth0 & is_comm
        inner = (depth == 1) & is_comm  # DDP's all-reduce in flight inside backward
        aside = depth0 & ((phase == "checkpoint") | (phase == "eval"))
        use = comp | comm | inner | aside
        if not use.any():
            return
        sub = {k: cols[k][use] for k in ("rank", "step", "duration_ms")}
        slot, rank, ok = self._per_step(sub)
        dur, c, m, i, a = sub["duration_ms"], comp[use], comm[use], inner[use], aside[use]
        if ok is not None:
            dur, c, m, i, a = dur[ok], c[ok], m[ok], i[ok], a[ok]
        r = self.ring
        if c.any():
            self.flags["spans"] = True
            np.add.at(r["compute"], (slot[c], rank[c]), dur[c])
            r["n_compute"][slot[c], rank[c]] = 1
        if m.any():
            self.flags["comm_spans"] = True
            np.add.at(r["comm"], (slot[m], rank[m]), dur[m])
            r["n_comm"][slot[m], rank[m]] = 1
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
        # lateness only from collectives of the whole job (a subgroup's ranks meet apart)
        size = pick(cols["group_size"])
        whole = (size == 0) | (size >= max(2, self.declared_world, self.world))
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

    # -- GPUs and hosts ----------------------------------------------------------------------
    def _gpu(self, node: int, cols: dict[str, np.ndarray]) -> None:
        """Latest reading per device (samples of a batch are in time order, the last wins),
        clock baseline, throttle episodes and error counters."""
        d = self.dev
        slot = self._dev_slots(node, cols["device"], cols["rank"])
        ts, clock, reasons = cols["ts_ns"], cols["sm_clock_mhz"], cols["throttle_reasons"]
        for src, dst in (
            ("ts_ns", "ts"),
            ("sm_clock_mhz", "clock"),
            ("temp_c", "temp"),
            ("throttle_reasons", "reasons"),
            ("sm_util_pct", "util"),
            ("mem_total_bytes", "mem_total"),
        ):
            d[dst][slot] = cols[src]
        self.gpu_batches += 1
        if self.gpu_stats[0] < 1000 or self.gpu_batches % 8 == 1:  # roofline: a sample will do
            util = cols["sm_util_pct"]
            busy = util >= 50.0
            self.gpu_stats += (busy.sum(), util[busy].sum(), cols["mem_util_pct"][busy].sum())
        slow = (reasons & SLOWDOWN_BITS) != 0
        if slow.any():
            self.flags["throttled"] = True
            calm = ~slow
            d["base"][slot[calm]] = np.maximum(d["base"][slot[calm]], clock[calm])
        else:
            d["base"][slot] = np.maximum(d["base"][slot], clock)
        if self.flags.get("throttled"):
            # a throttle sample: its reason bit is set and the clock fell below the baseline
            base = d["base"][slot]
            low = (base <= 0) | (clock <= (1.0 - self.det.get("clock_drop", 0.05)) * base)
            episodes_update(d, "th_", slot, ts, low & ((reasons & THERMAL_BITS) != 0))
            episodes_update(d, "pw_", slot, ts, low & ((reasons & POWER_BITS) != 0))
        xid, dbe = cols["xid_events"], cols["ecc_dbe_total"]
        bad = (xid > 0) | (dbe > d["dbe"][slot])
        d["dbe"][slot] = dbe
        if bad.any():
            np.add.at(d["xid"], slot[bad], xid[bad])
            d["last_xid"][slot[bad & (xid > 0)]] = cols["last_xid"][bad & (xid > 0)]
            np.maximum.at(d["err_ns"], slot[bad], ts[bad])

    def _host(self, node: int, cols: dict[str, np.ndarray]) -> None:
        nd = self.node
        nd["cpu"][node] = cols["sys_cpu_pct"][-1]
        nd["iowait"][node] = cols["sys_iowait_pct"][-1]
        nd["ts"][node] = cols["ts_ns"][-1]
        nd["mem_used"][node] = cols["sys_mem_used_bytes"][-1]
        nd["mem_total"][node] = cols["sys_mem_total_bytes"][-1]
        rank = cols["rank"]
        if max(self.declared_world, self.world) <= 1 and (rank < 0).any():
            # a process started without a launcher is sampled without its rank: the job's
            # only rank
            rank = np.where((rank < 0) & (cols["pid"] > 0), 0, rank)
        mine = rank >= 0
        if mine.any():
            self._ensure_ranks(int(rank.max()) + 1)
            self._loader(rank[mine], {k: cols[k][mine] for k in _LOADER_COLUMNS})
        idx = np.full(len(rank), node, dtype=np.int64)
        self.cpu_samples(idx, cols["ts_ns"], cols["sys_cpu_pct"])

    def _loader(self, rank: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        """Each rank's process CPU and loader workers: the latest count and memory, their CPU
        smoothed over samples (started afresh when the worker count changes)."""
        rk = self.rank
        rk["proc_cpu"][rank] = cols["proc_cpu_pct"]
        ranks, inv = np.unique(rank, return_inverse=True)
        n = np.bincount(inv)
        mean = np.bincount(inv, weights=cols["loader_cpu_pct"]) / n
        last = np.zeros(len(ranks), dtype=np.int64)
        np.maximum.at(last, inv, np.arange(len(rank)))
        workers = cols["loader_workers"][last].astype(np.float64)
        old = rk["loader_cpu"][ranks]
        fresh = np.isnan(old) | (rk["loader_workers"][ranks] != workers)
        weight = 1.0 - 0.7**n  # each sample moves it 30 %
        rk["loader_cpu"][ranks] = np.where(fresh, mean, old + weight * (mean - old))
        rk["loader_workers"][ranks] = workers
        rk["loader_rss"][ranks] = cols["loader_rss_bytes"][last]

    # -- job events --------------------------------------------------------------------------
    def info(self, event: JobInfo) -> None:
        """A rank's job info: its intra-op threads, its CPU budget, whether the script set its
        threads itself."""
        if event.rank < 0:
            return
        self._ensure_ranks(event.rank + 1)
        extra, rk, r = event.extra, self.rank, event.rank
        rk["threads"][r] = _number(extra.get("torch.num_threads"))
        budget = _number(extra.get("cpu_budget"))
        if not budget >= 1:  # an older producer: its affinity (or the node) over local ranks
            cpus = _number(extra.get("cpu_affinity"))
            cpus = cpus if cpus >= 1 else float(event.cpu_count or 0)
            budget = max(1.0, cpus // max(1, event.local_world_size)) if cpus else np.nan
        rk["budget"][r] = budget
        rk["by_script"][r] = int("torch.num_threads.by_script" in extra)

    def progress(self, event: RankProgress) -> None:
        """Where a rank is inside a step that has gone on for long."""
        self._ensure_ranks(event.rank + 1)
        rk, r = self.rank, event.rank
        if event.ts_ns < rk["p_ts"][r]:
            return  # an older report
        rk["p_ts"][r], rk["p_step"][r] = event.ts_ns, event.step
        rk["p_phase"][r] = _PROGRESS.get(event.phase, -1)
        rk["p_since"][r] = event.since_ns

    def lifecycle(self, event: JobLifecycle) -> None:
        """A rank's (or the job's) lifecycle: the job has ended once it says so (rank -1) or
        every rank it knows of finished, failed or was killed."""
        if event.state not in ("finished", "failed", "killed"):
            if event.state == "started" and event.rank >= 0:
                self._ensure_ranks(event.rank + 1)
            return
        if event.rank == -1:
            self.ended = True
            return
        self._ensure_ranks(event.rank + 1)
        self.rank["ended"][event.rank] = 1
        world = max(self.declared_world, self.world)
        if self.world >= world and bool(self.rank["ended"][:world].all()):
            self.ended = True

    def cpu_samples(self, idx: np.ndarray, ts: np.ndarray, cpu: np.ndarray) -> None:
        """CPU-saturation episodes use the threshold in force (`cpu_threshold`)."""
        episodes_update(self.node, "cpu_", idx, ts, cpu >= self.det.get("cpu_threshold", 90.0))

    # -- complete steps ----------------------------------------------------------------------
    def complete_steps(self) -> int:
        """Mark newly complete steps usable; return how many there are since the last call."""
        pending = (self.step_no >= 0) & ~self.done
        if not pending.any() or not self.world:
            return 0
        rows = np.flatnonzero(pending)
        need = self.rank["last_step"] > self.newest_step - STEPS // 2  # ranks that report
        r = self.ring
        ok = ~np.isnan(r["st"][rows][:, need])
        if self.flags["spans"]:
            ok &= r["n_compute"][rows][:, need] > 0
        if self.flags["coll"]:
            ok &= r["n_coll"][rows][:, need] > 0
        complete = ok.all(axis=1)
        old = self.step_no[rows] <= self.newest_step - STEPS // 2
        self.done[rows[complete | old]] = True
        self.usable[rows[complete]] = True
        return int(complete.sum())

    def window(self, n: int) -> dict[str, np.ndarray]:
        """The last ``n`` complete steps in step order: each ring array as (steps, ranks)."""
        rows = np.flatnonzero(self.usable)
        rows = rows[np.argsort(self.step_no[rows], kind="stable")][-n:]
        need = self.rank["last_step"] > self.newest_step - STEPS // 2
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
            (job.ring, _RING, (STEPS, len(job.ring["st"][0]))),
            (job.rank, _RANK, (len(job.rank["node"]),)),
            (job.node, _NODE, (len(job.nodes),)),
        ):
            for k, (dt, fill) in spec.items():
                arrs.setdefault(k, np.full(shape, fill, dtype=dt))
        job.step_no, job.done, job.usable = (doc[k].copy() for k in ("step_no", "done", "usable"))
        job.dev_lookup = {int(n): a.copy() for n, a in doc["dev_lookup"].items()}
        job.flags = dict(doc["flags"])
        job.kernel_busy = dict(doc["kernel_busy"])
        job.gpu_stats = doc["gpu_stats"].copy()
        job.findings = {k: Finding(**f) for k, f in doc["findings"].items()}
        job.arrival = ArrivalRing.from_state(doc.get("arrival"), STEPS, job.world)
        job.det = _copy(doc["det"])
        return job


_LOADER_COLUMNS = ("proc_cpu_pct", "loader_workers", "loader_cpu_pct", "loader_rss_bytes")
_PROGRESS = {p: i for i, p in enumerate(PROGRESS_PHASES)}


def _number(text: str | None) -> float:
    """A job info value as a number; NaN when absent or not a number."""
    try:
        return float(text) if text is not None else np.nan
    except ValueError:
        return np.nan


def _copy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.copy()
    return x
