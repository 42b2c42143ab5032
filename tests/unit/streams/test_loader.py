"""The starvation diagnosis on what a real single-process job sends: its steps (data wait and
step time, its loader workers) and the node sampler's readings of its process and workers,
about one a second. What bounds a loader is judged only on readings of the workers it runs
now (a new worker's first reading covers its start and reads 0 %), and a data wait too short
for a worker to win back is no starvation."""

from __future__ import annotations

from perfloop.schemas import Diagnosis
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel

NS = 1_000_000_000
T0 = 1_700_000_000 * NS


class Job:
    """A single-process job: steps of ``step_ms`` waiting ``wait_ms`` for data, and a host
    reading every second: the process's CPU, its workers and their CPU together."""

    def __init__(self) -> None:
        self.f = Funnel()
        self.t = T0
        self.step = 0
        self.next_read = T0 + NS
        self.out: list[Diagnosis] = []

    def run(
        self, seconds: float, *, step_ms: float, wait_ms: float, workers: int, reads: list[float]
    ) -> None:
        """``reads``: the workers' CPU (100 = a core) of each host reading in turn (the last
        one repeats)."""
        end, k = self.t + int(seconds * NS), 0
        while self.t < end:
            self.t += int(step_ms * 1e6)
            cols = {"ts_ns": [self.t], "rank": [0], "step": [self.step],
                    "step_time_ms": [step_ms], "data_wait_ms": [wait_ms],
                    "num_workers": [workers]}  # fmt: skip
            self.f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="vm")), self.t)
            self.step += 1
            if self.t >= self.next_read:
                cpu = reads[min(k, len(reads) - 1)]
                k += 1
                host = {"ts_ns": [self.t], "rank": [-1], "pid": [42], "loader_workers": [workers],
                        "loader_cpu_pct": [cpu], "proc_cpu_pct": [60.0],
                        "sys_cpu_pct": [80.0]}  # fmt: skip
                self.f.observe(decode_batch(encode_batch("host", host, job_id="j", node="vm")),
                               self.t)  # fmt: skip
                self.next_read += NS
            self.out += self.f.tick(self.t + 200_000_000)

    def starvation(self) -> list[Diagnosis]:
        return [d for d in self.out if d.bottleneck == "dataloader_starvation"]


def test_a_cpu_bound_loader_s_new_worker_is_not_taken_for_an_io_bound_one() -> None:
    # cpu_loader: the loop blurs its own batches (0 workers), then runs one worker that computes
    # a whole core; the sampler's first reading of the new worker says 0 %
    job = Job()
    job.run(5, step_ms=40.0, wait_ms=26.0, workers=0, reads=[0.0])
    assert [d.state for d in job.starvation()][:1] == ["open"]
    before = len(job.out)
    job.run(6, step_ms=25.0, wait_ms=9.0, workers=1, reads=[0.0, 96.0, 97.0, 95.0])
    after = [d for d in job.out[before:] if d.bottleneck == "dataloader_starvation"]
    assert after, "the diagnosis says what its worker does"
    assert all("I/O-bound" not in d.summary for d in after)
    judged = [d for d in after if d.evidence.get("loader_workers") == 1]
    assert judged and judged[0].evidence["loader_bound"] == 2.0, "the first word on it: CPU-bound"
    assert "CPU-bound" in judged[0].summary and judged[0].evidence["loader_util"] > 0.9


def test_an_io_bound_loader_is_judged_on_its_second_reading() -> None:
    job = Job()
    job.run(3, step_ms=55.0, wait_ms=36.0, workers=0, reads=[0.0])
    before = len(job.out)
    job.run(5, step_ms=38.0, wait_ms=18.0, workers=1, reads=[0.0, 8.0, 9.0])
    after = [d for d in job.out[before:] if d.bottleneck == "dataloader_starvation"]
    judged = [d for d in after if d.evidence.get("loader_workers") == 1]
    assert judged[0].evidence["loader_bound"] == 1.0 and "I/O-bound" in judged[0].summary
    assert judged[0].evidence["loader_util"] > 0.05, "not the new worker's first 0 %"


def test_a_tiny_data_wait_of_very_fast_steps_is_no_starvation() -> None:
    # a Lightning run at ~400 steps/s: the batch from an in-memory dataset takes ~0.5 ms, a
    # fifth of a 2.5 ms step; no worker could win that back
    job = Job()
    job.run(8, step_ms=2.5, wait_ms=0.55, workers=0, reads=[0.0])
    assert job.starvation() == []
    # the same share of a step that waits long enough to matter is one
    job = Job()
    job.run(3, step_ms=25.0, wait_ms=5.5, workers=0, reads=[0.0])
    assert [d.state for d in job.starvation()][:1] == ["open"]
