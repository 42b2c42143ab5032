"""Roofline classification of a step or a kernel (Williams, Waterman & Patterson, CACM 2009).

A piece of work doing ``F`` FLOPs and moving ``Q`` bytes to and from device memory has the
arithmetic intensity ``I = F / Q``. On a device with peak ``P`` FLOP/s and memory bandwidth
``W`` B/s its attainable rate is ``min(P, I * W)``; the two roofs meet at the ridge point
``I* = P / W``. Equivalently, the work cannot finish faster than the ideal time
``max(F / P, Q / W)``, and ``roofline_fraction = ideal / measured`` says how close it came.

The class follows the diagnosis bottleneck names:

* ``overhead_bound``: the measured time is far from both roofs (``roofline_fraction`` below
  ``overhead_threshold``, 10 % by default) — launch latency, host work, synchronisation or
  waiting dominate, so neither faster math nor faster memory would help;
* ``compute_bound``: otherwise, at or right of the ridge (``I >= I*``);
* ``memory_bound``: otherwise, left of the ridge.

A ``roofline_fraction`` above 1 means the FLOP or byte counts, or the precision, are off (for
example sparse math counted as dense, or bytes served from cache counted as DRAM traffic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from perfloop.models.devices import Device, device

__all__ = ["BOUND_CLASSES", "Bound", "RooflinePoint", "roofline_point"]

Bound = Literal["memory_bound", "compute_bound", "overhead_bound"]
BOUND_CLASSES: tuple[Bound, ...] = ("memory_bound", "compute_bound", "overhead_bound")


@dataclass(frozen=True)
class RooflinePoint:
    """Where one step or kernel sits on a device's roofline, and what bounds it.

    Rates are per second, intensities in FLOP per byte; ``arithmetic_intensity`` is ``inf``
    when no bytes moved.

    >>> p = roofline_point(1e12, 1e9, 0.002, "h100", "bf16")
    >>> p.arithmetic_intensity, p.bound
    (1000.0, 'compute_bound')
    >>> round(p.compute_fraction, 3)
    0.505
    """

    device: str
    precision: str
    flops: float
    bytes_moved: float
    duration_s: float
    peak_flops: float
    bandwidth_bytes_per_s: float
    arithmetic_intensity: float
    ridge_point: float
    attainable_flops: float
    achieved_flops: float
    achieved_bytes_per_s: float
    compute_fraction: float
    bandwidth_fraction: float
    compute_time_s: float
    memory_time_s: float
    ideal_time_s: float
    roofline_fraction: float
    overhead_threshold: float
    bound: Bound


def _check(name: str, value: float, *, positive: bool = False) -> float:
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0.0 or (positive and v == 0.0):
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be finite and {need}, got {value!r}")
    return v


def roofline_point(
    flops: float,
    bytes_moved: float,
    duration_s: float,
    dev: Device | str,
    precision: str = "bf16",
    *,
    overhead_threshold: float = 0.10,
) -> RooflinePoint:
    """Place work of ``flops`` FLOPs and ``bytes_moved`` DRAM bytes, measured over
    ``duration_s`` seconds, on ``dev``'s roofline at ``precision`` and classify it.

    A kernel at intensity 10 FLOP/B on an H100 (ridge ≈ 295 FLOP/B in BF16) running at its
    bandwidth roof is memory-bound; the same kernel 20 times slower is overhead-bound:

    >>> roofline_point(10e9, 1e9, 1e9 / 3.35e12, "h100").bound
    'memory_bound'
    >>> roofline_point(10e9, 1e9, 20e9 / 3.35e12, "h100").bound
    'overhead_bound'
    """
    f = _check("flops", flops)
    q = _check("bytes_moved", bytes_moved)
    t = _check("duration_s", duration_s, positive=True)
    thr = float(overhead_threshold)
    if not 0.0 <= thr < 1.0:
        raise ValueError(f"overhead_threshold must be in [0, 1), got {overhead_threshold!r}")
    d = device(dev) if isinstance(dev, str) else dev
    peak = d.peak(precision)
    bw = d.memory_bandwidth_bytes_per_s
    intensity = f / q if q > 0.0 else (math.inf if f > 0.0 else 0.0)
    ridge = peak / bw
    attainable = peak if math.isinf(intensity) else min(peak, intensity * bw)
    compute_s, memory_s = f / peak, q / bw
    ideal_s = max(compute_s, memory_s)
    fraction = ideal_s / t
    bound: Bound
    if fraction < thr:
        bound = "overhead_bound"
    elif intensity >= ridge:
        bound = "compute_bound"
    else:
        bound = "memory_bound"
    return RooflinePoint(
        device=d.name,
        precision=precision.strip().lower(),
        flops=f,
        bytes_moved=q,
        duration_s=t,
        peak_flops=peak,
        bandwidth_bytes_per_s=bw,
        arithmetic_intensity=intensity,
        ridge_point=ridge,
        attainable_flops=attainable,
        achieved_flops=f / t,
        achieved_bytes_per_s=q / t,
        compute_fraction=f / t / peak,
        bandwidth_fraction=q / t / bw,
        compute_time_s=compute_s,
        memory_time_s=memory_s,
        ideal_time_s=ideal_s,
        roofline_fraction=fraction,
        overhead_threshold=thr,
        bound=bound,
    )
