"""The GPU and host samples of a simulated job (a mixin of
`perfloop.producers.simulator.SimulatedJob`, private to it): each GPU's readings averaged over
the sampling interval from its rank's phase timeline, as NVML does (utilisation, power,
clocks, temperature, memory, link traffic), and each rank's process, loader workers and node
at the host interval."""

from __future__ import annotations

import math

import numpy as np

from perfloop.producers._simulator_config import CONTEXT_BYTES, GIB, IDLE_W, SimConfig

__all__ = ["Samples"]

# Per phase: SM util %, memory util %, share of dynamic power, link activity (0..1).
_SIGNATURE = np.array(
    [
        [2.0, 1.0, 0.06, 0.0],  # data_wait: the GPU idles
        [96.0, 45.0, 0.82, 0.0],  # forward
        [98.0, 55.0, 0.92, 0.25],  # backward: gradient buckets start their all-reduce
        [55.0, 20.0, 0.30, 1.0],  # comm: NCCL kernels
        [75.0, 88.0, 0.55, 0.0],  # optimizer: memory-bound
        [100.0, 0.0, 0.10, 0.0],  # hang: an NCCL kernel spinning, little power
        [0.0, 0.0, 0.0, 0.0],  # idle: not started, or the rank that hung outside the GPU
    ]
)
_MAX_CLOCK_MHZ = 1980.0


class Samples:
    """GPU and host samples of `SimulatedJob`, which holds the state below; they call
    `FaultEffects`' ``_clocks``, ``_fault_state`` and ``_ranks``, the job's ``active_faults``
    and `Emission`'s ``_ns``."""

    cfg: SimConfig
    world: int
    per_node: int
    num_workers: int
    power_limit_w: float
    state: str
    _rng: np.random.Generator
    _tl_b: np.ndarray
    _tl_p: np.ndarray
    _mem_hist: tuple[np.ndarray, np.ndarray, np.ndarray]
    _energy: np.ndarray
    _pids: np.ndarray
    _gpu_tick: int
    _host_tick: int
    _last: tuple[np.ndarray, np.ndarray]

    # -- GPU samples ---------------------------------------------------------------------------
    def _averages(self, ticks: np.ndarray) -> np.ndarray:
        """Each signature channel averaged over the interval before each tick: (C, T, W)."""
        dt, w = self.cfg.gpu_interval_ms, self.world
        b = self._tl_b
        base = float(b[:, 0].min())
        x = np.minimum(b, ticks[-1] + dt) - base  # far bounds would cost float precision
        span = float(x.max()) + 2 * dt + 1
        off = np.arange(w)[:, None] * span
        xp = (x + off).ravel()
        vals = _SIGNATURE[self._tl_p]  # (W, M, C)
        cum = np.concatenate(
            [np.zeros((w, 1, vals.shape[2])), np.cumsum(vals * np.diff(x, axis=1)[..., None], 1)],
            axis=1,
        )
        hi = ((ticks - base)[None, :] + off).ravel()
        out = np.empty((vals.shape[2], len(ticks), w))
        for c in range(vals.shape[2]):
            fp = cum[..., c].ravel()
            avg = (np.interp(hi, xp, fp) - np.interp(hi - dt, xp, fp)) / dt
            out[c] = avg.reshape(w, len(ticks)).T
        return out

    def _trim(self, need_ms: float) -> None:
        j = int(np.searchsorted(self._tl_b.max(axis=0), need_ms)) - 1
        if j > 0:
            self._tl_b, self._tl_p = self._tl_b[:, j:], self._tl_p[:, j:]

    def _gpu(self, until_ms: float) -> dict[str, np.ndarray] | None:
        cfg, rng, w = self.cfg, self._rng, self.world
        dt = cfg.gpu_interval_ms
        last = math.floor(until_ms / dt + 1e-9)
        if last < self._gpu_tick:
            return None
        ticks = np.arange(self._gpu_tick, last + 1) * dt
        self._gpu_tick = last + 1
        util, mem_util, act, link = self._averages(ticks)
        self._trim(self._gpu_tick * dt - dt)
        shape = util.shape
        clock, throttle, temp_floor = self._clocks(ticks, shape)
        util = np.clip(util + rng.normal(0, 0.8, shape), 0, 100)
        power = IDLE_W + (cfg.power_limit_w - IDLE_W - 50) * act * clock**2
        power = np.clip(power + rng.normal(0, 4.0, shape), 40, self.power_limit_w)
        temp = 31 + 0.068 * power + rng.normal(0, 0.4, shape)
        temp = np.where(temp_floor > temp, temp_floor + rng.normal(0, 0.6, shape), temp)
        energy = self._energy + np.cumsum(power * dt, axis=0)  # W x ms = mJ
        self._energy = energy[-1]
        st = self._fault_state(float(ticks[-1]))
        # while communicating, links move data at the ring's pace (its slowest link)
        ring_gbps = cfg.inter_node_gbps if cfg.nodes > 1 else cfg.intra_node_gbps
        link_bps = link * (ring_gbps * 1e9) / st.comm_div
        mem = self._mem_at(ticks) + CONTEXT_BYTES
        return {
            "ts_ns": np.broadcast_to(self._ns(ticks)[:, None], shape),
            "rank": np.broadcast_to(np.arange(w), shape),
            "device": np.broadcast_to(np.arange(w) % self.per_node, shape),
            "sm_util_pct": np.round(util, 1),
            "mem_util_pct": np.round(np.clip(mem_util + rng.normal(0, 0.5, shape), 0, 100), 1),
            "mem_used_bytes": mem,
            "mem_total_bytes": np.full(shape, cfg.gpu_mem_bytes),
            "power_w": np.round(power, 1),
            "temp_c": np.round(temp, 1),
            "sm_clock_mhz": np.round(_MAX_CLOCK_MHZ * clock / 15) * 15,
            "power_limit_w": np.full(shape, self.power_limit_w),
            "energy_mj": np.rint(energy).astype(np.int64),
            "mem_clock_mhz": np.full(shape, 2619.0),
            "throttle_reasons": throttle,
            "pcie_rx_bytes_per_s": np.round(util * 4.0e6),
            "pcie_tx_bytes_per_s": np.round(util * 0.5e6),
            "nvlink_rx_bytes_per_s": np.round(link_bps),
            "nvlink_tx_bytes_per_s": np.round(link_bps),
            "process_mem_bytes": mem,
        }

    def _mem_at(self, ticks: np.ndarray) -> np.ndarray:
        """Device memory reserved by each rank at each tick (bytes)."""
        starts, reserved, before = self._mem_hist
        if not len(starts):
            return np.broadcast_to(before, (len(ticks), self.world)).astype(np.int64)
        idx = np.searchsorted(starts, ticks, side="right") - 1
        out = np.where(idx[:, None] >= 0, reserved[np.maximum(idx, 0)], before)
        return out.astype(np.int64)

    # -- host samples --------------------------------------------------------------------------
    def _host(self, until_ms: float) -> dict[str, np.ndarray] | None:
        cfg, rng, w, g = self.cfg, self._rng, self.world, self.per_node
        dt = cfg.host_interval_ms
        last = math.floor(until_ms / dt + 1e-9)
        if last < self._host_tick:
            return None
        ticks = np.arange(self._host_tick, last + 1) * dt
        self._host_tick = last + 1
        shape = (len(ticks), w)
        step_ms, wait_share = self._last
        steps_per_s = np.where(np.isfinite(step_ms), 1000 / step_ms, 0.0)
        st = self._fault_state(float(ticks[-1]))
        nw = self.num_workers
        load_ms = cfg.load_ms * st.load_mult
        loader_busy = np.minimum(1.0, load_ms * steps_per_s / 1000 / max(nw, 1))
        loader_cpu = 100.0 * nw * loader_busy * rng.normal(1, 0.03, shape)
        hung = self.state == "hung"
        proc_cpu = 30 + 90 * (1 - wait_share) + (0 if nw else 100 * loader_busy)
        proc_cpu = np.broadcast_to(100.0 if hung else proc_cpu, shape) + rng.normal(0, 3, shape)
        if hung:
            culprits = [r for f in cfg.faults if f.kind == "hang" for r in self._ranks(f)]
            proc_cpu[:, culprits] = np.abs(rng.normal(2, 0.5, (len(ticks), len(culprits))))
        proc_cpu = np.maximum(proc_cpu, 0.0)

        def per_node(a: np.ndarray) -> np.ndarray:  # a node-wide figure, on each of its ranks
            return np.repeat(a.reshape(len(ticks), cfg.nodes, g).sum(axis=2), g, axis=1)

        sys_cpu = np.clip(per_node(proc_cpu + loader_cpu) / cfg.cpu_count + 1.5, 0, 100)
        starving = np.zeros(w)
        for f in self.active_faults(float(ticks[-1]) / 1000):
            if f.kind == "dataloader_starvation":
                starving[self._ranks(f)] = 1.0
        # a starving node waits on its storage: iowait is node-wide
        node_starving = np.repeat(starving.reshape(cfg.nodes, g).max(axis=1), g)
        iowait = np.clip((0.6 + 8.4 * node_starving) * rng.normal(1, 0.1, shape), 0, 100)
        read = per_node(np.broadcast_to(cfg.batch_size * 110e3 * steps_per_s, shape))
        net = 0.0
        if cfg.nodes > 1:
            net = cfg.grad_bytes * 2 * (cfg.nodes - 1) / cfg.nodes / g * steps_per_s
        net_node = per_node(np.broadcast_to(net, shape))
        rss = 7.5 * GIB + self._pids % 97 * (16 << 20)
        loader_rss = nw * 1.2 * GIB
        return {
            "ts_ns": np.broadcast_to(self._ns(ticks)[:, None], shape),
            "rank": np.broadcast_to(np.arange(w), shape),
            "pid": np.broadcast_to(self._pids, shape),
            "proc_cpu_pct": np.round(proc_cpu, 1),
            "proc_rss_bytes": np.broadcast_to(rss.astype(np.int64), shape),
            "proc_threads": np.full(shape, 38 + nw),
            "sys_cpu_pct": np.round(sys_cpu, 1),
            "sys_iowait_pct": np.round(iowait, 1),
            "load_avg_1m": np.round(sys_cpu / 100 * cfg.cpu_count, 2),
            "sys_mem_used_bytes": np.full(
                shape, int(96 * GIB + g * (7.5 * GIB + loader_rss)), dtype=np.int64
            ),
            "sys_mem_total_bytes": np.full(shape, cfg.host_mem_bytes),
            "disk_read_bytes_per_s": np.round(read),
            "disk_write_bytes_per_s": np.full(shape, 2.0e6),
            "net_rx_bytes_per_s": np.round(net_node),
            "net_tx_bytes_per_s": np.round(net_node),
            "loader_workers": np.full(shape, nw),
            "loader_cpu_pct": np.round(np.maximum(loader_cpu, 0), 1),
            "loader_rss_bytes": np.full(shape, int(loader_rss), dtype=np.int64),
        }
