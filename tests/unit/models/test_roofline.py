"""Roofline placement and the memory/compute/overhead classification."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from perfloop.models.devices import device, devices
from perfloop.models.roofline import BOUND_CLASSES, roofline_point
from perfloop.schemas.analysis import BOTTLENECKS

H100_PEAK = 989.5e12  # BF16 dense, H100 SXM datasheet (1,979 TFLOPS with sparsity / 2)
H100_BW = 3.35e12  # HBM3, H100 SXM datasheet
H100_RIDGE = H100_PEAK / H100_BW  # 295.37 FLOP/byte


def at_roof(intensity: float, slowdown: float = 1.0) -> tuple[float, float, float]:
    """(flops, bytes, duration) of a kernel at ``intensity`` running ``slowdown``x the roof."""
    q = 1e9
    f = intensity * q
    ideal = max(f / H100_PEAK, q / H100_BW)
    return f, q, ideal * slowdown


def test_ridge_point_is_peak_over_bandwidth() -> None:
    p = roofline_point(*at_roof(10.0), "h100", "bf16")
    assert p.ridge_point == pytest.approx(H100_RIDGE)
    assert p.ridge_point == pytest.approx(295.37, abs=0.01)


@pytest.mark.parametrize("factor", [0.1, 0.5, 0.9])
def test_left_of_the_ridge_is_memory_bound(factor: float) -> None:
    p = roofline_point(*at_roof(H100_RIDGE * factor, slowdown=1.5), "h100", "bf16")
    assert p.bound == "memory_bound"
    assert p.attainable_flops == pytest.approx(H100_RIDGE * factor * H100_BW)
    assert p.bandwidth_fraction == pytest.approx(1 / 1.5)
    assert p.roofline_fraction == pytest.approx(1 / 1.5)


@pytest.mark.parametrize("factor", [1.0, 1.1, 10.0])
def test_at_or_right_of_the_ridge_is_compute_bound(factor: float) -> None:
    p = roofline_point(*at_roof(H100_RIDGE * factor, slowdown=2.0), "h100", "bf16")
    assert p.bound == "compute_bound"
    assert p.attainable_flops == pytest.approx(H100_PEAK)
    assert p.compute_fraction == pytest.approx(0.5)


def test_far_below_the_roof_is_overhead_bound_on_either_side() -> None:
    for factor in (0.2, 5.0):
        p = roofline_point(*at_roof(H100_RIDGE * factor, slowdown=50.0), "h100", "bf16")
        assert p.bound == "overhead_bound"
        assert p.roofline_fraction == pytest.approx(0.02)


def test_overhead_threshold_is_a_parameter() -> None:
    work = at_roof(50.0, slowdown=5.0)  # 20 % of the roof
    assert roofline_point(*work, "h100").bound == "memory_bound"
    assert roofline_point(*work, "h100", overhead_threshold=0.25).bound == "overhead_bound"
    assert roofline_point(*work, "h100", overhead_threshold=0.0).bound == "memory_bound"


def test_precision_moves_the_ridge() -> None:
    # 100 FLOP/byte: right of the FP32 ridge (67e12 / 3.35e12 = 20), left of the BF16 one.
    work = at_roof(100.0)
    assert roofline_point(*work, "h100", "fp32").bound == "compute_bound"
    assert roofline_point(*work, "h100", "bf16").bound == "memory_bound"


def test_no_bytes_or_no_flops() -> None:
    p = roofline_point(1e12, 0.0, 1.0, "h100")
    assert math.isinf(p.arithmetic_intensity) and p.attainable_flops == H100_PEAK
    assert p.bound == "overhead_bound"  # 1 TFLOP in a second is 0.1 % of peak
    q = roofline_point(0.0, 3.35e12, 1.0, "h100")
    assert q.arithmetic_intensity == 0.0 and q.bound == "memory_bound"
    idle = roofline_point(0.0, 0.0, 1e-3, "h100")
    assert idle.bound == "overhead_bound" and idle.roofline_fraction == 0.0


def test_classes_match_the_diagnosis_bottleneck_names() -> None:
    assert {BOTTLENECKS[c] for c in BOUND_CLASSES} == {"kernel"}


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1.0, 1.0, 1.0), "flops must be finite and >= 0, got -1.0"),
        ((1.0, math.nan, 1.0), "bytes_moved must be finite and >= 0, got nan"),
        ((1.0, 1.0, 0.0), "duration_s must be finite and > 0, got 0.0"),
        ((1.0, 1.0, math.inf), "duration_s must be finite and > 0, got inf"),
    ],
)
def test_bad_input_raises_one_line_value_error(
    args: tuple[float, float, float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        roofline_point(*args, "h100")


def test_bad_threshold_raises() -> None:
    with pytest.raises(ValueError, match="overhead_threshold"):
        roofline_point(1.0, 1.0, 1.0, "h100", overhead_threshold=1.5)


positive = st.floats(min_value=1e3, max_value=1e16, allow_nan=False, allow_infinity=False)


@given(
    flops=positive,
    bytes_moved=positive,
    duration=st.floats(min_value=1e-7, max_value=1e3),
    name=st.sampled_from(devices()),
)
def test_attainable_never_exceeds_either_roof(
    flops: float, bytes_moved: float, duration: float, name: str
) -> None:
    d = device(name)
    precision = d.precisions[1]  # fp32 or tf32, present everywhere
    p = roofline_point(flops, bytes_moved, duration, d, precision)
    peak, bw = d.peak(precision), d.memory_bandwidth_bytes_per_s
    assert p.attainable_flops <= min(peak, p.arithmetic_intensity * bw) * (1 + 1e-12)
    assert p.bound in BOUND_CLASSES
    # The roofline fraction is the achieved share of the attainable rate.
    assert p.roofline_fraction == pytest.approx(p.achieved_flops / p.attainable_flops)
