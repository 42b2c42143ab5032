"""``perfloop sql QUERY`` against the warehouse, and ``perfloop schemas export DIR``."""

from __future__ import annotations

import argparse
import json

from perfloop.exceptions import ConfigError
from perfloop.settings import load_settings

__all__ = ["schemas_command", "sql_command"]


def sql_command(args: argparse.Namespace) -> int:
    from perfloop.demo import format_table
    from perfloop.settings import StackSettings
    from perfloop.warehouse import query

    r = query(load_settings(StackSettings), args.query)
    if args.format == "json":
        for row in r.result_rows:
            print(json.dumps(dict(zip(r.column_names, row, strict=True)), default=str))
    else:
        print(format_table(list(r.column_names), r.result_rows))
    return 0


def schemas_command(args: argparse.Namespace) -> int:
    from perfloop.schemas import export_json_schemas

    try:
        files = export_json_schemas(args.dir)
    except OSError as e:
        raise ConfigError(f"cannot write schemas to {args.dir}: {e.strerror or e}") from e
    print(f"wrote {len(files)} JSON Schema files to {args.dir}")
    return 0
