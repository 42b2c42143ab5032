"""What a user decides before a job starts, without a stack: ``perfloop run --pin KNOB``,
``PERFLOOP_PINNED_KNOBS``, ``perfloop config set actuator.pinned …`` and ``PERFLOOP_QUIET``
(one-line errors naming the valid knobs; what the job's agent is started with)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from perfloop.cli import build_parser, main
from perfloop.cli.config import build_change, parse_value
from perfloop.exceptions import ConfigError
from perfloop.settings import ActuatorSettings, ProducerSettings
from tests.helpers import clean_env, closed_port, one_line  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_env")


def test_run_takes_pins_repeatedly() -> None:
    args = build_parser().parse_args(
        ["run", "--pin", "torch.num_threads", "--pin", "dataloader.num_workers", "--", "x"]
    )
    assert args.pin == ["torch.num_threads", "dataloader.num_workers"]
    assert build_parser().parse_args(["run", "--", "x"]).pin is None


def test_an_unknown_pin_is_a_bad_command_line_naming_the_valid_knobs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--pin", "threads", "--", "true"]) == 2
    out, err = capsys.readouterr()
    line = one_line(err)
    assert out == "" and line.startswith("perfloop: error: argument --pin: unknown knob 'threads'")
    assert (
        "valid: cluster.drain_node, dataloader.num_workers" in line and "torch.num_threads" in line
    )


@pytest.mark.parametrize(
    ("env", "pinned"),
    [
        ("torch.num_threads", ("torch.num_threads",)),
        ("torch.num_threads, dataloader.num_workers",
         ("dataloader.num_workers", "torch.num_threads")),
        ('["dataloader.pin_memory"]', ("dataloader.pin_memory",)),
        ("", ()),
    ],
)  # fmt: skip
def test_the_job_reads_its_pins_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: str, pinned: tuple[str, ...]
) -> None:
    monkeypatch.setenv("PERFLOOP_PINNED_KNOBS", env)
    assert ProducerSettings().pinned_knobs == pinned


def test_an_unknown_pin_in_the_environment_is_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PERFLOOP_PINNED_KNOBS", "torch.threads")
    assert main(["run", "--", "true"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("perfloop: invalid setting PERFLOOP_PINNED_KNOBS")
    assert "unknown knob 'torch.threads'" in line


@pytest.mark.parametrize(("env", "quiet"), [("1", True), ("0", False), ("true", True)])
def test_quiet_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: str, quiet: bool
) -> None:
    assert ProducerSettings().quiet is False
    monkeypatch.setenv("PERFLOOP_QUIET", env)
    assert ProducerSettings().quiet is quiet


@pytest.mark.parametrize("quiet", [False, True])
def test_the_jobs_agent_is_started_with_its_pins_and_voice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quiet: bool
) -> None:
    from perfloop.producers.knobs import TorchKnobs, start_agent

    settings = ProducerSettings(
        PERFLOOP_KAFKA_BOOTSTRAP=f"127.0.0.1:{closed_port()}", home=tmp_path, quiet=quiet,
        pinned_knobs="torch.num_threads",
    )  # fmt: skip
    agent = start_agent(settings, TorchKnobs(None, None), job_id="j1", node="n0", rank=0)
    try:
        assert agent.pinned == frozenset({"torch.num_threads"})
        assert agent.announce is not quiet
    finally:
        agent.stop()


def test_config_set_checks_the_pins_before_sending(capsys: pytest.CaptureFixture[str]) -> None:
    change = build_change(
        "actuator.pinned", parse_value('["torch.num_threads"]'), job="llm-7", author="a@b"
    )
    assert (change.target, change.applies_to, change.value) == (
        "actuator", "llm-7", '["torch.num_threads"]'
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"actuator.pinned: unknown knob 'threads' to pin; valid"):
        build_change("actuator.pinned", '["threads"]', job="llm-7")
    assert main(["config", "set", "actuator.pinned", "threads", "--job", "llm-7"]) == 1
    line = one_line(capsys.readouterr().err)
    assert "unknown knob 'threads' to pin; valid: cluster.drain_node" in line


def test_the_action_hook_is_not_a_live_setting() -> None:
    with pytest.raises(ConfigError, match=r"unknown actuator setting 'actuator\.straggler_hook'"):
        build_change("actuator.straggler_hook", "rm -rf /", job="llm-7")


def test_run_passes_the_pins_to_the_command_and_publishes_them_for_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import perfloop.cli.config as config_cli
    from perfloop.cli.run import run_command

    published: list[Any] = []
    monkeypatch.setattr(
        config_cli, "publish_change", lambda s, c, t=10.0: published.append(c) or ""
    )
    monkeypatch.setenv("PERFLOOP_PINNED_KNOBS", "dataloader.num_workers")
    out = tmp_path / "env.txt"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ.get('PERFLOOP_PINNED_KNOBS'))"
    args = argparse.Namespace(
        cmd=["--", "python3", "-c", script], job_id="pin-job", node="n0", no_gpu=True,
        tier="observe", pin=["torch.num_threads"],
    )  # fmt: skip
    settings = ProducerSettings(
        PERFLOOP_KAFKA_BOOTSTRAP=f"127.0.0.1:{closed_port()}", home=tmp_path,
        message_timeout_ms=1000,
    )  # fmt: skip
    monkeypatch.setattr("perfloop.cli.run._start_sampler", lambda *a, **k: (None, None))
    assert run_command(args, settings) == 0
    assert out.read_text() == "dataloader.num_workers,torch.num_threads"
    assert [(c.key, c.value, c.applies_to, c.reason) for c in published] == [
        ("actuator.tier", "observe", "pin-job", "perfloop run --tier"),
        ("actuator.pinned", '["dataloader.num_workers", "torch.num_threads"]', "pin-job",
         "perfloop run --pin"),
    ]  # fmt: skip
    err = capsys.readouterr().err
    assert (
        "perfloop: job pin-job: pinned dataloader.num_workers, torch.num_threads "
        "(its agents and the actuator leave them alone)"
    ) in err


def test_actuator_settings_for_the_hook_have_safe_defaults() -> None:
    s = ActuatorSettings()
    assert (s.straggler_hook, s.straggler_hook_timeout_s, s.straggler_hook_max_per_hour) == (
        "", 30.0, 4
    )  # fmt: skip
