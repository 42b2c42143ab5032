"""Moved: the embedded warehouse server is the stack's, `perfloop.stack.warehouse_server`
(``python -m perfloop.stack.warehouse_server``). These names warn and keep working for one
release, and ``python -m perfloop.chserver`` still runs the server."""

import sys

from perfloop.deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__, {n: "perfloop.stack.warehouse_server" for n in ("WarehouseServer", "main")}
)

if __name__ == "__main__":
    from perfloop.stack.warehouse_server import main

    sys.exit(main())
