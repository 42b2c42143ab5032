"""``perfloop jobs`` against the real embedded stack: a running job published through the
project's publisher (its info, lifecycle, steps, an open diagnosis, a command and its verdict)
and a finished one are listed with their state, ranks, step time, open diagnosis and last
change, as JSON for scripts and as a table for people."""

from __future__ import annotations

import itertools
import json
import statistics
import time
import uuid

import pytest

from perfloop.producers.emitter import Emitter
from perfloop.producers.publisher import Publisher
from perfloop.schemas import ActuationResult, Command, Diagnosis, JobInfo, JobLifecycle
from perfloop.settings import StackSettings

from .conftest import perfloop_cli, query, wait_for

pytestmark = pytest.mark.integration

NS = 1_000_000_000


def test_jobs_lists_a_running_job_with_its_diagnosis_and_a_finished_one(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    tag = uuid.uuid4().hex[:8]
    running, finished = f"it-jobs-run-{tag}", f"it-jobs-done-{tag}"
    pub = Publisher(stack)
    now = time.time_ns()
    em = Emitter(pub, job_id=running, node="n0", producer_id="it-jobs")
    common = {"job_id": running, "node": "n0"}
    slurm = f"9{tag[:4]}"
    em.event(JobInfo(ts_ns=now - 20 * NS, **common, rank=0, world_size=2, nodes=1,
                     scheduler="slurm", slurm_job_id=slurm, slurm_job_name="llm"))  # fmt: skip
    em.event(JobLifecycle(ts_ns=now - 20 * NS, **common, rank=-1, state="started"))
    times = [100.0 + (i % 5) for i in range(20)]
    for i, ms in enumerate(times):
        for rank in (0, 1):
            em.add("step", ts_ns=now - (20 - i) * NS // 2, rank=rank, step=i, step_time_ms=ms,
                   data_wait_ms=1.0)  # fmt: skip
    em.event(Diagnosis(ts_ns=now, **common, rank=-1, diagnosis_id=f"d-{tag}",
                       bottleneck="dataloader_starvation", level="host", loop="training",
                       state="open", onset_ns=now - 8 * NS, step_share=0.4, confidence=0.9,
                       critical_path=True, ranks=[0, 1]))  # fmt: skip
    cmd = Command(ts_ns=now - 5 * NS, **common, rank=-1, seq=1, knob="dataloader.num_workers",
                  from_value=0, value=2, expires_ts_ns=now + 60 * NS)  # fmt: skip
    em.event(cmd)
    em.event(ActuationResult(ts_ns=now - NS, **common, rank=0, command_id=cmd.event_id,
                             status="kept", knob=cmd.knob, value=2, step=15))  # fmt: skip
    done = Emitter(pub, job_id=finished, node="n1", producer_id="it-jobs")
    for state, t in (("started", now - 3 * NS), ("finished", now - 2 * NS)):
        done.event(JobLifecycle(ts_ns=t, job_id=finished, node="n1", rank=-1, state=state,
                                exit_code=0 if state == "finished" else None))  # fmt: skip
    em.flush()
    assert pub.flush(10) == 0
    pub.close()

    def count(table: str, job: str) -> int:
        sql = f"SELECT count() FROM {table} WHERE job_id = {{j:String}}"
        return int(query(stack, sql, j=job)[0][0])

    def landed() -> bool:
        diag = query(stack, "SELECT count() FROM diagnoses WHERE diagnosis_id = {d:String}",
                     d=f"d-{tag}")[0][0]  # fmt: skip
        return (count("steps", running), count("actuations", running), diag,
                count("job_lifecycle", finished)) == (40, 1, 1, 2)  # fmt: skip

    wait_for(landed, 30, "the jobs' events in the warehouse")

    out = perfloop_cli("jobs", "--json", "--since", "1h", env=stack_env_vars)
    assert out.returncode == 0, out.stderr
    jobs = {j["job_id"]: j for j in json.loads(out.stdout)}
    job = jobs[running]
    assert job["state"] == "running"
    assert (job["ranks"], job["nodes"]) == (2, 1)
    assert job["step_time_ms"] == pytest.approx(statistics.median(times))
    assert job["steps_per_s"] == pytest.approx(2.0, rel=0.1)  # a step every 0.5 s
    (diag,) = [d for d in job["diagnoses"] if d["diagnosis_id"] == f"d-{tag}"]
    assert (diag["bottleneck"], diag["ranks"], diag["critical_path"]) == (
        "dataloader_starvation", [0, 1], True
    )  # fmt: skip
    assert job["last_change"] | {"ts": None} == {
        "knob": "dataloader.num_workers", "from_value": "0", "to_value": "2", "verdict": "kept",
        "ts": None,
    }  # fmt: skip
    assert job["started_ns"] <= now - 19 * NS and job["last_seen_ns"] >= now - 2 * NS
    assert (jobs[finished]["state"], jobs[finished]["exit_code"]) == ("finished", 0)
    assert (job["identity"]["scheduler"], job["identity"]["slurm_job_id"]) == ("slurm", slurm)
    by_slurm = perfloop_cli(
        "jobs", "--json", "--since", "1h", "--slurm-job", slurm, env=stack_env_vars
    )
    assert by_slurm.returncode == 0, by_slurm.stderr
    assert [j["job_id"] for j in json.loads(by_slurm.stdout)] == [running]

    # the table of this job alone (the session's other tests leave jobs whose long diagnoses
    # and ids would share the 120 columns)
    table = perfloop_cli("jobs", "--since", "1h", "--slurm-job", slurm, env=stack_env_vars)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith(running))
    assert lines[at].split()[1:6] == [
        "running", "2", "1", f"{statistics.median(times):.1f}", "2.00"
    ]  # fmt: skip
    row = [lines[at], *itertools.takewhile(lambda x: x.startswith(" "), lines[at + 1 :])]
    assert "dataloader_starvation" in " ".join(row)  # the stream tier's may come first
    assert max(len(x) for x in lines) <= 120
