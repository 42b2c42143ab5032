"""A single-process CPU training job (a small CNN on synthetic images), healthy or with one
of the common single-process faults. It does not import perfloop.

    python bench/realworld_jobs/single.py --fault io_loader --seconds 40 --seed 3 --truth DIR

Faults (``--fault``), with the perfloop ``bottleneck`` a right diagnosis names:

- ``none`` (healthy, ``none``): in-memory data, torch's default threads; with ``--compile``
  the model is ``torch.compile``'d (Inductor; its first steps wait for the compilation, and
  ``--seconds`` counts from the end of the first step: a cold compilation on two CPUs can
  take longer than the whole run);
- ``io_loader`` (``dataloader_starvation``): ``num_workers=0`` and every sample waits on
  "storage" (``time.sleep`` of ~1 ms, drawn per seed) before a cheap decode: the loop waits, the
  CPU does not work; one torch thread for the model, so its compute stays small beside the
  wait however busy the machine is. From the first step;
- ``cpu_loader`` (``dataloader_starvation``): ``num_workers=0`` and a costly augmentation in
  ``__getitem__`` (blur passes in NumPy), one torch thread for the model. From the first step;
- ``threads`` (``thread_oversubscription``): ``torch.set_num_threads`` far above the CPUs
  (6–16× them, drawn per seed). From the first step;
- ``memory_leak`` (``memory_leak``; an ``oom`` may follow): at ``--onset-s`` the script caps
  its own address space (``RLIMIT_AS``: its size then plus 600–900 MB) and from then keeps tensors
  every step (a history of outputs never freed; ~25–45 MB a second, drawn per seed) until an
  allocation fails and the error ends the job (15–35 s after the onset).

With ``--teacher`` the model learns from a frozen teacher too (knowledge distillation): a
second CNN in ``eval()`` mode runs under ``torch.no_grad()`` before the student in every step,
and the loss adds the distance to its softened outputs.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jobkit import Truth, add_common_args, cpus

KINDS = {
    "none": "none",
    "io_loader": "dataloader_starvation",
    "cpu_loader": "dataloader_starvation",
    "threads": "thread_oversubscription",
    "memory_leak": "memory_leak",
}


class Images(Dataset):  # type: ignore[type-arg]
    """Synthetic 3×32×32 images; each read waits ``wait_s`` (storage) and blurs ``passes``."""

    def __init__(self, size: int, wait_s: float = 0.0, passes: int = 0) -> None:
        self.size, self.wait_s, self.passes = size, wait_s, passes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.wait_s:
            time.sleep(self.wait_s)  # a network file system's read: waiting, not computing
        rng = np.random.default_rng(i)
        img = rng.standard_normal((3, 32, 32), dtype=np.float32)
        for _ in range(self.passes):
            img = (img + np.roll(img, 1, 1) + np.roll(img, 1, 2) + np.roll(img, -1, 2)) * 0.25
        return torch.from_numpy(img), i % 10


def cnn() -> nn.Module:
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


def address_space_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--fault", choices=sorted(KINDS), default="none")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (the fault: 0)")
    p.add_argument("--leak-mb-s", type=float, default=0.0, help="MB kept a second (0: seed)")
    p.add_argument("--headroom-mb", type=float, default=0.0, help="RLIMIT_AS margin (0: seed)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--teacher", action="store_true", help="distil from a frozen teacher")
    args = p.parse_args()
    kind = KINDS[args.fault]
    healthy = "healthy_compiled" if args.compile else "healthy_single"
    scenario = args.fault if args.fault != "none" else healthy
    if args.teacher:
        scenario = "distill_io" if args.fault == "io_loader" else f"distill_{scenario}"
    truth = Truth(
        args.truth,
        scenario=scenario,
        kind=kind,
        ranks=[] if kind == "none" else [0],
        seed=args.seed,
        report_s=args.report_s,
    )
    rng = truth.rng
    torch.manual_seed(args.seed)
    wait_s = passes = 0
    if args.fault == "io_loader":
        wait_s = rng.uniform(0.8e-3, 1.4e-3)
    if args.fault == "cpu_loader":
        passes = rng.randint(25, 40)
    if args.fault in ("io_loader", "cpu_loader"):
        torch.set_num_threads(1)
    if args.fault == "threads":
        torch.set_num_threads(rng.choice([6, 8, 12, 16]) * cpus())
    truth.set(
        wait_ms=round(wait_s * 1e3, 3),
        blur_passes=passes,
        threads=torch.get_num_threads(),
        cpus=cpus(),
        compiled=args.compile,
        teacher=args.teacher,
    )

    if args.fault in ("io_loader", "cpu_loader"):
        data: Dataset = Images(1_000_000, wait_s=wait_s, passes=passes)  # type: ignore[type-arg]
    else:  # in memory: a few thousand images, reused every epoch
        g = torch.Generator().manual_seed(args.seed)
        x = torch.randn(4096, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (4096,), generator=g)
        data = torch.utils.data.TensorDataset(x, y)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    net = cnn()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if args.compile:
        net = torch.compile(net)  # type: ignore[assignment]
    loss_fn = nn.CrossEntropyLoss()
    teacher = None
    if args.teacher:
        teacher = cnn().eval()
        for q in teacher.parameters():
            q.requires_grad_(False)

    leak: list[torch.Tensor] = []
    leak_b_s = headroom = 0.0
    if args.fault == "memory_leak":
        leak_mb_s = args.leak_mb_s or rng.uniform(25.0, 45.0)
        headroom = args.headroom_mb or rng.uniform(600, 900)
        leak_b_s = leak_mb_s * 2**20
        truth.set(leak_mb_s=round(leak_mb_s, 2), headroom_mb=round(headroom, 1))
    last_leak = 0.0
    print(
        f"{truth.doc['scenario']}: {args.seconds:g} s, {torch.get_num_threads()} threads, "
        f"{cpus()} CPUs, batch {args.batch_size}",
        flush=True,
    )
    error: BaseException | None = None
    try:
        truth.begin()
        if kind in ("dataloader_starvation", "thread_oversubscription"):
            truth.fault()  # a property of the job: from its first step
        done = False
        # a compiled model: the run's seconds count from the end of its compiling first step
        since = None if args.compile else 0.0
        while not done:
            for xb, yb in loader:
                opt.zero_grad()
                soft = None
                if teacher is not None:
                    with torch.no_grad():
                        soft = (teacher(xb) / 2.0).softmax(-1)
                out = net(xb)
                loss = loss_fn(out, yb)
                if soft is not None:
                    loss = loss + (out / 2.0).log_softmax(-1).mul(soft).sum(-1).neg().mean()
                loss.backward()
                opt.step()
                now = time.perf_counter()
                if leak_b_s and truth.elapsed_s() >= args.onset_s:
                    if truth.doc["onset_ns"] is None:
                        # the cap: the address space the warm job has now, plus a margin
                        limit = address_space_bytes() + int(headroom * 2**20)
                        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                        truth.fault(rlimit_as_bytes=limit)
                    # a history kept "for later analysis" that nothing ever frees
                    n = int(leak_b_s * min(now - (last_leak or now - 0.01), 1.0) / 4)
                    leak.append(torch.empty(max(n, 1)).fill_(float(loss)))
                last_leak = now
                truth.step()
                if since is None:
                    since = truth.elapsed_s()
                if truth.elapsed_s() - since >= args.seconds:
                    done = True
                    break
    except BaseException as e:
        error = e
        raise
    finally:
        leak.clear()
        truth.finish(error)


if __name__ == "__main__":
    main()
