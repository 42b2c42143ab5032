"""Device catalog: the datasheet figures the analytical models reason with.

Every figure is the vendor's datasheet figure, converted to SI units:

* ``peak_flops`` holds **dense** rates (no structured sparsity); NVIDIA prints the sparse rate
  first for tensor cores, so those figures are halved here. For each precision the catalog keeps
  the best dense rate the datasheet lists (the tensor-core rate where the precision has one,
  e.g. FP64 Tensor Core on A100/H100); ``fp32`` is the CUDA-core (non-tensor) rate and ``tf32``
  the tensor-core rate on FP32 data. Only the precisions the datasheet lists are present.
  GeForce parts run FP16/BF16/FP8 tensor math at half rate with FP32 accumulation, which is what
  mixed-precision training uses, so those are the figures kept for the RTX 4090.
* ``memory_bytes`` reads the datasheet "GB" as GiB (2**30 bytes): HBM and GDDR parts come in
  binary sizes (an "80GB" H100 holds 80 GiB). NVML reports a little less (ECC, driver reserve).
* Bandwidths are decimal (1 GB/s = 1e9 B/s). ``interconnect_bytes_per_s`` and
  ``pcie_bytes_per_s`` are **bidirectional totals per GPU**, as the datasheets print them
  (NVLink 4: 900 GB/s = 450 GB/s each way; PCIe 4.0 x16: 64 GB/s = 32 GB/s each way); use
  :attr:`Device.interconnect_unidirectional_bytes_per_s` for one direction. Parts without
  NVLink list their PCIe link as the interconnect.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from perfloop.exceptions import ConfigError

__all__ = ["PRECISIONS", "Device", "device", "devices", "match_device"]

PRECISIONS: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
"""Precision names a ``peak_flops`` mapping may use (``int8`` rates are integer OP/s)."""

_GIB = 2**30
_T = 1e12  # tera (FLOP/s)
_G = 1e9  # giga (B/s)


@dataclass(frozen=True)
class Device:
    """One accelerator's datasheet figures, in SI units (see the module docstring).

    >>> h100 = device("h100")
    >>> h100.full_name
    'NVIDIA H100 SXM5 80GB'
    >>> h100.peak("bf16") / 1e12
    989.5
    >>> round(h100.ridge_point("bf16"), 1)  # FLOP per byte where the roofline bends
    295.4
    """

    name: str
    full_name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    peak_flops: Mapping[str, float] = field(hash=False)
    interconnect: str
    interconnect_bytes_per_s: float
    pcie_bytes_per_s: float
    tdp_w: float
    memory_type: str = ""
    aliases: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        unknown = sorted(set(self.peak_flops) - set(PRECISIONS))
        if unknown:
            raise ValueError(f"unknown precision {unknown[0]!r}; valid: {', '.join(PRECISIONS)}")
        # A read-only view keeps the frozen dataclass honestly immutable.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # MappingProxyType does not pickle; rebuild from a plain dict.
        return (
            Device,
            (
                self.name,
                self.full_name,
                self.memory_bytes,
                self.memory_bandwidth_bytes_per_s,
                dict(self.peak_flops),
                self.interconnect,
                self.interconnect_bytes_per_s,
                self.pcie_bytes_per_s,
                self.tdp_w,
                self.memory_type,
                self.aliases,
            ),
        )

    @property
    def precisions(self) -> tuple[str, ...]:
        """Precisions this device lists, in :data:`PRECISIONS` order."""
        return tuple(p for p in PRECISIONS if p in self.peak_flops)

    @property
    def interconnect_unidirectional_bytes_per_s(self) -> float:
        """Interconnect bandwidth in one direction (half the bidirectional total)."""
        return self.interconnect_bytes_per_s / 2.0

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; :class:`ConfigError` if the device lacks it.

        >>> device("v100").peak("fp16") / 1e12
        125.0
        """
        key = precision.strip().lower()
        if key not in self.peak_flops:
            raise ConfigError(
                f"{self.name} has no {precision!r} peak; valid: {', '.join(self.precisions)}"
            )
        return self.peak_flops[key]

    def ridge_point(self, precision: str) -> float:
        """Arithmetic intensity (FLOP/byte) where compute and memory roofs meet."""
        return self.peak(precision) / self.memory_bandwidth_bytes_per_s


_CATALOG: tuple[Device, ...] = (
    # NVIDIA Tesla V100 datasheet (V100 SXM2 column); tensor FP16 is dense already.
    Device(
        name="v100",
        full_name="NVIDIA Tesla V100 SXM2 32GB",
        memory_bytes=32 * _GIB,
        memory_bandwidth_bytes_per_s=900 * _G,
        peak_flops={"fp64": 7.8 * _T, "fp32": 15.7 * _T, "fp16": 125 * _T},
        interconnect="NVLink 2",
        interconnect_bytes_per_s=300 * _G,
        pcie_bytes_per_s=32 * _G,
        tdp_w=300,
        memory_type="HBM2",
        aliases=("v100-32gb", "v100-sxm2", "v100-sxm2-32gb"),
    ),
    # Same datasheet, 16 GB SXM2 variant: same compute and bandwidth, half the memory.
    Device(
        name="v100-16gb",
        full_name="NVIDIA Tesla V100 SXM2 16GB",
        memory_bytes=16 * _GIB,
        memory_bandwidth_bytes_per_s=900 * _G,
        peak_flops={"fp64": 7.8 * _T, "fp32": 15.7 * _T, "fp16": 125 * _T},
        interconnect="NVLink 2",
        interconnect_bytes_per_s=300 * _G,
        pcie_bytes_per_s=32 * _G,
        tdp_w=300,
        memory_type="HBM2",
        aliases=("v100-sxm2-16gb",),
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM column); dense = sparse / 2.
    Device(
        name="a100-40gb",
        full_name="NVIDIA A100 SXM4 40GB",
        memory_bytes=40 * _GIB,
        memory_bandwidth_bytes_per_s=1555 * _G,
        peak_flops={
            "fp64": 19.5 * _T,
            "fp32": 19.5 * _T,
            "tf32": 156 * _T,
            "bf16": 312 * _T,
            "fp16": 312 * _T,
            "int8": 624 * _T,
        },
        interconnect="NVLink 3",
        interconnect_bytes_per_s=600 * _G,
        pcie_bytes_per_s=64 * _G,
        tdp_w=400,
        memory_type="HBM2",
        aliases=("a100-sxm4-40gb", "a100-40gb-sxm"),
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column); dense = sparse / 2.
    Device(
        name="a100-80gb",
        full_name="NVIDIA A100 SXM4 80GB",
        memory_bytes=80 * _GIB,
        memory_bandwidth_bytes_per_s=2039 * _G,
        peak_flops={
            "fp64": 19.5 * _T,
            "fp32": 19.5 * _T,
            "tf32": 156 * _T,
            "bf16": 312 * _T,
            "fp16": 312 * _T,
            "int8": 624 * _T,
        },
        interconnect="NVLink 3",
        interconnect_bytes_per_s=600 * _G,
        pcie_bytes_per_s=64 * _G,
        tdp_w=400,
        memory_type="HBM2e",
        aliases=("a100", "a100-sxm4-80gb", "a100-80gb-sxm", "a100-sxm"),
    ),
    # NVIDIA A10 Tensor Core GPU datasheet; dense = sparse / 2.
    Device(
        name="a10",
        full_name="NVIDIA A10",
        memory_bytes=24 * _GIB,
        memory_bandwidth_bytes_per_s=600 * _G,
        peak_flops={
            "fp32": 31.2 * _T,
            "tf32": 62.5 * _T,
            "bf16": 125 * _T,
            "fp16": 125 * _T,
            "int8": 250 * _T,
        },
        interconnect="PCIe 4.0",
        interconnect_bytes_per_s=64 * _G,
        pcie_bytes_per_s=64 * _G,
        tdp_w=150,
        memory_type="GDDR6",
        aliases=("a10-24gb",),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column); dense = sparse / 2.
    Device(
        name="h100",
        full_name="NVIDIA H100 SXM5 80GB",
        memory_bytes=80 * _GIB,
        memory_bandwidth_bytes_per_s=3350 * _G,
        peak_flops={
            "fp64": 67 * _T,
            "fp32": 67 * _T,
            "tf32": 494.5 * _T,
            "bf16": 989.5 * _T,
            "fp16": 989.5 * _T,
            "fp8": 1979 * _T,
            "int8": 1979 * _T,
        },
        interconnect="NVLink 4",
        interconnect_bytes_per_s=900 * _G,
        pcie_bytes_per_s=128 * _G,
        tdp_w=700,
        memory_type="HBM3",
        aliases=("h100-sxm", "h100-sxm5", "h100-80gb", "h100-sxm5-80gb"),
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column); dense = sparse / 2.
    # Its NVLink is a 2- or 4-GPU bridge; TDP is 300-350 W configurable, the maximum kept.
    Device(
        name="h100-pcie",
        full_name="NVIDIA H100 PCIe 80GB",
        memory_bytes=80 * _GIB,
        memory_bandwidth_bytes_per_s=2000 * _G,
        peak_flops={
            "fp64": 51 * _T,
            "fp32": 51 * _T,
            "tf32": 378 * _T,
            "bf16": 756.5 * _T,
            "fp16": 756.5 * _T,
            "fp8": 1513 * _T,
            "int8": 1513 * _T,
        },
        interconnect="NVLink 4 bridge",
        interconnect_bytes_per_s=600 * _G,
        pcie_bytes_per_s=128 * _G,
        tdp_w=350,
        memory_type="HBM2e",
        aliases=("h100-pcie-80gb",),
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column); dense = sparse / 2.
    Device(
        name="h200",
        full_name="NVIDIA H200 SXM 141GB",
        memory_bytes=141 * _GIB,
        memory_bandwidth_bytes_per_s=4800 * _G,
        peak_flops={
            "fp64": 67 * _T,
            "fp32": 67 * _T,
            "tf32": 494.5 * _T,
            "bf16": 989.5 * _T,
            "fp16": 989.5 * _T,
            "fp8": 1979 * _T,
            "int8": 1979 * _T,
        },
        interconnect="NVLink 4",
        interconnect_bytes_per_s=900 * _G,
        pcie_bytes_per_s=128 * _G,
        tdp_w=700,
        memory_type="HBM3e",
        aliases=("h200-sxm", "h200-141gb"),
    ),
    # NVIDIA L4 Tensor Core GPU datasheet; dense = sparse / 2.
    Device(
        name="l4",
        full_name="NVIDIA L4",
        memory_bytes=24 * _GIB,
        memory_bandwidth_bytes_per_s=300 * _G,
        peak_flops={
            "fp32": 30.3 * _T,
            "tf32": 60 * _T,
            "bf16": 121 * _T,
            "fp16": 121 * _T,
            "fp8": 242.5 * _T,
            "int8": 242.5 * _T,
        },
        interconnect="PCIe 4.0",
        interconnect_bytes_per_s=64 * _G,
        pcie_bytes_per_s=64 * _G,
        tdp_w=72,
        memory_type="GDDR6",
        aliases=("l4-24gb",),
    ),
    # NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090 column): dense
    # tensor rates with FP32 accumulate; TGP 450 W. No NVLink.
    Device(
        name="rtx4090",
        full_name="NVIDIA GeForce RTX 4090",
        memory_bytes=24 * _GIB,
        memory_bandwidth_bytes_per_s=1008 * _G,
        peak_flops={
            "fp32": 82.6 * _T,
            "tf32": 82.6 * _T,
            "bf16": 165.2 * _T,
            "fp16": 165.2 * _T,
            "fp8": 330.3 * _T,
            "int8": 660.6 * _T,
        },
        interconnect="PCIe 4.0",
        interconnect_bytes_per_s=64 * _G,
        pcie_bytes_per_s=64 * _G,
        tdp_w=450,
        memory_type="GDDR6X",
        aliases=("4090", "rtx-4090", "geforce-rtx-4090"),
    ),
)


def _key(name: str) -> str:
    """Lookup key: lowercase, with spaces, dashes and underscores dropped."""
    return re.sub(r"[\s_\-]+", "", name.strip().lower())


_BY_NAME: Mapping[str, Device] = MappingProxyType(
    {_key(n): d for d in _CATALOG for n in (d.name, *d.aliases)}
)


def devices() -> list[str]:
    """Catalog names, sorted.

    >>> devices()[:3]
    ['a10', 'a100-40gb', 'a100-80gb']
    """
    return sorted(d.name for d in _CATALOG)


def device(name: str) -> Device:
    """The catalog entry for ``name`` (case-, dash-, space-insensitive; aliases accepted).

    >>> device("H100-SXM").name
    'h100'
    >>> device("RTX 4090").memory_bytes // 2**30
    24
    """
    found = _BY_NAME.get(_key(name))
    if found is None:
        raise ConfigError(f"unknown device {name!r}; valid: {', '.join(devices())}")
    return found


# NVML product names, normalised by _nvml_key, for each catalog entry. Exact names only: a
# variant with other figures (A100 PCIe, H100 NVL, A10G, RTX 4090 D, laptop parts) gets None
# rather than a near miss.
_NVML_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "V100 SXM2 32GB": "v100",
        "V100 DGXS 32GB": "v100",
        "V100 SXM2 16GB": "v100-16gb",
        "V100 DGXS 16GB": "v100-16gb",
        "A100 SXM4 40GB": "a100-40gb",
        "A100 SXM4 80GB": "a100-80gb",
        "A10": "a10",
        "H100 80GB HBM3": "h100",
        "H100 SXM5 80GB": "h100",
        "H100 SXM5": "h100",
        "H100 PCIE": "h100-pcie",
        "H200": "h200",
        "H200 141GB HBM3E": "h200",
        "L4": "l4",
        "RTX 4090": "rtx4090",
    }
)


def _nvml_key(nvml_name: str) -> str:
    words = re.sub(r"[\s_\-]+", " ", nvml_name.strip().upper()).split()
    while words and words[0] in ("NVIDIA", "TESLA", "GEFORCE"):
        words.pop(0)
    return " ".join(words)


def match_device(nvml_name: str) -> Device | None:
    """The catalog entry for an NVML product name, or None when none describes it.

    >>> match_device("NVIDIA H100 80GB HBM3").name
    'h100'
    >>> match_device("NVIDIA GeForce RTX 4090").name
    'rtx4090'
    >>> match_device("NVIDIA A10G") is None
    True
    """
    key = _NVML_NAMES.get(_nvml_key(nvml_name))
    return None if key is None else device(key)
