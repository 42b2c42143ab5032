"""A healthy fully sharded data-parallel CPU training job: FSDP2's ``fully_shard`` (per layer,
then the root) over gloo, AdamW, an MLP on synthetic data. It does not import perfloop:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/realworld_jobs/fsdp.py --seconds 30 --seed 3 --truth DIR

Each step all-gathers every layer's parameters for forward and backward and reduce-scatters
the gradients (the collectives perfloop should see). ``--fsdp1`` uses the older
``FullyShardedDataParallel`` wrapper instead. Ground truth: ``none`` (healthy).
"""

from __future__ import annotations

import argparse
import sys
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
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--fsdp1", action="store_true", help="FullyShardedDataParallel instead")
    args = p.parse_args()
    rank, world, _ = dist_env()
    truth = Truth(
        args.truth, scenario="fsdp", kind="none", ranks=[], seed=args.seed, report_s=args.report_s
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(args.seed)
    layers = [nn.Linear(256, args.width), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10))
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    truth.set(api="FullyShardedDataParallel" if args.fsdp1 else "fully_shard", world=world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(args.seed * 100 + rank)
    pool_x, pool_y = torch.randn(4096, 256, generator=g), torch.randint(0, 10, (4096,))
    if rank == 0:
        print(f"fsdp ({truth.doc['params']['api']}): {world} ranks", flush=True)

    def step() -> None:
        idx = torch.randint(0, len(pool_x), (args.batch_size,), generator=g)
        loss = loss_fn(model(pool_x[idx]), pool_y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()

    train_ranks(truth, step, args.steps, args.seconds)


if __name__ == "__main__":
    main()
