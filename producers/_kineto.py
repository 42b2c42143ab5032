"""Reading PyTorch-profiler (Kineto) traces as a stream, and naming what is in them.

Private helpers of `perfloop.producers.replay`:

- `open_trace` / `iter_trace`: stream the ``traceEvents`` items of a ``.json`` or ``.json.gz``
  file with ijson (yajl2_c), never loading the file; the small top-level metadata
  (``distributedInfo``, ``deviceProperties``, ``baseTimeNanoseconds``, ``host_name`` …), found
  before or after the event list, is collected into a dict as the stream passes it.
- classification: `kernel_class` (GPU activity → one of `KERNEL_CLASSES`), `phase_of` (CPU op or
  user annotation → a standard phase); `collective_op` and `dtype_bytes` are re-exported from
  `perfloop.producers._collectives`, which names and sizes collectives.
- one step's figures: `union_us` (the length of a union of intervals, overlaps once),
  `kernel_rows` (busy time and counts per stream and class) and `tile_step` (the depth-0
  phase tiling of a step from the host spans that mark phases).

Every failure to read a trace is a `TraceError` whose message is one line naming the file.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gzip
import itertools
import json
import operator
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import ijson
import numpy as np

from perfloop.exceptions import PerfloopError
from perfloop.producers._collectives import collective_op, dtype_bytes
from perfloop.schemas.telemetry import KERNEL_CLASSES

__all__ = [
    "EVENTS_PREFIX",
    "GPU_CATS",
    "HOST_CATS",
    "LAUNCH_CATS",
    "TraceError",
    "collective_op",
    "dtype_bytes",
    "is_launch",
    "iter_events",
    "iter_trace",
    "kernel_class",
    "kernel_rows",
    "phase_of",
    "tile_step",
    "union_us",
]


class TraceError(PerfloopError):
    """A trace file that cannot be replayed; the message names the file and the reason."""


# Event categories, lower-cased: new Kineto names and the capitalised ones of PyTorch ≤ 1.9.
GPU_CATS: dict[str, str] = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
}
"""GPU activity categories and the class their events get when the name says nothing more."""
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
"""Host-side runtime calls; those that launch work carry the ``correlation`` of their activity."""
HOST_CATS = frozenset({"cpu_op", "operator", "user_annotation"})
"""Host-side spans that can mark a phase (``python_function`` stacks are left out)."""

# Top-level keys kept from a trace (everything else is skipped without being built).
META_KEYS = frozenset(
    {
        "schemaVersion",
        "distributedInfo",
        "deviceProperties",
        "baseTimeNanoseconds",
        "displayTimeUnit",
        "traceName",
        "host_name",
        "hostname",
    }
)

EVENTS_PREFIX = "_events_prefix"
_END_OF_EVENTS = ("traceEvents", "end_array", None)
_END_OF_TOP_ARRAY = ("", "end_array", None)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__  # yajl adds a context window below
    return text[:200]


def _open(path: Path) -> BinaryIO:
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by iter_trace's finally
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    magic = fh.read(2)
    if not magic:
        fh.close()
        raise TraceError(f"{path}: empty file")
    fh.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    return fh


def iter_trace(path: str | Path, meta: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yield the trace's events one by one; fill ``meta`` with its top-level metadata.

    ``meta`` is complete only once the iterator is exhausted (Kineto writes some keys, such
    as ``baseTimeNanoseconds``, after the event list); ``meta[EVENTS_PREFIX]`` then holds the
    ijson prefix of the events, for a second pass with `iter_events`. Raises `TraceError` for
    a file that is not JSON, a truncated gzip stream or a trace without ``traceEvents``.

    The metadata before the events is read token by token (it is small); the events are
    built by ijson in C; the keys after them are parsed from the last 64 KiB of the text,
    and only if that fails is the document's outline read again, token by token.
    """
    p = Path(path)
    prefix = _read_head(p, meta)
    meta[EVENTS_PREFIX] = prefix
    fh = _open(p)
    tail = _Tail(fh)
    try:
        with _translated(p):
            yield from _dicts(ijson.items(tail, prefix, use_float=True))
    finally:
        fh.close()
    if prefix == "item":
        return  # the bare-array form has no metadata
    after = _trailing_keys(tail.bytes())
    if after is None:
        after = _read_after_events(p)
    for key, value in after.items():
        if key in META_KEYS:
            meta[key] = value


def _read_head(p: Path, meta: dict[str, Any]) -> str:
    """Collect the metadata keys before ``traceEvents``; return the events' ijson prefix."""
    fh = _open(p)
    try:
        with _translated(p):
            tokens = ijson.parse(fh, use_float=True)
            first = next(tokens, None)
            if first is None:
                raise TraceError(f"{p}: empty file")
            if first[:2] == ("", "start_array"):  # the bare-array form of the Chrome format
                return "item"
            if first[:2] != ("", "start_map"):
                raise TraceError(f"{p}: not a trace: the JSON document is not an object")
            for prefix, event, value in tokens:
                if prefix != "" or event != "map_key":
                    continue  # the closing end_map
                if value == "traceEvents":
                    _, ev, _ = next(tokens)
                    if ev != "start_array":
                        raise TraceError(f"{p}: not a trace: 'traceEvents' is not a list")
                    return "traceEvents.item"
                if value in META_KEYS:
                    meta[value] = _build(tokens)
                else:
                    _skip(tokens)
    finally:
        fh.close()
    raise TraceError(f"{p}: not a trace: no 'traceEvents' list")


def _read_after_events(p: Path) -> dict[str, Any]:
    """The top-level keys after ``traceEvents``, the slow way (the list is skipped in C)."""
    out: dict[str, Any] = {}
    fh = _open(p)
    try:
        with _translated(p):
            tokens = ijson.parse(fh, use_float=True)
            seen = False
            for prefix, event, value in tokens:
                if prefix != "" or event != "map_key":
                    continue
                if value == "traceEvents":
                    seen = True
                    drain = itertools.takewhile(
                        functools.partial(operator.ne, _END_OF_EVENTS), tokens
                    )
                    collections.deque(drain, maxlen=0)
                elif seen and value in META_KEYS:
                    out[value] = _build(tokens)
                else:
                    _skip(tokens)
    finally:
        fh.close()
    return out


class _Tail:
    """A file wrapper that remembers the last ``keep`` bytes read through it."""

    def __init__(self, fh: BinaryIO, keep: int = 1 << 16) -> None:
        self._fh, self._keep = fh, keep
        self._last = b""
        self._prev = b""

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        if data:
            if len(data) >= self._keep:
                self._prev, self._last = b"", data[-self._keep :]
            else:
                self._prev, self._last = self._last, data
        return data

    def bytes(self) -> bytes:
        return (self._prev + self._last)[-self._keep :]


_EVENTS_END = re.compile(rb"[}\[]\s*\]\s*([,}])")


def _trailing_keys(tail: bytes) -> dict[str, Any] | None:
    """Parse the keys that follow the events list from the end of the document.

    The boundary is the leftmost ``}]`` (or ``[]``) whose remainder is a complete JSON
    object body: anything to its left inside the event list leaves unbalanced text. ``None``
    when no boundary is found in ``tail`` (the caller then reads the outline again).
    """
    for m in _EVENTS_END.finditer(tail):
        if m.group(1) == b"}":
            if not tail[m.end() :].strip():
                return {}
            continue
        try:
            doc = json.loads(b"{" + tail[m.end() :])
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def iter_events(path: str | Path, prefix: str) -> Iterator[dict[str, Any]]:
    """Yield the events under ``prefix`` (from a first pass's ``meta[EVENTS_PREFIX]``).

    About three times faster than `iter_trace`: ijson builds the events in C and skips the
    rest of the document without handing it to Python.
    """
    p = Path(path)
    fh = _open(p)
    try:
        with _translated(p):
            yield from _dicts(ijson.items(fh, prefix, use_float=True))
    finally:
        fh.close()


@contextlib.contextmanager
def _translated(p: Path) -> Iterator[None]:
    """Turn the parser's and the decompressor's errors into one-line `TraceError`s."""
    try:
        yield
    except TraceError:
        raise
    except ijson.JSONError as e:
        raise TraceError(f"{p}: not valid JSON: {_one_line(e)}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise TraceError(f"{p}: truncated or corrupt gzip stream: {_one_line(e)}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not valid JSON: {_one_line(e)}") from None
    except OSError as e:
        raise TraceError(f"{p}: cannot read: {_one_line(e)}") from None


def _dicts(items: Iterator[Any]) -> Iterator[dict[str, Any]]:
    return (i for i in items if type(i) is dict)


def _build(tokens: Iterator[tuple[str, str, Any]]) -> Any:
    """Build the value that starts at the next token (small metadata values only)."""
    builder = ijson.ObjectBuilder()
    depth = 0
    for _, event, value in tokens:
        builder.event(event, value)
        if event in ("start_map", "start_array"):
            depth += 1
        elif event in ("end_map", "end_array"):
            depth -= 1
        if depth == 0:
            return builder.value
    return builder.value


def _skip(tokens: Iterator[tuple[str, str, Any]]) -> None:
    depth = 0
    for _, event, _ in tokens:
        if event in ("start_map", "start_array"):
            depth += 1
        elif event in ("end_map", "end_array"):
            depth -= 1
        if depth == 0:
            return


# --- what a GPU activity is -------------------------------------------------------------------

_KERNEL_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cls, re.compile(rx))
    for cls, rx in (
        ("comm", r"nccl|rccl|all_?reduce_kernel|cross_device_reduce"),
        ("memcpy", r"^memcpy"),
        ("memset", r"^memset"),
        ("attention", r"flash|attention|attn|fmha|_mha|mha_|sdpa|xformers"),
        (
            "norm",
            r"layer_?norm|batch_?norm|rms_?norm|group_?norm|instance_?norm|bn_fw|bn_bw"
            r"|cudnn::bn_|normalization|welford|rowwisemoments|gammabeta",
        ),
        (
            "conv",
            r"conv|fprop|dgrad|wgrad|winograd|fft2d|cudnn::cnn|scudnn|im2col|col2im"
            r"|nchwtonhwc|nhwctonchw|implicit_?gemm|cask_cudnn",
        ),
        (
            "gemm",
            r"(?<!fb)gemm|gemv|matmul|cublas|cutlass|^cijk_|wmma|xmma|sm\d\d_|mma_|bmm|splitkreduce"
            r"|triton_mm|triton_tem",
        ),
        (
            "reduction",
            r"reduce|reduction|softmax|argmax|argmin|cub::|scan|_sum_|sum_kernel|mean_kernel"
            r"|max_?pool|avg_?pool|average_?pool|adaptive_max|triton_red|triton_per|norm_kernel|topk",
        ),
        (
            "elementwise",
            r"elementwise|vectorized|pointwise|triton_poi|fill|copy|multi_tensor_apply"
            r"|dropout|catarray|where_kernel|clamp|activation|relu|gelu|silu|sigmoid|tanh"
            r"|add_kernel|mul_kernel|index_elementwise",
        ),
    )
)


@functools.lru_cache(maxsize=8192)  # kernel names repeat: a step launches the same few hundred
def kernel_class(name: str, cat: str) -> str:
    """The class of one GPU activity, from its name and (lower-cased) category.

    >>> kernel_class("ampere_sgemm_32x32_sliced1x4_tn", "kernel")
    'gemm'
    >>> kernel_class("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32", "kernel")
    'conv'
    >>> kernel_class("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)", "kernel")
    'comm'
    >>> kernel_class("Memcpy DtoD (Device -> Device)", "gpu_memcpy")
    'memcpy'
    >>> kernel_class("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32", "kernel")
    'gemm'
    >>> kernel_class("mystery", "kernel")
    'other'
    """
    base = GPU_CATS.get(cat, "kernel")
    if base != "kernel":
        return base
    low = name.lower()
    for cls, rx in _KERNEL_RULES:
        if rx.search(low):
            return cls
    return "other"


# --- what a host span is ----------------------------------------------------------------------

PHASES = ("data_wait", "comm", "optimizer", "checkpoint", "eval", "backward", "forward")
"""Phases a host span can mark, highest priority first: where marks overlap, the earlier wins
(a blocking collective inside the forward annotation is comm; zero_grad inside nothing else is
optimizer)."""

_PHASE_ALIASES = {
    "data_wait": "data_wait",
    "data_load": "data_wait",
    "data_loading": "data_wait",
    "dataloader": "data_wait",
    "data": "data_wait",
    "forward": "forward",
    "fwd": "forward",
    "backward": "backward",
    "bwd": "backward",
    "optimizer": "optimizer",
    "optimizer_step": "optimizer",
    "optim": "optimizer",
    "zero_grad": "optimizer",
    "comm": "comm",
    "checkpoint": "checkpoint",
    "eval": "eval",
    "evaluation": "eval",
    "validation": "eval",
}
_COMM_PREFIXES = ("nccl:", "gloo:", "mpi:", "ucc:", "xccl:", "c10d::", "record_param_comms")


def phase_of(name: str) -> str | None:
    """The standard phase a host span marks, or ``None`` when it marks none.

    >>> phase_of("Optimizer.step#SGD.step"), phase_of("## backward ##")
    ('optimizer', 'backward')
    >>> phase_of("autograd::engine::evaluate_function: ConvolutionBackward0")
    'backward'
    >>> phase_of("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__")
    'data_wait'
    >>> phase_of("gloo:all_reduce"), phase_of("DistributedDataParallel.forward")
    ('comm', 'forward')
    >>> phase_of("aten::add") is None
    True
    """
    if name.startswith("autograd::engine::evaluate_function:"):
        return "backward"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if name.startswith("enumerate(DataLoader)"):
        return "data_wait"
    if name.startswith(_COMM_PREFIXES):
        return "comm"
    if name.endswith(".forward") and "DataParallel" in name:
        return "forward"
    key = name.strip()
    if key.startswith("##") and key.endswith("##"):
        key = key[2:-2]
    key = key.strip().lower().replace(" ", "_").replace("-", "_")
    return _PHASE_ALIASES.get(key)


_LAUNCH = re.compile(r"launch|memcpy|memset", re.IGNORECASE)


def is_launch(name: str) -> bool:
    """Whether a runtime call starts GPU work (its correlation id names the activity).

    >>> is_launch("cudaLaunchKernel"), is_launch("hipExtModuleLaunchKernel"), is_launch("cudaFree")
    (True, True, False)
    """
    return _LAUNCH.search(name) is not None


# --- interval unions ----------------------------------------------------------------------------


def union_us(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of intervals ``[starts[i], ends[i])`` (overlaps once).

    >>> union_us(np.array([0.0, 5.0, 1.0, 20.0]), np.array([10.0, 7.0, 2.0, 21.0]))
    11.0
    """
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    opens = np.empty(len(s), dtype=bool)
    opens[0] = True
    opens[1:] = s[1:] > reach[:-1]  # a gap before this interval: a new merged run starts
    closes = np.empty(len(s), dtype=bool)
    closes[-1] = True
    closes[:-1] = opens[1:]
    return float(np.sum(reach[closes] - s[opens]))


# --- one step's figures ---------------------------------------------------------------------


def kernel_rows(
    start: np.ndarray, end: np.ndarray, stream: np.ndarray, cls: np.ndarray
) -> list[tuple[int, str, int, float]]:
    """``(stream, kernel_class, count, busy_us)`` rows of one step's GPU activities.

    One row per stream and class, per stream over its classes (``"all"``), per class over
    all streams (stream ``-1``), and the step's GPU busy time (stream ``-1``, ``"all"``);
    busy time is the union of the intervals. A step without GPU activity gets the last row
    only, with zeros.

    >>> import numpy as np
    >>> kernel_rows(np.array([0.0, 5.0, 2.0]), np.array([10.0, 12.0, 4.0]),
    ...             np.array([7, 7, 9]), np.array([0, 0, 3], dtype=np.int8))
    [(-1, 'all', 3, 12.0), (-1, 'gemm', 2, 12.0), (-1, 'elementwise', 1, 2.0), \
(7, 'all', 2, 12.0), (7, 'gemm', 2, 12.0), (9, 'all', 1, 2.0), (9, 'elementwise', 1, 2.0)]
    """
    rows = [(-1, "all", len(start), union_us(start, end))]
    for code in np.unique(cls):
        m = cls == code
        rows.append((-1, KERNEL_CLASSES[int(code)], int(m.sum()), union_us(start[m], end[m])))
    for s in np.unique(stream):
        on = stream == s
        rows.append((int(s), "all", int(on.sum()), union_us(start[on], end[on])))
        for code in np.unique(cls[on]):
            m = on & (cls == code)
            rows.append(
                (int(s), KERNEL_CLASSES[int(code)], int(m.sum()), union_us(start[m], end[m]))
            )
    return rows


def tile_step(
    start: float, end: float, m_start: np.ndarray, m_end: np.ndarray, m_phase: np.ndarray
) -> list[tuple[float, float, str, str]]:
    """Tile ``[start, end]`` with phases: ``(start_us, end_us, phase, name)``, in order.

    Each instant takes the highest-priority phase (`PHASES` order) among the marks covering
    it. Unmarked time before the first backward mark is ``forward`` (when the step has a
    backward); any other unmarked time is phase ``user``, name ``other``. Adjacent tiles of
    one phase are merged; together the tiles cover the step exactly once.

    >>> import numpy as np
    >>> codes = np.array([PHASES.index("backward"), PHASES.index("optimizer")], dtype=np.int8)
    >>> for t in tile_step(0.0, 10.0, np.array([4.0, 8.0]), np.array([7.0, 9.0]), codes):
    ...     print(t)
    (0.0, 4.0, 'forward', 'forward')
    (4.0, 7.0, 'backward', 'backward')
    (7.0, 8.0, 'user', 'other')
    (8.0, 9.0, 'optimizer', 'optimizer')
    (9.0, 10.0, 'user', 'other')
    """
    if not end > start:
        return []
    s = np.clip(m_start, start, end)
    e = np.clip(m_end, start, end)
    keep = e > s
    s, e, ph = s[keep], e[keep], m_phase[keep]
    backward = PHASES.index("backward")
    bw = s[ph == backward]
    first_backward = float(bw.min()) if len(bw) else None
    # Sweep over the marks' boundaries with a count of open marks per phase.
    times = np.concatenate([s, e])
    deltas = np.concatenate([np.ones(len(s), dtype=np.int64), -np.ones(len(e), dtype=np.int64)])
    phases = np.concatenate([ph, ph]).astype(np.int64)
    order = np.lexsort((deltas, times))
    counts = [0] * len(PHASES)
    tiles: list[tuple[float, float, str, str]] = []
    cur = start

    def label(a: float, b: float) -> None:
        if not b > a:
            return
        active = next((p for p, c in enumerate(counts) if c > 0), None)
        if active is not None:
            phase = name = PHASES[active]
        elif first_backward is not None and b <= first_backward:
            phase = name = "forward"
        else:
            phase, name = "user", "other"
        if tiles and tiles[-1][2] == phase and tiles[-1][3] == name and tiles[-1][1] == a:
            tiles[-1] = (tiles[-1][0], b, phase, name)
        else:
            tiles.append((a, b, phase, name))

    for k in order:
        t = float(times[k])
        if t > cur:
            label(cur, t)
            cur = t
        counts[int(phases[k])] += int(deltas[k])
    label(cur, end)
    return tiles
