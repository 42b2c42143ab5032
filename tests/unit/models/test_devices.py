"""The device catalog: lookup, NVML matching, and datasheet figures in SI units."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from perfloop.exceptions import ConfigError
from perfloop.models.devices import PRECISIONS, Device, device, devices, match_device

REQUIRED = ["a100-40gb", "a100-80gb", "h100", "h100-pcie", "h200", "rtx4090", "v100", "l4", "a10"]


def test_catalog_covers_the_common_training_and_inference_parts() -> None:
    assert set(REQUIRED) <= set(devices())
    assert devices() == sorted(devices())


@pytest.mark.parametrize("name", REQUIRED)
def test_entries_are_consistent(name: str) -> None:
    d = device(name)
    assert d.name == name
    assert d.memory_bytes > 0 and d.memory_bandwidth_bytes_per_s > 0 and d.tdp_w > 0
    assert d.interconnect_bytes_per_s >= d.pcie_bytes_per_s > 0
    assert set(d.peak_flops) <= set(PRECISIONS)
    assert "fp32" in d.peak_flops
    # Tensor-core half precision is never slower than FP32 on these parts.
    half = d.peak_flops.get("bf16", d.peak_flops.get("fp16"))
    assert half is not None and half > d.peak_flops["fp32"]


def test_h100_figures_are_the_dense_datasheet_ones() -> None:
    h100 = device("h100")
    # H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s.
    assert h100.peak("bf16") == pytest.approx(1979e12 / 2)
    assert h100.peak("fp8") == pytest.approx(3958e12 / 2)
    assert h100.memory_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    assert h100.memory_bytes == 80 * 2**30
    assert h100.interconnect_bytes_per_s == pytest.approx(900e9)
    assert h100.interconnect_unidirectional_bytes_per_s == pytest.approx(450e9)
    # Ridge point by hand: 989.5e12 / 3.35e12 = 295.37 FLOP/byte.
    assert h100.ridge_point("bf16") == pytest.approx(295.37, abs=0.01)


def test_a100_and_h200_memory_differ_from_their_siblings() -> None:
    assert device("a100-40gb").memory_bandwidth_bytes_per_s == pytest.approx(1555e9)
    assert device("a100-80gb").memory_bandwidth_bytes_per_s == pytest.approx(2039e9)
    assert device("h200").memory_bytes == 141 * 2**30
    assert device("h200").peak_flops == device("h100").peak_flops


def test_fp8_only_where_the_hardware_has_it() -> None:
    assert "fp8" in device("h100").peak_flops and "fp8" in device("l4").peak_flops
    assert "fp8" not in device("a100-80gb").peak_flops
    assert "bf16" not in device("v100").peak_flops


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("H100", "h100"),
        ("h100-sxm", "h100"),
        ("H100 SXM5", "h100"),
        ("h100_pcie", "h100-pcie"),
        ("RTX 4090", "rtx4090"),
        ("A100-80GB", "a100-80gb"),
        ("a100", "a100-80gb"),
        ("  L4 ", "l4"),
    ],
)
def test_lookup_ignores_case_dashes_and_takes_aliases(query: str, expected: str) -> None:
    assert device(query).name == expected


def test_unknown_device_names_the_value_and_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        device("tpu-v5")
    message = str(err.value)
    assert "'tpu-v5'" in message and "h100" in message and "rtx4090" in message
    assert "\n" not in message


def test_missing_precision_is_a_config_error_listing_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"v100 has no 'fp8' peak; valid: fp64, fp32, fp16"):
        device("v100").peak("fp8")


@pytest.mark.parametrize(
    ("nvml", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A10", "a10"),
    ],
)
def test_nvml_names_match_their_entry(nvml: str, expected: str) -> None:
    found = match_device(nvml)
    assert found is not None and found.name == expected


@pytest.mark.parametrize(
    "nvml", ["NVIDIA A10G", "NVIDIA L40S", "NVIDIA H100 NVL", "NVIDIA GeForce RTX 4090 D", ""]
)
def test_other_products_are_not_near_missed(nvml: str) -> None:
    assert match_device(nvml) is None


def test_devices_are_frozen_hashable_and_picklable() -> None:
    d = device("a10")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tdp_w = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        d.peak_flops["fp32"] = 0.0  # type: ignore[index]
    assert pickle.loads(pickle.dumps(d)) == d
    assert len({d, device("a10")}) == 1


def test_unknown_precision_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        Device("x", "X", 1, 1.0, {"fp4": 1.0}, "PCIe", 1.0, 1.0, 1.0)
