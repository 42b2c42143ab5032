"""What a traced process offers its job agent: the knobs beyond `TorchKnobs`' own (the
profiler capture; with CUDA, the GPU power limit), the DataLoader the training data last came
from, and the script's own thread count (its ``torch.set_num_threads`` calls, a bound the agent
never raises threads past).

`Session` starts the agent with these, as a callback of its pipeline
(`perfloop.producers._training_agent.start_agent_callback`, as the explicit API does).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

from perfloop.producers._hooks_state import _S, log
from perfloop.producers.training import Pipeline

CAPTURE_MAX_STEPS = 50
"""The longest profiler capture a command may ask for (``profiler.capture_steps``)."""


def _live_loader() -> tuple[Any, Any] | None:
    """The iterator the training data last came from, and its DataLoader (None if gone)."""
    tr = _S.tracer
    source = tr.source if tr is not None else None
    ref = _S.iters.get(source[0]) if source else None
    it = ref() if ref is not None else None
    loader = getattr(it, "_perfloop_loader", None)
    return None if it is None or loader is None else (it, loader)


def _optional_knobs(pipeline: Pipeline, rank: int, settings: Any = None) -> dict[str, Any]:
    """The profiler capture (publishing through the session's ``pipeline``) and, with CUDA,
    the GPU power limit (each where available): through the node's power-limit helper where
    ``power_helper`` names its socket (`perfloop.producers.power_helper`: the process stays
    unprivileged), else through NVML itself."""
    out: dict[str, Any] = {}
    try:
        from perfloop.producers._capture import ProfileCapture, emit_to

        out["capture"] = ProfileCapture(
            job_id=pipeline.job_id,
            node=pipeline.node,
            rank=rank,
            emit=emit_to(pipeline.emitter),
            max_steps=CAPTURE_MAX_STEPS,
        )
    except Exception as e:
        pipeline.errors("the profiler capture knob", e)
    torch = _S.torch
    try:
        helper = getattr(settings, "power_helper", None)
        if torch.cuda.is_available() and torch.cuda.is_initialized() and helper is not None:
            from perfloop.producers.power_helper import helper_handler, helper_range

            devices = [_nvml_index(torch)]
            out["power_range"] = helper_range(helper, devices)
            out["power"] = helper_handler(helper, devices)
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            from perfloop.producers._power import power_limit_handler, power_limit_range
            from perfloop.producers.gpu import NvmlBackend

            backend = NvmlBackend()
            backend.init()
            devices = [_nvml_index(torch)]
            out["power"] = power_limit_handler(backend, devices)
            out["power_range"] = power_limit_range(backend, devices)
    except Exception as e:  # no NVML, or no power control here: the knob is not offered
        log.info("perfloop: no GPU power-limit knob: %s", e)
    return out


def _nvml_index(torch: Any) -> int:
    """The NVML index of this process's CUDA device (CUDA_VISIBLE_DEVICES renumbers CUDA's;
    NVML's follow the PCI bus), found by its PCI bus id."""
    import pynvml

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode())
    return int(pynvml.nvmlDeviceGetIndex(handle))


def _make_set_threads(orig: Any) -> Any:
    """The script sets its own thread count: never raised past it (the stream tier reads it
    in the job info); the job agent's changes call the original."""

    @functools.wraps(orig)
    def set_num_threads(n: Any) -> Any:
        out = orig(n)
        with contextlib.suppress(Exception):
            s = _S
            if s.pid == os.getpid() and not isinstance(n, bool):
                s.threads_by_script = int(n)
                if s.session is not None:
                    s.session.info_dirty = True
        return out

    set_num_threads.__perfloop_wrapped__ = orig  # type: ignore[attr-defined]
    return set_num_threads
