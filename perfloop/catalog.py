"""Moved: the warehouse's tables, migrations and rollups are the warehouse tier
(`perfloop.warehouse.tables`, `.migrations`, `.rollups`); the topics are the contract's
(`perfloop.schemas.topics`). These names warn and keep working for one release."""

from perfloop.deprecation import moved

__all__: list[str] = []

_TABLES = ("DEAD_LETTER_PAYLOAD_BYTES", "KIND_TABLES", "MERGE_SELECTOR_BASE", "RAW_TTL_DAYS",
           "TABLES", "WINDOW_KEY")  # fmt: skip
_ROLLUPS = ("ROLLUPS", "ROLLUP_RESOLUTIONS", "ROLLUP_SECONDS", "ROLLUP_TTL_DAYS")

__getattr__ = moved(
    __name__,
    {
        **{n: "perfloop.warehouse.tables" for n in _TABLES},
        **{n: "perfloop.warehouse.migrations" for n in ("MIGRATIONS", "Migration")},
        **{n: "perfloop.warehouse.rollups" for n in _ROLLUPS},
        **{n: "perfloop.schemas.topics" for n in ("KIND_TOPICS", "TOPICS", "Topics")},
    },
)
