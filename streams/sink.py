"""Moved: the sink is the warehouse tier's, `perfloop.warehouse.sink`. These names warn and
keep working for one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        n: "perfloop.warehouse.sink"
        for n in ("PREFETCH_KIB", "Sink", "SinkStats", "rows_from_dead_letter", "rows_from_message")
    },
)
