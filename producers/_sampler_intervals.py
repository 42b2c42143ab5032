"""How often the node sampler (`perfloop.producers.node_sampler.NodeSampler`) reads each signal.

Every GPU signal (`GPU_SIGNALS`) gets its own interval in an `AdaptiveController`, between the
settings' least and most (never under a floor the backend asks for), judged unchanged within its
`GPU_TOLERANCES`; host sampling has one interval that only stretches when over budget.
`sampling_controller` builds that controller from the settings; `apply_setting` changes one
live sampling setting on it, with the effect a restart with that setting would have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from perfloop.producers.adaptive import AdaptiveController, SignalSpec
from perfloop.producers.gpu import GPU_SIGNALS
from perfloop.settings import ProducerSettings

__all__ = ["CONTROL_WINDOW_S", "GPU_TOLERANCES", "apply_setting", "sampling_controller"]

CONTROL_WINDOW_S = 2.0
"""The budget controller judges overhead over this recent window (the published figure uses
the meter's whole window) and changes the scale at most once per window."""

GPU_TOLERANCES: dict[str, dict[str, Any]] = {
    "utilization": {"abs_tol": 2.0},  # percentage points
    "memory": {"rel_tol": 0.01, "abs_tol": float(16 << 20)},
    "power": {"rel_tol": 0.03, "abs_tol": 5.0},
    "power_limit": {"abs_tol": 1.0},
    "energy": {"counter": True, "rel_tol": 0.05, "abs_tol": 5000.0},  # mJ/s
    "temperature": {"abs_tol": 1.0},
    "clocks": {"abs_tol": 15.0},
    "throttle": {"abs_tol": 0.5},  # any change of the bitmask
    "pcie": {"rel_tol": 0.1, "abs_tol": 1e6},
    "nvlink": {"rel_tol": 0.1, "abs_tol": 1e6},
    "ecc": {"counter": True, "abs_tol": 0.0},  # any new error
    "xid": {"abs_tol": 0.5},
    "process_memory": {"rel_tol": 0.01, "abs_tol": float(16 << 20)},
}
"""What counts as "unchanged" for each GPU signal (see `SignalSpec`)."""


def sampling_controller(
    settings: ProducerSettings,
    floors: Mapping[str, float],
    *,
    gpu_max_s: float,
    host_max_factor: float,
) -> AdaptiveController:
    """The controller of every GPU signal (``gpu.<signal>``, none under its ``floors`` entry)
    and of ``host``, started at the settings' intervals."""
    st = settings
    gpu_min = st.gpu_min_interval_ms / 1000.0
    gpu_start = st.gpu_interval_ms / 1000.0
    specs = []
    for name in GPU_SIGNALS:
        lo = max(gpu_min, floors.get(name, 0.0))
        hi = max(gpu_max_s, gpu_start, lo)
        start = min(hi, max(lo, gpu_start))
        specs.append(SignalSpec(f"gpu.{name}", lo, hi, start, **GPU_TOLERANCES[name]))
    host_s = st.host_interval_ms / 1000.0
    specs.append(SignalSpec("host", host_s, host_s * max(1.0, host_max_factor), adaptive=False))
    return AdaptiveController(
        specs,
        budget_pct=st.overhead_budget_pct,
        enabled=st.adaptive_sampling,
        settle_s=CONTROL_WINDOW_S,
    )


def apply_setting(
    ctl: AdaptiveController,
    name: str,
    new: Any,
    *,
    gpu_max_s: float,
    host_max_factor: float,
) -> None:
    """Apply the checked value ``new`` of the `ProducerSettings` field ``name`` (one of
    `SAMPLING_KEYS`' values) to ``ctl``."""
    if name == "gpu_interval_ms":
        sec = float(new) / 1000.0
        for signal_name in GPU_SIGNALS:
            ctl.set_interval(f"gpu.{signal_name}", sec, max_interval_s=max(gpu_max_s, sec))
    elif name == "host_interval_ms":
        sec = float(new) / 1000.0
        ctl.set_interval(
            "host",
            sec,
            min_interval_s=sec,
            max_interval_s=sec * max(1.0, host_max_factor),
        )
    elif name == "adaptive_sampling":
        ctl.set_enabled(bool(new))
    else:
        ctl.set_budget(float(new))
