"""When a rank last changed (``changed_ns``): a knob perfloop may change took a new value in
the job info the job agent publishes again after each change, or the rank's loader runs a
worker count it has not run. What a rank holds in memory moves after such a change, so
detectors that judge memory count from it. A rank's first job info and first host reading
are its start, not a change; a loader that restarts its workers each epoch is no change."""

from __future__ import annotations

from perfloop.schemas import JobInfo
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.detection.job_state import JobState

NS = 1_000_000_000
T0 = 1_700_000_000 * NS
BOUNDS = {"bounds.torch.num_threads": "1,4", "bounds.dataloader.num_workers": "0,8"}


def _info(job: JobState, second: int, threads: str, workers: str = "2") -> None:
    extra = {**BOUNDS, "torch.num_threads": threads, "dataloader.num_workers": workers,
             "cpu_budget": "4"}  # fmt: skip
    job.info(JobInfo(ts_ns=T0 + second * NS, job_id="j", node="n0", rank=0, extra=extra))


def _host(job: JobState, second: int, workers: int) -> None:
    cols = {"ts_ns": [T0 + second * NS], "rank": [0], "pid": [42], "loader_workers": [workers],
            "loader_cpu_pct": [50.0], "proc_cpu_pct": [90.0], "sys_cpu_pct": [80.0]}  # fmt: skip
    batch = decode_batch(encode_batch("host", cols, job_id="j", node="n0"))
    job.ingest("host", "n0", batch.columns, T0 + second * NS)


def test_a_knob_s_new_value_in_the_job_info_is_a_change() -> None:
    job = JobState("j")
    _info(job, 1, threads="4")
    _info(job, 3, threads="4")  # published again, nothing moved
    assert job.rank["changed_ns"][0] == 0
    _info(job, 7, threads="2")
    assert job.rank["changed_ns"][0] == T0 + 7 * NS
    _info(job, 9, threads="2", workers="3")
    assert job.rank["changed_ns"][0] == T0 + 9 * NS


def test_a_loader_running_a_new_worker_count_is_a_change_an_epoch_s_restart_is_not() -> None:
    job = JobState("j")
    _host(job, 1, 2)  # its first reading: workers it started with
    assert job.rank["changed_ns"][0] == 0
    for second, workers in ((2, 2), (3, 0), (4, 2), (5, 0), (6, 2)):  # restarts each epoch
        _host(job, second, workers)
    assert job.rank["changed_ns"][0] == 0
    _host(job, 8, 4)
    assert job.rank["changed_ns"][0] == T0 + 8 * NS
    _host(job, 9, 0)
    _host(job, 10, 2)  # back to a count it ran before, after others
    assert job.rank["changed_ns"][0] == T0 + 10 * NS


def test_workers_started_after_the_first_reading_are_a_change() -> None:
    job = JobState("j")
    _host(job, 1, 0)
    _host(job, 5, 2)
    assert job.rank["changed_ns"][0] == T0 + 5 * NS


def test_point_to_point_ops_say_nothing_of_arrival() -> None:
    """A collective of the whole job is where its ranks meet (the k-th of a step is the same
    on every rank); a send meets its peer's receive only, and waits out a pipeline's bubble."""
    for op, arrivals in (("all_reduce", True), ("send", False), ("recv", False)):
        job = JobState("j")
        cols = {"ts_ns": [T0, T0 + NS // 10], "rank": [0, 1], "step": [3, 3], "op": [op] * 2,
                "size_bytes": [64, 64], "group": ["world"] * 2, "group_size": [2, 2],
                "duration_ms": [100.0, 1.0]}  # fmt: skip
        batch = decode_batch(encode_batch("collective", cols, job_id="j", node="n0"))
        job.ingest("collective", "n0", batch.columns, T0 + NS)
        assert bool(job.flags.get("arrivals")) == arrivals, op
