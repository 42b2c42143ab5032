"""The per-rank step model of a simulated job (a mixin of
`perfloop.producers.simulator.SimulatedJob`, private to it): a chunk of data-parallel steps of
every rank at once (loading, forward, backward, the shared all-reduce, the optimizer) under
the faults and knobs of its start, each rank's phase timeline the GPU samples are averaged
from, device memory with a leak, and the cut at an out-of-memory or a hang."""

from __future__ import annotations

from typing import Any

import numpy as np

from perfloop.producers._simulator_config import (
    CONTEXT_BYTES,
    GIB,
    HANG,
    IDLE,
    SimConfig,
    StepReport,
)

__all__ = ["StepModel"]

_FAR_MS = 1e12


class StepModel:
    """Steps of `SimulatedJob`, which holds the state below; ``_steps`` calls `FaultEffects`'
    ``_boundaries``, ``_fault_state`` and ``_ranks``, the job's ``active_faults`` and
    `Emission`'s ``_oom``."""

    cfg: SimConfig
    world: int
    num_workers: int
    prefetch_factor: int
    state: str
    step: int
    _rng: np.random.Generator
    _k: int
    _start: np.ndarray
    _clock: float
    _tl_b: np.ndarray
    _tl_p: np.ndarray
    _leaked: np.ndarray
    _reserved: np.ndarray
    _mem_hist: tuple[np.ndarray, np.ndarray, np.ndarray]
    _last: tuple[np.ndarray, np.ndarray]

    def _steps(self, end_ms: float) -> dict[str, Any]:
        cfg, rng, w, k = self.cfg, self._rng, self.world, self._k
        s0 = self._start
        clock = float(s0.max())
        bounds = [b for b in self._boundaries(clock) if b > clock]
        bound = min([*bounds, end_ms])
        hangs = [f.onset_s * 1000 for f in cfg.faults if f.kind == "hang"]
        t_hang = min([t for t in hangs if t > clock], default=None)
        st = self._fault_state(clock)
        shape = (k, w)
        cm = st.compute_mult
        fwd = cfg.forward_ms * cm * rng.normal(1.0, 0.02, shape)
        bwd = cfg.backward_ms * cm * rng.normal(1.0, 0.02, shape)
        opt = cfg.optimizer_ms * cm * rng.normal(1.0, 0.03, shape)
        load = cfg.load_ms * st.load_mult * rng.normal(1.0, 0.03, shape)
        ar = cfg.allreduce_ms(st.comm_div) * rng.normal(1.0, 0.03, k)
        ex = np.maximum(ar - cfg.comm_overlap * cfg.backward_ms, 0.1 * ar)
        busy = fwd + bwd + opt + ex[:, None]
        nw = self.num_workers
        wait = np.maximum(0.0, load / nw - busy) if nw else load
        wait = wait + np.abs(rng.normal(0.0, 1.0 / self.prefetch_factor, shape))
        pre = wait + fwd + bwd
        d = np.empty(k)
        d[0] = (s0 + pre[0]).max()
        d[1:] = (opt[:-1] + pre[1:]).max(axis=1)
        a = np.cumsum(d + ex)  # end of each step's all-reduce (shared by every rank)
        s = np.empty(shape)
        s[0] = s0
        s[1:] = a[:-1, None] + opt[:-1]
        e = a[:, None] + opt
        smax = s.max(axis=1)
        late = smax >= bound
        n = int(np.argmax(late)) if late.any() else k  # ≥ 1: smax[0] == clock < bound
        # memory: the leak grows per step; out of memory when the next activations do not fit
        leaked = self._leaked + st.leak * np.arange(1, k + 1)[:, None]
        peak = cfg.static_mem_bytes + cfg.activation_bytes + leaked
        # the caching allocator keeps what it reserved; it cannot reserve past the device
        grown = np.minimum(peak + GIB, cfg.gpu_mem_bytes - CONTEXT_BYTES)
        reserved = np.maximum(self._reserved, np.maximum.accumulate(grown, axis=0))
        oom = (peak[:n] + CONTEXT_BYTES) > cfg.gpu_mem_bytes
        t_cut: float | None = None
        oom_at: tuple[int, int] | None = None
        if oom.any():
            ko = int(np.argmax(oom.any(axis=1)))
            ro = int(np.argmax(oom[ko]))
            t_oom = float(s[ko, ro] + wait[ko, ro] + 0.5 * fwd[ko, ro])
            if t_hang is None or t_oom < t_hang:
                oom_at, t_cut, n = (ko, ro), t_oom, ko
        hang = oom_at is None and t_hang is not None and e[n - 1].max() >= t_hang
        if hang:
            assert t_hang is not None
            t_cut = t_hang
        done = n
        if t_cut is not None:
            done = int(np.searchsorted(e[:n].max(axis=1), t_cut, side="right"))
        tl_rows = min(n + 1, k) if t_cut is not None else n
        # timeline of phases per rank (for the GPU samples)
        starts = np.stack(
            [s, s + wait, s + wait + fwd, s + pre, np.broadcast_to(a[:, None], shape)], axis=2
        )[:tl_rows]
        tb = np.concatenate(
            [starts.transpose(1, 0, 2).reshape(w, 5 * tl_rows), e[tl_rows - 1][:, None]], axis=1
        )
        tp = np.tile(np.arange(5), (w, tl_rows))
        if t_cut is not None:
            tb = np.minimum(tb, t_cut)
            last = np.full(w, IDLE if oom_at else HANG)
            if hang:
                last[[r for f in cfg.faults if f.kind == "hang" for r in self._ranks(f)]] = IDLE
            tb = np.concatenate([tb, np.full((w, 1), _FAR_MS)], axis=1)
            tp = np.concatenate([tp, last[:, None]], axis=1)
        self._tl_b = np.concatenate([self._tl_b[:, :-1], tb], axis=1)
        self._tl_p = np.concatenate([self._tl_p, tp], axis=1)
        # bookkeeping
        first_step = self.step
        self.step += done
        self._mem_hist = (smax[:done], reserved[:done], self._reserved)
        if done:
            self._leaked = leaked[done - 1]
            self._reserved = reserved[done - 1]
            st_ms = e[:done] - s[:done]
            self._last = (st_ms.mean(axis=0), (wait[:done] / st_ms).mean(axis=0))
        if oom_at is not None:
            until = float(t_cut)  # type: ignore[arg-type]
            self._oom(oom_at, until, float(peak[oom_at] + CONTEXT_BYTES))
        elif hang:
            until = float(t_cut)  # type: ignore[arg-type]
            self.state = "hung"
            self._last = (np.full(w, np.inf), np.zeros(w))
        else:
            until = float(e[n - 1].min())
            self._start = e[n - 1].copy()
        self._clock = until if t_cut is not None else float(self._start.max())
        comm = a[:done, None] - (s[:done] + pre[:done])
        reports = []
        for i in range(done):
            t = float(e[i].max())
            reports.append(
                StepReport(
                    first_step + i,
                    t / 1000,
                    float((e[i] - s[i]).max()),
                    float((wait[i] / (e[i] - s[i])).mean()),
                    nw,
                    bool(self.active_faults(float(smax[i]) / 1000)),
                )
            )
        return {
            "until": until,
            "first_step": first_step,
            "s": s[:done],
            "e": e[:done],
            "phases": np.stack([wait, fwd, bwd, np.zeros(shape), opt], axis=2)[:done],
            "starts": starts[:done],
            "comm": comm,
            "ar_start": (s + pre)[:done] - (ar - ex)[:done, None],
            "a": a[:done],
            "leaked": leaked[:done],
            "reserved": reserved[:done],
            "peak": peak[:done],
            "reports": reports,
        }
