"""Where this process sits in its job: its rank, the job's size, and its node's share of it,
from torch.distributed once initialised, else from the launcher's environment."""

from __future__ import annotations

import os
import sys

__all__ = ["launcher_world"]


def launcher_world() -> dict[str, int]:
    """Rank and sizes from torch.distributed once initialised, else the launcher's environment.

    Reading ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
    ``GROUP_WORLD_SIZE`` (torchrun, torch.distributed.launch, mpirun-style launchers) is this
    function's whole job, hence the exception to "library code never reads os.environ".

    >>> w = launcher_world(); sorted(w) == ["local_rank", "local_world_size", "nodes", "rank",
    ...                                      "world_size"]
    True
    """
    env = os.environ

    def num(*names: str, default: int) -> int:
        for n in names:
            v = env.get(n)
            if v is not None and v.strip().isdigit():
                return int(v)
        return default

    rank = num("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default=0)
    world = num("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a half-torn-down process group: keep the launcher's view
        pass
    local_rank = num("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    local_world = num("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", default=world)
    local_world = max(1, min(local_world, world))
    nodes = num("GROUP_WORLD_SIZE", default=max(1, -(-world // local_world)))
    return {
        "rank": max(rank, 0),
        "world_size": max(world, 1),
        "local_rank": max(local_rank, 0),
        "local_world_size": local_world,
        "nodes": max(nodes, 1),
    }
