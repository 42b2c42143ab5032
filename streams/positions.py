"""How far each stream worker has read: a small file per worker, for the embedded stack.

Every snapshot interval a worker writes ``$PERFLOOP_HOME/streams/<worker>/positions.json``:
the broker cluster it reads, when, and the next offset it will read of each input partition it
holds. The worker's committed offsets trail its reading by up to ``changelog_interval_s``
(input is acknowledged once the changelog holds it), so they cannot say whether it has read a
record; this file can. Public: the stack's broker recycling (`perfloop.stack._recycle`) reads
it to know that no worker still needs what the broker holds.

>>> import tempfile
>>> from pathlib import Path
>>> home = Path(tempfile.mkdtemp())
>>> write_positions(home / "streams" / "0" / POSITIONS, "c1", {("t", 0): 12}, at=5.0)
>>> read_positions(home)
[{'cluster': 'c1', 'at': 5.0, 'offsets': {('t', 0): 12}, 'worker': '0'}]
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["POSITIONS", "read_positions", "write_positions"]

POSITIONS = "positions.json"


def write_positions(
    path: Path, cluster: str | None, offsets: dict[tuple[str, int], int], *, at: float
) -> None:
    """Write a worker's positions atomically (a reader never sees half a file); an error
    writing is left to the next interval (the file is advice, the worker goes on)."""
    doc = {"cluster": cluster, "at": at, "offsets": [[t, p, o] for (t, p), o in offsets.items()]}
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)


def read_positions(home: Path) -> list[dict[str, Any]]:
    """Every worker's last positions under ``home`` (a file that cannot be read is left out)."""
    out = []
    for path in sorted((home / "streams").glob(f"*/{POSITIONS}")):
        try:
            doc = json.loads(path.read_text())
            offsets = {(str(t), int(p)): int(o) for t, p, o in doc["offsets"]}
            at = float(doc["at"])
            out.append(
                {
                    "cluster": doc.get("cluster"),
                    "at": at,
                    "offsets": offsets,
                    "worker": path.parent.name,
                }
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
