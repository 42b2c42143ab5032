"""Memory on a CPU job: its process's RSS (no CUDA allocator figures) — a leak after the
job's first steps is one, the growth of its first steps is not; a CPU allocator's failure is
an out-of-memory."""

from __future__ import annotations

from perfloop.schemas import Diagnosis, JobLifecycle
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel

NS = 1_000_000_000
MIB = 1 << 20
T0 = 1_700_000_000 * NS


def _run(rss: list[float], failed: str = "") -> list[Diagnosis]:
    f = Funnel()
    out: list[Diagnosis] = []
    for i, r in enumerate(rss):
        t = T0 + (i + 1) * 100_000_000
        cols = {"ts_ns": [t], "rank": [0], "step": [i], "step_time_ms": [100.0],
                "rss_bytes": [int(r)]}  # fmt: skip
        f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n0")), t)
        out += f.tick(t + 300_000_000)
    end = T0 + (len(rss) + 5) * 100_000_000
    if failed:
        f.observe_event(JobLifecycle(ts_ns=end, job_id="j", node="n0", rank=0, state="failed",
                                     message=failed), end)  # fmt: skip
    return out + [d for k in range(8) for d in f.tick(end + k * NS // 4)]


def _opened(diags: list[Diagnosis], kind: str) -> list[Diagnosis]:
    return [d for d in diags if d.bottleneck == kind and d.state == "open"]


def test_a_leak_in_the_rss_of_a_cpu_job_is_one_and_its_oom_too() -> None:
    warm = [400 * MIB + min(i, 40) * MIB for i in range(80)]  # grows while it warms up
    leak = [warm[-1] + (i + 1) * 15 * MIB + (i % 3) * MIB for i in range(60)]
    failed = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4194304 bytes"
    )
    diags = _run(warm + leak, failed=failed)
    (d,) = _opened(diags, "memory_leak")
    assert d.ranks == [0] and d.evidence["growth_bytes_per_s"] > 50 * MIB
    assert d.onset_ns >= T0 + 70 * 100_000_000, "not the warm-up (within a 1 s RSS point)"
    assert [x.ranks for x in _opened(diags, "oom")] == [[0]]


def test_the_warm_up_and_a_settled_rss_are_no_leak() -> None:
    warm = [400 * MIB + min(i, 40) * 1.5 * MIB for i in range(80)]
    noisy = [warm[-1] + (5 if i % 4 else -3) * MIB for i in range(80)]
    assert not _opened(_run(warm + noisy), "memory_leak")
