"""The command line: misuse exits 2, failures exit 1, each with one line on stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from perfloop import __version__
from perfloop.cli import build_parser, main
from tests.helpers import clean_env, closed_port, one_line  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--bogus"],
        ["launch"],
        ["up", "--bogus"],
        ["sql"],
        ["sql", "SELECT 1", "--format", "xml"],
        ["sql", "SELECT 1", "--verbose"],
        ["service", "scheduler"],
        ["demo", "--ranks", "four"],
    ],
)
def test_misuse_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line(err)
    assert line.startswith("perfloop") and "error" in line and "--help" in line


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert one_line(capsys.readouterr().out) == f"perfloop {__version__}"


def test_parsed_options() -> None:
    args = build_parser().parse_args(["demo", "--ranks", "8", "--fault-at", "3.5"])
    assert (args.command, args.ranks, args.fault_at) == ("demo", 8, 3.5)
    assert build_parser().parse_args(["sql", "SELECT 1"]).format == "table"


def test_sql_against_a_closed_port_fails_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_URL", url)
    assert main(["sql", "SELECT 1"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line(err)
    assert line.startswith("perfloop: ") and url in line


def test_sql_with_a_non_http_url_fails_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PERFLOOP_CLICKHOUSE_URL", "ftp://warehouse:21")
    assert main(["sql", "SELECT 1"]) == 1
    assert "PERFLOOP_CLICKHOUSE_URL" in one_line(capsys.readouterr().err)


def test_invalid_setting_fails_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PERFLOOP_KAFKA_PORT", "0")
    assert main(["sql", "SELECT 1"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("perfloop: ") and "PERFLOOP_KAFKA_PORT" in line


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        # a service the command does not start reads it later: checked at the entry point
        (
            "PERFLOOP_TIER",
            "bogus",
            "PERFLOOP_TIER='bogus': must be one of observe, recommend, approve, auto",
        ),
        (
            "PERFLOOP_WINDOW_S",
            "zero",
            "unknown setting PERFLOOP_WINDOW_S (did you mean PERFLOOP_WINDOWS",
        ),
        ("PERFLOOP_WINDOWS", "", "PERFLOOP_WINDOWS=''"),
        ("PERFLOOP_SINK_FLUSH_S", "soon", "unknown setting PERFLOOP_SINK_FLUSH_S"),
    ],
)
def test_every_perfloop_variable_is_checked_before_any_command(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    value: str,
    said: str,
) -> None:
    monkeypatch.setenv(name, value)
    assert main(["status"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("perfloop: ") and said in line, line


def test_aliases_internal_and_compose_variables_are_not_unknown() -> None:
    from perfloop.settings import check_environment

    check_environment(
        {
            "PERFLOOP_KAFKA_BOOTSTRAP": "kafka:9092",
            "PERFLOOP_CLICKHOUSE_URL": "http://ch:8123",
            "PERFLOOP_RUN_HOOKS": "1",
            "PERFLOOP_STREAMS_REPLICAS": "3",
            "PERFLOOP_BENCH_KAFKA_PORT": "1",
            "PERFLOOP_TIER": "approve",
        }
    )


def test_output_into_a_pipe_its_reader_closed_ends_quietly(tmp_path: Path) -> None:
    """``perfloop keys list RING | head -1``: no traceback when ``head`` stops reading."""
    from perfloop.identity import Keyring, PrivateKey, TrustedKey

    ring = Keyring([TrustedKey.of(PrivateKey.generate().public_bytes(), f"p{i}")
                    for i in range(3000)])  # fmt: skip
    ring.save(tmp_path / "ring.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "perfloop.cli", "keys", "list", str(tmp_path / "ring.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.read(20)
    proc.stdout.close()  # the reader goes away with most of the output unread
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert b"Traceback" not in err and b"Exception ignored" not in err, err
