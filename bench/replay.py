"""Trace replay: speed and peak memory per trace, against loading the same JSON whole.

    python bench/replay.py                        # every trace under ../shared/data/traces
    python bench/replay.py --match trace_filter   # only paths containing this
    python bench/replay.py --repeat 3

For each trace it times `replay_trace` into a publisher that drops messages (so this is the
reading, attribution and encoding, not Kafka), best of ``--repeat``, and measures its peak
traced Python memory (tracemalloc, in a separate run because tracing slows allocation). The
baseline, in the same process, is what a straightforward tool does first: ``json.load`` of
the decompressed file (time and tracemalloc peak). It prints MB/s of decompressed JSON, the
peaks and the ratios replay/baseline, and ends with one JSON line (also saved under
``bench/results/``). Tests never assert these numbers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/replay.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, save_result, say
from perfloop.producers.replay import TraceError, index_trace, replay_trace

TRACES = REPO.parent / "shared" / "data" / "traces"
MB = 1e6


class _Drop:
    def publish(self, topic: str, key: str, value: bytes) -> bool:
        return True


def _open(p: Path) -> Any:
    return gzip.open(p) if p.suffix == ".gz" else open(p, "rb")


def _decompressed(p: Path) -> int:
    with _open(p) as f:
        return sum(len(c) for c in iter(lambda: f.read(1 << 20), b""))


def _replay(p: Path) -> None:
    try:
        idx = index_trace(p)
    except TraceError:
        idx = index_trace(p, whole_trace=True)
    replay_trace(p, _Drop(), job_id="bench", index=idx)


def _load(p: Path) -> None:
    with _open(p) as f:
        json.load(f)


def _best(fn: Any, p: Path, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(p)
        best = min(best, time.perf_counter() - t0)
    return best


def _peak(fn: Any, p: Path) -> int:
    tracemalloc.start()
    try:
        fn(p)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--match", default="", help="only traces whose path contains this")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    paths = sorted(p for p in args.traces.rglob("*.json*") if args.match in str(p))
    paths = [p for p in paths if p.name.endswith((".json", ".json.gz"))]
    if not paths:
        say(f"no trace under {args.traces} matching {args.match!r}")
        return 2
    rows = []
    for p in paths:
        size = _decompressed(p)
        t_replay = _best(_replay, p, args.repeat)
        t_load = _best(_load, p, args.repeat)
        peak_replay, peak_load = _peak(_replay, p), _peak(_load, p)
        row = {
            "trace": str(p.relative_to(args.traces)),
            "json_mb": round(size / MB, 2),
            "replay_s": round(t_replay, 3),
            "replay_mb_per_s": round(size / MB / t_replay, 1),
            "json_load_s": round(t_load, 3),
            "replay_peak_mb": round(peak_replay / MB, 2),
            "json_load_peak_mb": round(peak_load / MB, 2),
            "peak_vs_json_size": round(peak_replay / size, 3),
            "peak_vs_json_load_peak": round(peak_replay / peak_load, 3),
        }
        rows.append(row)
        say(
            f"{row['trace'][:60]:<60} {row['json_mb']:>7.1f} MB  replay {t_replay:6.2f} s "
            f"({row['replay_mb_per_s']:5.1f} MB/s; json.load {t_load:5.2f} s)  peak "
            f"{row['replay_peak_mb']:6.2f} MB (json.load {row['json_load_peak_mb']:7.1f} MB)"
        )
    largest = max(rows, key=lambda r: r["json_mb"])
    save_result(
        "replay",
        {
            "bench": "replay",
            "repeat": args.repeat,
            "traces": rows,
            "largest": largest,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
