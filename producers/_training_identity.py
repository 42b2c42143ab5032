"""Job identity: the `JobInfo` fields of a training job, found by looking at what runs.

`describe_job` reads the launcher's world and the scheduler's identity (Slurm, Kubernetes:
`perfloop.producers.world`), the host, torch when
the script imported it (never imported here), and the model and optimizer it is given: model
name, parameters, precision, parallelism. Public through `perfloop.producers.training`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from perfloop.producers.world import launcher_world, scheduler_identity

__all__ = ["describe_job"]

_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
_WRAPPERS = {
    "DistributedDataParallel": "ddp",
    "FullyShardedDataParallel": "fsdp",
    "DataParallel": "dp",
}


def describe_job(
    *,
    model: Any = None,
    optimizer: Any = None,
    precision: str | None = None,
    command: str = "",
    **fields: Any,
) -> dict[str, Any]:
    """`JobInfo` fields found by looking at the model, the optimizer, torch and the host.

    ``fields`` (any `JobInfo` field) override what is found. torch is never imported here.

    >>> d = describe_job(command="python train.py", batch_size=32)
    >>> d["world_size"] >= 1, d["command"], d["batch_size"], d["cpu_count"] > 0
    (True, 'python train.py', 32, True)
    """
    info: dict[str, Any] = dict(launcher_world())
    info.pop("rank")
    info.pop("local_rank")
    info.update(scheduler_identity())
    info["cpu_count"] = os.cpu_count() or 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        info["host_mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    torch = sys.modules.get("torch")
    if torch is not None:
        info["framework"] = "torch"
        info["framework_version"] = str(getattr(torch, "__version__", ""))
        info["cuda_version"] = str(getattr(torch.version, "cuda", None) or "")
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                info["gpu_name"] = str(props.name)[:256]
                info["gpu_mem_bytes"] = int(props.total_memory)
                info["gpu_count"] = int(torch.cuda.device_count())
        dist = sys.modules.get("torch.distributed")
        with contextlib.suppress(Exception):
            if dist is not None and dist.is_available() and dist.is_initialized():
                info["backend"] = str(dist.get_backend())
    if model is not None:
        with contextlib.suppress(Exception):
            wrapper = type(model).__name__
            inner = getattr(model, "module", model) if wrapper in _WRAPPERS else model
            info["model_name"] = type(inner).__name__[:256]
            info["parallelism"] = _WRAPPERS.get(
                wrapper, "none" if info["world_size"] == 1 else "dp"
            )
            params = list(model.parameters())
            info["model_params"] = int(sum(p.numel() for p in params))
            if precision is None and params:
                dtype = str(params[0].dtype).removeprefix("torch.")
                precision = _PRECISION.get(dtype, dtype)
                if precision == "fp32" and params[0].is_cuda:
                    with contextlib.suppress(Exception):
                        if torch is not None and torch.backends.cuda.matmul.allow_tf32:
                            precision = "tf32"
            if info["parallelism"] in ("ddp", "fsdp", "dp"):
                info["dp_size"] = info["world_size"]
    if optimizer is not None:
        info["optimizer"] = type(optimizer).__name__[:256]
    if precision:
        info["precision"] = precision[:256]
    info["command"] = command[:4096]
    info.update({k: v for k, v in fields.items() if v is not None})
    return info
