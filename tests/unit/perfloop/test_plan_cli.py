"""``perfloop plan``: the table, the JSON document, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from typing import Any

import pytest

from perfloop.cli import main
from perfloop.cli.plan import parse_count
from perfloop.exceptions import ConfigError
from perfloop.models.devices import device
from tests.helpers import clean_env, one_line  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_env")

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
BASE = ["plan", "--params", "7.5B", "--world", "64", "--optimizer", "adam", "--precision", "bf16"]


def _json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main([*BASE, *extra, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc: dict[str, Any] = json.loads(out)
    return doc


def test_json_shape_and_zero_paper_figures(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys)
    assert set(doc) == {"strategies", "recommended"}
    assert list(doc["strategies"]) == STRATEGIES
    for s in doc["strategies"].values():
        assert {"model_state_bytes_per_gpu", "activation_bytes_per_gpu", "comm_bytes_per_step"} <= (
            set(s)
        )
        assert s["activation_bytes_per_gpu"] is None
        assert s["fits"] is None and s["comm_time_s"] is None
    gb = {n: round(s["model_state_bytes_per_gpu"] / 1e9, 2) for n, s in doc["strategies"].items()}
    assert (gb["ddp"], gb["zero1"], gb["zero2"], gb["zero3"]) == (120.0, 31.41, 16.64, 1.88)
    psi = 7_500_000_000
    assert doc["strategies"]["ddp"]["comm_bytes_per_step"] == 2 * psi * 2
    assert doc["strategies"]["zero3"]["comm_bytes_per_step"] == 3 * psi * 2
    assert doc["recommended"] == "ddp"  # no memory limit: the least communication


def test_gpu_sets_the_memory_limit_and_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--gpu", "a100-80gb")
    fits = {n: s["fits"] for n, s in doc["strategies"].items()}
    assert fits == {"ddp": False, "zero1": True, "zero2": True, "zero3": True, "fsdp": True}
    assert doc["recommended"] == "zero1"
    link = device("a100-80gb").interconnect_unidirectional_bytes_per_s
    ddp = doc["strategies"]["ddp"]
    assert ddp["comm_time_s"] == pytest.approx(ddp["comm_bytes_per_step"] * 63 / 64 / link)


def test_bandwidth_flag_overrides_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--gpu", "h100", "--bandwidth-gbps", "25")
    z3 = doc["strategies"]["zero3"]
    assert z3["comm_time_s"] == pytest.approx(z3["comm_bytes_per_step"] * 63 / 64 / 25e9)


def test_fits_only_with_zero3(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--gpu", "v100-16gb")
    assert [n for n, s in doc["strategies"].items() if s["fits"]] == ["zero3", "fsdp"]
    assert doc["recommended"] == "zero3"


def test_ddp_fits_and_is_recommended(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--params", "350M", "--world", "8", "--optimizer", "adamw"]
    assert main([*argv, "--precision", "fp32", "--gpu", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"] == "ddp"
    assert doc["strategies"]["ddp"]["model_state_bytes_per_gpu"] == 16 * 350_000_000


def test_activations_when_the_shape_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--seq-len", "2048"]
    doc = _json(capsys, *shape, "--micro-batch", "1", "--recompute", "full")
    acts = {s["activation_bytes_per_gpu"] for s in doc["strategies"].values()}
    assert acts == {32 * 2 * 2048 * 1 * 4096}


def test_table_names_every_strategy_and_the_recommendation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*BASE, "--gpu", "a100-80gb"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert "NVIDIA A100" in lines[0]
    assert [line.split()[0] for line in lines[2:7]] == STRATEGIES
    assert lines[-1].startswith("recommended: zero1")


def test_nothing_fits_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--params", "70B", "--world", "8", "--optimizer", "adam", "--precision"]
    assert main([*argv, "bf16", "--gpu", "h100"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("recommended: zero3 (does NOT fit)")


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("7e9", 7 * 10**9),
        ("7B", 7 * 10**9),
        ("1.3b", 1_300_000_000),
        ("350M", 350_000_000),
        ("125k", 125_000),
        ("2T", 2 * 10**12),
        ("1_000", 1000),
        (" 42 ", 42),
        ("1.5e3", 1500),
    ],
)
def test_params_forms(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["", "0", "-7B", "7X", "B", "1e-3", "seven", "nan", "inf"])
def test_params_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--params"):
        parse_count(text)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (("--params", "0"), "--params '0'"),
        (("--params", "lots"), "--params 'lots'"),
        (("--world", "0"), "world"),
        (("--optimizer", "lamb"), "'lamb'; valid: adam, adamw, sgd"),
        (("--precision", "fp8"), "'fp8'; valid: fp32, bf16, fp16"),
        (("--gpu", "tpu-v5"), "unknown device 'tpu-v5'"),
        (("--bandwidth-gbps", "0"), "bandwidth"),
        (("--layers", "32"), "--hidden"),
        (("--headroom", "1.5"), "headroom"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], change: tuple[str, str], needle: str
) -> None:
    argv = list(BASE)
    if change[0] in argv:
        argv[argv.index(change[0]) + 1] = change[1]
    else:
        argv += change
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line(err)
    assert line.startswith("perfloop: ") and needle in line


def test_missing_required_flag_is_argparse_misuse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--params", "7B"])
    assert info.value.code == 2
    assert "--world" in one_line(capsys.readouterr().err)
