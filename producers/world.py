"""Where this process sits in its job: its rank, the job's size, and its node's share of it,
from torch.distributed once initialised, else from the launcher's environment; and the job's
identity in its scheduler (Slurm, Kubernetes)."""

from __future__ import annotations

import os
import sys

__all__ = ["launcher_world", "scheduler_identity"]


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


_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def scheduler_identity(
    environ: dict[str, str] | None = None, namespace_file: str = _SA_NAMESPACE
) -> dict[str, str]:
    """The job's identity in its scheduler: `JobInfo`'s ``scheduler`` and ``slurm_*`` or
    ``k8s_*`` fields, empty where there is none.

    Slurm from its job environment (``SLURM_JOB_ID``, ``SLURM_JOB_NAME``,
    ``SLURM_JOB_NODELIST``, ``SLURM_STEP_ID``). Kubernetes where ``KUBERNETES_SERVICE_HOST``
    says the process runs in a pod: the pod, namespace and node from the downward API's
    environment (``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``, set in the pod spec with
    ``fieldRef`` — docs/training-integration.md), else the pod from ``HOSTNAME`` and the
    namespace from the service account's file. Like `launcher_world`, reading the launcher's
    environment is its whole job.

    >>> scheduler_identity({"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "llm",
    ...                     "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_STEP_ID": "0"})
    ... # doctest: +NORMALIZE_WHITESPACE
    {'scheduler': 'slurm', 'slurm_job_id': '4242', 'slurm_job_name': 'llm',
     'slurm_nodelist': 'gpu[01-04]', 'slurm_step_id': '0'}
    >>> scheduler_identity({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "POD_NAME": "train-0",
    ...                     "POD_NAMESPACE": "ml", "NODE_NAME": "node-7"}, namespace_file="")
    {'scheduler': 'kubernetes', 'k8s_pod': 'train-0', 'k8s_namespace': 'ml', 'k8s_node': 'node-7'}
    >>> scheduler_identity({"HOME": "/root"})
    {}
    """
    env = os.environ if environ is None else environ

    def get(name: str, limit: int = 256) -> str:
        return str(env.get(name, "")).strip()[:limit]

    if get("SLURM_JOB_ID"):
        return {
            "scheduler": "slurm",
            "slurm_job_id": get("SLURM_JOB_ID"),
            "slurm_job_name": get("SLURM_JOB_NAME"),
            "slurm_nodelist": get("SLURM_JOB_NODELIST", 4096) or get("SLURM_NODELIST", 4096),
            "slurm_step_id": get("SLURM_STEP_ID"),
        }
    if get("KUBERNETES_SERVICE_HOST"):
        namespace = get("POD_NAMESPACE")
        if not namespace and namespace_file:
            try:
                with open(namespace_file, encoding="utf-8") as f:
                    namespace = f.read().strip()[:256]
            except OSError:
                namespace = ""
        return {
            "scheduler": "kubernetes",
            "k8s_pod": get("POD_NAME") or get("HOSTNAME"),
            "k8s_namespace": namespace,
            "k8s_node": get("NODE_NAME"),
        }
    return {}
