"""``perfloop sql QUERY`` against the warehouse, and ``perfloop schemas export DIR``.

``perfloop sql`` takes what a ClickHouse client takes: one statement or several separated by
``;`` (run in order; a failure stops the rest and says which statement failed and how many
ran), a statement ending in ``FORMAT <name>`` (the server's own output, written as it comes),
and statements that return no rows (DDL, ``INSERT … VALUES``, ``SYSTEM``, ``OPTIMIZE``: ``ok``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from perfloop.exceptions import ConfigError, WarehouseError
from perfloop.settings import load_settings

__all__ = ["explicit_format", "returns_rows", "schemas_command", "split_statements", "sql_command"]

# statements that answer with rows (the others are run as commands: DDL, INSERT, SYSTEM, …)
_ROWS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS", "VALUES"})
_FORMAT_AT_END = re.compile(r"\bFORMAT\s+([A-Za-z][A-Za-z0-9_]*)\s*$", re.IGNORECASE)


def _blank(sql: str) -> tuple[str, list[int]]:
    """``sql`` with the insides of its quoted strings, quoted names and comments turned to
    spaces (so keywords and ``;`` are found only in the statement's own text), and the
    positions of its top-level ``;``."""
    out, cuts = list(sql), []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = i + 1
            while j < n:
                if sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:  # a doubled quote inside
                        j += 2
                        continue
                    break
                j += 1
            out[i + 1 : min(j, n)] = " " * (min(j, n) - i - 1)
            i = j + 1
        elif sql.startswith("--", i) or c == "#":  # a comment to the end of the line
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = " " * (j - i)
            i = j
        else:
            if c == ";":
                cuts.append(i)
            i += 1
    return "".join(out), cuts


def split_statements(sql: str) -> list[str]:
    """The statements of ``sql``, split at the ``;`` outside strings and comments, each
    stripped; empty ones (``;;``, a trailing ``;``, only a comment) dropped.

    >>> split_statements("SELECT 1; SELECT ';' AS semi -- a ; in a comment\\n;")
    ['SELECT 1', "SELECT ';' AS semi -- a ; in a comment"]
    >>> split_statements("  ;  /* nothing */ ")
    []
    """
    blank, cuts = _blank(sql)
    out, start = [], 0
    for cut in [*cuts, len(sql)]:
        if blank[start:cut].strip():
            out.append(sql[start:cut].strip())
        start = cut + 1
    return out


def explicit_format(statement: str) -> str | None:
    """The output format a statement asks for itself (``… FORMAT JSON``), or None.

    >>> explicit_format("SELECT 1 FORMAT JSONEachRow"), explicit_format("SELECT 'FORMAT CSV'")
    ('JSONEachRow', None)
    """
    m = _FORMAT_AT_END.search(_blank(statement)[0])
    return m.group(1) if m else None


def returns_rows(statement: str) -> bool:
    """Whether a statement answers with rows (SELECT, WITH, SHOW, DESCRIBE, EXPLAIN, EXISTS,
    or a parenthesised query); DDL, INSERT and the other commands do not.

    >>> returns_rows("(SELECT 1) UNION ALL (SELECT 2)"), returns_rows("/* x */ show tables")
    (True, True)
    >>> returns_rows("CREATE TABLE t (x Int8) ENGINE = Memory")
    False
    """
    text = _blank(statement)[0].lstrip()  # comments blanked: the first word is the statement's
    if text.startswith("("):
        return True
    word = re.match(r"[A-Za-z]+", text)
    return bool(word) and word.group(0).upper() in _ROWS


def sql_command(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from perfloop.demo import format_table
    from perfloop.settings import StackSettings
    from perfloop.warehouse.access import client, query_error

    statements = split_statements(args.query)
    if not statements:
        raise ConfigError("empty query: give one SQL statement or several separated by ';'")
    ch = client(load_settings(StackSettings))
    ran = 0
    try:
        for i, statement in enumerate(statements):
            if i and args.format == "table":
                print()
            try:
                if explicit_format(statement):
                    sys.stdout.buffer.write(ch.raw_query(statement))
                    sys.stdout.flush()
                elif returns_rows(statement):
                    r = ch.query(statement)
                    if args.format == "json":
                        for row in r.result_rows:
                            print(
                                json.dumps(dict(zip(r.column_names, row, strict=True)), default=str)
                            )
                    else:
                        print(format_table(list(r.column_names), r.result_rows))
                else:
                    ch.command(statement)
                    if args.format == "table":
                        print("ok")
            except ClickHouseError as e:
                where = (
                    f"statement {i + 1} of {len(statements)} ({ran} ran before it): "
                    if len(statements) > 1
                    else ""
                )
                raise WarehouseError(where + query_error(e)) from e
            ran += 1
    finally:
        ch.close()
    return 0


def schemas_command(args: argparse.Namespace) -> int:
    from perfloop.schemas import export_json_schemas

    try:
        files = export_json_schemas(args.dir)
    except OSError as e:
        raise ConfigError(f"cannot write schemas to {args.dir}: {e.strerror or e}") from e
    print(f"wrote {len(files)} JSON Schema files to {args.dir}")
    return 0
