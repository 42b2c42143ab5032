"""The memory and communication model: exact bytes against real torch, the ZeRO paper's figures,
and the recommendation rule of `plan`."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from perfloop.exceptions import ConfigError
from perfloop.models.memory import (
    OPTIMIZERS,
    STRATEGIES,
    TRAINING_PRECISIONS,
    TransformerShape,
    activation_bytes,
    comm_bytes_per_step,
    estimate,
    plan,
)

GIB = 2**30


# --- exact bytes against real torch models and optimizers (CPU) -------------------------------


class _EmbedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    return model, torch.randn(8, 32)


def _transformer() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return model, torch.randn(4, 6, 32)


def _embed_lstm() -> tuple[nn.Module, torch.Tensor]:
    return _EmbedLSTM(), torch.randint(0, 100, (4, 7))


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": _mlp,
    "transformer": _transformer,
    "embed_lstm": _embed_lstm,
}
OPTIMIZER_CASES: dict[
    str, tuple[str, float, Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]]
] = {
    "adam": ("adam", 0.0, lambda ps: torch.optim.Adam(ps, lr=1e-3)),
    "adamw": ("adamw", 0.0, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "sgd": ("sgd", 0.0, lambda ps: torch.optim.SGD(ps, lr=1e-2)),
    "sgd_momentum": ("sgd", 0.9, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
}


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return _bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.parametrize("opt_case", list(OPTIMIZER_CASES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_fp32_bytes_equal_torch_exactly(model_name: str, opt_case: str) -> None:
    torch.manual_seed(0)
    model, x = MODELS[model_name]()
    name, momentum, make = OPTIMIZER_CASES[opt_case]
    params = list(model.parameters())
    opt = make(params)
    model(x).float().pow(2).mean().backward()
    opt.step()

    e = estimate(
        "ddp",
        sum(p.numel() for p in params),
        1,
        name,
        "fp32",
        param_tensors=len(params),
        momentum=momentum,
    )
    assert all(p.grad is not None for p in params)
    assert e.parameter_bytes == _bytes(params)
    assert e.gradient_bytes == _bytes(p.grad for p in params if p.grad is not None)
    assert e.optimizer_state_bytes == _state_bytes(opt)
    assert e.master_weight_bytes == 0
    if opt_case == "sgd":
        assert e.optimizer_state_bytes == 0 == len(opt.state)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_bf16_with_fp32_master_copy_equals_torch_exactly(model_name: str) -> None:
    # Mixed precision by hand: bf16 model and gradients, fp32 master weights the optimizer owns.
    torch.manual_seed(0)
    model, x = MODELS[model_name]()
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adam(master, lr=1e-3)
    x = x if not x.is_floating_point() else x.to(torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    for m, p in zip(master, params, strict=True):
        assert p.grad is not None
        m.grad = p.grad.float()
    opt.step()
    with torch.no_grad():
        for m, p in zip(master, params, strict=True):
            m.grad = None  # the fp32 gradient is transient, as in the ZeRO paper
            p.copy_(m)

    e = estimate(
        "ddp", sum(p.numel() for p in params), 1, "adam", "bf16", param_tensors=len(params)
    )
    assert e.parameter_bytes == _bytes(params)
    assert e.gradient_bytes == _bytes(p.grad for p in params if p.grad is not None)
    assert e.master_weight_bytes == _bytes(master)
    assert e.optimizer_state_bytes == _state_bytes(opt)
    numel = sum(p.numel() for p in params)
    assert e.master_weight_bytes + e.optimizer_state_bytes == 12 * numel + 4 * len(params)


def test_shards_round_up() -> None:
    e = estimate("zero3", 10, 4, "adam", "fp32")  # ceil(10 / 4) = 3 elements per GPU
    assert (e.parameter_bytes, e.gradient_bytes, e.optimizer_state_bytes) == (12, 12, 24)


# --- the ZeRO paper (Rajbhandari et al., SC'20) -----------------------------------------------

PSI_7B5 = 7_500_000_000


@pytest.mark.parametrize(
    ("strategy", "gb"),
    [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)],
)
def test_zero_paper_figure_1(strategy: str, gb: float) -> None:
    # Figure 1: Ψ = 7.5B, Nd = 64, K = 12 (mixed-precision Adam), GB = 1e9 bytes.
    e = estimate(strategy, PSI_7B5, 64, "adam", "fp16")
    digits = 2 if gb < 10 else 1
    assert round(e.model_state_bytes_per_gpu / 1e9, digits) == gb


# Table 1, per-device GB for Pos, Pos+g, Pos+g+p, as printed (some figures truncated).
TABLE_1 = [
    (7_500_000_000, 1, (120, 120, 120)),
    (7_500_000_000, 4, (52.5, 41.3, 30)),
    (7_500_000_000, 16, (35.6, 21.6, 7.5)),
    (7_500_000_000, 64, (31.4, 16.6, 1.88)),
    (7_500_000_000, 256, (30.4, 15.4, 0.47)),
    (7_500_000_000, 1024, (30.1, 15.1, 0.12)),
    (128_000_000_000, 1, (2048, 2048, 2048)),
    (128_000_000_000, 4, (896, 704, 512)),
    (128_000_000_000, 16, (608, 368, 128)),
    (128_000_000_000, 64, (536, 284, 32)),
    (128_000_000_000, 256, (518, 263, 8)),
    (128_000_000_000, 1024, (513, 257, 2)),
    (1_000_000_000_000, 1, (16000, 16000, 16000)),
    (1_000_000_000_000, 4, (7000, 5500, 4000)),
    (1_000_000_000_000, 16, (4750, 2875, 1000)),
    (1_000_000_000_000, 64, (4187, 2218, 250)),
    (1_000_000_000_000, 256, (4046, 2054, 62.5)),
    (1_000_000_000_000, 1024, (4011, 2013, 15.6)),
]


def _last_digit(printed: float) -> float:
    text = repr(float(printed)).rstrip("0").rstrip(".")
    return 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)


@pytest.mark.parametrize(("psi", "nd", "row"), TABLE_1)
def test_zero_paper_table_1(psi: int, nd: int, row: tuple[float, float, float]) -> None:
    for strategy, printed in zip(("zero1", "zero2", "zero3"), row, strict=True):
        gb = estimate(strategy, psi, nd, "adam", "fp16").model_state_bytes_per_gpu / 1e9
        assert abs(gb - printed) < _last_digit(printed), (strategy, gb, printed)


def test_zero_paper_communication_2psi_vs_3psi() -> None:
    # §7: DP and ZeRO-1/2 move 2Ψ elements per step, ZeRO-3 3Ψ (1.5x); fp16 elements.
    for strategy in ("ddp", "zero1", "zero2"):
        assert comm_bytes_per_step(strategy, PSI_7B5, 64, "fp16") == 2 * PSI_7B5 * 2
    for strategy in ("zero3", "fsdp"):
        assert comm_bytes_per_step(strategy, PSI_7B5, 64, "fp16") == 3 * PSI_7B5 * 2
    assert comm_bytes_per_step("ddp", 1000, 64, "fp32") == 8000


def test_comm_time_uses_the_ring_factor() -> None:
    e = estimate("ddp", 1_000_000_000, 8, "adam", "bf16", bandwidth_bytes_per_s=100e9)
    assert e.comm_time_s == pytest.approx(4e9 * 7 / 8 / 100e9)
    assert estimate("ddp", 1000, 1, "adam", "bf16", bandwidth_bytes_per_s=1e9).comm_time_s == 0


# --- activations (Korthikanti et al. 2022) ----------------------------------------------------


def test_activations_follow_korthikanti() -> None:
    s, b, h, a, layers = 2048, 2, 4096, 32, 4
    shape = TransformerShape(layers, h, a, s, b)
    assert activation_bytes(shape, "bf16") == layers * s * b * h * (34 + 5 * a * s // h)
    sel = TransformerShape(layers, h, a, s, b, recompute="selective")
    full = TransformerShape(layers, h, a, s, b, recompute="full")
    assert activation_bytes(sel, "fp16") == layers * 34 * s * b * h
    assert activation_bytes(full, "bf16") == layers * 2 * s * b * h
    assert activation_bytes(full, "bf16") < activation_bytes(sel, "bf16")
    assert activation_bytes(sel, "bf16") < activation_bytes(shape, "bf16")
    assert activation_bytes(shape, "bf16") < activation_bytes(shape, "fp32")


def test_activations_are_the_same_for_every_strategy() -> None:
    shape = TransformerShape(2, 256, 4, 128, 2)
    got = {estimate(s, 10**6, 8, "adam", "bf16", shape=shape).activation_bytes for s in STRATEGIES}
    assert got == {activation_bytes(shape, "bf16")}
    assert estimate("ddp", 10**6, 8, "adam", "bf16").activation_bytes is None


# --- FSDP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", TRAINING_PRECISIONS)
def test_fsdp_is_zero3_plus_one_unsharded_unit(precision: str) -> None:
    z3 = estimate("zero3", 64_000, 8, "adam", precision)
    fs = estimate("fsdp", 64_000, 8, "adam", precision, fsdp_unit_params=4_000)
    elem = 4 if precision == "fp32" else 2
    assert fs.model_state_bytes_per_gpu == z3.model_state_bytes_per_gpu + 2 * elem * 4_000
    default = estimate("fsdp", 64_000, 8, "adam", precision)  # 32 units of 2,000
    assert default.model_state_bytes_per_gpu == z3.model_state_bytes_per_gpu + 2 * elem * 2_000
    shape = TransformerShape(layers=4, hidden=64, heads=4, seq_len=16, micro_batch=1)
    by_layer = estimate("fsdp", 64_000, 8, "adam", precision, shape=shape)
    assert by_layer.model_state_bytes_per_gpu == fs.model_state_bytes_per_gpu + 2 * elem * 12_000


def test_fsdp_on_one_gpu_holds_what_ddp_holds() -> None:
    ddp = estimate("ddp", 10**6, 1, "adamw", "bf16")
    assert estimate("fsdp", 10**6, 1, "adamw", "bf16").model_state_bytes_per_gpu == (
        ddp.model_state_bytes_per_gpu
    )


# --- plan -------------------------------------------------------------------------------------


def test_plan_fits_only_with_zero3() -> None:
    p = plan(PSI_7B5, 64, "adam", "bf16", gpu_memory_bytes=16 * GIB)
    fitting = [s for s, e in p.strategies.items() if e.fits]
    assert fitting == ["zero3", "fsdp"]
    assert (p.recommended, p.fits) == ("zero3", True)


def test_plan_recommends_ddp_when_it_fits() -> None:
    p = plan(
        1_000_000_000, 8, "adam", "bf16", gpu_memory_bytes=80 * GIB, bandwidth_bytes_per_s=1e11
    )
    assert all(e.fits for e in p.strategies.values())
    assert (p.recommended, p.fits) == ("ddp", True)
    assert p.strategies["ddp"].comm_time_s == pytest.approx(4e9 * 7 / 8 / 1e11)


def test_plan_recommends_the_simplest_of_equal_communication() -> None:
    p = plan(PSI_7B5, 64, "adam", "bf16", gpu_memory_bytes=80 * GIB)
    assert not p.strategies["ddp"].fits
    assert p.recommended == "zero1"


def test_plan_counts_activations_against_the_limit() -> None:
    shape = TransformerShape(layers=32, hidden=4096, heads=32, seq_len=4096, micro_batch=4)
    without = plan(PSI_7B5, 64, "adam", "bf16", gpu_memory_bytes=80 * GIB)
    with_acts = plan(PSI_7B5, 64, "adam", "bf16", gpu_memory_bytes=80 * GIB, shape=shape)
    assert without.recommended == "zero1"
    assert with_acts.strategies["zero1"].activation_bytes == activation_bytes(shape, "bf16")
    assert with_acts.fits is False  # ~275 GB of activations fit nowhere


def test_plan_when_nothing_fits_picks_the_least_memory() -> None:
    p = plan(70_000_000_000, 8, "adam", "bf16", gpu_memory_bytes=80 * GIB)
    assert (p.recommended, p.fits) == ("zero3", False)
    assert not any(e.fits for e in p.strategies.values())


def test_plan_without_a_memory_limit_minimises_communication() -> None:
    p = plan(PSI_7B5, 64, "adam", "bf16")
    assert (p.recommended, p.fits, p.usable_memory_bytes) == ("ddp", None, None)
    assert all(e.fits is None for e in p.strategies.values())


def test_plan_is_a_plain_json_ready_value() -> None:
    p = plan(10**9, 8, "sgd", "fp32", gpu_memory_bytes=40 * GIB, momentum=0.9)
    assert pickle.loads(pickle.dumps(p)) == p
    doc = p.as_dict()
    assert set(doc) == {"strategies", "recommended"}
    assert list(doc["strategies"]) == list(STRATEGIES)
    ddp = doc["strategies"]["ddp"]
    assert ddp["model_state_bytes_per_gpu"] == 12 * 10**9
    assert ddp["activation_bytes_per_gpu"] is None


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: estimate("ddp", 0, 8, "adam", "bf16"), "params"),
        (lambda: estimate("ddp", -5, 8, "adam", "bf16"), "-5"),
        (lambda: estimate("ddp", 10, 0, "adam", "bf16"), "world"),
        (lambda: estimate("zero4", 10, 8, "adam", "bf16"), "'zero4'; valid: ddp, zero1"),
        (lambda: estimate("ddp", 10, 8, "lamb", "bf16"), "'lamb'; valid: adam, adamw, sgd"),
        (lambda: estimate("ddp", 10, 8, "adam", "fp8"), "'fp8'; valid: fp32, bf16, fp16"),
        (lambda: TransformerShape(1, 8, 2, 4, 1, recompute="some"), "'some'; valid: none"),
        (lambda: TransformerShape(0, 8, 2, 4, 1), "layers"),
        (lambda: plan(10, 8, "adam", "bf16", gpu_memory_bytes=0), "gpu_memory_bytes"),
        (lambda: plan(10, 8, "adam", "bf16", bandwidth_bytes_per_s=-1.0), "bandwidth"),
        (lambda: plan(10, 8, "adam", "bf16", headroom=1.0), "headroom"),
    ],
)
def test_bad_input_is_a_one_line_config_error(call: Callable[[], object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert needle in str(info.value) and "\n" not in str(info.value)


# --- properties -------------------------------------------------------------------------------

_inputs = {
    "params": st.integers(1, 10**13),
    "world": st.integers(1, 100_000),
    "optimizer": st.sampled_from(OPTIMIZERS),
    "precision": st.sampled_from(TRAINING_PRECISIONS),
    "momentum": st.sampled_from([0.0, 0.9]),
    "param_tensors": st.integers(0, 10_000),
}


@given(**_inputs)
def test_memory_never_grows_from_ddp_to_zero3(
    params: int, world: int, optimizer: str, precision: str, momentum: float, param_tensors: int
) -> None:
    mem = [
        estimate(
            s, params, world, optimizer, precision, param_tensors=param_tensors, momentum=momentum
        ).model_state_bytes_per_gpu
        for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")
    ]
    assert mem[:4] == sorted(mem[:4], reverse=True)
    assert mem[4] >= mem[3]


@given(**_inputs)
def test_zero3_communicates_one_and_a_half_times_ddp(
    params: int, world: int, optimizer: str, precision: str, momentum: float, param_tensors: int
) -> None:
    ddp = estimate("ddp", params, world, optimizer, precision).comm_bytes_per_step
    z3 = estimate("zero3", params, world, optimizer, precision).comm_bytes_per_step
    assert 2 * z3 == 3 * ddp
    assert (ddp == 0) == (world == 1)


@given(**_inputs)
def test_plan_recommends_a_fitting_strategy_whenever_one_fits(
    params: int, world: int, optimizer: str, precision: str, momentum: float, param_tensors: int
) -> None:
    p = plan(params, world, optimizer, precision, gpu_memory_bytes=80 * GIB, momentum=momentum)
    fitting = [e for e in p.strategies.values() if e.fits]
    assert p.fits == bool(fitting)
    if fitting:
        least = min(e.comm_bytes_per_step for e in fitting)
        assert p.strategies[p.recommended].comm_bytes_per_step == least
    else:
        least_mem = min(e.total_bytes_per_gpu for e in p.strategies.values())
        assert p.strategies[p.recommended].total_bytes_per_gpu == least_mem
