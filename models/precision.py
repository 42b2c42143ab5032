"""Mixed-precision benefit: what a step would take in a lower precision on the same device.

The step splits into three parts that move independently (Amdahl's law):

* **compute** — time in math-bound kernels; it scales with the ratio of dense peaks,
  ``peak[from] / peak[to]`` (FP32 → BF16 on an H100: 67 → 989.5 TFLOP/s);
* **memory** — time in bandwidth-bound kernels; it scales with the bytes moved. The share
  ``scalable_bytes_share`` of the bytes (activations, weights, gradients) shrinks with the element
  size (4 → 2 bytes for BF16/FP16, → 1 for FP8); the rest (FP32 master weights and optimizer
  state under the usual mixed-precision recipe) does not. TF32 stores FP32, so its bytes stay;
* **other** — launch overhead, host work, communication, data waits: unchanged.

Assumptions, which make the result an upper bound on the gain: kernels keep the same fraction
of peak FLOP/s and bandwidth in both precisions, no new casts are added, and the FLOP count does
not change. FP8 recipes keep many tensors in BF16: pass a smaller ``scalable_bytes_share`` for
them. From FLOPs and bytes (:func:`precision_speedup`) compute and memory overlap as in the
roofline, ``max(compute, memory) + other``; from a measured split
(:func:`precision_speedup_from_split`) the parts add up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perfloop.models.devices import Device, device

__all__ = [
    "ELEMENT_BYTES",
    "PrecisionEstimate",
    "precision_estimates",
    "precision_speedup",
    "precision_speedup_from_split",
]

ELEMENT_BYTES: dict[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,  # TF32 is a tensor-core math mode on FP32 storage
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
}
"""Bytes per stored element at each precision."""


@dataclass(frozen=True)
class PrecisionEstimate:
    """A step's time, by part, before and after a precision change, and the speedup.

    >>> e = precision_speedup_from_split(1.0, "h100", compute_share=0.5)
    >>> round(e.compute_ratio, 2), round(e.speedup, 3)
    (14.77, 1.873)
    """

    device: str
    from_precision: str
    to_precision: str
    compute_ratio: float  # peak[to] / peak[from]
    bytes_ratio: float  # bytes before / bytes after
    compute_s_before: float
    memory_s_before: float
    other_s: float
    compute_s_after: float
    memory_s_after: float
    step_s_before: float
    step_s_after: float
    speedup: float  # step_s_before / step_s_after

    @property
    def saved_share(self) -> float:
        """Fraction of the current step time saved (0 when nothing changes)."""
        if self.step_s_before == 0.0:
            return 0.0
        return 1.0 - self.step_s_after / self.step_s_before


def _nonneg(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return v


def _ratios(
    d: Device, from_precision: str, to_precision: str, scalable_bytes_share: float
) -> tuple[str, str, float, float]:
    src, dst = from_precision.strip().lower(), to_precision.strip().lower()
    compute_ratio = d.peak(dst) / d.peak(src)  # ConfigError names the valid precisions
    share = _nonneg("scalable_bytes_share", scalable_bytes_share)
    if share > 1.0:
        raise ValueError(f"scalable_bytes_share must be in [0, 1], got {scalable_bytes_share!r}")
    shrink = ELEMENT_BYTES[dst] / ELEMENT_BYTES[src]
    bytes_ratio = 1.0 / (1.0 - share + share * shrink)
    return src, dst, compute_ratio, bytes_ratio


def precision_speedup(
    flops: float,
    bytes_moved: float,
    dev: Device | str,
    *,
    from_precision: str = "fp32",
    to_precision: str = "bf16",
    other_s: float = 0.0,
    scalable_bytes_share: float = 1.0,
) -> PrecisionEstimate:
    """Estimate from a step's FLOPs and DRAM bytes, plus ``other_s`` seconds of non-GPU time.

    A GEMM-heavy step on an A100 (intensity 1,000 FLOP/B, compute-bound in both precisions)
    gains the full FP32 → BF16 peak ratio, 312 / 19.5 = 16; a copy-like step (no FLOPs) gains
    only the halved bytes:

    >>> precision_speedup(1e12, 1e9, "a100-80gb").speedup
    16.0
    >>> precision_speedup(0.0, 1e9, "a100-80gb").speedup
    2.0
    """
    d = device(dev) if isinstance(dev, str) else dev
    f = _nonneg("flops", flops)
    q = _nonneg("bytes_moved", bytes_moved)
    o = _nonneg("other_s", other_s)
    src, dst, c_ratio, b_ratio = _ratios(d, from_precision, to_precision, scalable_bytes_share)
    c0, m0 = f / d.peak(src), q / d.memory_bandwidth_bytes_per_s
    c1, m1 = c0 / c_ratio, m0 / b_ratio
    before, after = max(c0, m0) + o, max(c1, m1) + o
    return _estimate(d, src, dst, c_ratio, b_ratio, (c0, m0, o, c1, m1), before, after)


def precision_speedup_from_split(
    step_time_s: float,
    dev: Device | str,
    *,
    compute_share: float,
    memory_share: float = 0.0,
    from_precision: str = "fp32",
    to_precision: str = "bf16",
    scalable_bytes_share: float = 1.0,
) -> PrecisionEstimate:
    """Estimate from a measured step time split into compute, memory and other shares.

    Half the step in FP32 math on an H100 (BF16 peak 14.8× the FP32 one) caps the gain near 2:

    >>> round(precision_speedup_from_split(0.2, "h100", compute_share=0.5).speedup, 2)
    1.87
    >>> precision_speedup_from_split(0.2, "h100", compute_share=0.0).speedup
    1.0
    """
    d = device(dev) if isinstance(dev, str) else dev
    t = _nonneg("step_time_s", step_time_s)
    cs, ms = _nonneg("compute_share", compute_share), _nonneg("memory_share", memory_share)
    if cs + ms > 1.0 + 1e-9:
        raise ValueError(f"compute_share + memory_share must be <= 1, got {cs + ms!r}")
    src, dst, c_ratio, b_ratio = _ratios(d, from_precision, to_precision, scalable_bytes_share)
    c0, m0 = cs * t, ms * t
    o = max(0.0, t - c0 - m0)
    c1, m1 = c0 / c_ratio, m0 / b_ratio
    after = c1 + m1 + o
    return _estimate(d, src, dst, c_ratio, b_ratio, (c0, m0, o, c1, m1), t, after)


def _estimate(
    d: Device,
    src: str,
    dst: str,
    c_ratio: float,
    b_ratio: float,
    parts: tuple[float, float, float, float, float],
    before: float,
    after: float,
) -> PrecisionEstimate:
    """``parts``: compute and memory time before, other time, compute and memory time after."""
    c0, m0, o, c1, m1 = parts
    # the speedup lies between 1 and the larger ratio (or the smaller, for a slower precision);
    # clamped so rounding in subnormal times (a near-zero step) cannot carry it outside
    lo, hi = min(1.0, c_ratio, b_ratio), max(1.0, c_ratio, b_ratio)
    speedup = min(max(before / after, lo), hi) if after > 0.0 else 1.0
    return PrecisionEstimate(
        device=d.name,
        from_precision=src,
        to_precision=dst,
        compute_ratio=c_ratio,
        bytes_ratio=b_ratio,
        compute_s_before=c0,
        memory_s_before=m0,
        other_s=o,
        compute_s_after=c1,
        memory_s_after=m1,
        step_s_before=before,
        step_s_after=after,
        speedup=speedup,
    )


def precision_estimates(
    flops: float,
    bytes_moved: float,
    dev: Device | str,
    *,
    from_precision: str = "fp32",
    other_s: float = 0.0,
    scalable_bytes_share: float = 1.0,
) -> list[PrecisionEstimate]:
    """Estimates for every training precision the device lists other than ``from_precision``
    (among TF32, BF16, FP16, FP8), best first.

    >>> [e.to_precision for e in precision_estimates(1e12, 1e9, "h100")]
    ['fp8', 'bf16', 'fp16', 'tf32']
    >>> [e.to_precision for e in precision_estimates(1e12, 1e9, "v100")]
    ['fp16']
    """
    d = device(dev) if isinstance(dev, str) else dev
    src = from_precision.strip().lower()
    out = [
        precision_speedup(
            flops,
            bytes_moved,
            d,
            from_precision=src,
            to_precision=p,
            other_s=other_s,
            scalable_bytes_share=scalable_bytes_share,
        )
        for p in ("tf32", "bf16", "fp16", "fp8")
        if p in d.peak_flops and p != src
    ]
    return sorted(out, key=lambda e: -e.speedup)  # stable: ties keep the listed order
