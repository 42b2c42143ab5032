"""A plain CPU training script with two common performance mistakes, for `perfloop demo --real`.

It does not import perfloop. Its mistakes are real ones:

- the DataLoader has ``num_workers=0`` while every sample goes through a costly augmentation
  (a few blur passes in NumPy), so the training loop waits for its data;
- it sets ``torch.set_num_threads`` to a fixed count (default: four times the CPUs it may
  use, as a script copied from a bigger machine would), oversubscribing the cores.

Run it plainly (``python -m perfloop.examples.cpu_training --seconds 30``) or under perfloop
(``perfloop run --tier auto -- python -m perfloop.examples.cpu_training``). Every
``--report-s`` seconds it prints its own throughput, so the effect of any change can be read
from its output alone.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class AugmentedImages(Dataset):  # type: ignore[type-arg]
    """Synthetic 3×48×48 images with a label, blurred ``passes`` times on every read."""

    def __init__(self, size: int, passes: int) -> None:
        self.size, self.passes = size, passes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(i)
        img = rng.standard_normal((3, 48, 48), dtype=np.float32)
        for _ in range(self.passes):
            img = (img + np.roll(img, 1, 1) + np.roll(img, 1, 2) + np.roll(img, -1, 2)) * 0.25
        return torch.from_numpy(img), i % 10


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(8),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def main() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="train this long (default 60)")
    p.add_argument("--threads", type=int, default=4 * (cpus or 1), help="torch threads")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (default 0)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--blur-passes", type=int, default=50, help="augmentation cost per sample")
    p.add_argument("--report-s", type=float, default=5.0, help="print throughput this often")
    args = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    data = AugmentedImages(100_000, args.blur_passes)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    print(f"training for {args.seconds:g} s: {args.threads} threads, {args.workers} loader "
          f"workers, {cpus} CPUs", flush=True)  # fmt: skip
    start = last = time.perf_counter()
    steps = last_steps = 0
    while time.perf_counter() - start < args.seconds:
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            steps += 1
            now = time.perf_counter()
            if now - last >= args.report_s:
                rate = (steps - last_steps) / (now - last)
                print(f"t={now - start:5.1f}s step {steps:5d}  {rate:5.2f} steps/s  "
                      f"loss {loss.item():.3f}", flush=True)  # fmt: skip
                last, last_steps = now, steps
            if now - start >= args.seconds:
                break
    print(f"done: {steps} steps in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
