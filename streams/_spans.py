"""Which nested ``comm`` spans are time a rank spent blocked inside a compute phase.

The training hooks nest DDP's gradient all-reduce as ``comm`` spans (depth 1) inside the
``backward`` that waited for it; a replayed profiler trace also nests annotations named after
a collective inside the depth-0 ``comm`` span that already counts them. Only the first kind
is time to add to a rank's blocked time (and to take from its compute): a depth-1 ``comm``
span that lies inside a depth-0 ``comm`` span of the same rank and step (in the same batch:
a step's spans travel together) is counted once, by its parent.

>>> import numpy as np
>>> cols = {"rank": np.array([0, 0, 0, 0]), "step": np.array([1, 1, 1, 1]),
...         "depth": np.array([0, 1, 0, 1]),
...         "phase": np.array(["backward", "comm", "comm", "comm"], dtype=object),
...         "ts_ns": np.array([0, 5_000_000, 50_000_000, 51_000_000]),
...         "duration_ms": np.array([40.0, 20.0, 10.0, 2.0])}
>>> comm_inside_compute(cols).tolist()
[False, True, False, False]
"""

from __future__ import annotations

import numpy as np

__all__ = ["comm_inside_compute"]


def comm_inside_compute(cols: dict[str, np.ndarray]) -> np.ndarray:
    """Rows that are depth-1 ``comm`` spans not inside a depth-0 ``comm`` span."""
    is_comm = cols["phase"] == "comm"
    inner = is_comm & (cols["depth"] == 1)
    outer = is_comm & (cols["depth"] == 0)
    if not inner.any() or not outer.any():
        return inner
    ts = cols["ts_ns"].astype(np.int64)
    end = ts + np.rint(cols["duration_ms"] * 1e6).astype(np.int64)
    _, inv = np.unique(np.stack([cols["rank"], cols["step"]], axis=1), axis=0, return_inverse=True)
    inv = inv.ravel()
    base = int(ts.min())
    # (key, start) as one sortable number: key index above the start's 42 bits (73 minutes)
    rel = np.clip(ts - base, 0, (1 << 42) - 1)
    code = inv.astype(np.int64) * (1 << 42) + rel
    o = np.flatnonzero(outer)
    o = o[np.argsort(code[o], kind="stable")]
    i = np.flatnonzero(inner)
    at = np.searchsorted(code[o], code[i], side="right") - 1  # the last outer span starting first
    ok = at >= 0
    parent = o[np.maximum(at, 0)]
    nested = ok & (inv[parent] == inv[i]) & (end[parent] >= end[i])
    out = inner.copy()
    out[i[nested]] = False
    return out
