"""The command line: misuse exits 2, failures exit 1, each with one line on stderr."""

from __future__ import annotations

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
