"""A pipeline-parallel CPU training job: ``torch.distributed.pipelining`` with one stage per
rank (an MLP cut into ``--world`` pieces), the GPipe schedule over ``--microbatches``
micro-batches, SGD, synthetic data, gloo. It does not import perfloop:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/realworld_jobs/pp.py --seconds 30 --seed 3 --truth DIR

Each step every stage runs a forward and a backward per micro-batch and sends its
activations (forward) and gradients (backward) to its neighbours point to point: short steps
made of many small pieces, the hardest shape for a per-call observer. ``--fault`` (the
perfloop ``bottleneck`` a right diagnosis names, and the culprit rank, drawn per seed):

- ``none`` (``none``): healthy;
- ``heavy_stage`` (``load_imbalance``): the model is cut unevenly: one stage carries 2-4
  more hidden layers than the others (drawn per seed), so it computes 2-3x as long and the
  whole pipeline runs at its pace. A property of the job: from its first step;
- ``slow_stage`` (``straggler``): at ``--onset-s`` one rank's stage starts computing more in
  every micro-batch's forward (0.6-1.5x the rank's median step before, over the step's
  micro-batches; drawn per seed): a rank that really became slower, the whole pipeline at
  its pace;
- ``stage_contention`` (``straggler``): every rank is pinned to its own CPU
  (``os.sched_setaffinity`` by ``LOCAL_RANK``); at ``--onset-s`` a separate process that
  burns CPU starts, pinned to one rank's CPU: that rank slows from outside (its compute and
  its point-to-point transfers), and the whole pipeline runs at its pace.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jobkit import Burner, Truth, add_common_args, dist_env, pin_to_cpu, train_ranks

KINDS = {
    "none": "none",
    "heavy_stage": "load_imbalance",
    "slow_stage": "straggler",
    "stage_contention": "straggler",
}


class _Slowable(nn.Module):
    """A stage whose forward computes ``extra_ms`` more when set (a slower rank)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.extra_ms = 0.0
        self.scratch = torch.randn(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra_ms:
            deadline = time.perf_counter() + self.extra_ms / 1e3
            while time.perf_counter() < deadline:  # a fixed product: no values decaying
                torch.mm(self.scratch, self.scratch)  # to denormals (slow beyond the deadline)
        return self.body(x)


def _stage(rank: int, world: int, width: int, extra: int = 0) -> _Slowable:
    """Rank ``rank``'s piece: the first takes the 64 input features, the last gives 10
    classes, each has two linear layers, and ``extra`` more hidden ones."""
    d_in = 64 if rank == 0 else width
    last = (
        nn.Linear(width, 10)
        if rank == world - 1
        else nn.Sequential(nn.Linear(width, width), nn.GELU())
    )
    hidden = [m for _ in range(extra) for m in (nn.Linear(width, width), nn.GELU())]
    return _Slowable(nn.Sequential(nn.Linear(d_in, width), nn.GELU(), *hidden, last))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--steps", type=int, default=0, help="exactly this many steps (0: seconds)")
    p.add_argument("--microbatches", type=int, default=0, help="per step (0: 4-6 by seed)")
    p.add_argument("--microbatch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--fault", choices=sorted(KINDS), default="none")
    p.add_argument("--culprit", type=int, default=-1, help="the faulty rank (-1: by seed)")
    args = p.parse_args()
    rank, world, local_rank = dist_env()
    shared = random.Random(args.seed)  # the same draws on every rank
    n_micro = args.microbatches or shared.randint(4, 6)
    culprit = args.culprit if args.culprit >= 0 else shared.randrange(world)
    kind = KINDS[args.fault]
    truth = Truth(
        args.truth,
        scenario="healthy_pp" if kind == "none" else f"pp_{args.fault}",
        kind=kind,
        ranks=[] if kind == "none" else [culprit],
        seed=args.seed,
        report_s=args.report_s,
    )
    torch.set_num_threads(1)
    cpu = pin_to_cpu(local_rank) if args.fault == "stage_contention" else -1
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    extra = shared.randint(2, 4) if args.fault == "heavy_stage" else 0
    slow_factor = shared.uniform(0.6, 1.5)
    torch.manual_seed(args.seed + rank)
    stage_mod = _stage(rank, world, args.width, extra if rank == culprit else 0)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=n_micro, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.01, momentum=0.9)
    truth.set(world=world, microbatches=n_micro, microbatch_size=args.microbatch_size,
              culprit=culprit, cpu=cpu, extra_layers=extra,
              slow_factor=round(slow_factor, 2))  # fmt: skip
    g = torch.Generator().manual_seed(args.seed)  # every rank draws the same batches
    batch = n_micro * args.microbatch_size
    pool_x, pool_y = torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g)
    if rank == 0:
        print(f"pp (GPipe): {world} stages, {n_micro} micro-batches", flush=True)

    burner: list[Burner] = []

    def step() -> None:
        if args.fault == "heavy_stage" and rank == culprit:
            truth.fault(extra_layers=extra)  # a property of the job: from its first step
        due = truth.elapsed_s() >= args.onset_s
        if args.fault == "slow_stage" and due and rank == culprit and not stage_mod.extra_ms:
            ends = truth.doc["step_ms"][-201:]  # each step's end, ms after the start
            gaps = sorted(b - a for a, b in itertools.pairwise(ends)) or [10.0]
            stage_mod.extra_ms = slow_factor * gaps[len(gaps) // 2] / n_micro
            truth.fault(extra_ms=round(stage_mod.extra_ms, 3))
        late = args.fault == "stage_contention" and due
        if late and rank == culprit and not burner:
            truth.fault(cpu=cpu)
            burner.append(Burner(cpu, args.seconds + 60))
        idx = torch.randint(0, len(pool_x), (batch,), generator=g)
        if rank == 0:
            schedule.step(pool_x[idx])
        elif rank == world - 1:
            schedule.step(target=pool_y[idx])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()

    try:
        train_ranks(truth, step, args.steps, args.seconds)
    finally:
        for b in burner:
            b.stop()


if __name__ == "__main__":
    main()
