"""What the person watching a job sees on its stderr (one line per change applied, kept, rolled
back or rejected, from the job agent), and the knobs the user pinned (refused by the agent).
A closed or broken stderr never reaches the training loop. No broker."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfloop.actuators import JobAgent, sign
from perfloop.actuators.config_patch import ConfigPatch
from perfloop.schemas import Command, KnobValue, encode_event
from perfloop.settings import BaseServiceSettings

KEY = b"notice-key"
S = 1_000_000_000
NOW = 1_700_000_000 * S
WORKERS, THREADS = "dataloader.num_workers", "torch.num_threads"


class Knobs:
    """Two knobs and their values; ``fail`` makes setting that value raise."""

    def __init__(self, fail: KnobValue | None = None) -> None:
        self.values: dict[str, KnobValue] = {WORKERS: 0, THREADS: 2}
        self.fail = fail
        self.handlers = {k: self._setter(k) for k in self.values}

    def _setter(self, knob: str) -> Any:
        def set_(value: KnobValue) -> None:
            if value == self.fail:
                raise RuntimeError("cannot")
            self.values[knob] = value

        return set_


def _agent(knobs: Knobs, **kw: Any) -> JobAgent:
    settings = BaseServiceSettings(PERFLOOP_KAFKA_BOOTSTRAP="127.0.0.1:1")
    fields: dict[str, Any] = dict(job_id="job-1", node="n0", signing_key=KEY, rank=0,
                                  handlers=knobs.handlers, read=knobs.values.get,
                                  announce=True, settle_steps=2, verify_steps=20)  # fmt: skip
    return JobAgent(settings, **(fields | kw))


def _cmd(seq: int, knob: str, value: KnobValue, **kw: Any) -> bytes:
    fields: dict[str, Any] = dict(ts_ns=NOW, job_id="job-1", node="n0", rank=-1, seq=seq,
                                  knob=knob, value=value, expires_ts_ns=NOW + 60 * S,
                                  event_id=f"{seq:02d}c1f00aa11bb22cc33dd44ee")  # fmt: skip
    return encode_event(sign(Command(**(fields | kw)), KEY))


def _steps(agent: JobAgent, n: int, ms: float, start: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    for step in range(start, start + n):
        agent.step_boundary(step)
        agent.observe_step(step, ms * (1 + 0.02 * rng.standard_normal()), 1.0)
    return start + n


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_a_change_that_helped_is_one_line_applied_and_one_line_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    knobs = Knobs()
    agent = _agent(knobs)
    step = _steps(agent, 30, 130, 0)
    agent.receive(_cmd(1, WORKERS, 1), now_ns=NOW)
    _steps(agent, 23, 96, step)
    applied, kept = _lines(capsys)
    assert applied == (
        "perfloop[rank 0]: applied dataloader.num_workers 0 → 1 at step 30 (command 01c1f00aa11b)"
    )
    assert kept.startswith("perfloop[rank 0]: kept dataloader.num_workers = 1: it helped: ")
    assert re.search(
        r"step time p50 1[23]\d\.\d → 9\d\.\d ms \(-2\d\.\d %, p = [^;]+; "
        r"20 steps before, 20 after\)$",
        kept,
    ), kept


def test_a_rollback_is_one_line_naming_both_values(capsys: pytest.CaptureFixture[str]) -> None:
    knobs = Knobs()
    agent = _agent(knobs)
    step = _steps(agent, 30, 100, 0)
    agent.receive(_cmd(1, THREADS, 4), now_ns=NOW)
    _steps(agent, 24, 300, step)
    lines = _lines(capsys)
    assert lines[0].startswith("perfloop[rank 0]: applied torch.num_threads 2 → 4 at step 30")
    assert lines[1].startswith("perfloop[rank 0]: rolled back torch.num_threads 4 → 2: it hurt: ")
    assert knobs.values[THREADS] == 2 and len(lines) == 2


def test_a_rejection_is_one_line_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(Knobs())
    agent.receive(_cmd(1, WORKERS, 999), now_ns=NOW)
    [line] = _lines(capsys)
    assert line == (
        "perfloop[rank 0]: rejected dataloader.num_workers = 999 (command 01c1f00aa11b): "
        "dataloader.num_workers=999 is outside [0, 64]"
    )


def test_a_slow_loop_change_says_it_is_for_the_next_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    knobs = Knobs()
    agent = _agent(knobs, patch=ConfigPatch(tmp_path / "p.json", job_id="job-1"))
    agent.receive(_cmd(1, "train.batch_size", 64, loop="slow"), now_ns=NOW)
    [line] = _lines(capsys)
    assert line.startswith(
        "perfloop[rank 0]: recorded train.batch_size = 64 for the next start (command "
    )


def test_announce_off_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    agent = _agent(Knobs(), announce=False)
    step = _steps(agent, 30, 100, 0)
    agent.receive(_cmd(1, WORKERS, 1), now_ns=NOW)
    agent.receive(_cmd(2, WORKERS, 999), now_ns=NOW)
    _steps(agent, 25, 60, step)  # it helped: kept
    assert [r.status for r in agent.results] == ["rejected", "applied", "kept"]
    assert capsys.readouterr().err == ""


class Broken(io.TextIOBase):
    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("stream", ["closed", "broken", "none"])
def test_a_closed_or_broken_stderr_does_not_matter(
    monkeypatch: pytest.MonkeyPatch, stream: str
) -> None:
    closed = io.StringIO()
    closed.close()
    err = {"closed": closed, "broken": Broken(), "none": None}[stream]
    monkeypatch.setattr(sys, "stderr", err)
    knobs = Knobs()
    agent = _agent(knobs)
    step = _steps(agent, 30, 100, 0)
    agent.receive(_cmd(1, WORKERS, 999), now_ns=NOW)
    agent.receive(_cmd(2, THREADS, 4), now_ns=NOW)
    _steps(agent, 25, 300, step)
    assert [r.status for r in agent.results] == ["rejected", "applied", "rolled_back"]


# -- pinned knobs ---------------------------------------------------------------------------


def test_a_pinned_knob_is_rejected_and_nothing_changes(capsys: pytest.CaptureFixture[str]) -> None:
    knobs = Knobs()
    agent = _agent(knobs, pinned=(THREADS,))
    reason = agent.receive(_cmd(1, THREADS, 1), now_ns=NOW)
    assert reason == "pinned by the user (perfloop run --pin, PERFLOOP_PINNED_KNOBS)"
    assert agent.step_boundary(1) == [] and knobs.values[THREADS] == 2
    [rejected] = agent.results
    assert (rejected.status, rejected.knob, rejected.reason) == ("rejected", THREADS, reason)
    assert _lines(capsys) == [
        f"perfloop[rank 0]: rejected torch.num_threads = 1 (command 01c1f00aa11b): {reason}"
    ]
    assert agent.receive(_cmd(2, WORKERS, 1), now_ns=NOW) is None, "another knob is not pinned"


def test_a_pinned_knob_is_refused_for_the_next_start_too(tmp_path: Path) -> None:
    patch = ConfigPatch(tmp_path / "p.json", job_id="job-1")
    agent = _agent(Knobs(), pinned=("train.batch_size",), patch=patch, announce=False)
    why = agent.receive(_cmd(1, "train.batch_size", 64, loop="slow"), now_ns=NOW)
    assert why is not None and why.startswith("pinned by the user")
    assert not (tmp_path / "p.json").exists()


def test_an_unsigned_command_for_a_pinned_knob_is_refused_for_its_signature() -> None:
    agent = _agent(Knobs(), pinned=(THREADS,))
    cmd = Command(ts_ns=NOW, job_id="job-1", node="n0", rank=-1, seq=1, knob=THREADS, value=1,
                  expires_ts_ns=NOW + 60 * S)  # fmt: skip
    assert "signature" in (agent.receive(encode_event(cmd), now_ns=NOW) or "")
