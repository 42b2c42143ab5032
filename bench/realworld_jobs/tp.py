"""A healthy tensor-parallel CPU training job: DTensor's ``parallelize_module`` (two blocks,
each a column-wise then a row-wise linear layer) over a gloo device mesh, SGD, synthetic data.
It does not import perfloop:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/realworld_jobs/tp.py --seconds 30 --seed 3 --truth DIR

Each step all-reduces each block's row-wise output in forward and the second block's input
gradient in backward, through PyTorch's functional collectives (not ``torch.distributed``'s
functions): the collectives perfloop should see. Ground truth: ``none`` (healthy); with
``--fault straggler_compute`` one rank (drawn from the seed) computes 0.6-1.5x a step more in
each forward from ``--onset-s`` on, and the others wait for it at every all-reduce.
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
from _jobkit import Truth, add_common_args, dist_env, train_ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--steps", type=int, default=0, help="exactly this many steps (0: seconds)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--fault", choices=["none", "straggler_compute"], default="none")
    args = p.parse_args()
    rank, world, _ = dist_env()
    shared = random.Random(args.seed)  # the same draws on every rank
    culprit, slow_factor = shared.randrange(world), shared.uniform(0.6, 1.5)
    slow = args.fault == "straggler_compute"
    truth = Truth(
        args.truth,
        scenario="tp_straggler" if slow else "tp",
        kind="straggler" if slow else "none",
        ranks=[culprit] if slow else [],
        seed=args.seed,
        report_s=args.report_s,
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(args.seed)  # the same weights on every rank before they are sharded
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(
        nn.Linear(256, args.width),
        nn.ReLU(),
        nn.Linear(args.width, 256),
        nn.Linear(256, args.width),
        nn.ReLU(),
        nn.Linear(args.width, 256),
    )
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    plan |= {"3": ColwiseParallel(), "5": RowwiseParallel()}
    model = parallelize_module(model, mesh, plan)
    truth.set(
        api="parallelize_module",
        world=world,
        out_bytes=args.batch_size * 256 * 4,
        culprit=culprit if slow else -1,
        slow_factor=round(slow_factor, 2),
    )
    extra_ms, scratch = 0.0, torch.randn(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # every rank reads the same batch (tensor parallelism splits the layers, not the data)
    g = torch.Generator().manual_seed(args.seed)
    pool_x, pool_y = torch.randn(2048, 256, generator=g), torch.randn(2048, 256, generator=g)
    if rank == 0:
        print(f"tp (parallelize_module): {world} ranks", flush=True)

    def step() -> None:
        nonlocal extra_ms, scratch
        if slow and rank == culprit and not extra_ms and truth.elapsed_s() >= args.onset_s:
            ends = truth.doc["step_ms"][-51:]
            gaps = sorted(b - a for a, b in itertools.pairwise(ends)) or [10.0]
            extra_ms = slow_factor * gaps[len(gaps) // 2]
            truth.fault(slow_ms=round(extra_ms, 2))
        idx = torch.randint(0, len(pool_x), (args.batch_size,), generator=g)
        out = model(pool_x[idx])
        deadline = time.perf_counter() + extra_ms / 1e3  # the slower rank's own compute
        while time.perf_counter() < deadline:
            scratch = torch.tanh(scratch @ scratch.T @ scratch * 1e-3)
        loss = nn.functional.mse_loss(out, pool_y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()

    train_ranks(truth, step, args.steps, args.seconds)


if __name__ == "__main__":
    main()
