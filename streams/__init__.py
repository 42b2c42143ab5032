"""Modeling tier, streaming part: windows, rules and the warehouse sink.

Contract: processors consume the telemetry topics at least once, keep window state in memory,
emit closed windows to ``perfloop.windows`` and recommendations to
``perfloop.recommendations``, and send bad input to ``perfloop.dlq`` without stopping. The
Faust app is `perfloop.streams.app` (imported on demand: it pulls in Faust); the sink is
`perfloop.streams.sink`.
"""

from perfloop.streams.rules import KNOB_NUM_WORKERS, DataWaitRule
from perfloop.streams.windows import TumblingWindows, WindowRow, summarize

__all__ = ["KNOB_NUM_WORKERS", "DataWaitRule", "TumblingWindows", "WindowRow", "summarize"]
