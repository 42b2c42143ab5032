"""What the real-scenario training scripts share: their arguments, their ground truth and their
own step clock. It imports neither perfloop nor the bench: the scripts are what a user would
run, and perfloop observes them unmodified through ``perfloop run``.

Ground truth: every process of a run writes ``<truth dir>/rank<R>.json`` (atomically, again at
its end, and at once when its fault begins, in case the fault kills it):

- ``scenario``, ``kind`` (the perfloop ``bottleneck`` a right diagnosis has: ``none`` for a
  healthy job), ``ranks`` (the culprit ranks), ``node``;
- ``onset_ns``: the wall clock (``time.time_ns()``) when this process's fault really began,
  taken by the process at that moment (null in the processes without the fault, and in healthy
  runs);
- ``start_ns`` / ``end_ns``: the training loop's first step began / the last one ended;
  ``step_ms``: each step's end in ms after ``start_ns`` (so steps/s of any part of the run can
  be computed the same way with and without perfloop);
- ``params``: the timings and sizes this seed chose; ``exit``: ``ok`` or the error's first line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "Burner",
    "Truth",
    "add_common_args",
    "all_stop",
    "cpus",
    "dist_env",
    "pin_to_cpu",
    "train_ranks",
]


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="seeds data, model and timings")
    p.add_argument("--seconds", type=float, default=30.0, help="train this long (wall)")
    p.add_argument("--onset-s", type=float, default=10.0, help="the fault begins after this")
    p.add_argument(
        "--truth",
        default=os.environ.get("REALWORLD_TRUTH", ""),
        help="folder for the ground truth (env REALWORLD_TRUTH); none: not written",
    )
    p.add_argument("--report-s", type=float, default=5.0, help="print throughput this often")


def all_stop(truth: Truth, n: int, steps: int, seconds: float, every: int = 10) -> bool:
    """Whether every rank stops after its ``n``-th step: at exactly ``steps`` steps when set,
    else once any rank has run ``seconds`` (asked every ``every`` steps and agreed by an
    all-reduce, so that no rank is left alone at a collective)."""
    if steps:
        return n >= steps
    if n % every:
        return False
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(truth.elapsed_s() >= seconds)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def train_ranks(truth: Truth, step: Callable[[], None], steps: int, seconds: float) -> None:
    """The distributed scripts' loop: ``step()`` (one optimizer step) until `all_stop`, the
    truth's clock around it, a closing barrier, and the process group destroyed unless an
    error ends the run (whose first line the truth keeps)."""
    import torch.distributed as dist

    error: BaseException | None = None
    try:
        truth.begin()
        stop, i = False, 0
        while not stop:
            step()
            truth.step()
            i += 1
            stop = all_stop(truth, i, steps, seconds)
        dist.barrier()
    except BaseException as e:
        error = e
        raise
    finally:
        truth.finish(error)
        if error is None:
            dist.destroy_process_group()


def cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment (0, 1, 0 without one)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def pin_to_cpu(local_rank: int) -> int:
    """Pin this process to one CPU of the machine, chosen by its local rank; return it."""
    cpu = sorted(os.sched_getaffinity(0))[local_rank % cpus()]
    os.sched_setaffinity(0, {cpu})
    return cpu


# A separate process that burns one CPU until its parent is gone or its time is up.
_BURN = """
import os, sys, time
cpu, until, parent = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {cpu})
x, n = 1.0, 0
while True:
    x = x * 1.0000001 + 1e-9
    n += 1
    if n % 200000 == 0 and (time.time() > until or os.getppid() != parent):
        break
"""


class Burner:
    """CPU contention: a separate process burning ``cpu`` (the CPU a rank was pinned to) for
    at most ``seconds``, ended by `stop` or by its parent's exit."""

    def __init__(self, cpu: int, seconds: float) -> None:
        until = str(time.time() + seconds)
        self.proc = subprocess.Popen(
            [sys.executable, "-E", "-S", "-c", _BURN, str(cpu), until, str(os.getpid())]
        )

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Truth:
    """One process's ground truth and step clock.

    >>> t = Truth("", scenario="healthy", kind="none", ranks=[], seed=1)
    >>> t.begin(); t.step(); t.fault(); t.fault()
    >>> len(t.doc["step_ms"]), t.doc["onset_ns"] > 0
    (1, True)
    """

    def __init__(
        self,
        folder: str,
        *,
        scenario: str,
        kind: str,
        ranks: list[int],
        seed: int,
        report_s: float = 5.0,
        **params: Any,
    ) -> None:
        self.rank, self.world, self.local_rank = dist_env()
        self.path = Path(folder) / f"rank{self.rank}.json" if folder else None
        self.rng = random.Random(seed * 1000 + self.rank)
        self.report_s = report_s
        self.doc: dict[str, Any] = {
            "scenario": scenario,
            "kind": kind,
            "ranks": sorted(ranks),
            "node": os.environ.get("PERFLOOP_NODE") or socket.gethostname(),
            "rank": self.rank,
            "world": self.world,
            "seed": seed,
            "pid": os.getpid(),
            "onset_ns": None,
            "start_ns": None,
            "end_ns": None,
            "step_ms": [],
            "params": dict(params),
            "exit": "running",
        }
        self._last_report = self._last_steps = 0.0

    @property
    def steps(self) -> int:
        return len(self.doc["step_ms"])

    def begin(self) -> None:
        """The training loop starts now (idempotent)."""
        if self.doc["start_ns"] is None:
            self.doc["start_ns"] = time.time_ns()
            self._last_report = time.perf_counter()
            self.write()

    def elapsed_s(self) -> float:
        start = self.doc["start_ns"]
        return 0.0 if start is None else (time.time_ns() - start) / 1e9

    def step(self) -> None:
        """One optimizer step just ended; print throughput every ``report_s``."""
        now = time.time_ns()
        self.doc["step_ms"].append(round((now - self.doc["start_ns"]) / 1e6, 2))
        self.doc["end_ns"] = now
        t = time.perf_counter()
        if self.rank == 0 and t - self._last_report >= self.report_s:
            rate = (self.steps - self._last_steps) / (t - self._last_report)
            print(
                f"[rank {self.rank}] t={self.elapsed_s():5.1f}s step {self.steps:5d} "
                f"{rate:6.2f} steps/s",
                flush=True,
            )
            self._last_report, self._last_steps = t, self.steps

    def fault(self, **extra: Any) -> None:
        """The fault begins now in this process (the first call counts); written at once."""
        if self.doc["onset_ns"] is None:
            self.doc["onset_ns"] = time.time_ns()
            self.doc["params"].update(extra, onset_step=self.steps)
            self.write()

    def set(self, **params: Any) -> None:
        self.doc["params"].update(params)

    def finish(self, error: BaseException | None = None) -> None:
        """The script ends (normally, or with ``error``): write the final truth."""
        self.doc["exit"] = "ok" if error is None else f"{type(error).__name__}: {error}"[:300]
        self.write()
        if self.rank == 0:
            secs = self.elapsed_s()
            print(
                f"done: {self.steps} steps in {secs:.1f} s "
                f"({self.steps / max(secs, 1e-9):.2f} steps/s)",
                flush=True,
            )

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.doc))
        os.replace(tmp, self.path)
