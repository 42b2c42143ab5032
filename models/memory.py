"""Memory and communication of data-parallel training: DDP, ZeRO-1/2/3 and FSDP, per GPU.

**Model states** (Rajbhandari et al., SC'20, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §3.1 and §5). With ``Ψ`` parameters on ``Nd`` GPUs:

========= ============ ============ ===================== ==================================
precision parameters   gradients    master weights        optimizer states
========= ============ ============ ===================== ==================================
fp32      4 B/param    4 B/param    none                  Adam/AdamW 8, SGD+momentum 4, SGD 0
bf16/fp16 2 B/param    2 B/param    4 B/param (fp32)      same, in fp32
========= ============ ============ ===================== ==================================

so mixed-precision Adam holds ``(2 + 2 + K)Ψ`` bytes with the paper's ``K = 12`` (fp32 master
4 + exp_avg 4 + exp_avg_sq 4). Adam and AdamW also keep a ``step`` counter which torch 2.x
stores as a 0-dim float32 tensor per *parameter tensor*: 4 bytes each, counted exactly when the
caller gives ``param_tensors`` (0, the default, leaves them out, as the paper does). Counters are
kept whole on every GPU, a bound that slightly overcounts the sharded strategies.

Each strategy keeps a full copy of some states and a ``ceil(Ψ / Nd)`` shard of the others:

* ``ddp``: everything replicated, ``(2 + 2 + K)Ψ`` (the paper's "baseline DP");
* ``zero1`` (P_os): optimizer states and master weights sharded, ``2Ψ + 2Ψ + KΨ/Nd``;
* ``zero2`` (P_os+g): gradients too, ``2Ψ + (2 + K)Ψ/Nd``;
* ``zero3`` (P_os+g+p): parameters too, ``(2 + 2 + K)Ψ/Nd``;
* ``fsdp``: PyTorch FSDP FULL_SHARD. It shards everything like ZeRO-3 but flattens each wrapped
  *unit* (module subtree) into one flat parameter and, while the unit computes, holds its
  unsharded flat parameter and, in backward, its unsharded flat gradient: ``(p + g) · U`` more
  bytes for the largest unit of ``U`` parameters (``fsdp_unit_params``; by default
  ``ceil(Ψ / layers)`` — one transformer block per unit, the usual auto-wrap policy — with
  ``layers`` from the `TransformerShape`, else `DEFAULT_FSDP_UNITS`). The prefetch of the next
  unit is not counted. With mixed precision its persistent weights are the fp32 sharded flat
  parameter (reported as master weights; no 16-bit copy outlives the all-gather) and its sharded
  gradient is cast back to fp32, so its sharded total equals ZeRO-3's ``16Ψ/Nd`` with a
  different breakdown. On one GPU FSDP runs unsharded and holds no extra buffer.

**Communication** per GPU per step (ZeRO §7): the gradient all-reduce of DDP is a
reduce-scatter plus an all-gather, ``2Ψ`` elements; ZeRO-1/2 move the same ``2Ψ``; ZeRO-3 and
FSDP all-gather the parameters in forward and again in backward and reduce-scatter the
gradients, ``3Ψ``. Elements are the gradient/parameter size (2 bytes in mixed precision, 4 in
fp32). A ring moves ``(Nd - 1)/Nd`` of that volume through each GPU's link, so
``time = bytes · (Nd - 1)/Nd / bandwidth`` with the per-GPU, one-direction bandwidth. One GPU
communicates nothing.

**Activations** (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4) per transformer layer without tensor parallelism, for sequence length
``s``, micro-batch ``b``, hidden size ``h`` and ``a`` heads, in 16-bit:
``s·b·h·(34 + 5·a·s/h)`` bytes without recomputation, ``34·s·b·h`` with selective
recomputation and ``2·s·b·h`` (the layer input) with full recomputation. In fp32 every 2-byte
tensor counts 4 bytes and the 1-byte dropout masks (``2sbh + a·s²·b``) stay, giving
``66sbh + 9as²b``, ``66sbh`` and ``4sbh``. Embedding, loss and framework buffers are not
counted. Data parallelism does not shard activations: every strategy holds the same.

**Recommendation** (`plan`): a strategy *fits* when its model states plus activations stay
within ``gpu_memory_bytes · (1 - headroom)``; the headroom covers what is not modelled (CUDA
context, allocator fragmentation, communication buffers and, without a `TransformerShape`, the
activations themselves). Among the strategies that fit, the one with the least communication
wins; ties go to the simplest (ddp < zero1 < zero2 < zero3 = fsdp), then to the least memory.
Since ZeRO-1/2 communicate as much as DDP, this picks the simplest strategy that fits. If none
fits, the one with the least memory is recommended and flagged as not fitting.

>>> p = plan(7_500_000_000, 64, "adam", "bf16", gpu_memory_bytes=80 * 2**30)
>>> p.recommended, p.fits, round(p.strategies["zero1"].model_state_bytes_per_gpu / 1e9, 1)
('zero1', True, 31.4)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from perfloop.exceptions import ConfigError

__all__ = [
    "DEFAULT_FSDP_UNITS",
    "HEADROOM_WITHOUT_ACTIVATIONS",
    "HEADROOM_WITH_ACTIVATIONS",
    "OPTIMIZERS",
    "RECOMPUTE_MODES",
    "STRATEGIES",
    "TRAINING_PRECISIONS",
    "Plan",
    "StrategyEstimate",
    "TransformerShape",
    "activation_bytes",
    "comm_bytes_per_step",
    "estimate",
    "plan",
]

STRATEGIES: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3", "fsdp")
"""Strategy names, simplest first."""
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd")
TRAINING_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""``fp32``, or 16-bit mixed precision with fp32 master weights and optimizer states."""
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")

DEFAULT_FSDP_UNITS = 32
"""FSDP units assumed when neither ``fsdp_unit_params`` nor the layer count is known
(a 32-block transformer wrapped one block per unit, Llama-2-7B-like)."""
HEADROOM_WITHOUT_ACTIVATIONS = 0.25
"""Share of GPU memory kept free when activations are not estimated."""
HEADROOM_WITH_ACTIVATIONS = 0.10
"""Share of GPU memory kept free (context, fragmentation, buffers) when they are."""

_SIMPLICITY = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
_SHARDED = {  # (parameters, gradients, optimizer states and master weights) sharded?
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp": (True, True, True),
}


def _choice(kind: str, value: str, valid: tuple[str, ...]) -> str:
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in valid:
        raise ConfigError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")
    return str(key)


def _count(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def _positive(name: str, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return value


@dataclass(frozen=True)
class TransformerShape:
    """The transformer the activation estimate is for (Korthikanti et al. 2022 notation).

    ``layers`` (L), ``hidden`` (h), ``heads`` (a), ``seq_len`` (s), ``micro_batch`` (b) and
    ``recompute``: "none", "selective" (attention core only) or "full" (keep layer inputs).

    >>> TransformerShape(layers=32, hidden=4096, heads=32, seq_len=2048, micro_batch=1).recompute
    'none'
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int
    recompute: str = "none"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "micro_batch"):
            _count(name, getattr(self, name))
        object.__setattr__(
            self, "recompute", _choice("recompute mode", self.recompute, RECOMPUTE_MODES)
        )


def activation_bytes(shape: TransformerShape, precision: str) -> int:
    """Activation bytes one GPU holds for one micro-batch (formula in the module docstring).

    GPT-3 175B's layer (h = 12288, a = 96, s = 2048, b = 1), one layer in bf16:

    >>> one = TransformerShape(layers=1, hidden=12288, heads=96, seq_len=2048, micro_batch=1)
    >>> activation_bytes(one, "bf16") == 2048 * 12288 * (34 + 5 * 96 * 2048 // 12288)
    True
    >>> full = TransformerShape(1, 12288, 96, 2048, 1, recompute="full")
    >>> activation_bytes(full, "bf16"), activation_bytes(full, "fp32")
    (50331648, 100663296)
    """
    mixed = _choice("precision", precision, TRAINING_PRECISIONS) != "fp32"
    sbh = shape.seq_len * shape.micro_batch * shape.hidden
    as2b = shape.heads * shape.seq_len**2 * shape.micro_batch
    if shape.recompute == "full":
        per_layer = (2 if mixed else 4) * sbh
    elif shape.recompute == "selective":
        per_layer = (34 if mixed else 66) * sbh
    else:
        per_layer = (34 if mixed else 66) * sbh + (5 if mixed else 9) * as2b
    return shape.layers * per_layer


def comm_bytes_per_step(strategy: str, params: int, world: int, precision: str) -> int:
    """Bytes each GPU moves through collectives per step: 2Ψ (DDP, ZeRO-1/2) or 3Ψ elements.

    >>> comm_bytes_per_step("ddp", 1000, 8, "bf16"), comm_bytes_per_step("zero3", 1000, 8, "bf16")
    (4000, 6000)
    >>> comm_bytes_per_step("fsdp", 1000, 1, "fp32")
    0
    """
    strategy = _choice("strategy", strategy, STRATEGIES)
    params, world = _count("params", params), _count("world", world)
    element = 4 if _choice("precision", precision, TRAINING_PRECISIONS) == "fp32" else 2
    if world == 1:
        return 0
    return (3 if _SHARDED[strategy][0] else 2) * params * element


@dataclass(frozen=True)
class StrategyEstimate:
    """One strategy's bytes per GPU and communication per step.

    ``activation_bytes``, ``comm_time_s`` and ``fits`` are None when the inputs they need
    (a `TransformerShape`, a bandwidth, a memory limit) were not given.

    >>> e = estimate("zero2", 1_000_000, 4, "adam", "bf16")
    >>> e.parameter_bytes, e.gradient_bytes, e.optimizer_state_bytes, e.master_weight_bytes
    (2000000, 500000, 2000000, 1000000)
    >>> e.model_state_bytes_per_gpu, e.comm_bytes_per_step
    (5500000, 4000000)
    """

    strategy: str
    world: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    master_weight_bytes: int
    activation_bytes: int | None
    comm_bytes_per_step: int
    comm_time_s: float | None = None
    fits: bool | None = None

    @property
    def model_state_bytes_per_gpu(self) -> int:
        """Parameters + gradients + optimizer states + master weights."""
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
            + self.master_weight_bytes
        )

    @property
    def total_bytes_per_gpu(self) -> int:
        """Model states plus activations (model states alone when activations are unknown)."""
        return self.model_state_bytes_per_gpu + (self.activation_bytes or 0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with the per-GPU totals."""
        return {
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "master_weight_bytes": self.master_weight_bytes,
            "model_state_bytes_per_gpu": self.model_state_bytes_per_gpu,
            "activation_bytes_per_gpu": self.activation_bytes,
            "total_bytes_per_gpu": self.total_bytes_per_gpu,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_time_s": self.comm_time_s,
            "fits": self.fits,
        }


def estimate(
    strategy: str,
    params: int,
    world: int,
    optimizer: str,
    precision: str,
    *,
    param_tensors: int = 0,
    momentum: float = 0.0,
    shape: TransformerShape | None = None,
    fsdp_unit_params: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
) -> StrategyEstimate:
    """Bytes per GPU and communication per step of one strategy (see the module docstring).

    ``param_tensors`` is the number of parameter tensors (Adam's step counters); ``momentum``
    applies to SGD only. The ZeRO paper's 7.5B model on 64 GPUs, P_os+g+p:

    >>> estimate("zero3", 7_500_000_000, 64, "adam", "fp16").model_state_bytes_per_gpu / 1e9
    1.875
    >>> estimate("ddp", 10, 1, "sgd", "fp32", momentum=0.9).optimizer_state_bytes
    40
    """
    strategy = _choice("strategy", strategy, STRATEGIES)
    optimizer = _choice("optimizer", optimizer, OPTIMIZERS)
    mixed = _choice("precision", precision, TRAINING_PRECISIONS) != "fp32"
    params, world = _count("params", params), _count("world", world)
    param_tensors = _count("param_tensors", param_tensors, minimum=0)
    if not (math.isfinite(momentum) and momentum >= 0):
        raise ConfigError(f"momentum must be >= 0, got {momentum!r}")
    _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)

    p, g = (2, 2) if mixed else (4, 4)
    master = 4 if mixed else 0
    if optimizer in ("adam", "adamw"):
        state, counters = 8, 4 * param_tensors
    else:
        state, counters = (4 if momentum > 0 else 0), 0

    shard = math.ceil(params / world)
    shard_p, shard_g, shard_os = _SHARDED[strategy]
    param_bytes = p * (shard if shard_p else params)
    grad_bytes = g * (shard if shard_g else params)
    state_bytes = state * (shard if shard_os else params) + counters
    master_bytes = master * (shard if shard_os else params)

    if strategy == "fsdp":
        if fsdp_unit_params is None:
            units = shape.layers if shape is not None else DEFAULT_FSDP_UNITS
            fsdp_unit_params = math.ceil(params / units)
        unit = min(_count("fsdp_unit_params", fsdp_unit_params), params) if world > 1 else 0
        if mixed:  # the fp32 shard is the only persistent copy; its gradient is fp32 too
            param_bytes, master_bytes = p * unit, 4 * shard
            grad_bytes = 4 * shard + g * unit
        else:
            param_bytes += p * unit
            grad_bytes += g * unit

    comm = comm_bytes_per_step(strategy, params, world, precision)
    comm_time = None
    if bandwidth_bytes_per_s is not None:
        comm_time = comm * (world - 1) / world / bandwidth_bytes_per_s
    return StrategyEstimate(
        strategy=strategy,
        world=world,
        parameter_bytes=param_bytes,
        gradient_bytes=grad_bytes,
        optimizer_state_bytes=state_bytes,
        master_weight_bytes=master_bytes,
        activation_bytes=None if shape is None else activation_bytes(shape, precision),
        comm_bytes_per_step=comm,
        comm_time_s=comm_time,
    )


@dataclass(frozen=True)
class Plan:
    """Every strategy's estimate and the recommended one (rule in the module docstring).

    ``usable_memory_bytes`` is the limit a strategy must stay within (None without a GPU
    memory size); ``fits`` tells whether the recommended strategy stays within it.

    >>> p = plan(1_000_000_000, 8, "adamw", "bf16", gpu_memory_bytes=5 * 2**30)
    >>> p.recommended, [s for s, e in p.strategies.items() if e.fits]
    ('zero2', ['zero2', 'zero3', 'fsdp'])
    """

    strategies: Mapping[str, StrategyEstimate] = field(hash=False)
    recommended: str
    fits: bool | None
    usable_memory_bytes: int | None
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", MappingProxyType(dict(self.strategies)))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # MappingProxyType does not pickle; rebuild from a plain dict.
        return (
            Plan,
            (
                dict(self.strategies),
                self.recommended,
                self.fits,
                self.usable_memory_bytes,
                self.reason,
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        """``{"strategies": {name: {...}}, "recommended": name}``, JSON-ready."""
        return {
            "strategies": {name: e.as_dict() for name, e in self.strategies.items()},
            "recommended": self.recommended,
        }


def plan(
    params: int,
    world: int,
    optimizer: str,
    precision: str,
    gpu_memory_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    *,
    param_tensors: int = 0,
    momentum: float = 0.0,
    shape: TransformerShape | None = None,
    fsdp_unit_params: int | None = None,
    headroom: float | None = None,
) -> Plan:
    """Estimate every strategy and recommend one (rule in the module docstring).

    ``headroom`` defaults to `HEADROOM_WITH_ACTIVATIONS` when ``shape`` is given, else to
    `HEADROOM_WITHOUT_ACTIVATIONS`. Without ``gpu_memory_bytes`` every strategy counts as
    fitting (``fits`` is None) and the least communication decides.

    >>> plan(7_000_000_000, 8, "adam", "bf16", gpu_memory_bytes=80 * 2**30).recommended
    'zero1'
    >>> p = plan(70_000_000_000, 8, "adam", "bf16", gpu_memory_bytes=80 * 2**30)
    >>> p.recommended, p.fits
    ('zero3', False)
    """
    _positive("gpu_memory_bytes", gpu_memory_bytes)
    if headroom is None:
        headroom = HEADROOM_WITHOUT_ACTIVATIONS if shape is None else HEADROOM_WITH_ACTIVATIONS
    if not (math.isfinite(headroom) and 0.0 <= headroom < 1.0):
        raise ConfigError(f"headroom must be in [0, 1), got {headroom!r}")
    usable = None if gpu_memory_bytes is None else int(gpu_memory_bytes * (1.0 - headroom))

    estimates: dict[str, StrategyEstimate] = {}
    for name in STRATEGIES:
        e = estimate(
            name,
            params,
            world,
            optimizer,
            precision,
            param_tensors=param_tensors,
            momentum=momentum,
            shape=shape,
            fsdp_unit_params=fsdp_unit_params,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        )
        fits = None if usable is None else e.total_bytes_per_gpu <= usable
        estimates[name] = replace(e, fits=fits)

    fitting = [e for e in estimates.values() if e.fits is not False]
    if fitting:
        best = min(
            fitting,
            key=lambda e: (e.comm_bytes_per_step, _SIMPLICITY[e.strategy], e.total_bytes_per_gpu),
        )
        reason = (
            "the least communication among the strategies that fit"
            if usable is not None
            else "no memory limit given: the least communication"
        )
    else:
        best = min(
            estimates.values(), key=lambda e: (e.total_bytes_per_gpu, _SIMPLICITY[e.strategy])
        )
        reason = "nothing fits: the least memory per GPU"
    return Plan(
        strategies=estimates,
        recommended=best.strategy,
        fits=best.fits,
        usable_memory_bytes=usable,
        reason=reason,
    )
