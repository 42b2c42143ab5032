"""Host telemetry: the machine, each watched training process, and its data-loader workers.

`HostSampler.sample()` returns one row per watched process (keys are `HostSample` fields):
system CPU and iowait (share of the whole machine since the previous sample), 1-minute load,
memory, disk and network throughput (bytes/s since the previous sample; loopback excluded),
the process's CPU (percent of one core), RSS and threads, how long its threads waited for a
CPU (`run_delay_ns`: runnable but not running, in percent of one core), the room it has under a
memory limit of its own (`perfloop.producers._memroom`: its address-space limit or its
cgroup's), and its descendants — the data-loader workers a PyTorch ``DataLoader`` forks — as a
count, summed CPU and summed RSS. With no process to watch it returns one node-level row
(``pid`` 0, ``rank`` -1).

A watched process's rank is the one given, else the ``RANK`` its launcher put in its
environment (torchrun, ``perfloop run``), else -1. A process that exits is dropped and logged
once; ``alive`` turns false when every watched process is gone. The first sample of a rate
reads 0 (there is no previous one). Nothing here raises into the caller: a counter the platform
does not offer (disk counters in some containers) reads 0 and is listed in ``missing``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from perfloop.producers._memroom import cgroup_dirs, memory_room

__all__ = ["HOST_SIGNALS", "HostSampler", "rank_of", "run_delay_ns"]

log = logging.getLogger("perfloop.producers.host")

HOST_SIGNALS = (
    "cpu",
    "memory",
    "load",
    "disk_io",
    "net_io",
    "process",
    "run_delay",
    "loader_workers",
)
"""What the host sampler reads; the capability report lists those it cannot."""


def rank_of(pid: int) -> int:
    """The ``RANK`` in the environment of process ``pid`` (set by its launcher), else -1.

    >>> rank_of(2**22 + 12345)   # no such process
    -1
    """
    try:
        env = psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return -1
    try:
        rank = int(env.get("RANK", "-1"))
    except ValueError:
        return -1
    return rank if 0 <= rank <= 1 << 20 else -1


class _Rates:
    """Bytes/s of a set of cumulative counters between consecutive reads."""

    def __init__(self) -> None:
        self._prev: dict[str, float] = {}
        self._t: float | None = None

    def __call__(self, values: Mapping[str, float], t: float) -> dict[str, float]:
        prev, prev_t = self._prev, self._t
        self._prev, self._t = dict(values), t
        if prev_t is None or t <= prev_t:
            return dict.fromkeys(values, 0.0)
        dt = t - prev_t
        return {k: max(0.0, v - prev.get(k, v)) / dt for k, v in values.items()}


class HostSampler:
    """Reads the host and the watched training processes with psutil.

    >>> import os
    >>> s = HostSampler({os.getpid(): 0})
    >>> row = s.sample()[0]
    >>> row["pid"] == os.getpid(), row["rank"], row["proc_rss_bytes"] > 0
    (True, 0, True)
    """

    def __init__(
        self,
        pids: Mapping[int, int] | Iterable[int] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        watch = dict(pids) if isinstance(pids, Mapping) else {p: rank_of(p) for p in pids}
        self._clock = clock
        self._procs: dict[int, tuple[psutil.Process, int]] = {}
        self._gone: list[int] = []
        for pid, rank in watch.items():
            try:
                self._procs[pid] = (psutil.Process(pid), rank)
            except psutil.Error:
                log.warning("process %d does not exist; it is not watched", pid)
                self._gone.append(pid)
        self._watched_any = bool(watch)
        self._checked: set[int] = set()  # descendants already checked for a launcher's RANK
        self._proc_cpu: dict[int, tuple[float, float]] = {}  # pid -> (cpu seconds, at)
        self._delay: dict[int, tuple[dict[int, int], float]] = {}  # pid -> ({tid: ns}, at)
        self._children: dict[int, psutil.Process] = {}
        self._cgroups: dict[int, list[tuple[Any, bool]]] = {}  # pid -> its memory cgroups
        self._proc_children = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
        self._cpu_prev: Any = None
        self._sys_cpu = (0.0, 0.0)
        self._disk = _Rates()
        self._net = _Rates()
        self.missing: dict[str, str] = {}
        """Signals this platform does not offer, with the reason."""
        self.children: frozenset[int] = frozenset()
        """Descendants of the watched processes seen by the last sample."""
        self._probe()

    @property
    def pids(self) -> dict[int, int]:
        """Watched pids that are still alive, with their rank."""
        return {pid: rank for pid, (_, rank) in self._procs.items()}

    @property
    def alive(self) -> bool:
        """False once every watched process has exited (always True when watching none)."""
        return bool(self._procs) or not self._watched_any

    def _probe(self) -> None:
        if psutil.disk_io_counters() is None:
            self.missing["disk_io"] = "no disk counters on this platform (container?)"
        if not psutil.net_io_counters(pernic=True):
            self.missing["net_io"] = "no network counters on this platform"
        if not hasattr(psutil.cpu_times(), "iowait"):
            self.missing["iowait"] = "the platform does not report iowait"
        try:
            os.getloadavg()
        except OSError:
            self.missing["load"] = "no load average on this platform"
        if run_delay_ns(os.getpid()) is None:
            self.missing["run_delay"] = "the kernel reports no scheduler statistics (schedstat)"
        if not self._watched_any:
            self.missing["process"] = "no training process watched (node-level only)"
            self.missing["loader_workers"] = "no training process watched"

    def _system(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        ct = psutil.cpu_times()
        prev, self._cpu_prev = self._cpu_prev, ct
        total = 0.0 if prev is None else _cpu_total(ct) - _cpu_total(prev)
        if total > 0:  # else too soon for the kernel's tick: keep the last figures
            idle = ct.idle - prev.idle
            iowait = getattr(ct, "iowait", 0.0) - getattr(prev, "iowait", 0.0)
            self._sys_cpu = (
                _pct(100.0 * (total - idle - iowait) / total),
                _pct(100.0 * iowait / total),
            )
        out["sys_cpu_pct"], out["sys_iowait_pct"] = self._sys_cpu
        if "load" not in self.missing:
            out["load_avg_1m"] = max(0.0, os.getloadavg()[0])
        vm = psutil.virtual_memory()
        out["sys_mem_used_bytes"] = max(0, int(vm.total - vm.available))
        out["sys_mem_total_bytes"] = int(vm.total)
        if "disk_io" not in self.missing:
            d = psutil.disk_io_counters()
            if d is not None:
                r = self._disk({"r": d.read_bytes, "w": d.write_bytes}, now)
                out["disk_read_bytes_per_s"], out["disk_write_bytes_per_s"] = r["r"], r["w"]
        if "net_io" not in self.missing:
            rx = tx = 0
            for nic, c in psutil.net_io_counters(pernic=True).items():
                if nic == "lo" or nic.startswith("lo"):
                    continue
                rx += c.bytes_recv
                tx += c.bytes_sent
            r = self._net({"rx": rx, "tx": tx}, now)
            out["net_rx_bytes_per_s"], out["net_tx_bytes_per_s"] = r["rx"], r["tx"]
        return out

    def _cpu_pct(self, pid: int, seconds: float, now: float) -> float:
        prev = self._proc_cpu.get(pid)
        self._proc_cpu[pid] = (seconds, now)
        if prev is None or now <= prev[1]:
            return 0.0
        return max(0.0, 100.0 * (seconds - prev[0]) / (now - prev[1]))

    def _run_delay_pct(self, pid: int, now: float) -> float:
        """How long the process's threads waited for a CPU since the previous sample, summed
        over its threads, in percent of one core (two threads each waiting half the time read
        100). A thread that started in between counts from its start, one that exited drops
        out. 0 on the first sample and where the kernel keeps no scheduler statistics."""
        if "run_delay" in self.missing:
            return 0.0
        now_ns = run_delay_ns(pid)
        if now_ns is None:
            return 0.0
        prev = self._delay.get(pid)
        self._delay[pid] = (now_ns, now)
        if prev is None or now <= prev[1]:
            return 0.0
        waited = sum(max(0, ns - prev[0].get(tid, 0)) for tid, ns in now_ns.items())
        return 100.0 * waited / 1e9 / (now - prev[1])

    def _process(self, pid: int, p: psutil.Process, now: float, seen: set[int]) -> dict[str, Any]:
        with p.oneshot():
            if p.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
                raise psutil.ZombieProcess(pid)
            t = p.cpu_times()
            mem = p.memory_info()
            threads = p.num_threads()
        kids = self._descendants(p)
        cpu_s = t.user + t.system
        row: dict[str, Any] = {
            "pid": pid,
            "proc_cpu_pct": self._cpu_pct(pid, cpu_s, now),
            "proc_rss_bytes": int(mem.rss),
            "proc_threads": int(threads),
            "proc_run_delay_pct": self._run_delay_pct(pid, now),
        }
        dirs = self._cgroups.get(pid)
        if dirs is None:
            dirs = self._cgroups[pid] = cgroup_dirs(Path(f"/proc/{pid}"))
        row["mem_room_bytes"], row["mem_room_limit"] = memory_room(pid, int(mem.vms), dirs)
        n, cpu, rss = 0, 0.0, 0
        for kid in kids:
            kp = self._children.get(kid)
            try:
                if kp is None:  # a new worker (a pid leaves the cache as soon as it is gone)
                    kp = psutil.Process(kid)
                    self._proc_cpu.pop(kid, None)
                with kp.oneshot():
                    kt = kp.cpu_times()
                    krss = kp.memory_info().rss
            except psutil.Error:
                continue
            self._children[kid] = kp
            seen.add(kid)
            n += 1
            cpu += self._cpu_pct(kid, kt.user + kt.system, now)
            rss += int(krss)
        row["loader_workers"], row["loader_cpu_pct"], row["loader_rss_bytes"] = n, cpu, rss
        return row

    def _descendants(self, p: psutil.Process) -> list[int]:
        """Pids of every descendant of ``p``.

        Linux lists each thread's children in ``/proc/<pid>/task/<tid>/children``: reading
        those costs microseconds, where psutil's ``children()`` reads every process's stat
        (milliseconds on a busy node). Elsewhere, psutil.
        """
        if not self._proc_children:
            kids = p.children(recursive=True)
            return [k.pid for k in kids if k.pid not in self._procs]
        out: list[int] = []
        stack = [p.pid]
        while stack:
            parent = stack.pop()
            if parent != p.pid and parent in self._procs:
                continue  # a watched rank of its own: its workers are its own
            try:
                tids = os.listdir(f"/proc/{parent}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{parent}/task/{tid}/children") as f:
                        kids = [int(k) for k in f.read().split()]
                except OSError:
                    continue
                out += [k for k in kids if k not in self._procs]
                stack += kids
        return out

    def _adopt_ranks(self) -> None:
        """Watch, as ranks of their own, descendants a launcher started with a ``RANK``.

        Under ``perfloop run -- torchrun …`` the watched process is torchrun; its children are
        the ranks (each with its own data-loader workers), not loader workers of torchrun.
        """
        present: set[int] = set()
        for pid, (p, rank) in list(self._procs.items()):
            if rank >= 0:
                continue
            for kid in self._descendants(p):
                present.add(kid)
                if kid in self._checked:
                    continue
                self._checked.add(kid)
                kid_rank = rank_of(kid)
                if kid_rank < 0:
                    continue
                try:
                    proc = psutil.Process(kid)
                    if rank_of(proc.ppid()) == kid_rank:
                        continue  # a rank's loader worker inherits its RANK: not a rank
                except psutil.Error:
                    continue
                self._procs[kid] = (proc, kid_rank)
                self._children.pop(kid, None)
                log.info("watching rank %d (pid %d) started by pid %d", kid_rank, kid, pid)
        self._checked &= present

    def sample(self) -> list[dict[str, Any]]:
        """One row per live watched process (or one node-level row); never raises."""
        now = self._clock()
        try:
            system = self._system(now)
        except (psutil.Error, OSError) as e:  # pragma: no cover - the platform failed us
            log.debug("system counters failed: %s", e)
            system = {}
        try:
            self._adopt_ranks()
        except (psutil.Error, OSError) as e:  # pragma: no cover - raced with an exit
            log.debug("looking for launched ranks failed: %s", e)
        rows: list[dict[str, Any]] = []
        seen_children: set[int] = set()
        for pid, (p, rank) in list(self._procs.items()):
            try:
                row = self._process(pid, p, now, seen_children)
            except psutil.Error:
                del self._procs[pid]
                self._proc_cpu.pop(pid, None)
                self._delay.pop(pid, None)
                self._cgroups.pop(pid, None)
                log.warning("watched process %d exited; it is no longer sampled", pid)
                continue
            row.update(system)
            row["rank"] = rank
            rows.append(row)
        if not self._watched_any:
            rows.append({"pid": 0, "rank": -1, **system})
        # forget workers that are gone so their pids cannot be confused with new ones
        for k in set(self._children) - seen_children:
            self._children.pop(k, None)
            self._proc_cpu.pop(k, None)
        self.children = frozenset(seen_children)
        return rows


def run_delay_ns(pid: int) -> dict[int, int] | None:
    """Per thread of process ``pid``, the nanoseconds it has spent runnable but waiting for a
    CPU (the second field of ``/proc/<pid>/task/<tid>/schedstat``); None where the kernel
    keeps no such statistics or the process is gone.

    >>> import os
    >>> waited = run_delay_ns(os.getpid())
    >>> waited is None or all(ns >= 0 for ns in waited.values())
    True
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: dict[int, int] = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
            out[int(tid)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just exited, or a kernel without the statistics
    return out or None


def _cpu_total(ct: Any) -> float:
    total = float(sum(ct))
    # Linux counts guest time inside user and nice as well; do not count it twice.
    return total - getattr(ct, "guest", 0.0) - getattr(ct, "guest_nice", 0.0)


def _pct(v: float) -> float:
    return min(100.0, max(0.0, v))
