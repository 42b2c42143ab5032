"""What a window is and what a closed one comes out as: `WindowSpec` (size and hop, whole
panes), `parse_specs`, and the columns of closed windows (`COLUMNS`) and panes
(`PANE_COLUMNS`). Public through `perfloop.streams.windows`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from perfloop.exceptions import ConfigError

__all__ = [
    "COLUMNS",
    "DEFAULT_SPECS",
    "NS",
    "PANE_COLUMNS",
    "WindowColumns",
    "WindowSpec",
    "empty_columns",
    "parse_specs",
]

NS = 1_000_000_000
WindowColumns = dict[str, np.ndarray]
"""Equal-length columns, one row per closed window of one series (see `COLUMNS`)."""
COLUMNS = (
    *("ts_ns", "window_end_ns", "window_s", "hop_s", "job_id", "node", "rank", "device"),
    *("metric", "count", "mean", "min", "max", "p50", "p95", "p99", "rate_per_s"),
    *("slope_per_s", "closed_ns"),
)
PANE_COLUMNS = (
    *("ts_ns", "job_id", "node", "rank", "device", "metric"),
    *("count", "mean", "min", "max", "last"),
)
_STRINGS = frozenset({"job_id", "node", "metric"})
_FLOATS = frozenset({"window_s", "hop_s", "mean", "min", "max", "p50", "p95", "p99", "last"})


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """A window of ``size_s`` seconds starting every ``hop_s`` (tumbling when equal).

    >>> WindowSpec(60, 10), str(WindowSpec(10)), WindowSpec(10).tumbling
    (WindowSpec(size_s=60.0, hop_s=10.0), '10', True)
    """

    size_s: float
    hop_s: float | None = None

    def __post_init__(self) -> None:
        size = float(self.size_s)
        hop = size if self.hop_s is None else float(self.hop_s)
        if not (math.isfinite(size) and size > 0 and math.isfinite(hop) and 0 < hop <= size):
            raise ConfigError(
                f"window {self.size_s!r}/{self.hop_s!r}: need 0 < hop_s <= size_s (seconds)"
            )
        object.__setattr__(self, "size_s", size)
        object.__setattr__(self, "hop_s", hop)

    @property
    def size_ns(self) -> int:
        return round(self.size_s * NS)

    @property
    def hop_ns(self) -> int:
        return round(float(self.hop_s or self.size_s) * NS)

    @property
    def block_ns(self) -> int:
        """The block its windows are merged from: gcd(size, hop)."""
        return math.gcd(self.size_ns, self.hop_ns)

    @property
    def tumbling(self) -> bool:
        return self.hop_ns == self.size_ns

    @property
    def key(self) -> tuple[int, int]:
        """The state key: a changed spec is a new window that starts clean."""
        return self.size_ns, self.hop_ns

    def __str__(self) -> str:
        return f"{self.size_s:g}" if self.tumbling else f"{self.size_s:g}/{self.hop_s:g}"


def parse_specs(value: str | Iterable[str | float | WindowSpec]) -> tuple[WindowSpec, ...]:
    """Specs from ``"1,10,60,60/10"`` (size or size/hop, seconds) or a list of them.

    >>> [str(s) for s in parse_specs("1, 10,60/10")]
    ['1', '10', '60/10']
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    specs: list[WindowSpec] = []
    for item in items:
        if isinstance(item, WindowSpec):
            spec = item
        else:
            text = str(item).strip()
            size, _, hop = text.partition("/")
            try:
                spec = WindowSpec(float(size), float(hop) if hop else None)
            except ValueError:
                raise ConfigError(
                    f"window spec {text!r}: expected seconds like '10' or size/hop like '60/10'"
                ) from None
        if spec.key not in {s.key for s in specs}:
            specs.append(spec)
    if not specs:
        raise ConfigError(f"no window specs in {value!r}; e.g. '1,10,60,60/10'")
    return tuple(specs)


DEFAULT_SPECS = parse_specs("1,10,60,60/10")


def empty_columns(names: Sequence[str]) -> WindowColumns:
    return {
        c: np.zeros(0, dtype=object if c in _STRINGS else float if c in _FLOATS else np.int64)
        for c in names
    }
