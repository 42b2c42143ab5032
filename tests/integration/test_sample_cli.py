"""`perfloop sample` as a user runs it, against the real embedded stack: host samples, the NVML
capability report (no GPU on this machine) and the sampler's own stats land in the warehouse."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from perfloop.settings import StackSettings
from perfloop.warehouse import client

from .conftest import perfloop_cli, wait_for

pytestmark = pytest.mark.integration


def _rows(settings: StackSettings, sql: str, **params: object) -> list[tuple]:
    ch = client(settings)
    try:
        return list(ch.query(sql, parameters=params).result_rows)
    finally:
        ch.close()


def test_sample_lands_host_rows_and_capabilities(
    stack: StackSettings, stack_env_vars: dict[str, str]
) -> None:
    job = f"sample-{uuid.uuid4().hex[:8]}"
    # a second watched process caps its own address space, as a script may (``ulimit -v``)
    capped = subprocess.Popen(
        [sys.executable, "-c", "import resource, time; resource.setrlimit(resource.RLIMIT_AS, "
         f"({3 << 30}, resource.RLIM_INFINITY)); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert capped.stdout is not None and capped.stdout.readline().strip() == "ready"
        out = perfloop_cli(
            "sample", "--job-id", job, "--node", "it-node", "--duration", "3",
            "--pid", str(os.getpid()), "--pid", str(capped.pid),
            env=stack_env_vars,
            timeout=60,
        )  # fmt: skip
    finally:
        capped.kill()
        capped.wait()
    assert out.returncode == 0, out.stderr
    nvml_lines = [line for line in out.stderr.splitlines() if "nvml" in line.lower()]
    gpu_available = "GPU: unavailable" not in out.stdout
    if not gpu_available:  # this machine: the missing GPU is said exactly once
        assert len(nvml_lines) == 1, out.stderr
        assert "host sampling continues" in nvml_lines[0]

    host = wait_for(
        lambda: _rows(
            stack,
            "SELECT rank, pid, proc_rss_bytes, sys_mem_total_bytes, proc_run_delay_pct "
            "FROM host_samples "
            "WHERE job_id = {job:String} AND node = 'it-node'",
            job=job,
        ),
        30,
        "host samples in the warehouse",
    )
    assert len(host) >= 4  # 1 s interval over 3 s, two processes
    assert {r[1] for r in host} == {os.getpid(), capped.pid}
    assert all(r[2] > 0 and r[3] > 0 for r in host)
    assert all(0 <= r[4] < 10_000 for r in host)  # its threads' wait for a CPU, % of a core
    room = _rows(
        stack,
        "SELECT mem_room_limit, min(mem_room_bytes) FROM host_samples "
        "WHERE job_id = {job:String} AND pid = {pid:UInt32} GROUP BY mem_room_limit",
        job=job,
        pid=capped.pid,
    )
    assert [r[0] for r in room] == ["address_space"], room
    assert 0 < room[0][1] < 3 << 30, "the cap less the process's peak virtual size"

    def both_reports() -> list[tuple] | None:
        rows = _rows(
            stack,
            "SELECT component, available, missing, reason FROM capabilities "
            "WHERE job_id = {job:String}",
            job=job,
        )
        return rows if len(rows) >= 2 else None

    caps = wait_for(both_reports, 30, "capability reports in the warehouse")
    by = {r[0]: r for r in caps}
    assert set(by) == {"nvml", "host"}
    assert by["host"][1]
    if not gpu_available:
        _, available, missing, reason = by["nvml"]
        assert not available and missing == ["gpu"]
        assert reason.startswith("NVML unavailable")

    stats = wait_for(
        lambda: _rows(
            stack,
            "SELECT samples, overhead_pct, rates_hz FROM producer_stats "
            "WHERE job_id = {job:String} ORDER BY ts DESC LIMIT 1",
            job=job,
        ),
        30,
        "the sampler's stats in the warehouse",
    )
    samples, overhead_pct, rates = stats[0]
    assert samples >= len(host) and overhead_pct >= 0
    assert "host" in rates
