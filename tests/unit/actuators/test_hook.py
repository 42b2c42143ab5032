"""The action hook's template and runner: placeholders replaced per argument, no shell, values
that cannot become options, a timeout that kills the hook and its children, and one line on
how it went."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from perfloop.actuators.hook import check_template, render, run_hook
from perfloop.exceptions import ConfigError
from perfloop.settings import ActuatorSettings

VALUES = {"node": "n3", "job": "llm-7", "ranks": "1,5", "rec_id": "ab12", "reason": "rank 1 late"}


def test_placeholders_are_replaced_in_each_argument_and_nothing_is_split_again() -> None:
    argv = render(
        "kubectl label node {node} perfloop/straggler=true --overwrite "
        "'perfloop/reason={reason}; $(reboot)' {job}:{ranks}:{rec_id}",
        VALUES,
    )
    assert argv == [
        "kubectl", "label", "node", "n3", "perfloop/straggler=true", "--overwrite",
        "perfloop/reason=rank 1 late; $(reboot)", "llm-7:1,5:ab12",
    ]  # fmt: skip


def test_a_value_with_spaces_or_shell_syntax_stays_one_argument() -> None:
    argv = render("echo {reason}", VALUES | {"reason": "a b; rm -rf / `x` $HOME {node}"})
    assert argv == ["echo", "a b; rm -rf / `x` $HOME {node}"], "no re-expansion either"


@pytest.mark.parametrize("field", ["node", "job", "rec_id", "reason"])
def test_a_value_that_could_become_an_option_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match="starts with '-'"):
        render("drain {node} {job} {rec_id} {reason}", VALUES | {field: "--all"})


def test_a_value_of_several_lines_is_refused() -> None:
    with pytest.raises(ConfigError, match="not one line"):
        render("drain {node}", VALUES | {"node": "n3\nn4"})


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("drain 'n3", "cannot be split"),
        ("drain {host}", "unknown placeholder {host}"),
        ("{node}-drain now", "must be fixed"),
    ],
)
def test_a_bad_template_is_refused_with_what_is_wrong(template: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        check_template(template)


def test_the_setting_is_checked_when_the_actuator_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFLOOP_STRAGGLER_HOOK", "scontrol update nodename={host}")
    with pytest.raises(ValueError, match=r"unknown placeholder \{host\}.*valid: \{node\}"):
        ActuatorSettings()
    monkeypatch.setenv("PERFLOOP_STRAGGLER_HOOK", "scontrol update nodename={node} state=drain")
    assert ActuatorSettings().straggler_hook.endswith("state=drain")
    monkeypatch.delenv("PERFLOOP_STRAGGLER_HOOK")
    assert ActuatorSettings().straggler_hook == "", "no hook by default"


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "hook.py"
    path.write_text(f"import sys, os, time\n{body}\n")
    return str(path)


def test_a_hook_that_succeeds_reports_its_exit_code_and_first_line(tmp_path: Path) -> None:
    hook = _script(tmp_path, "print(); print('drained', sys.argv[1]); print('more')")
    result = run_hook([sys.executable, hook, "n3"], timeout_s=30)
    assert result.ok and (result.exit_code, result.first_line) == (0, "drained n3")
    assert result.describe() == "exit 0: drained n3"


def test_a_failing_hook_reports_its_exit_code_and_what_it_said(tmp_path: Path) -> None:
    hook = _script(tmp_path, "print('scontrol: error: Invalid node name', file=sys.stderr)\n"
                             "sys.exit(3)")  # fmt: skip
    result = run_hook([sys.executable, hook], timeout_s=30)
    assert not result.ok and result.exit_code == 3
    assert result.describe() == "exit 3: scontrol: error: Invalid node name"


def test_a_hook_that_cannot_run_says_why(tmp_path: Path) -> None:
    result = run_hook([str(tmp_path / "no-such-program")], timeout_s=30)
    assert not result.ok and result.exit_code is None
    assert "cannot run" in result.describe() and "No such file" in result.describe()


def test_a_hook_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    hook = _script(
        tmp_path,
        "import subprocess\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
        "print('draining…', flush=True)\n"
        "time.sleep(60)",
    )
    started = time.monotonic()
    result = run_hook([sys.executable, hook], timeout_s=1.5)
    assert time.monotonic() - started < 15
    assert not result.ok and result.exit_code is None
    assert result.describe() == "timed out after 1.5 s, killed (output: draining…)"
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the hook's own children are killed too"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def test_the_hook_gets_no_stdin(tmp_path: Path) -> None:
    hook = _script(tmp_path, "print(repr(sys.stdin.read()))")
    assert run_hook([sys.executable, hook], timeout_s=30).first_line == "''"
