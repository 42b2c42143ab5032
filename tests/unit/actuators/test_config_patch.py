"""Slow-loop changes: the job agent records them in the job's config patch for its next start,
at once and without touching the running job; the next start's tunables begin from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from perfloop.actuators import JobAgent, sign
from perfloop.actuators.config_patch import ConfigPatch, patch_path, read_patch
from perfloop.exceptions import ConfigError
from perfloop.schemas import Command, encode_event
from perfloop.settings import BaseServiceSettings

KEY = b"patch-key"
S = 1_000_000_000
NOW = 1_700_000_000 * S


def _cmd(seq: int, knob: str = "train.batch_size", value: int = 64, loop: str = "slow") -> bytes:
    cmd = Command(ts_ns=NOW, job_id="job-1", node="n0", rank=-1, seq=seq, knob=knob,
                  from_value=32, value=value, loop=loop, expires_ts_ns=NOW + 60 * S)  # type: ignore[arg-type]  # fmt: skip
    return encode_event(sign(cmd, KEY))


def _agent(patch: ConfigPatch | None, handled: list[object]) -> JobAgent:
    settings = BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1")
    return JobAgent(settings, job_id="job-1", node="n0", signing_key=KEY, patch=patch,
                    handlers={"dataloader.num_workers": handled.append})  # fmt: skip


def test_a_slow_command_is_recorded_for_the_next_start_and_acked_at_once(tmp_path: Path) -> None:
    path = patch_path(tmp_path, "job-1")
    handled: list[object] = []
    agent = _agent(ConfigPatch(path, job_id="job-1"), handled)
    assert agent.receive(_cmd(1), now_ns=NOW) is None
    (ack,) = agent.results
    assert (ack.status, ack.knob, ack.value) == ("applied", "train.batch_size", 64)
    assert str(path) in ack.reason and "next start" in ack.reason
    assert read_patch(path) == {"train.batch_size": 64}
    assert agent.step_boundary(1) == [] and not agent.verifying, "nothing changes in this run"
    assert handled == []
    assert agent.receive(_cmd(2, value=128), now_ns=NOW) is None
    assert read_patch(path) == {"train.batch_size": 128}, "the newest value wins"


def test_slow_commands_without_a_patch_or_off_the_allow_list_are_refused(tmp_path: Path) -> None:
    handled: list[object] = []
    assert "no config patch" in (_agent(None, handled).receive(_cmd(1), now_ns=NOW) or "")
    agent = _agent(ConfigPatch(tmp_path / "p.json", job_id="job-1"), handled)
    assert "allow-list" in (agent.receive(_cmd(1, knob="model.depth"), now_ns=NOW) or "")
    assert "outside" in (agent.receive(_cmd(2, value=0), now_ns=NOW) or "")
    assert [r.status for r in agent.results] == ["rejected", "rejected"]
    assert not (tmp_path / "p.json").exists()


def test_an_unwritable_patch_rejects_the_command(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    agent = _agent(ConfigPatch(tmp_path / "file" / "p.json", job_id="job-1"), [])
    reason = agent.receive(_cmd(1), now_ns=NOW)
    assert reason is not None and f"config patch {tmp_path / 'file' / 'p.json'}" in reason
    assert agent.results[-1].status == "rejected"


def test_a_broken_patch_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        read_patch(path)
    assert read_patch(tmp_path / "missing.json") == {}


def test_tunables_start_from_the_patch() -> None:
    from perfloop.producers import knobs

    try:
        knobs.use_patch({"train.batch_size": 64, "train.grad_accum_steps": 0})
        assert knobs.tunable("train.batch_size", 32, lo=1, hi=1024).value == 64
        # a value out of the script's own bounds is not used
        assert knobs.tunable("train.grad_accum_steps", 4, lo=1, hi=64).value == 4
    finally:
        knobs.use_patch({})
        for name in ("train.batch_size", "train.grad_accum_steps"):
            knobs._TUNABLES.pop(name, None)
