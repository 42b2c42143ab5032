"""A job that has ended gets nothing more — no diagnosis opened, no recommendation — and every
stream component lets go of it; its late telemetry does not bring it back, a restart does."""

from __future__ import annotations

import pytest

from perfloop.schemas import BatchBuilder, JobInfo, JobLifecycle, encode_event
from perfloop.schemas.topics import Topics
from perfloop.settings import StreamsSettings
from perfloop.streams.engine import StreamEngine

NS = 1_000_000_000
NOW = 1_800_000_000 * NS
T0 = NOW - 60 * NS


def _job_info(rank: int, job: str = "j") -> bytes:
    """Two ranks of a CPU job, each with 8 threads on a budget of one CPU."""
    return encode_event(
        JobInfo(
            ts_ns=T0,
            job_id=job,
            node="n0",
            rank=rank,
            world_size=2,
            local_world_size=2,
            cpu_count=2,
            extra={"torch.num_threads": "8", "cpu_budget": "1"},
        )
    )


def _steps(first: int, n: int, t0: int, job: str = "j", wait_ms: float = 60.0) -> bytes:
    b = BatchBuilder("step", job_id=job, node="n0", producer_id="t")
    for i in range(first, first + n):
        for r in (0, 1):
            b.add(ts_ns=t0 + (i - first) * 100_000_000, rank=r, step=i, step_time_ms=100.0,
                  data_wait_ms=wait_ms, num_workers=0)  # fmt: skip
    return b.encode()


def _end(ts: int, rank: int = -1, state: str = "finished", job: str = "j") -> bytes:
    return encode_event(JobLifecycle(ts_ns=ts, job_id=job, node="n0", rank=rank, state=state))


def _state_of(eng: StreamEngine, job: str = "j") -> dict[str, bool]:
    return {
        "funnel": job in eng.funnel._jobs,
        "steps": job in eng.steps._jobs,
        "phases": job in eng.phases._jobs,
        "rule": job in eng.rule._jobs,
        "threads": job in eng.threads._jobs,
        "outcomes": job in eng.outcomes._device,
        "predict": job in eng.predict._jobs,
    }


@pytest.mark.parametrize("how", ["job", "every rank", "failed"])
def test_an_ended_job_gets_nothing_more_and_is_let_go(how: str) -> None:
    eng = StreamEngine(StreamsSettings())
    for r in (0, 1):
        eng.ingest(Topics.JOB, _job_info(r), wall_ns=T0)
    eng.ingest(Topics.STEP, _steps(0, 200, T0), wall_ns=T0 + 21 * NS)
    end = T0 + 20 * NS
    if how == "job":
        eng.ingest(Topics.JOB, _end(end), wall_ns=end + NS)
    elif how == "every rank":
        for r in (0, 1):
            eng.ingest(Topics.JOB, _end(end, rank=r), wall_ns=end + NS)
    else:
        eng.ingest(Topics.JOB, _end(end, rank=1, state="failed"), wall_ns=end + NS)
        eng.ingest(Topics.JOB, _end(end, rank=0, state="killed"), wall_ns=end + NS)
    out = [eng.tick(end + k * NS // 4) for k in range(4 * 600)]  # ten minutes after its end
    after = [o for o in out for d in o.diagnoses if d.state == "open" and d.ts_ns > end]
    recs = [r for o in out for r in o.recommendations if r.ts_ns > end]
    assert not after and not recs
    assert not any(_state_of(eng).values()), _state_of(eng)


def test_late_telemetry_of_an_ended_job_does_not_bring_it_back() -> None:
    eng = StreamEngine(StreamsSettings())
    for r in (0, 1):
        eng.ingest(Topics.JOB, _job_info(r), wall_ns=T0)
    eng.ingest(Topics.STEP, _steps(0, 100, T0), wall_ns=T0 + 11 * NS)
    eng.ingest(Topics.JOB, _end(T0 + 10 * NS), wall_ns=T0 + 11 * NS)
    for k in range(20):
        eng.tick(T0 + 11 * NS + k * NS // 4)
    eng.ingest(Topics.STEP, _steps(100, 100, T0 + 10 * NS), wall_ns=T0 + 21 * NS)
    out = [eng.tick(T0 + 21 * NS + k * NS // 4) for k in range(4 * 120)]
    assert not [r for o in out for r in o.recommendations]
    assert not [d for o in out for d in o.diagnoses if d.state == "open"]
    assert not any(_state_of(eng).values()), _state_of(eng)


def test_a_job_started_again_is_analysed_again() -> None:
    eng = StreamEngine(StreamsSettings())
    for r in (0, 1):
        eng.ingest(Topics.JOB, _job_info(r), wall_ns=T0)
    eng.ingest(Topics.STEP, _steps(0, 50, T0), wall_ns=T0 + 6 * NS)
    eng.ingest(Topics.JOB, _end(T0 + 5 * NS), wall_ns=T0 + 6 * NS)
    for k in range(4 * 60):
        eng.tick(T0 + 6 * NS + k * NS // 4)
    again = T0 + 70 * NS
    eng.ingest(Topics.JOB, _end(again, state="started"), wall_ns=again)
    for r in (0, 1):
        eng.ingest(Topics.JOB, _job_info(r), wall_ns=again)
    eng.ingest(Topics.STEP, _steps(0, 300, again), wall_ns=again + 31 * NS)
    out = [eng.tick(again + 31 * NS + k * NS // 4) for k in range(4 * 60)]
    assert [d for o in out for d in o.diagnoses if d.state == "open"], "starved: diagnosed"
