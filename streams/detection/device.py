"""Device and host detectors: thermal and power throttling, GPU errors, CPU saturation, and
the kernel-level roofline class (context only).

* thermal_throttle / power_throttle — a GPU sample counts when its NVML clocks-event reason
  has a thermal (SW/HW thermal slowdown) or power (SW power cap, HW power brake) bit *and* its
  SM clock is at least ``min_clock_drop`` below the device's own unthrottled baseline (or no
  baseline is known yet). Opens after ``persist_s`` of unbroken throttled samples; resolves
  after ``clear_s`` without one. An episode that has started but not yet lasted ``persist_s``
  is *pending*: the funnel holds the symptoms it would explain (a straggler on that rank).
* gpu_error — an XID event or a rise of the ECC double-bit error count; resolves after
  ``clear_s`` (event time) without a new one.
* cpu_saturation — node CPU at or above ``threshold_pct`` for ``persist_s``, for a job with
  GPUs (job info or GPU samples), whose CPUs feed them. A CPU training job is meant to keep
  its CPUs busy: what contention does to it shows as its stragglers and slower steps.
* roofline (memory_bound / compute_bound / overhead_bound) — from kernel summaries when the job
  publishes them (GPU busy vs compute time, memory- vs compute-class kernel time), else a rough
  guess from NVML SM vs memory utilisation; low confidence, never on the critical path.

Public through `perfloop.streams.detection` (`device_detectors`): the funnel runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from perfloop.streams.detection._common import replace_findings
from perfloop.streams.detection.job_state import (
    COMPUTE_CLASSES,
    MEMORY_CLASSES,
    NS,
    Finding,
    JobState,
)

if TYPE_CHECKING:
    from perfloop.streams.detection.config import DetectConfig

__all__ = ["device_detectors"]


def device_detectors(job: JobState, cfg: DetectConfig) -> None:
    """Run the GPU and host detectors over the job's latest device and node state."""
    job.det["pending"] = []
    for bottleneck, prefix in (("thermal_throttle", "th_"), ("power_throttle", "pw_")):
        if cfg.throttle.enabled:
            _throttle(job, cfg, bottleneck, prefix)
        else:
            replace_findings(job, bottleneck + ":", {})
    if cfg.gpu_error.enabled:
        _gpu_error(job, cfg)
    else:
        replace_findings(job, "gpu_error:", {})
    if cfg.cpu.enabled:
        _cpu(job, cfg)
    else:
        replace_findings(job, "cpu_saturation:", {})
    if cfg.roofline.enabled:
        _roofline(job, cfg)
    else:
        replace_findings(job, "roofline:", {})


def _rank_share(job: JobState, rank: int) -> float:
    excess = job.det.get("excess_share")
    if excess is not None and 0 <= rank < len(excess):
        return float(excess[rank])
    return 0.0


def _dev_name(job: JobState, i: int) -> tuple[str, int]:
    node = int(job.dev["node"][i])
    return (job.nodes[node] if 0 <= node < len(job.nodes) else "unknown"), int(job.dev["device"][i])


def _throttle(job: JobState, cfg: DetectConfig, bottleneck: str, p: str) -> None:
    d, t = job.dev, cfg.throttle
    n = len(d["ts"])
    st = job.det.setdefault(bottleneck, {"active": np.zeros(0, dtype=bool)})
    if len(st["active"]) < n:
        st["active"] = np.concatenate([st["active"], np.zeros(n - len(st["active"]), bool)])
    start, on, off = d[p + "start"], d[p + "on"], d[p + "off"]
    if not st["active"].any() and not (start > 0).any():
        replace_findings(job, bottleneck + ":", {})
        return
    ongoing = start > 0
    lasting = ongoing & (on - start >= t.persist_s * NS)
    cleared = (off > on) & (off - on >= t.clear_s * NS)
    active = st["active"]
    active[:] = (active | lasting) & ~(active & cleared)
    for i in np.flatnonzero(ongoing & ~active & (on >= off)):
        rank = int(d["rank"][i])
        job.det["pending"].append((bottleneck, [rank] if rank >= 0 else [], [_dev_name(job, i)[0]]))
    found = {}
    for i in np.flatnonzero(active):
        node, dev = _dev_name(job, int(i))
        key = f"{bottleneck}:{node}:{dev}"
        if off[i] > on[i] and key in job.findings:  # clearing: keep the throttled evidence
            found[key] = job.findings[key]
            continue
        rank = int(d["rank"][i])
        base, clock = float(d["base"][i]), float(d["clock"][i])
        ratio = clock / base if base > 0 else np.nan
        drop = (1 - ratio) * max(job.det.get("compute_share", 1.0), 0.0) if ratio == ratio else 0
        share = max(_rank_share(job, rank), drop if drop == drop else 0.0)
        severe = bool(d["reasons"][i] & 0x40) or (ratio == ratio and ratio <= 0.9)
        ev = {
            "sm_clock_mhz": clock,
            "temp_c": float(d["temp"][i]),
            "throttle_reasons": float(d["reasons"][i]),
            "throttled_s": round((int(on[i]) - int(start[i] or on[i])) / NS, 3),
        }
        if base > 0:
            ev.update(baseline_clock_mhz=base, clock_ratio=round(ratio, 4))
        what = "thermal" if bottleneck == "thermal_throttle" else "power"
        found[key] = Finding(
            key=key,
            bottleneck=bottleneck,
            onset_ns=int(start[i] or on[i]),
            step_share=float(np.clip(share, 0, 1)),
            confidence=0.95 if severe else 0.7,
            ranks=[rank] if rank >= 0 else [],
            nodes=[node],
            rank=rank,
            evidence=ev,
            summary=f"GPU {dev} on {node} (rank {rank}) is {what}-throttled"
            + (f" to {100 * ratio:.0f}% of its clock" if ratio == ratio else ""),
        )
    replace_findings(job, bottleneck + ":", found)


def _gpu_error(job: JobState, cfg: DetectConfig) -> None:
    d = job.dev
    if not (d["err_ns"] > 0).any():
        replace_findings(job, "gpu_error:", {})
        return
    now = int(d["ts"].max())
    active = (d["err_ns"] > 0) & (now - d["err_ns"] < cfg.gpu_error.clear_s * NS)
    found = {}
    for i in np.flatnonzero(active):
        node, dev = _dev_name(job, int(i))
        rank = int(d["rank"][i])
        key = f"gpu_error:{node}:{dev}"
        found[key] = Finding(
            key=key,
            bottleneck="gpu_error",
            onset_ns=int(d["err_ns"][i]),
            step_share=0.0,
            confidence=0.95,
            ranks=[rank] if rank >= 0 else [],
            nodes=[node],
            rank=rank,
            evidence={
                "xid_events": float(d["xid"][i]),
                "last_xid": float(d["last_xid"][i]),
                "ecc_dbe_total": float(d["dbe"][i]),
            },
            summary=f"GPU {dev} on {node} reported hardware errors (XID {d['last_xid'][i]}, "
            f"{d['dbe'][i]} ECC double-bit errors)",
        )
    replace_findings(job, "gpu_error:", found)


def _cpu(job: JobState, cfg: DetectConfig) -> None:
    nd, c = job.node, cfg.cpu
    if not (job.gpus or len(job.dev["node"])):
        replace_findings(job, "cpu_saturation:", {})
        return
    n = len(nd["ts"])
    st = job.det.setdefault("cpu", {"active": np.zeros(0, dtype=bool)})
    if len(st["active"]) < n:
        st["active"] = np.concatenate([st["active"], np.zeros(n - len(st["active"]), bool)])
    start, on, off = nd["cpu_start"], nd["cpu_on"], nd["cpu_off"]
    if not st["active"].any() and not (start > 0).any():
        replace_findings(job, "cpu_saturation:", {})
        return
    lasting = (start > 0) & (on - start >= c.persist_s * NS)
    cleared = (off > on) & (off - on >= c.clear_s * NS)
    active = st["active"]
    active[:] = (active | lasting) & ~(active & cleared)
    for i in np.flatnonzero((start > 0) & ~active & (on >= off)):
        ranks = [int(r) for r in np.flatnonzero(job.rank["node"] == i)]
        job.det["pending"].append(("cpu_saturation", ranks, [job.nodes[i]]))
    found = {}
    for i in np.flatnonzero(active):
        name = job.nodes[i]
        ranks = [int(r) for r in np.flatnonzero(job.rank["node"] == i)]
        share = 0.0
        for key in ("wait_share", "excess_share"):
            v = job.det.get(key)
            if v is not None and ranks:
                share = max(
                    share, float(np.nan_to_num(np.max(v[[r for r in ranks if r < len(v)]])))
                )
        found[f"cpu_saturation:{name}"] = Finding(
            key=f"cpu_saturation:{name}",
            bottleneck="cpu_saturation",
            onset_ns=int(start[i] or on[i]),
            step_share=float(np.clip(share, 0, 1)),
            confidence=0.8,
            ranks=ranks,
            nodes=[name],
            evidence={"sys_cpu_pct": float(nd["cpu"][i]), "sys_iowait_pct": float(nd["iowait"][i])},
            summary=f"node {name} CPU at {nd['cpu'][i]:.0f}%",
        )
    replace_findings(job, "cpu_saturation:", found)


def _roofline(job: JobState, cfg: DetectConfig) -> None:
    """Context: recomputed when another ``min_samples`` busy GPU samples came in (or 50 steps)."""
    need = cfg.roofline.min_samples
    progress = float(job.gpu_stats[0]) + 100.0 * job.det.get("steps_seen", 0)
    if progress < job.det.get("roofline_at", 0.0):
        return
    job.det["roofline_at"] = progress + max(need, 1) * 10
    found = {}
    kb = job.kernel_busy
    compute = sum(kb.get(k, 0.0) for k in COMPUTE_CLASSES)
    memory = sum(kb.get(k, 0.0) for k in MEMORY_CLASSES)
    ratio = job.det.get("busy_ratio", -1.0)
    ev: dict[str, float] = {}
    if job.flags["kernels"] and job.det.get("steps_seen", 0) >= min(need, 50):
        ev = {
            "gpu_busy_ratio": round(ratio, 4),
            "compute_kernel_ms": compute,
            "memory_kernel_ms": memory,
        }
        if 0 <= ratio < 0.6:
            kind, conf = "overhead_bound", 0.6
        else:
            kind, conf = ("memory_bound" if memory > compute else "compute_bound"), 0.6
    elif job.gpu_stats[0] >= need:
        sm, mem = job.gpu_stats[1:] / job.gpu_stats[0]
        ev = {"sm_util_pct": round(float(sm), 2), "mem_util_pct": round(float(mem), 2)}
        kind, conf = ("memory_bound" if mem >= 0.75 * sm else "compute_bound"), 0.3
    else:
        replace_findings(job, "roofline:", {})
        return
    found[f"roofline:{kind}"] = Finding(
        key=f"roofline:{kind}",
        bottleneck=kind,
        onset_ns=job.watermark_ns,
        step_share=float(np.clip(job.det.get("compute_share", 0.0), 0, 1)),
        confidence=conf,
        evidence=ev,
        summary=f"kernels look {kind.replace('_', '-')} (context, not a fault)",
    )
    replace_findings(job, "roofline:", found)
