"""JSON Schema for every event family, for producers and consumers not written in Python.

`export_json_schemas` writes, per family, the schema of one event as an object
(``event/<kind>.v<version>.json``) and, for telemetry, the schema of the batched columnar
message that actually travels on Kafka (``batch/<kind>.v<version>.json``), plus an
``index.json`` naming each kind's topic-independent wire form and version range.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson

from perfloop.schemas.base import Event
from perfloop.schemas.codec import _MISSING, _SPECS, BATCH_KINDS, EVENT_KINDS, MAX_MESSAGE_BYTES

__all__ = ["batch_json_schema", "event_json_schema", "export_json_schemas"]

_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def event_json_schema(model: type[Event]) -> dict[str, Any]:
    """The JSON Schema of one event of ``model`` as a standalone object (with ``kind``)."""
    schema = copy.deepcopy(model.model_json_schema())
    schema["$schema"] = _DRAFT
    schema["$id"] = f"perfloop:event/{model.KIND}/v{model.SCHEMA_VERSION}"
    schema.setdefault("properties", {})["kind"] = {"const": model.KIND}
    schema.setdefault("required", []).append("kind")
    return schema


def batch_json_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema of a columnar batch message of ``kind`` (see `perfloop.schemas.codec`)."""
    model = BATCH_KINDS[kind]
    fields = model.model_json_schema()["properties"]
    columns: dict[str, Any] = {}
    required = []
    for c in _SPECS[kind]:
        item = copy.deepcopy(fields[c.name])
        for key in ("title", "default", "description"):
            item.pop(key, None)
        columns[c.name] = {"type": "array", "items": item}
        if c.default is _MISSING:
            required.append(c.name)
    return {
        "$schema": _DRAFT,
        "$id": f"perfloop:batch/{kind}/v{model.SCHEMA_VERSION}",
        "title": f"{model.__name__} batch",
        "description": (
            f"Many {kind} samples of one node, column by column; every column holds one value "
            f"per sample. Sample i has event_id '<batch_id>-<i>'. At most {MAX_MESSAGE_BYTES} "
            "bytes per message."
        ),
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "schema_version", "job_id", "node", "batch_id", "columns"],
        "properties": {
            "kind": {"const": kind},
            "schema_version": {
                "type": "integer",
                "minimum": model.MIN_SCHEMA_VERSION,
                "maximum": model.SCHEMA_VERSION,
            },
            "job_id": fields["job_id"] | {"type": "string"},
            "node": {"type": "string", "minLength": 1, "maxLength": 255},
            "batch_id": {"type": "string", "minLength": 1, "maxLength": 255},
            "producer_id": {"type": "string"},
            "seq": {"type": "integer", "minimum": 0},
            "columns": {
                "type": "object",
                "additionalProperties": False,
                "required": required,
                "properties": columns,
            },
        },
    }


def export_json_schemas(directory: str | Path) -> list[Path]:
    """Write every schema under ``directory``; return the files written."""
    root = Path(directory)
    written: list[Path] = []
    index: dict[str, Any] = {}

    def write(rel: str, doc: dict[str, Any]) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        written.append(path)

    for kind, model in sorted((BATCH_KINDS | EVENT_KINDS).items()):
        v = model.SCHEMA_VERSION
        entry: dict[str, Any] = {
            "model": model.__name__,
            "schema_version": v,
            "min_schema_version": model.MIN_SCHEMA_VERSION,
            "event": f"event/{kind}.v{v}.json",
            "wire": "columnar batch" if kind in BATCH_KINDS else "one JSON object per message",
        }
        write(entry["event"], event_json_schema(model))
        if kind in BATCH_KINDS:
            entry["batch"] = f"batch/{kind}.v{v}.json"
            write(entry["batch"], batch_json_schema(kind))
        index[kind] = entry
    write("index.json", {"kinds": index})
    return written
