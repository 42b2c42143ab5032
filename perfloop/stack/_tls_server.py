"""TLS for the embedded warehouse server (`perfloop.stack.warehouse_server`): the server's
context from its certificate and key, and each connection's handshake in its own thread."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

from perfloop.exceptions import WarehouseError

__all__ = ["HANDSHAKE_TIMEOUT_S", "handshake", "server_context"]

log = logging.getLogger("perfloop.stack.warehouse_server")

HANDSHAKE_TIMEOUT_S = 10.0
"""How long a client may take over its TLS handshake."""


def server_context(cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """TLS 1.2 or later with ``cert`` and ``key``; one `WarehouseError` line if they do not
    load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise WarehouseError(
            f"cannot load the warehouse's TLS certificate {cert} and key {key} "
            f"(PERFLOOP_CLICKHOUSE_TLS_CERT, _KEY): {getattr(e, 'strerror', None) or e}"
        ) from None
    return ctx


def handshake(request: Any, client_address: Any) -> bool:
    """Finish a deferred TLS handshake (the listening socket defers it, so a stalled client
    holds up no one else); False, with a line in the log, if the client fails it. A plain
    socket passes as it is."""
    if not isinstance(request, ssl.SSLSocket):
        return True
    try:
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        request.do_handshake()
        request.settimeout(None)
    except (ssl.SSLError, OSError) as e:
        log.info("TLS handshake with %s failed: %s", client_address[0], e)
        return False
    return True
