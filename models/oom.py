"""Time until a rank runs out of GPU memory, from the trend of its per-step memory peaks.

`TimeToOOM` watches one rank's memory, one training step at a time, and forecasts how many
seconds remain until the step's peak reaches the device's memory less ``margin_bytes`` (the
CUDA context and the allocator's fragmentation, which torch's counters do not see). It answers
``math.inf`` unless memory is growing *significantly and steadily*.

**Blocks.** Steps are grouped in blocks of ``block_steps``; each completed block keeps its
median time, its median peak (its *level*, robust to allocator spikes) and its step-to-step
jitter σ (the median absolute deviation of the differences between consecutive peaks,
× 1.4826 / √2, at least ``floor_bytes``: a trend inside the block is not jitter). The standard
error of a level is ``1.2533 σ / √block_steps`` (that of a median of Gaussian values). A
*window* is ``blocks`` consecutive levels; the model keeps the last three windows (sharing
their end blocks, ``3 · blocks − 2`` levels, 208 steps by default). Memory is growing when,
over the newest window:

* **significantly**: each rise between consecutive levels exceeds ``z`` times its standard
  error, so step-to-step jitter alone never makes a trend;
* **steadily**: *every* rise does, so a one-off jump (a larger batch, a new buffer), which
  lifts at most two consecutive rises (the block it falls in is part old, part new), or a
  periodic allocator spike, which the medians ignore, never reads as growth;
* **without levelling off**: when the newest window's rise is significantly (``z``) smaller
  than the oldest window's, the growth is decelerating (a warm-up); the per-block rise is taken
  to shrink geometrically at the ratio those two rises imply, the growth still to come is that
  series' sum, and no OOM is forecast while it stays below the headroom. A steady leak rises
  alike in every window (up to jitter), so this never hides one; a leak that follows a steeper
  warm-up (or a jump) is forecast once those have left the oldest window.

The growth rate is the smallest of the newest window's block-to-block rates (conservative: the
latest rate of a decelerating curve), and the forecast is ``(total − margin − recent peak) /
rate``, counted from the last step seen (less the time since, when ``x`` carries ``ts_s``); the
recent peak is the highest peak of the last completed block and the current one (and of
``x``), so the jitter and spikes on top of the trend are inside the headroom. Nothing is
forecast before the three windows are complete (start-up growth: allocator, optimizer state);
after that a leak is forecast about ``blocks × block_steps`` steps after it starts (80 by
default: 8 s at 100 ms per step).

``learn_one(x)`` takes one step of one rank: ``x["ts_s"]`` (event time, s),
``x["mem_peak_bytes"]`` (the step's peak allocated memory, or ``mem_allocated_bytes`` when no
peak is reported — then the forecast is for the allocated memory, later than the real OOM) and
``x["mem_total_bytes"]`` (the device's memory, e.g. `JobInfo.gpu_mem_bytes`; the last one seen
is kept). A step without a time or a memory figure is skipped; without a known total the
forecast is ``math.inf``. `warning` says whether the forecast falls within a horizon.

Cost: ~2 µs per ``learn_one`` + ``warning`` (amortised; a block's statistics are computed
once when it completes), measured on this project's 2-core CI machine with CPython 3.11.

>>> m = TimeToOOM()
>>> gib = float(1 << 30)
>>> for i in range(400):  # flat at 40 GiB for 20 s, then leaking 50 MiB per 100-ms step
...     leak = max(0, i - 200) * 50 * 2**20
...     m.learn_one({"ts_s": i * 0.1, "mem_peak_bytes": 40 * gib + leak,
...                  "mem_total_bytes": 80 * gib})
>>> round(m.predict_one({"ts_s": 39.9}))  # (80 - 1 - 49.7) GiB at 0.49 GiB/s
60
>>> m.warning({"ts_s": 39.9}, horizon_s=120.0), m.warning({"ts_s": 39.9}, horizon_s=30.0)
(True, False)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from itertools import pairwise

import numpy as np

from perfloop.models.base import Features, Forecaster, feature, register

__all__ = ["TimeToOOM"]

_MEDIAN_SE = 1.2533  # standard error of a median of n Gaussian values: ~1.2533 σ / √n
_MAD_SIGMA = 1.4826  # σ of Gaussian values from their median absolute deviation


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    h = n // 2
    return s[h] if n % 2 else 0.5 * (s[h - 1] + s[h])


def _leak_stream(seed: int) -> Iterator[tuple[dict[str, float], float | None]]:
    """One rank's steps: flat peaks with jitter and an allocator spike every 25 steps, then a
    leak of 40 MiB per step from step 120 on (100-ms steps, 80 GB device)."""
    rng = np.random.default_rng(seed)
    for i in range(240):
        peak = 50e9 + rng.normal(0, 30e6) + (2e9 if i % 25 == 0 else 0.0)
        peak += max(0, i - 120) * 40 * 2**20
        yield {"ts_s": 1000.0 + i * 0.1, "mem_peak_bytes": peak, "mem_total_bytes": 80e9}, None


@register(
    example=lambda: TimeToOOM(block_steps=8, blocks=3),
    stream=_leak_stream,
)
class TimeToOOM(Forecaster):
    """Seconds until a rank's per-step memory peak reaches its device's memory (`math.inf`
    when memory is not growing significantly); see the module's docstring for the method."""

    def __init__(
        self,
        block_steps: int = 16,
        blocks: int = 5,
        z: float = 3.0,
        margin_bytes: float = float(1 << 30),
        floor_bytes: float = float(1 << 20),
    ) -> None:
        if block_steps < 2 or blocks < 3:
            raise ValueError(f"need block_steps >= 2 and blocks >= 3, got {block_steps}, {blocks}")
        if not (z > 0 and margin_bytes >= 0 and floor_bytes > 0):
            raise ValueError(
                "need z > 0, margin_bytes >= 0, floor_bytes > 0; got "
                f"{z!r}, {margin_bytes!r}, {floor_bytes!r}"
            )
        self.block_steps = block_steps
        self.blocks = blocks
        self.z = z
        self.margin_bytes = margin_bytes
        self.floor_bytes = floor_bytes
        self.n_seen = 0
        self._ts: list[float] = []  # the current block's times and peaks
        self._ys: list[float] = []
        self._cur_max = -math.inf
        # completed blocks, newest last: (median time, level, standard error of the level, max)
        self._done: deque[tuple[float, float, float, float]] = deque(maxlen=3 * blocks - 2)
        self._t_last = math.nan
        self._total = math.nan
        self._rate = 0.0  # significant steady growth, bytes/s (0: none)
        self._room_cap = math.inf  # growth still to come of a levelling curve, bytes

    # -- learning ---------------------------------------------------------------------------
    def learn_one(self, x: Features, y: float | None = None) -> None:
        total = feature(x, "mem_total_bytes")
        if total is not None and total > 0:
            self._total = total
        t = feature(x, "ts_s")
        peak = feature(x, "mem_peak_bytes")
        if peak is None or peak <= 0:
            peak = feature(x, "mem_allocated_bytes")
        if t is None or peak is None:
            return
        self.n_seen += 1
        self._t_last = t
        self._ts.append(t)
        self._ys.append(peak)
        if peak > self._cur_max:
            self._cur_max = peak
        if len(self._ys) >= self.block_steps:
            self._close_block()

    def _close_block(self) -> None:
        ys = self._ys
        level = _median(ys)
        steps = [b - a for a, b in pairwise(ys)]
        mid = _median(steps)
        # jitter from step-to-step differences: a trend inside the block does not count
        mad = _median([abs(d - mid) for d in steps])
        sigma = max(_MAD_SIGMA * mad / math.sqrt(2.0), self.floor_bytes)
        se = _MEDIAN_SE * sigma / math.sqrt(len(ys))
        self._done.append((_median(self._ts), level, se, self._cur_max))
        self._ts, self._ys, self._cur_max = [], [], -math.inf
        self._update_trend()

    def _update_trend(self) -> None:
        self._rate, self._room_cap = 0.0, math.inf
        b, k, z = self._done, self.blocks, self.z
        if len(b) < 3 * k - 2:
            return
        new = list(b)[-k:]
        rates: list[float] = []
        for (t0, l0, s0, _), (t1, l1, s1, _) in pairwise(new):
            if not (l1 - l0 > z * math.hypot(s0, s1) and t1 > t0):
                return  # not rising significantly across every block: no trend
            rates.append((l1 - l0) / (t1 - t0))
        self._rate = min(rates)
        (_, l0, s0, _), (_, l1, s1, _) = b[0], b[k - 1]  # the oldest window's ends
        (_, l2, s2, _), (_, l3, s3, _) = new[0], new[-1]
        old_rise, new_rise = l1 - l0, l3 - l2
        if new_rise < old_rise - z * math.sqrt(s0 * s0 + s1 * s1 + s2 * s2 + s3 * s3):
            # slowing down by `ratio` per block over the 2 (k - 1) blocks between the windows
            ratio = (new_rise / old_rise) ** (1.0 / (2 * k - 2))
            self._room_cap = new_rise / (k - 1) * ratio / (1.0 - ratio)

    # -- answers ----------------------------------------------------------------------------
    def predict_one(self, x: Features) -> float:
        """Seconds from ``x["ts_s"]`` (or the last step seen) until the peak reaches the
        device's memory less ``margin_bytes``; 0.0 when it already has; `math.inf` when memory
        is not growing significantly (or not yet known to)."""
        if self._rate <= 0:
            return math.inf
        total = feature(x, "mem_total_bytes")
        total = self._total if total is None or total <= 0 else total
        if not total > 0:
            return math.inf
        recent = max(self._done[-1][3], self._cur_max)
        now_peak = feature(x, "mem_peak_bytes")
        if now_peak is not None:
            recent = max(recent, now_peak)
        room = total - self.margin_bytes - recent
        if room <= 0:
            return 0.0
        if room > self._room_cap:
            return math.inf  # a levelling curve: it stops growing before the memory runs out
        now = feature(x, "ts_s")
        since = 0.0 if now is None else max(0.0, now - self._t_last)
        return max(0.0, room / self._rate - since)

    def warning(self, x: Features, horizon_s: float = 120.0) -> bool:
        """Whether to warn now: the forecast (`predict_one`) is within ``horizon_s`` seconds.

        Pure, like `predict_one`. The default horizon (2 min) leaves time to checkpoint; a
        longer one warns earlier on a leak, and earlier on a long warm-up too.
        """
        return self.predict_one(x) <= horizon_s

    @property
    def growth_bytes_per_s(self) -> float:
        """The significant steady growth rate the forecast uses (0.0 when there is none)."""
        return self._rate
