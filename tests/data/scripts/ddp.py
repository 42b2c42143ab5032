"""Data-parallel training with DistributedDataParallel (gloo, CPU), for torchrun.

Unmodified training code for `perfloop run -- torchrun --nproc_per_node=2 ddp.py`: the
process group comes from torchrun's environment, a DistributedSampler splits the data, and
the loss is all-reduced each step for logging. Each rank prints ``rank=R world=W steps=N``.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(args.samples, 64), torch.randint(0, 4, (args.samples,)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            steps += 1
    dist.barrier()
    print(f"rank={rank} world={world} steps={steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
