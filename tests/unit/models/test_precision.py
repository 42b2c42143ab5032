"""Mixed-precision benefit: Amdahl over compute, memory and unchanged time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from perfloop.exceptions import ConfigError
from perfloop.models.devices import device
from perfloop.models.precision import (
    precision_estimates,
    precision_speedup,
    precision_speedup_from_split,
)

# A100 datasheet, dense: FP32 19.5, TF32 156, BF16 312 TFLOPS; 2,039 GB/s (80 GB SXM).
A100_FP32, A100_TF32, A100_BF16, A100_BW = 19.5e12, 156e12, 312e12, 2039e9


def test_compute_bound_step_gains_the_peak_ratio() -> None:
    e = precision_speedup(1e15, 1e9, "a100-80gb")
    assert e.compute_ratio == pytest.approx(A100_BF16 / A100_FP32) == pytest.approx(16.0)
    assert e.step_s_before == pytest.approx(1e15 / A100_FP32)
    assert e.step_s_after == pytest.approx(1e15 / A100_BF16)
    assert e.speedup == pytest.approx(16.0)


def test_tf32_keeps_fp32_bytes() -> None:
    e = precision_speedup(0.0, 1e9, "a100-80gb", to_precision="tf32")
    assert e.bytes_ratio == 1.0 and e.speedup == pytest.approx(1.0)
    g = precision_speedup(1e15, 1e9, "a100-80gb", to_precision="tf32")
    assert g.speedup == pytest.approx(A100_TF32 / A100_FP32)


def test_memory_bound_step_gains_the_bytes_ratio_only() -> None:
    # 1 FLOP/byte: memory-bound in both precisions; bytes halve.
    e = precision_speedup(1e9, 1e9, "a100-80gb")
    assert e.memory_s_before == pytest.approx(1e9 / A100_BW)
    assert e.speedup == pytest.approx(2.0)
    # Optimizer state in FP32: only 60 % of bytes shrink -> 1 / (0.4 + 0.3) = 1.4286.
    p = precision_speedup(1e9, 1e9, "a100-80gb", scalable_bytes_share=0.6)
    assert p.speedup == pytest.approx(1 / 0.7)
    # FP8 on an H100: 4 bytes -> 1 byte.
    assert precision_speedup(1e9, 1e9, "h100", to_precision="fp8").bytes_ratio == 4.0


def test_unchanged_time_limits_the_gain_amdahl() -> None:
    # Compute 1 s in FP32 -> 1/16 s; 1 s of other time stays: 2 / 1.0625.
    e = precision_speedup(A100_FP32, 0.0, "a100-80gb", other_s=1.0)
    assert e.speedup == pytest.approx(2 / (1 + 1 / 16))
    assert e.saved_share == pytest.approx(1 - 1.0625 / 2)


def test_split_with_no_compute_or_memory_share_gains_nothing() -> None:
    e = precision_speedup_from_split(0.3, "h100", compute_share=0.0)
    assert e.speedup == 1.0 and e.step_s_after == pytest.approx(0.3)
    assert e.saved_share == pytest.approx(0.0)


def test_split_shares_add_up() -> None:
    # 50 % compute (x16), 30 % memory (x2), 20 % other on an A100.
    e = precision_speedup_from_split(1.0, "a100-80gb", compute_share=0.5, memory_share=0.3)
    assert e.step_s_after == pytest.approx(0.5 / 16 + 0.3 / 2 + 0.2)
    assert e.other_s == pytest.approx(0.2)


def test_fp8_is_offered_only_where_the_device_has_it() -> None:
    assert {e.to_precision for e in precision_estimates(1e15, 1e9, "a100-80gb")} == {
        "tf32",
        "bf16",
        "fp16",
    }
    h100 = precision_estimates(1e15, 1e9, "h100")
    assert h100[0].to_precision == "fp8"
    assert [e.speedup for e in h100] == sorted((e.speedup for e in h100), reverse=True)
    with pytest.raises(ConfigError, match="a100-80gb has no 'fp8' peak"):
        precision_speedup(1e15, 1e9, "a100-80gb", to_precision="fp8")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"flops": -1.0}, "flops must be finite and >= 0, got -1.0"),
        ({"bytes_moved": math.nan}, "bytes_moved must be finite"),
        ({"other_s": -0.1}, "other_s must be finite"),
        ({"scalable_bytes_share": 1.5}, r"scalable_bytes_share must be in \[0, 1\]"),
    ],
)
def test_bad_input_raises(kwargs: dict[str, float], match: str) -> None:
    args: dict[str, float] = {"flops": 1e12, "bytes_moved": 1e9, **kwargs}
    flops, bytes_moved = args.pop("flops"), args.pop("bytes_moved")
    with pytest.raises(ValueError, match=match):
        precision_speedup(flops, bytes_moved, "h100", **args)


def test_shares_over_one_raise() -> None:
    with pytest.raises(ValueError, match="compute_share \\+ memory_share must be <= 1"):
        precision_speedup_from_split(1.0, "h100", compute_share=0.7, memory_share=0.5)


work = st.floats(min_value=0.0, max_value=1e16)


@given(
    flops=work,
    bytes_moved=work,
    other=st.floats(min_value=0.0, max_value=10.0),
    share=st.floats(min_value=0.0, max_value=1.0),
    to=st.sampled_from(["tf32", "bf16", "fp16", "fp8"]),
)
def test_speedup_is_between_one_and_the_best_ratio(
    flops: float, bytes_moved: float, other: float, share: float, to: str
) -> None:
    e = precision_speedup(
        flops,
        bytes_moved,
        device("h100"),
        to_precision=to,
        other_s=other,
        scalable_bytes_share=share,
    )
    assert 1.0 - 1e-9 <= e.speedup <= max(e.compute_ratio, e.bytes_ratio) * (1 + 1e-9)


def test_a_near_zero_step_keeps_its_speedup_within_the_ratios() -> None:
    # found by hypothesis: with subnormal times the division rounded the speedup past the ratio
    e = precision_speedup(2.2250738585072014e-308, 0.0, "h100", to_precision="tf32")
    assert 1.0 <= e.speedup <= max(e.compute_ratio, e.bytes_ratio)
