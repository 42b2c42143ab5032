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
    """Concatenate queued batches by (job, kind), first-seen order, ``columns[kind]`` only.

    ``node`` in ``columns[kind]`` asks for each row's node (an object column); the group's
    node is its first batch's.

    >>> from perfloop.schemas.codec import decode_batch, encode_batch
    >>> b = [decode_batch(encode_batch("step", {"ts_ns": [i], "rank": [i], "step": [i],
    ...      "step_time_ms": [1.0]}, job_id="j", node=f"n{i}")) for i in (1, 2)]
    >>> [(k, c["step"].tolist(), c["node"].tolist(), w) for _, _, k, c, w in
    ...  group_batches([(b[0], 10), (b[1], 20)], {"step": ("step", "node")})]
    [('step', [1, 2], ['n1', 'n2'], 20)]
    """
    order: dict[tuple[str, str], list[tuple[Batch, int]]] = {}
    for b, wall in pending:
        if b.kind in columns and len(b):
            order.setdefault((b.job_id, b.kind), []).append((b, wall))
    out: list[Group] = []
    for (job_id, kind), items in order.items():
        names = columns[kind]
        parts: dict[str, list[np.ndarray]] = {c: [] for c in names}
        for b, _ in items:
            for c in names:
                parts[c].append(np.full(len(b), b.node, object) if c == "node" else b.columns[c])
        cols = {c: v[0] if len(v) == 1 else np.concatenate(v) for c, v in parts.items()}
        out.append((job_id, items[0][0].node, kind, cols, max(w for _, w in items)))
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
