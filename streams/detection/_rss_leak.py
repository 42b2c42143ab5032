"""A CPU job's memory leak, from its processes' resident memory (RSS).

A CPU job has no CUDA allocator figures; its step events carry the process's RSS, which the
sampler reads at most every ``memory_every_ns`` (250 ms) and which moves in chunks (the
allocator maps memory by the megabyte, frees a step's temporaries and maps them again). So RSS
is judged over seconds, not step by step. Each rank keeps one point a second, the lowest reading
of that second: temporaries come and go above it, what a leak keeps raises it (`HISTORY`
points).

A rank's points count from ``rss_settle_s`` after its latest change: its start (stretched to the
job's ``warmup_steps`` steps, at most twice as long: a process's RSS grows while it warms up),
a knob perfloop changed (the job info it publishes again after each), a new count of its loader
workers. A rank leaks when, over a run of its latest n ≥ ``rss_points`` points (the shortest
that holds), its RSS rose

- fast enough: the Theil–Sen slope (the median of the pairwise slopes) is at least
  ``rss_min_growth_bytes_per_s``;
- far enough: slope × span is at least ``rss_min_rise_bytes``, and ``rss_noise_factor`` times
  the scatter of the points about their trend (the run's, or all the rank's points', whichever
  is larger): a process whose allocator swings by hundreds of MB must rise further than a
  small one;
- steadily: by at least a quarter of that slope in ``rss_up_share`` of its steps (from each
  point to the one a quarter of the run later), and never by more than a third of the rise
  from one point to the next (an allocator's step up, or two, is no leak);
- to a new high: above every earlier point it counts (a rise inside the band RSS has shown
  is noise).

So a 30 MB/s leak is found ~5 s after it starts, 5 MB/s in ~8 s on a quiet allocator, later on
a noisy one. It opens only while RSS still rises (the slope over the latest 2 × ``rss_points``
points is at least ``rss_min_growth_bytes_per_s``: a leak that stopped is not news), and
resolves once the slope over the run it was found on, or those points if more, falls under a
quarter of that. Time to OOM is the room left at this rate under the tightest bound the
rank's host samples show: its own address-space limit or its cgroup's memory limit (the room
read with the latest sample, less what RSS rose since), else the host's available memory.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from perfloop.streams.detection._common import node_of, replace_findings
from perfloop.streams.detection._state_parts import NS, Finding
from perfloop.streams.detection.job_state import JobState

__all__ = ["HISTORY", "rss_leak_detector"]

HISTORY = 32
"""One-second RSS points kept per rank."""

_MAD = 1.4826  # a median absolute deviation times this estimates a normal scatter's sigma
_STATS = ("slope", "rise", "scatter", "steady", "jump", "high")
_INT = {"seen": 0, "b0": 0, "b1": 0, "n": 0, "onset": 0}  # per rank, int64
_FLOAT = {"bmin": np.nan, "rate": np.nan, "rise": np.nan, "span": np.nan, "steady": np.nan}


def rss_leak_detector(job: JobState, p: Any, win: dict) -> None:
    """Update the job's ``memory_leak:r<rank>`` findings from its ranks' RSS over time."""
    st = job.det.setdefault("rss", {})
    w = win["mem"].shape[1]
    a = _arrays(st, w)
    fresh = _fold(a, win, w)
    end = win["end"][:, :w]
    if "start_ns" not in st and (end > 0).any():
        st["start_ns"] = int(end[end > 0].min())
    if "warm_ns" not in st and job.det.get("steps_seen", 0) > p.warmup_steps:
        st["warm_ns"] = int(end.max())
    if "start_ns" not in st:
        return
    settle, start = int(p.rss_settle_s * NS), int(st["start_ns"])
    warm = max(start + settle, min(int(st.get("warm_ns", 1 << 62)), start + 2 * settle))
    changed = _take(job.rank["changed_ns"], w, 0)
    base = np.maximum(warm, np.where(changed > 0, changed + settle, 0))
    if fresh.any():
        _judge(a, p, np.flatnonzero(fresh), base)
    found = {}
    for r in np.flatnonzero(a["active"]):
        rate, rss = float(a["rate"][r]), float(a["m"][r, -1])
        headroom, bound = _room(job, int(r), rss)
        tto = headroom / rate if rate > 0 and headroom == headroom else np.nan
        ev = {
            "growth_bytes_per_s": round(rate, 1),
            "rise_bytes": round(float(a["rise"][r]), 1),
            "rss_bytes": rss,
            "rising_share": round(float(a["steady"][r]), 3),
            "seconds": round(float(a["span"][r]), 2),
        }
        if tto == tto:
            ev.update(headroom_bytes=float(headroom), time_to_oom_s=round(float(tto), 2))
        key = f"memory_leak:r{r}"
        found[key] = Finding(
            key=key,
            bottleneck="memory_leak",
            onset_ns=int(a["onset"][r]),
            step_share=0.0,
            confidence=float(min(1.0, 0.5 + 0.5 * float(a["steady"][r]))),
            ranks=[int(r)],
            nodes=node_of(job, int(r)),
            rank=int(r),
            step=int(win["step"][-1]),
            evidence=ev,
            summary=f"rank {r}'s memory (RSS) grows {rate / 2**20:.1f} MiB a second"
            + (f"; out of {bound} in about {tto:.0f} s" if tto == tto else ""),
        )
    replace_findings(job, "memory_leak:", found)


def _fold(a: dict[str, np.ndarray], win: dict, w: int) -> np.ndarray:
    """Fold the window's new readings into each rank's second (its lowest reading, at its
    last reading's time); a rank whose second closed gets a new point. Which ranks did."""
    end, mem, need = win["end"][:, :w], win["mem"][:, :w], win["need"][:w]
    new = np.zeros(w, dtype=bool)
    for e, v in zip(end, mem, strict=True):  # steps in order: each rank's readings in time order
        ok = need & (e > a["seen"]) & (v > 0)  # (NaN > 0 is False: no reading)
        if not ok.any():
            continue
        a["seen"][ok] = e[ok]
        close = ok & (a["b0"] > 0) & (e - a["b0"] >= NS)
        if close.any():
            for k in ("t", "m"):
                a[k][close] = np.roll(a[k][close], -1, axis=1)
            a["t"][close, -1], a["m"][close, -1] = a["b1"][close], a["bmin"][close]
            new |= close
        restart = ok & (close | (a["b0"] == 0))
        a["b0"][restart], a["bmin"][restart] = e[restart], v[restart]
        keep = ok & ~restart
        a["bmin"][keep] = np.minimum(a["bmin"][keep], v[keep])
        a["b1"][ok] = e[ok]
    return new


def _judge(a: dict[str, np.ndarray], p: Any, ranks: np.ndarray, base: np.ndarray) -> None:
    """Open, update or resolve the leak of each of ``ranks`` (they have a new point)."""
    t, m = a["t"][ranks], a["m"][ranks]
    ok = (t > 0) & (t >= base[ranks, None]) & ~np.isnan(m)  # a suffix: t rises along a row
    n_ok = ok.sum(axis=1)
    lo = int(p.rss_points)
    if not (n_ok >= lo).any():
        return
    stats = _runs(t, np.where(ok, m, np.nan), lo, int(n_ok.max()))
    idx = np.arange(len(ranks))
    top = np.clip(n_ok - lo, 0, None)  # each rank's longest run: the scatter of all its points
    scatter = np.fmax(stats["scatter"], stats["scatter"][idx, top][:, None])
    rise = stats["rise"]
    with np.errstate(invalid="ignore"):
        holds = (
            (stats["slope"] >= p.rss_min_growth_bytes_per_s)
            & (rise >= p.rss_min_rise_bytes)
            & (rise >= p.rss_noise_factor * scatter)
            & (stats["steady"] >= p.rss_up_share)
            & (stats["jump"] <= rise / 3)
            & (stats["high"] > 0)
        )
    quarter = 0.25 * p.rss_min_growth_bytes_per_s
    for i, r in enumerate(ranks.tolist()):
        if n_ok[i] < lo:
            continue  # too few points since its start or its latest change: as it was
        slope, have = stats["slope"][i], int(n_ok[i])
        if a["active"][r]:  # judged on the run it was found on, or the latest 2 lo points
            k = _stop_run(int(a["n"][r]), lo, have)
            if not slope[k] >= quarter:  # it stopped rising
                a["active"][r] = False
                continue
        else:
            ks = np.flatnonzero(holds[i])  # and it still rises: over the latest 2 lo points
            if not len(ks) or not slope[_stop_run(lo, lo, have)] >= p.rss_min_growth_bytes_per_s:
                continue
            k, n = int(ks[0]), lo + int(ks[0])
            a["active"][r], a["n"][r] = True, n
            a["onset"][r] = _onset(t[i, -n:], m[i, -n:])
        a["rate"][r], a["rise"][r], a["steady"][r] = slope[k], rise[i, k], stats["steady"][i, k]
        a["span"][r] = (t[i, -1] - t[i, -(lo + k)]) / NS


def _runs(t: np.ndarray, m: np.ndarray, lo: int, hi: int) -> dict[str, np.ndarray]:
    """For each row and each run of its latest n points (n = lo..hi; column n - lo): the
    Theil–Sen slope (bytes a second), the rise over the run, the scatter about that trend,
    the share of its steps (each point to the one a quarter of the run later) that rose by at
    least a quarter of the slope, the largest rise from one point to the next, and whether
    its last point is above every earlier one (1.0). NaN where a row has fewer than n."""
    rows = len(t)
    out = {k: np.full((rows, hi - lo + 1), np.nan) for k in _STATS}
    secs = (t - t[:, -1:]) / NS  # (NaN points have a NaN value, never a NaN time)
    before = np.fmax.accumulate(np.where(np.isnan(m), -np.inf, m), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        for n in range(lo, hi + 1):
            x, y = secs[:, -n:], m[:, -n:]
            i, j = _pairs(n)
            slope = np.median((y[:, j] - y[:, i]) / (x[:, j] - x[:, i]), axis=1)
            span = x[:, -1] - x[:, 0]
            res = y - slope[:, None] * x
            dev = np.abs(res - np.median(res, axis=1, keepdims=True))
            dy = np.diff(y, axis=1)
            lag = max(1, round((n - 1) / 4))  # a long run's steps: over its quarters' seconds
            ly, lx = y[:, lag:] - y[:, :-lag], x[:, lag:] - x[:, :-lag]
            prior = before[:, -n - 1] if n < t.shape[1] else np.full(rows, -np.inf)
            c = n - lo
            out["slope"][:, c] = slope
            out["rise"][:, c] = slope * span
            out["scatter"][:, c] = _MAD * np.median(dev, axis=1)
            out["steady"][:, c] = (ly >= 0.25 * slope[:, None] * lx).mean(axis=1)
            out["jump"][:, c] = dy.max(axis=1)
            out["high"][:, c] = (y[:, -1] > prior).astype(np.float64)
            gone = np.isnan(y[:, 0])  # fewer than n points
            for k in _STATS:
                out[k][gone, c] = np.nan
    return out


def _stop_run(n: int, lo: int, have: int) -> int:
    """The column of the run a leak found on ``n`` points is judged stopped on: those
    points, or the latest ``2 lo`` if more (as many as there are)."""
    return min(max(n, 2 * lo), have) - lo


def _onset(t: np.ndarray, m: np.ndarray) -> int:
    """When the rise of a run began: its last point at or below its first."""
    return int(t[np.flatnonzero(m <= m[0])[-1]])


@cache
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    i, j = np.triu_indices(n, 1)
    return i, j


def _arrays(st: dict[str, Any], w: int) -> dict[str, np.ndarray]:
    """The per-rank state, grown to ``w`` ranks: the points (``t`` ns, ``m`` bytes; oldest
    first), the open second (``b0`` its first reading, ``b1`` its last, ``bmin`` its lowest),
    the newest reading folded (``seen``), and each leak's figures."""
    a: dict[str, np.ndarray] = st.setdefault("arrays", {})
    spec: dict[str, tuple[Any, Any, tuple[int, ...]]] = {
        "t": (np.int64, 0, (HISTORY,)),
        "m": (np.float64, np.nan, (HISTORY,)),
        "active": (np.bool_, False, ()),
        **{k: (np.int64, v, ()) for k, v in _INT.items()},
        **{k: (np.float64, v, ()) for k, v in _FLOAT.items()},
    }
    for k, (dt, fill, tail) in spec.items():
        old = a.get(k)
        n = 0 if old is None else len(old)
        if n < w:
            pad = np.full((w - n, *tail), fill, dtype=dt)
            a[k] = pad if old is None else np.concatenate([old, pad])
    return a


def _take(arr: np.ndarray, w: int, fill: Any) -> np.ndarray:
    out = np.full(w, fill, dtype=arr.dtype)
    n = min(w, len(arr))
    out[:n] = arr[:n]
    return out


_BOUNDS = {1: "its address-space limit", 2: "its cgroup's memory limit"}


def _room(job: JobState, rank: int, rss: float) -> tuple[float, str]:
    """The memory rank ``rank`` (RSS ``rss`` now) has left, and what bounds it: a limit of its
    own (the room its latest host sample read, less what RSS rose since), else the host's
    available memory (its total less RSS when the host sample says no more)."""
    rk = job.rank
    if rank < len(rk["mem_room_limit"]) and rk["mem_room_limit"][rank] in _BOUNDS:
        room, at = float(rk["mem_room"][rank]), float(rk["mem_room_rss"][rank])
        if room == room:
            rose = max(0.0, rss - at) if at == at else 0.0
            return max(0.0, room - rose), _BOUNDS[int(rk["mem_room_limit"][rank])]
    n = int(rk["node"][rank]) if rank < len(rk["node"]) else -1
    if not 0 <= n < len(job.node["mem_total"]):
        return np.nan, ""
    total, used = float(job.node["mem_total"][n]), float(job.node["mem_used"][n])
    if not total > 0:
        return np.nan, ""
    room = total - used if used == used and used > 0 else total - rss
    return max(0.0, room), "the host's memory"
