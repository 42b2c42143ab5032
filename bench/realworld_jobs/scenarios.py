"""The catalog of real scenarios: which script, how it is launched, what its ground truth is,
and how the bench runs it. Pure data and command lines; it imports neither perfloop nor torch.

A scenario's ``variants`` are how the bench runs it: ``plain`` (the command alone, no perfloop:
the same stack up on the machine), ``observe`` and ``auto`` (``perfloop run --tier T``). With
``rotate`` the bench runs one variant a round, in turn; otherwise every variant each round, in
an order that rotates with the round (so the machine's drift falls on all of them).

Multi-rank jobs run 2 ranks of one torch thread each: on this project's 2-CPU machine a third
rank would share a CPU with another, a real load imbalance and CPU saturation that would blur
the ground truth of the fault under test (``nprocs`` takes more where there are more CPUs).

>>> s = SCENARIOS["straggler_compute"]
>>> cmd, drawn = s.command(seed=7, seconds=30, truth_dir=Path("/t"), python="py")
>>> cmd[:5], drawn["nproc"], 7 <= drawn["onset_s"] <= 11
(['py', '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node'], 2, True)
>>> sorted(n for n, s in SCENARIOS.items() if s.actionable)
['cpu_loader', 'io_loader', 'threads']
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["JOBS", "SCENARIOS", "Scenario", "perfloop_run"]

JOBS = Path(__file__).resolve().parent
"""The folder holding the training scripts."""


@dataclass(frozen=True)
class Scenario:
    """One real scenario: ``script`` with ``args``, launched as a single process (``nprocs``
    holds 0) or by torchrun with one of ``nprocs`` ranks (drawn per seed); ``kind`` is the
    perfloop ``bottleneck`` a right diagnosis names (``none``: healthy)."""

    name: str
    script: str
    kind: str
    args: tuple[str, ...] = ()
    nprocs: tuple[int, ...] = (0,)
    variants: tuple[str, ...] = ("observe",)
    rotate: bool = False
    seconds: float = 30.0
    fixed_seconds: bool = False  # the fault ends the job: --seconds is only a cap
    onset_s: tuple[float, float] | None = None  # drawn per run; None: from the first step
    target_speedup: float | None = None  # actionable: tier auto over plain, second half
    follow_on: tuple[str, ...] = ()  # kinds that may follow the truth (neither right nor false)
    description: str = ""

    @property
    def healthy(self) -> bool:
        return self.kind == "none"

    @property
    def actionable(self) -> bool:
        return self.target_speedup is not None

    def draw(self, seed: int, seconds: float) -> dict[str, Any]:
        """What this seed chooses: the rank count and the fault's onset (seconds)."""
        rng = random.Random(zlib.crc32(f"{self.name}:{seed}".encode()))
        nproc = rng.choice(self.nprocs)
        onset = rng.uniform(*self.onset_s) if self.onset_s else 0.0
        return {"nproc": nproc, "onset_s": round(min(onset, seconds / 3 + 1.0), 2)}

    def command(
        self,
        *,
        seed: int,
        seconds: float,
        truth_dir: Path,
        python: str,
        extra: tuple[str, ...] = (),
    ) -> tuple[list[str], dict[str, Any]]:
        """The plain command line of one run, and what the seed drew."""
        secs = self.seconds if self.fixed_seconds else seconds
        drawn = self.draw(seed, secs)
        script = str(JOBS / self.script)
        args = [
            *self.args,
            "--seed",
            str(seed),
            "--seconds",
            f"{secs:g}",
            "--onset-s",
            f"{drawn['onset_s']:g}",
            "--truth",
            str(truth_dir),
            *extra,
        ]
        if drawn["nproc"]:
            launch = [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(drawn["nproc"]),
            ]
            return [*launch, script, *args], drawn | {"seconds": secs}
        return [python, script, *args], drawn | {"seconds": secs}


def perfloop_run(python: str, job_id: str, tier: str, command: list[str]) -> list[str]:
    """``command`` under ``perfloop run --tier TIER`` (no GPU sampler: CPU jobs)."""
    return [
        python,
        "-m",
        "perfloop.cli",
        "run",
        "--job-id",
        job_id,
        "--tier",
        tier,
        "--no-gpu",
        "--",
        *command,
    ]


_PAIRED = ("plain", "observe", "auto")
_ROTATING = ("observe", "auto")
_FAULT = (7.0, 11.0)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "healthy_single",
            "single.py",
            "none",
            ("--fault", "none"),
            variants=_PAIRED,
            seconds=22,
            description="a small CNN, one process, torch's default threads",
        ),
        Scenario(
            "healthy_compiled",
            "single.py",
            "none",
            ("--fault", "none", "--compile"),
            variants=_PAIRED,
            seconds=30,
            description="the small CNN under torch.compile (Inductor), one process",
        ),
        Scenario(
            "healthy_ddp",
            "ddp.py",
            "none",
            ("--fault", "none"),
            nprocs=(2,),
            variants=_PAIRED,
            seconds=22,
            description="DDP over gloo, 2 ranks",
        ),
        Scenario(
            "healthy_pp",
            "pp.py",
            "none",
            (),
            nprocs=(2,),
            variants=_PAIRED,
            seconds=22,
            description="pipeline parallelism (GPipe, 4-6 micro-batches) over gloo, 2 stages",
        ),
        Scenario(
            "straggler_compute",
            "ddp.py",
            "straggler",
            ("--fault", "straggler_compute"),
            nprocs=(2,),
            seconds=30,
            onset_s=_FAULT,
            description="one rank's forward computes 0.6-1.5x its step more",
        ),
        Scenario(
            "straggler_contention",
            "ddp.py",
            "straggler",
            ("--fault", "straggler_contention"),
            nprocs=(2,),
            seconds=30,
            onset_s=_FAULT,
            description="ranks pinned to a CPU each; a CPU burner joins one rank's CPU",
        ),
        Scenario(
            "pp_heavy_stage",
            "pp.py",
            "load_imbalance",
            ("--fault", "heavy_stage"),
            nprocs=(2,),
            seconds=30,
            description="a pipeline cut unevenly: one stage has 2-4 more hidden layers",
        ),
        Scenario(
            "pp_slow_stage",
            "pp.py",
            "straggler",
            ("--fault", "slow_stage"),
            nprocs=(2,),
            seconds=30,
            onset_s=_FAULT,
            description="a pipeline; one rank's stage computes 0.6-1.5x its step more",
        ),
        Scenario(
            "pp_stage_contention",
            "pp.py",
            "straggler",
            ("--fault", "stage_contention"),
            nprocs=(2,),
            seconds=30,
            onset_s=_FAULT,
            description="a pipeline's ranks pinned to a CPU each; a CPU burner joins one rank's",
        ),
        Scenario(
            "hang",
            "ddp.py",
            "hang",
            ("--fault", "hang", "--pg-timeout-s", "45"),
            nprocs=(2,),
            seconds=90,
            fixed_seconds=True,
            onset_s=_FAULT,
            description="one rank stops before its backward; gloo's timeout ends the job",
        ),
        Scenario(
            "io_loader",
            "single.py",
            "dataloader_starvation",
            ("--fault", "io_loader"),
            variants=_PAIRED,
            seconds=35,
            target_speedup=2.0,
            description="num_workers=0, each sample waits ~1 ms on storage",
        ),
        Scenario(
            "distill_io",
            "single.py",
            "dataloader_starvation",
            ("--fault", "io_loader", "--teacher"),
            variants=_PAIRED,
            seconds=35,
            target_speedup=2.0,
            description="the I/O-bound loader, and a frozen teacher's forward under no_grad "
            "in every step (distillation)",
        ),
        Scenario(
            "cpu_loader",
            "single.py",
            "dataloader_starvation",
            ("--fault", "cpu_loader"),
            variants=_PAIRED,
            seconds=35,
            target_speedup=1.5,
            description="num_workers=0, a costly augmentation per sample, 1 thread",
        ),
        Scenario(
            "threads",
            "single.py",
            "thread_oversubscription",
            ("--fault", "threads"),
            variants=_PAIRED,
            seconds=35,
            target_speedup=1.5,
            description="torch.set_num_threads 6-16x the CPUs",
        ),
        Scenario(
            "memory_leak",
            "single.py",
            "memory_leak",
            ("--fault", "memory_leak"),
            seconds=80,
            fixed_seconds=True,
            onset_s=_FAULT,
            follow_on=("oom",),
            description="RLIMIT_AS capped; tensors kept every step until allocation fails",
        ),
        Scenario(
            "ckpt_eval",
            "ddp.py",
            "none",
            ("--fault", "ckpt_eval"),
            nprocs=(2,),
            variants=_ROTATING,
            rotate=True,
            seconds=25,
            description="DDP with torch.save checkpoints and eval loops",
        ),
        Scenario(
            "grad_accum",
            "ddp.py",
            "none",
            ("--fault", "grad_accum"),
            nprocs=(2,),
            variants=_ROTATING,
            rotate=True,
            seconds=22,
            description="DDP, 2-4 micro-batches per step under no_sync",
        ),
        Scenario(
            "fsdp",
            "fsdp.py",
            "none",
            nprocs=(2,),
            variants=_ROTATING,
            rotate=True,
            seconds=22,
            description="FSDP2 fully_shard over gloo, 2 ranks",
        ),
        Scenario(
            "tensor_parallel",
            "tp.py",
            "none",
            nprocs=(2,),
            variants=_ROTATING,
            rotate=True,
            seconds=22,
            description="DTensor tensor parallelism (functional collectives) over gloo, 2 ranks",
        ),
        Scenario(
            "tp_straggler",
            "tp.py",
            "straggler",
            ("--fault", "straggler_compute"),
            nprocs=(2,),
            seconds=30,
            onset_s=_FAULT,
            description="tensor parallelism; one rank computes 0.6-1.5x its step more",
        ),
        Scenario(
            "lightning",
            "lightning_job.py",
            "none",
            variants=_ROTATING,
            rotate=True,
            seconds=22,
            description="lightning.Trainer on CPU",
        ),
        Scenario(
            "hf_trainer",
            "hf_job.py",
            "none",
            variants=_ROTATING,
            rotate=True,
            seconds=22,
            description="transformers.Trainer, a tiny GPT-2 from a config",
        ),
    )
}
