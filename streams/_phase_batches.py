"""Grouping observed batches before they are applied (private helper of the phase machine and
the step analysis).

Producers send small batches (a node's samples of one kind every few hundred milliseconds);
numpy's cost per call dwarfs its cost per element at that size. The components therefore only
queue what `observe` hands them and, at each tick, concatenate the queued batches of one job,
node and kind — in the order they came, keeping only the columns they use — and apply each
group at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from perfloop.schemas.codec import Batch

__all__ = ["Group", "group_batches", "unique_ints"]

Group = tuple[str, str, str, dict[str, np.ndarray], int]
"""job_id, node, kind, columns, the wall time the last of its batches came."""


def group_batches(
    pending: list[tuple[Batch, int]], columns: Mapping[str, tuple[str, ...]]
) -> list[Group]:
    """Concatenate queued batches by (job, node, kind), first-seen order, ``columns[kind]`` only.

    >>> from perfloop.schemas.codec import decode_batch, encode_batch
    >>> b = [decode_batch(encode_batch("step", {"ts_ns": [i], "rank": [0], "step": [i],
    ...      "step_time_ms": [1.0]}, job_id="j", node="n")) for i in (1, 2)]
    >>> [(k, c["step"].tolist(), w) for _, _, k, c, w in
    ...  group_batches([(b[0], 10), (b[1], 20)], {"step": ("step",)})]
    [('step', [1, 2], 20)]
    """
    order: dict[tuple[str, str, str], list[tuple[Batch, int]]] = {}
    for b, wall in pending:
        if b.kind in columns and len(b):
            order.setdefault((b.job_id, b.node, b.kind), []).append((b, wall))
    out: list[Group] = []
    for (job_id, node, kind), items in order.items():
        names = columns[kind]
        if len(items) == 1:
            cols = {c: items[0][0].columns[c] for c in names}
        else:
            cols = {c: np.concatenate([b.columns[c] for b, _ in items]) for c in names}
        out.append((job_id, node, kind, cols, max(w for _, w in items)))
    return out


def unique_ints(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)`` for integers, without sorting when their range is
    small (steps and ranks of a batch are: a few consecutive values).

    >>> u, inv = unique_ints(np.array([7, 5, 7, 9]))
    >>> u.tolist(), inv.tolist()
    ([5, 7, 9], [1, 0, 1, 2])
    """
    if not len(a):
        return a[:0], np.zeros(0, np.int64)
    lo = int(a.min())
    span = int(a.max()) - lo + 1
    if span > 4 * len(a) + 1024:
        return np.unique(a, return_inverse=True)
    off = a - lo
    present = np.bincount(off, minlength=span) > 0
    index = np.cumsum(present) - 1
    return np.flatnonzero(present) + lo, index[off]
