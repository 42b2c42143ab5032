"""Memory on a CPU job: its process's RSS (no CUDA allocator figures), as the sampler reads it
(at most every 250 ms, at step ends). A leak after the job's warm-up is one, found within
seconds whatever its rate (5 to 500 MB/s) and whatever the process holds; the growth of the
warm-up, an allocator that steps up once or twice, the band a noisy allocator wanders in, and
what a knob change or new loader workers take in the seconds after them are not. A CPU
allocator's failure is an out-of-memory."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.schemas import Diagnosis, JobInfo, JobLifecycle
from perfloop.schemas.codec import decode_batch, encode_batch
from perfloop.streams.funnel import Funnel

NS = 1_000_000_000
MIB = 1 << 20
MB = 1_000_000
T0 = 1_700_000_000 * NS


def _run(rss: list[float], failed: str = "") -> list[Diagnosis]:
    """One 100 ms step per reading."""
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


class Job:
    """A single process taking 20 ms steps whose RSS is read every 250 ms (the steps between
    carry the last reading), as the training hooks send it; ``events`` are (second, what)
    to send on the way: a job info or a host reading."""

    def __init__(self) -> None:
        self.f = Funnel()
        self.out: list[Diagnosis] = []

    def run(
        self, seconds: float, rss: Callable[[float], float], events: tuple = ()
    ) -> list[Diagnosis]:
        todo = sorted(events, key=lambda e: e[0])
        reading, read_at = 0.0, -1.0
        for step, s in enumerate(np.arange(0.02, seconds, 0.02)):
            if s - read_at >= 0.25:
                reading, read_at = rss(float(s)), float(s)
            t = T0 + int(s * NS)
            cols = {"ts_ns": [t], "rank": [0], "step": [step], "step_time_ms": [20.0],
                    "rss_bytes": [int(reading)]}  # fmt: skip
            self.f.observe(decode_batch(encode_batch("step", cols, job_id="j", node="n0")), t)
            while todo and todo[0][0] <= s:
                self._send(todo.pop(0)[1], t)
            if step % 5 == 4:
                self.out += self.f.tick(t + 50_000_000)
        return self.out

    def _send(self, what: dict, t: int) -> None:
        if "knobs" in what:
            extra = {"bounds.torch.num_threads": "1,2", "bounds.dataloader.num_workers": "0,8",
                     **what["knobs"]}  # fmt: skip
            self.f.observe_event(JobInfo(ts_ns=t, job_id="j", node="n0", rank=0, extra=extra), t)
        else:
            host = {"ts_ns": [t], "rank": [0], "pid": [42], "loader_workers": [what["workers"]],
                    "loader_cpu_pct": [50.0], "proc_cpu_pct": [90.0], "sys_cpu_pct": [80.0],
                    "loader_rss_bytes": [0], "sys_mem_total_bytes": [64 << 30],
                    "proc_rss_bytes": [int(what.get("rss", 0))],
                    "mem_room_bytes": [int(what.get("room", 0))],
                    "mem_room_limit": [what.get("limit", "")]}  # fmt: skip
            self.f.observe(decode_batch(encode_batch("host", host, job_id="j", node="n0")), t)


def _opened(diags: list[Diagnosis], kind: str = "memory_leak") -> list[Diagnosis]:
    return [d for d in diags if d.bottleneck == kind and d.state == "open"]


def _noise(seed: int, mib: float) -> Callable[[float], float]:
    """An allocator's band: each reading anywhere within ± ``mib`` of its level."""
    rng = np.random.default_rng(seed)
    return lambda s: float(rng.uniform(-mib, mib)) * MIB


def _leaking(
    rate_mb: float, onset_s: float, noise: Callable[[float], float]
) -> Callable[[float], float]:
    """A warmed-up process's RSS that keeps ``rate_mb`` MB a second from ``onset_s``."""
    return lambda s: _warm(s) + noise(s) + max(0.0, s - onset_s) * rate_mb * MB


def _warm(s: float) -> float:
    """A process's RSS while it warms up: 400 → 460 MiB over its first 3 s, then flat."""
    return (400 + 20 * min(s, 3.0)) * MIB


def test_a_leak_in_the_rss_of_a_cpu_job_is_one_and_its_oom_too() -> None:
    warm = [400 * MIB + min(i, 40) * MIB for i in range(80)]  # grows while it warms up
    leak = [warm[-1] + (i + 1) * 15 * MIB + (i % 3) * MIB for i in range(60)]
    failed = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4194304 bytes"
    )
    diags = _run(warm + leak, failed=failed)
    (d,) = _opened(diags)
    assert d.ranks == [0] and d.evidence["growth_bytes_per_s"] > 50 * MIB
    assert d.onset_ns >= T0 + 70 * 100_000_000, "not the warm-up (within a 1 s RSS point)"
    assert [x.ranks for x in _opened(diags, "oom")] == [[0]]


@pytest.mark.parametrize(
    ("limit", "named"),
    [("address_space", "its address-space limit"), ("cgroup", "its cgroup's memory limit")],
)
def test_time_to_oom_is_against_the_tightest_limit_the_process_has(limit: str, named: str) -> None:
    """A process capped at 2 GiB (its address space, or its container) runs out of it long
    before its 64 GiB host: the room its host samples read, less what RSS rose since, over
    the leak's rate. Each reading's room is the cap less the RSS then and 300 MiB the process
    maps without touching (VmSize above RSS)."""
    rss = _leaking(20, 15.0, lambda s: 0.0)
    cap = 2 << 30
    reads = [(float(k), {"workers": 0, "rss": rss(k), "room": cap - rss(k) - 300 * MIB,
                         "limit": limit}) for k in range(1, 30)]  # fmt: skip
    (d,) = _opened(Job().run(30, rss, tuple(reads)))[:1]
    left = cap - 300 * MIB - d.evidence["rss_bytes"]
    assert d.evidence["headroom_bytes"] == pytest.approx(left, rel=0.05, abs=30 * MB)
    assert d.evidence["time_to_oom_s"] == pytest.approx(left / (20 * MB), rel=0.25)
    assert f"out of {named} in about" in d.summary
    (h,) = _opened(Job().run(30, rss, tuple((k, {"workers": 0}) for k in range(1, 30))))[:1]
    assert "out of the host's memory" in h.summary and h.evidence["time_to_oom_s"] > 2000


def test_the_warm_up_and_a_settled_rss_are_no_leak() -> None:
    warm = [400 * MIB + min(i, 40) * 1.5 * MIB for i in range(80)]
    noisy = [warm[-1] + (5 if i % 4 else -3) * MIB for i in range(80)]
    assert not _opened(_run(warm + noisy))


def test_a_real_leak_is_found_within_seconds_of_its_onset() -> None:
    # the bench's memory_leak: a small CNN's RSS, ±12 MiB of allocator noise, keeps 32 MB/s
    diags = Job().run(30, _leaking(32, 12.0, _noise(1, 12)))
    (d,) = _opened(diags)
    assert T0 + 12 * NS < d.ts_ns <= T0 + 19 * NS
    assert T0 + 9 * NS <= d.onset_ns <= T0 + 14 * NS
    assert 25 * MB < d.evidence["growth_bytes_per_s"] < 40 * MB


def test_slow_and_fast_leaks_are_found_and_dated() -> None:
    for rate_mb, within_s in ((5, 10), (500, 6)):
        diags = Job().run(40, _leaking(rate_mb, 15.0, _noise(2, 4)))
        (d,) = _opened(diags)
        assert T0 + 15 * NS < d.ts_ns <= T0 + (15 + within_s) * NS, rate_mb
        assert T0 + 12 * NS <= d.onset_ns <= T0 + 17 * NS, rate_mb


def test_a_leak_that_stops_resolves_once() -> None:
    noise = _noise(5, 12)

    def stops(s: float) -> float:  # 30 MB/s from 12 s to 24 s, then it holds what it kept
        return _warm(s) + noise(s) + min(max(0.0, s - 12.0), 12.0) * 30 * MB

    diags = [d for d in Job().run(60, stops) if d.bottleneck == "memory_leak"]
    assert [d.state for d in diags if d.state != "update"] == ["open", "resolved"]
    assert T0 + 24 * NS < diags[-1].ts_ns <= T0 + 36 * NS


def test_a_process_holding_gigabytes_with_a_noisy_allocator_leaks_only_when_it_leaks() -> None:
    # 6 GiB resident; its temporaries come and go by up to 300 MiB a reading
    noise = _noise(3, 150)

    def big(s: float) -> float:
        return 6 * 1024 * MIB + _warm(s) - 400 * MIB + noise(s) + 150 * MIB

    assert not _opened(Job().run(60, big))
    (d,) = _opened(Job().run(60, lambda s: big(s) + max(0.0, s - 15.0) * 50 * MB))
    assert T0 + 15 * NS < d.ts_ns <= T0 + 35 * NS and d.onset_ns >= T0 + 12 * NS


def test_an_allocator_stepping_up_twice_is_no_leak() -> None:
    # +48 MiB at 12 s, +48 MiB at 15 s (arenas for a new phase), then flat
    def steps(s: float) -> float:
        return _warm(s) + (48 * MIB if s >= 12 else 0) + (48 * MIB if s >= 15 else 0)

    assert not _opened(Job().run(40, steps))


def _grows_after(change_s: float) -> Callable[[float], float]:
    """RSS takes 80 MiB more over the 4 s after ``change_s`` (buffers of more threads or
    workers), then stays."""
    return lambda s: _warm(s) + 20 * MIB * min(4.0, max(0.0, s - change_s))


def test_what_a_changed_knob_takes_in_the_seconds_after_it_is_no_leak() -> None:
    assert _opened(Job().run(30, _grows_after(12.0))), "the same growth, no change: a leak"
    infos = (
        (1.0, {"knobs": {"torch.num_threads": "2", "dataloader.num_workers": "0"}}),
        (12.0, {"knobs": {"torch.num_threads": "1", "dataloader.num_workers": "0"}}),
    )
    assert not _opened(Job().run(30, _grows_after(12.0), infos))


def test_a_loader_s_new_workers_settle_before_its_rss_is_judged() -> None:
    reads = [(float(k), {"workers": 0 if k < 12 else 2}) for k in range(1, 30)]
    assert not _opened(Job().run(30, _grows_after(12.0), tuple(reads)))
    # a loader that restarts its 2 workers each epoch is the same loader: a leak is one
    epochs = [(float(k), {"workers": 0 if k % 6 == 0 else 2}) for k in range(1, 40)]
    leak = Job().run(40, _leaking(20, 15.0, _noise(4, 4)), tuple(epochs))
    assert _opened(leak)


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.floats(-10.0, 10.0), min_size=200, max_size=200),
    st.floats(300.0, 8000.0),
)
def test_rss_that_stays_in_a_band_after_its_warm_up_is_never_a_leak(
    band: list[float], level_mib: float
) -> None:
    # any order of readings within a 20 MiB band (the least rise a leak needs is 32 MiB)
    diags = Job().run(45, lambda s: level_mib * MIB + _warm(s) + band[int(s * 4) % len(band)] * MIB)
    assert not _opened(diags)
