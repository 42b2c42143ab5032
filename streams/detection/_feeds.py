"""What a job's GPUs, hosts and job events say, folded into its state (a mixin of
`JobState`, `perfloop.streams.detection.job_state`, private to it): the latest reading per
GPU with its clock baseline, throttle episodes and error counters; per node its CPU, IO wait
and memory; per rank its process and loader CPU, its loader workers, its job info (threads,
CPU budget), its latest progress report and whether it ended."""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.schemas.job import PROGRESS_PHASES, JobInfo, JobLifecycle, RankProgress
from perfloop.streams.detection._state_parts import (
    _DEV,
    POWER_BITS,
    SLOWDOWN_BITS,
    THERMAL_BITS,
    episodes_update,
    grow,
    number,
)

__all__ = ["Feeds"]

_LOADER_COLUMNS = (
    "ts_ns",
    "proc_cpu_pct",
    "loader_workers",
    "loader_cpu_pct",
    "loader_rss_bytes",
    "proc_rss_bytes",
    "mem_room_bytes",
    "mem_room_limit",
    "proc_run_delay_pct",
)
MEM_LIMITS = ("", "address_space", "cgroup")
"""`HostSample.mem_room_limit` values, by the code a rank's ``mem_room_limit`` holds."""
_PROGRESS = {p: i for i, p in enumerate(PROGRESS_PHASES)}


class Feeds:
    """GPU, host and job-event handlers of `JobState` (which holds the arrays they fill)."""

    dev: dict[str, np.ndarray]
    node: dict[str, np.ndarray]
    rank: dict[str, np.ndarray]
    det: dict[str, Any]
    dev_lookup: dict[int, np.ndarray]
    flags: dict[str, bool]
    gpu_stats: np.ndarray
    gpu_batches: int
    declared_world: int
    ended: bool

    @property
    def world(self) -> int:
        raise NotImplementedError

    def _ensure_ranks(self, n: int) -> None:
        raise NotImplementedError

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
            grow(self.dev, _DEV, first + len(new), 0)
            lut[new] = np.arange(first, first + len(new))  # type: ignore[index]
            self.dev["node"][first:] = node
            self.dev["device"][first:] = new
            slot = lut[device]  # type: ignore[index]
        self.dev["rank"][slot] = rank
        return slot

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
        """Each rank's process CPU and loader workers: the latest count and memory, and their
        CPU smoothed over the readings taken since the count last changed, less the first of
        them: a worker the sampler sees for the first time reads 0 (its reading covers its
        start), so the first reading of a new count says nothing of what the workers do. Until
        a second one comes the workers' CPU is unknown (NaN)."""
        rk = self.rank
        rk["proc_cpu"][rank] = cols["proc_cpu_pct"]
        rk["run_delay"][rank] = cols["proc_run_delay_pct"]
        limit = np.array([MEM_LIMITS.index(v) if v in MEM_LIMITS else 0 for v in
                          cols["mem_room_limit"]], dtype=np.int8)  # fmt: skip
        rk["mem_room_limit"][rank] = limit
        rk["mem_room"][rank] = np.where(limit > 0, cols["mem_room_bytes"], np.nan)
        rk["mem_room_rss"][rank] = cols["proc_rss_bytes"]
        workers = cols["loader_workers"].astype(np.float64)
        cpu, ts, rss = cols["loader_cpu_pct"], cols.get("ts_ns"), cols["loader_rss_bytes"]
        for i, r in enumerate(rank.tolist()):  # in time order; a reading a second per rank
            rk["loader_rss"][r] = rss[i]
            before = rk["loader_workers"][r]
            if before != workers[i]:  # (NaN: the rank's first reading)
                rk["loader_workers"][r] = workers[i]
                rk["loader_cpu"][r] = np.nan
                rk["loader_settled"][r] = 0
                rk["loader_since"][r] = int(ts[i]) if ts is not None else 0
                if workers[i] > 0 and workers[i] != rk["loader_ran"][r]:
                    # workers started, or a count the rank has not run: its memory moves (a
                    # loader that restarts its workers each epoch, 2 → 0 → 2, is no change)
                    if before == before:
                        since = int(rk["loader_since"][r])
                        rk["changed_ns"][r] = max(int(rk["changed_ns"][r]), since)
                    rk["loader_ran"][r] = workers[i]
                continue
            old, n = rk["loader_cpu"][r], rk["loader_settled"][r]
            rk["loader_cpu"][r] = cpu[i] if n == 0 or old != old else old + 0.3 * (cpu[i] - old)
            rk["loader_settled"][r] = n + 1

    # -- job events --------------------------------------------------------------------------
    def info(self, event: JobInfo) -> None:
        """A rank's job info: its intra-op threads, its CPU budget, whether the script set its
        threads itself."""
        if event.rank < 0:
            return
        self._ensure_ranks(event.rank + 1)
        extra, rk, r = event.extra, self.rank, event.rank
        rk["threads"][r] = number(extra.get("torch.num_threads"))
        budget = number(extra.get("cpu_budget"))
        if not budget >= 1:  # an older producer: its affinity (or the node) over local ranks
            cpus = number(extra.get("cpu_affinity"))
            cpus = cpus if cpus >= 1 else float(event.cpu_count or 0)
            budget = max(1.0, cpus // max(1, event.local_world_size)) if cpus else np.nan
        rk["budget"][r] = budget
        rk["by_script"][r] = int("torch.num_threads.by_script" in extra)
        # the values of the knobs perfloop may change (those with bounds): the job agent
        # publishes its info again after each change, so a new value is when the rank changed
        knobs = "|".join(f"{k}={extra.get(k[7:], '')}" for k in sorted(extra) if k[:7] == "bounds.")
        seen = self.det.setdefault("knobs", {})
        if seen.get(str(r), knobs) != knobs:
            rk["changed_ns"][r] = max(int(rk["changed_ns"][r]), event.ts_ns)
        seen[str(r)] = knobs

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
