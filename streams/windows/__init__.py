"""Windows: multi-timescale event-time windows per (job, node, rank, device, metric).

Contract: `WindowSet` (no I/O, picklable state) takes decoded telemetry batches and metrics
computed elsewhere, keeps an event-time watermark per source, and `advance` returns the windows
that closed, columnar and grouped by job (`WindowColumns`, the columns of the ``windows``
message: `COLUMNS`; `split_by_job`). Specs are whole numbers of 1 s panes (`WindowSpec`,
`parse_specs`; `DEFAULT_SPECS`: tumbling 1, 10, 60 s and 60 s every 10 s); what each batch
kind yields is configurable (`AVAILABLE_METRICS`, `DEFAULT_METRICS`). Quantiles come from the
mergeable sketches of `perfloop.streams.sketch`.

Modules:

- ``window_set``: `WindowSet`: sources, watermarks and channels, settings, snapshots;
- ``specs``: `WindowSpec`, `parse_specs` and the columns of closed windows and panes;
- ``_closing``: the closing machinery `WindowSet` is built on (`WindowCore`);
- ``_samples``: telemetry batches → long-form samples, and the metrics each kind yields;
- ``_series_registry``: jobs, sources, metric names and dense series ids;
- ``_aggregates``: per-series aggregates over aligned blocks (`Agg`): reduce, merge, finish;
- ``_block_levels``: closed blocks of one size built from a smaller one, and hopping windows.
"""

from perfloop.streams.windows.specs import (
    COLUMNS,
    DEFAULT_SPECS,
    NS,
    PANE_COLUMNS,
    WindowColumns,
    WindowSpec,
    parse_specs,
)
from perfloop.streams.windows.window_set import (
    AVAILABLE_METRICS,
    DEFAULT_METRICS,
    FIRST_GAP_MAX_S,
    WindowSet,
    split_by_job,
)

__all__ = [
    "AVAILABLE_METRICS",
    "COLUMNS",
    "DEFAULT_METRICS",
    "DEFAULT_SPECS",
    "FIRST_GAP_MAX_S",
    "NS",
    "PANE_COLUMNS",
    "WindowColumns",
    "WindowSet",
    "WindowSpec",
    "parse_specs",
    "split_by_job",
]
