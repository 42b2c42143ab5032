"""``perfloop config``: reading VALUE, building the change, and one-line failures (no stack)."""

from __future__ import annotations

from typing import Any

import pytest

from perfloop.cli import build_parser, main
from perfloop.cli.config import ISSUER_JOB_ID, build_change, default_target, parse_value
from perfloop.exceptions import ConfigError
from perfloop.schemas import ConfigChange, decode_event, encode_event
from tests.helpers import clean_env, closed_port, one_line  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("250", 250),
        ("-3", -3),
        (" 7 ", 7),
        ("0.7", 0.7),
        ("-.5", -0.5),
        ("1e-3", 0.001),
        ("2.", 2.0),
        ("true", True),
        ("FALSE", False),
        ("1,10,60,60/10", "1,10,60,60/10"),
        ("60/10", "60/10"),
        ("1,2", "1,2"),
        ("fast", "fast"),
        ("nan", "nan"),
        ("0x10", "0x10"),
        ("1_000", "1_000"),
    ],
)
def test_value_parsing(text: str, expected: Any) -> None:
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text", ["", "   ", "1e999", "-1e400"])
def test_values_that_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="VALUE"):
        parse_value(text)


@pytest.mark.parametrize("value", [250, 0.75, True, False, "1,10,60,60/10"])
def test_the_change_keeps_its_value_and_type_through_the_codec(value: Any) -> None:
    target = "producers" if isinstance(value, int) and not isinstance(value, bool) else "streams"
    key = "sampling.host_interval_ms" if target == "producers" else "windows.specs"
    change = build_change(key, value, target=target, author="ana@n1")
    back = decode_event(encode_event(change))
    assert isinstance(back, ConfigChange)
    assert back.value == value and type(back.value) is type(value)
    assert (back.key, back.target, back.author) == (key, target, "ana@n1")


def test_target_follows_the_key_unless_given() -> None:
    assert build_change("sampling.adaptive", False).target == "producers"
    assert build_change("detect.straggler.score_threshold", 0.7).target == "streams"
    assert default_target("windows.specs") == "streams"


def test_every_job_or_one_job() -> None:
    every = build_change("detect.hang.after_s", 30, reason="too many false alarms")
    assert (every.applies_to, every.job_id) == ("*", ISSUER_JOB_ID)
    assert every.reason == "too many false alarms" and "@" in every.author
    one = build_change("detect.hang.after_s", 30, job="llm-7")
    assert (one.applies_to, one.job_id) == ("llm-7", "llm-7")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("sampling.gpu_interval_ms", 1), "sampling.gpu_interval_ms=1 is outside [10, 60000]"),
        (("sampling.gpu_rate", 1), "unknown sampling setting 'sampling.gpu_rate'"),
        (("Detect.X", 1), "invalid KEY 'Detect.X'"),
    ],
)
def test_a_bad_change_is_refused_before_it_is_sent(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        build_change(*args)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_only_detector_settings_can_be_set_for_one_job() -> None:
    assert build_change("detect.hang.after_s", 30, job="llm-7").applies_to == "llm-7"
    with pytest.raises(ConfigError, match=r"windows\.specs applies to every job"):
        build_change("windows.specs", "1,10", job="llm-7")
    assert build_change("windows.specs", "1,10").applies_to == "*"


def test_a_bad_job_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"invalid --job 'a b'"):
        build_change("detect.hang.after_s", 30, job="a b")


@pytest.mark.parametrize(
    "argv",
    [
        ["config"],
        ["config", "set", "detect.hang.after_s"],
        ["config", "set", "k", "1", "--target", "brokers"],
        ["config", "history", "--limit", "many"],
    ],
)
def test_misuse_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert "--help" in one_line(capsys.readouterr().err)


def test_parsed_options() -> None:
    args = build_parser().parse_args(
        ["config", "set", "sampling.host_interval_ms", "-5", "--job", "j1", "--reason", "why"]
    )
    assert (args.key, args.value, args.job, args.reason, args.target) == (
        "sampling.host_interval_ms",
        "-5",
        "j1",
        "why",
        None,
    )
    hist = build_parser().parse_args(["config", "history"])
    assert (hist.job, hist.limit, hist.json) == (None, 100, False)


def test_set_with_a_bad_value_exits_1_before_touching_the_broker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", f"127.0.0.1:{closed_port()}")
    assert main(["config", "set", "sampling.overhead_budget_pct", "0"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert one_line(err) == "perfloop: sampling.overhead_budget_pct=0 is outside (0, 100]"


def test_set_without_a_broker_exits_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bootstrap = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PERFLOOP_KAFKA_BOOTSTRAP", bootstrap)
    assert main(["config", "set", "detect.hang.after_s", "30"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("perfloop: ") and bootstrap in line


def test_history_without_a_warehouse_exits_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_URL", url)
    assert main(["config", "history", "--job", "j1"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("perfloop: ") and url in line


def test_history_limit_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "history", "--limit", "0"]) == 1
    assert "--limit 0" in one_line(capsys.readouterr().err)
