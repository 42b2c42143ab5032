"""The actuator's action hook: a command the operator configures for what no job can do to
itself — drain or cordon a straggler's node (``cluster.drain_node``).

The template comes from the actuator's own settings only (``PERFLOOP_STRAGGLER_HOOK``; never
from live config, which is not signed: the hook runs commands). It is split like a shell
would (`shlex`), but never run by one: each argument has its placeholders replaced
(``{node}``, ``{job}``, ``{ranks}``, ``{rec_id}``, ``{reason}``) and the program is executed
directly, in a session of its own, with a timeout after which it and its children are killed.
A value never starts an argument with ``-`` (it cannot become an option), and the program
itself is fixed (no placeholder in it).

>>> render('scontrol update nodename={node} state=drain reason="perfloop: {reason}"',
...        {"node": "n3", "job": "j", "ranks": "1", "rec_id": "ab", "reason": "rank 1 late"})
['scontrol', 'update', 'nodename=n3', 'state=drain', 'reason=perfloop: rank 1 late']
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from perfloop.command_template import PLACEHOLDER_PATTERN, PLACEHOLDERS, check_template
from perfloop.exceptions import ConfigError

__all__ = ["PLACEHOLDERS", "HookResult", "check_template", "render", "run_hook"]

OUTPUT_LINE_CHARS = 300


def render(template: str, values: Mapping[str, str]) -> list[str]:
    """The hook's argv: each argument of ``template`` with its placeholders replaced by
    ``values`` (one line each); `ConfigError` for a value that starts with ``-``."""
    for name, value in values.items():
        if value.startswith("-"):
            raise ConfigError(f"{{{name}}} = {value!r} starts with '-': not passed to the hook")
        if "\n" in value or "\r" in value or "\x00" in value:
            raise ConfigError(f"{{{name}}} = {value!r} is not one line")
    return [
        PLACEHOLDER_PATTERN.sub(lambda m: values[m.group(1)], arg)
        for arg in check_template(template)
    ]


@dataclass(frozen=True)
class HookResult:
    """How a run went: the exit code (None when it did not exit by itself) and the first
    line of its output, or why it could not run."""

    exit_code: int | None
    first_line: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.error

    def describe(self) -> str:
        """One line for the audit: ``exit 0: drained n3`` or the reason it failed."""
        if self.error:
            return self.error
        out = f": {self.first_line}" if self.first_line else " (no output)"
        return f"exit {self.exit_code}{out}"


def _first_line(output: bytes) -> str:
    for line in output.decode("utf-8", "replace").splitlines():
        if line.strip():
            return " ".join(line.split())[:OUTPUT_LINE_CHARS]
    return ""


def run_hook(argv: list[str], timeout_s: float) -> HookResult:
    """Run ``argv`` without a shell (stdin closed, stderr with stdout); after ``timeout_s``
    kill it and every process it started. Never raises for what the hook does."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills its children too
        )
    except OSError as e:
        return HookResult(None, error=f"cannot run {argv[0]!r}: {e.strerror or e}")
    with proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                out, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a child that escaped its group holds the pipe
                proc.kill()
                out = b""
            first = _first_line(out or b"")
            said = f" (output: {first})" if first else ""
            return HookResult(None, first, f"timed out after {timeout_s:g} s, killed{said}")
    return HookResult(proc.returncode, _first_line(out or b""))
