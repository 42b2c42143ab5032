"""The timing hook averages a DDP bucket exactly as DDP's own reducer does: real gloo ranks
(processes), the same model and data under DDP with no hook and under DDP with
`timed_allreduce_hook`, and every gradient equal bit for bit. A group of three, whose
reciprocal is not exact in binary, tells a divide from DDP's multiply by the reciprocal
before the all-reduce; a group of two is averaged after the all-reduce, on the
backend's thread, which must give the same bits."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import pytest

torch = pytest.importorskip("torch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from perfloop.producers._comm import InFlight, timed_allreduce_hook

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        inflight = InFlight()
        grads = []
        for hooked in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5)
            )
            ddp = DDP(model)
            if hooked:
                ddp.register_comm_hook(
                    None, timed_allreduce_hook(inflight, lambda g: ("world", g.size(), 0))
                )
            torch.manual_seed(100 + rank)  # each rank its own data
            x, y = torch.randn(32, 24) * 7.3, torch.randint(0, 5, (32,))
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            grads.append([p.grad.clone() for p in ddp.parameters()])
        done = inflight.take()
        out.put((rank, all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), len(done)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 2])
def test_the_hook_averages_as_ddps_reducer_bit_for_bit(world: int) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [r for r, _, _ in got] == list(range(world))
    assert all(equal for _, equal, _ in got), got
    assert all(n >= 1 for _, _, n in got), "the hook ran, and timed its all-reduce"
