"""A data-parallel CPU training job (DDP over gloo, an MLP on synthetic data), healthy or with
one of the common multi-rank faults. It does not import perfloop; start it with torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/realworld_jobs/ddp.py --fault straggler_compute --seconds 40 --seed 3 --truth DIR

Every rank runs one torch thread. ``--fault`` (the perfloop ``bottleneck`` a right diagnosis
names, and the culprit rank, drawn per seed):

- ``none`` (``none``): healthy;
- ``straggler_compute`` (``straggler``): from ``--onset-s`` one rank's forward computes more
  each step (matrix products: 0.6–1.5× its own median step time before the onset, drawn per
  seed), so the others wait for it in the gradient all-reduce;
- ``straggler_contention`` (``straggler``): every rank is pinned to its own CPU
  (``os.sched_setaffinity`` by ``LOCAL_RANK``); at ``--onset-s`` a separate process that burns
  CPU starts, pinned to one rank's CPU;
- ``hang`` (``hang``): at ``--onset-s`` one rank stops before its backward (the gradient
  all-reduce) and never comes back; the others wait in the all-reduce until the process
  group's timeout (``--pg-timeout-s``) ends the job;
- ``ckpt_eval`` (``none``): healthy, with a checkpoint every 80–140 steps (rank 0
  ``torch.save``s model and optimizer and fsyncs the file while the others wait at a barrier)
  and an evaluation loop every 150–250 steps (``model.eval()`` and ``torch.no_grad()`` on every
  rank, the loss all-reduced): neither is a hang or a straggler;
- ``grad_accum`` (``none``): healthy, 2–4 micro-batches per optimizer step, the first ones
  under ``model.no_sync()``.

Without ``--steps`` the job trains ``--seconds``: every 10 steps the ranks all-reduce whether
rank 0's time is up (a 4-byte collective). With ``--steps N`` it runs exactly N optimizer
steps and makes no collective of its own (only DDP's).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jobkit import Burner, Truth, add_common_args, all_stop, dist_env, pin_to_cpu

KINDS = {
    "none": "none",
    "straggler_compute": "straggler",
    "straggler_contention": "straggler",
    "hang": "hang",
    "ckpt_eval": "none",
    "grad_accum": "none",
}
SCENARIOS = {"none": "healthy_ddp"}


class Net(nn.Module):
    """An MLP whose forward computes ``extra_ms`` more when set (a slower rank)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(256, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )
        self.extra_ms = 0.0
        self.scratch = torch.randn(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra_ms:
            deadline = time.perf_counter() + self.extra_ms / 1e3
            a = self.scratch
            while time.perf_counter() < deadline:
                a = torch.tanh(a @ a.T @ a * 1e-3)
        return self.body(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--fault", choices=sorted(KINDS), default="none")
    p.add_argument("--steps", type=int, default=0, help="exactly this many steps (0: seconds)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--culprit", type=int, default=-1, help="the faulty rank (-1: seed)")
    p.add_argument("--slow-ms", type=float, default=0.0, help="straggler's extra ms (0: seed)")
    p.add_argument(
        "--slow-factor",
        type=float,
        default=0.0,
        help="else extra = this × the rank's median step before (0: seed)",
    )
    p.add_argument("--pg-timeout-s", type=float, default=30.0, help="process group timeout")
    args = p.parse_args()
    rank, world, local_rank = dist_env()
    shared = random.Random(args.seed)  # the same draws on every rank
    culprit = args.culprit if args.culprit >= 0 else shared.randrange(world)
    kind = KINDS[args.fault]
    truth = Truth(
        args.truth,
        scenario=SCENARIOS.get(args.fault, args.fault),
        kind=kind,
        ranks=[] if kind == "none" else [culprit],
        seed=args.seed,
        report_s=args.report_s,
    )
    torch.set_num_threads(1)
    cpu = pin_to_cpu(local_rank) if args.fault == "straggler_contention" else -1
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    torch.manual_seed(args.seed)
    slow_factor = args.slow_factor or shared.uniform(0.6, 1.5)
    accum = shared.choice([2, 3, 4]) if args.fault == "grad_accum" else 1
    ckpt_every = shared.randint(80, 140) if args.fault == "ckpt_eval" else 0
    eval_every = shared.randint(150, 250) if args.fault == "ckpt_eval" else 0
    truth.set(
        culprit=culprit,
        slow_factor=round(slow_factor, 2),
        accum=accum,
        ckpt_every=ckpt_every,
        eval_every=eval_every,
        cpu=cpu,
        world=world,
    )

    g = torch.Generator().manual_seed(args.seed)
    data = TensorDataset(torch.randn(8192, 256, generator=g), torch.randint(0, 10, (8192,)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    held_out = torch.randn(40 * args.batch_size, 256, generator=g).split(args.batch_size)
    net = Net(args.width)
    truth.set(grad_bytes=sum(p.numel() * p.element_size() for p in net.parameters()))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    ckpt_dir = Path(tempfile.mkdtemp(prefix="realworld-ckpt-")) if ckpt_every else None
    burner: Burner | None = None
    if rank == 0:
        print(
            f"{truth.doc['scenario']}: {world} ranks, culprit {culprit}, "
            f"{args.steps or args.seconds} {'steps' if args.steps else 's'}",
            flush=True,
        )
    error: BaseException | None = None
    try:
        truth.begin()
        epoch, micro, stop = 0, 0, False
        while not stop:
            sampler.set_epoch(epoch)
            epoch += 1
            for xb, yb in loader:
                micro += 1
                last_micro = micro % accum == 0
                faulty = rank == culprit and truth.elapsed_s() >= args.onset_s
                if faulty and args.fault == "straggler_compute" and not net.extra_ms:
                    ends = truth.doc["step_ms"][-51:]
                    gaps = sorted(b - a for a, b in itertools.pairwise(ends)) or [10.0]
                    net.extra_ms = args.slow_ms or slow_factor * gaps[len(gaps) // 2]
                    truth.fault(slow_ms=round(net.extra_ms, 2))
                if faulty and args.fault == "straggler_contention" and burner is None:
                    truth.fault(cpu=cpu)
                    burner = Burner(cpu, args.seconds + 60)
                if faulty and args.fault == "hang":
                    truth.fault()
                    print(f"[rank {rank}] hangs before its backward", flush=True)
                    time.sleep(10 * args.pg_timeout_s + 3600)
                if last_micro:
                    loss = loss_fn(model(xb), yb)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    with model.no_sync():
                        loss = loss_fn(model(xb), yb)
                        loss.backward()
                    continue
                truth.step()
                n = truth.steps
                if ckpt_every and n % ckpt_every == 0:
                    if rank == 0 and ckpt_dir is not None:
                        path = ckpt_dir / "last.pt"
                        torch.save(
                            {"model": net.state_dict(), "optim": opt.state_dict(), "step": n}, path
                        )
                        with open(path, "rb+") as f:
                            os.fsync(f.fileno())
                    dist.barrier()
                if eval_every and n % eval_every == 0:
                    model.eval()
                    with torch.no_grad():
                        total = sum(
                            float(loss_fn(model(x), torch.zeros(len(x), dtype=torch.long)))
                            for x in held_out
                        )
                    model.train()
                    t = torch.tensor([total])
                    dist.all_reduce(t)
                stop = all_stop(truth, n, args.steps, args.seconds)
                if stop:
                    break
        dist.barrier()
    except BaseException as e:
        error = e
        raise
    finally:
        if burner is not None:
            burner.stop()
        if ckpt_dir is not None:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        truth.finish(error)
        if error is None:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
