"""The `perfloop` command line.

`perfloop.cli.parser` builds the parser and dispatches (``main``); each command group's
bodies are a module of their own: `perfloop.cli.stack` (up, down, status, migrate, service,
dlq), `.demo`, `.query` (sql, schemas), `.run`, `.replay`, `.simulate`, `.sample`, `.config`,
`.plan`, `.recs` (recs, approve, reject).
"""

from perfloop.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
