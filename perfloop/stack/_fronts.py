"""Where the embedded broker's clients reach it: the supervisor's view of its fronts.

On loopback (the default) the bootstrap front is a plain relay (`perfloop.stack._front`) and
each broker process listens on, and advertises, a loopback port of its own. With
``--listen ADDR`` every front ends TLS and requires a client certificate
(`perfloop.stack._tls_front`): the bootstrap front at ``ADDR:PERFLOOP_KAFKA_PORT``, and one
per broker process at the ``ADDR`` port that process advertises, relaying to the loopback
port it listens on; that front closes when its broker ends.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

from perfloop.stack._front import Front, free_port
from perfloop.stack._tls_front import TlsFront

__all__ = ["BrokerFronts"]

LOOPBACK = "127.0.0.1"


def _open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class BrokerFronts:
    """The bootstrap front and each broker process's ports.

    ``context`` None: loopback, at ``host``; else the fronts serve TLS with it at ``host``
    and the broker processes listen on 127.0.0.1."""

    def __init__(
        self,
        host: str,
        port: int,
        context: ssl.SSLContext | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.host, self.port, self._context, self._say = host, port, context, say
        self._bootstrap: Front | TlsFront | None = None
        self.advertised: list[int] = []
        """Each broker process's advertised port, in order (the last is the current one)."""
        self._listens: dict[int, int] = {}  # advertised port -> the port its broker listens on
        self._tls: dict[int, TlsFront] = {}  # advertised port -> its front (with ``--listen``)

    def start(self) -> None:
        if self._context is None:
            self._bootstrap = Front(self.host, self.port)
        else:
            self._bootstrap = TlsFront(self.host, self.port, self._context, say=self._say)
        self._bootstrap.start()

    def next_broker(self) -> tuple[str, str]:
        """The next broker process's listener and advertised URLs, at ports no broker of
        this stack had, so a client that knew an earlier one is refused there. The fronts of
        earlier broker processes are closed."""
        self.broker_gone()
        avoid = {self.port, *self.advertised}
        advertised = free_port(self.host, avoid=avoid)
        listen = advertised
        if self._context is not None:
            listen = free_port(LOOPBACK, avoid=avoid | set(self._listens.values()) | {advertised})
            front = TlsFront(self.host, advertised, self._context, say=self._say)
            front.start()
            front.point_at(listen)
            self._tls[advertised] = front
        self.advertised.append(advertised)
        self._listens[advertised] = listen
        on = LOOPBACK if self._context is not None else self.host
        return f"tcp://{on}:{listen}", f"tcp://{_url_host(self.host)}:{advertised}"

    def broker_ready(self) -> bool:
        """Whether the current broker process accepts connections on its port."""
        if not self.advertised:
            return False
        listen = self._listens[self.advertised[-1]]
        return _open(LOOPBACK if self._context is not None else self.host, listen)

    def point_at(self, advertised: int | None) -> None:
        """The bootstrap front relays to the broker advertising ``advertised`` (None: new
        connections wait for the next one)."""
        if self._bootstrap is not None:
            target = None if advertised is None else self._listens[advertised]
            self._bootstrap.point_at(target)

    def broker_gone(self) -> None:
        """The broker processes so far have ended: their fronts close."""
        for front in self._tls.values():
            front.close()
        self._tls.clear()

    def close(self) -> None:
        self.broker_gone()
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None
