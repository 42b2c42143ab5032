"""The embedded broker's fronts beyond loopback (`perfloop up --listen ADDR`): TLS with a
client certificate required, relayed in the clear to the broker process on loopback.

tansu speaks plaintext only, so with ``--listen`` it listens on loopback and two kinds of
front stand at the stack's address, each a `TlsFront`: the bootstrap front at
``PERFLOOP_KAFKA_PORT`` (relayed to the broker of the moment, as `perfloop.stack._front` does
on loopback), and one per broker process at the port that process advertises in its
metadata, closed when the process ends (so a client that knew it is refused and bootstraps
again: `perfloop.stack._front` says why). Every byte of every client passes a front, so
unlike the loopback front these carry the telemetry itself; each runs an asyncio loop in a
thread of its own, where the TLS of all its connections is done (the handshake included,
within `HANDSHAKE_S`).

A client without a certificate the stack's CA signed fails the handshake and reaches nothing;
each such refusal is a line in the supervisor's log (one a minute per client address, with how
many more there were).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from perfloop.exceptions import StackError
from perfloop.stack._front import listening_socket

__all__ = ["HANDSHAKE_S", "TlsFront"]

HANDSHAKE_S = 10.0
"""How long a client may take over its TLS handshake."""
WAIT_S = 10.0
"""How long a connection that arrived with no broker to relay to waits for one."""
_CHUNK = 1 << 16
SAY_EVERY_S = 60.0
"""At most one line a minute per client address about its refused handshakes."""

log = logging.getLogger("perfloop.stack.supervisor")


class TlsFront:
    """Listens on ``host:port`` with ``context`` (a server context that requires a client
    certificate) and relays each connection to ``upstream:<the target port>`` (`point_at`)."""

    def __init__(
        self,
        host: str,
        port: int,
        context: ssl.SSLContext,
        upstream: str = "127.0.0.1",
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.host, self.upstream = host, upstream
        self._say = say or log.warning  # a line for the supervisor's log
        self._sock = listening_socket(host, port)
        self.port = int(self._sock.getsockname()[1])
        self._context = context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"perfloop-tls-front-{self.port}", daemon=True
        )
        self._target: int | None = None
        self._pointed: asyncio.Event | None = None  # set when a target is given
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None
        self.relayed = 0
        """Connections relayed so far."""
        self.refused = 0
        """Connections whose TLS handshake failed (no certificate the CA signed, no TLS)."""
        self._said: dict[str, tuple[float, int]] = {}  # address -> (last line, refused since)
        self._tasks: set[asyncio.Future[None]] = set()  # each connection's, held while it runs

    def start(self) -> None:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        try:
            fut.result(timeout=10)
        except Exception as e:
            self.close()
            raise StackError(f"cannot serve TLS on {self.host}:{self.port}: {e}") from e

    def point_at(self, port: int | None) -> None:
        """Relay new connections to ``port`` (None: hold them until the next broker); those
        relayed before are closed (their broker is gone)."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._point(port), self._loop).result(timeout=10)
        else:
            self._target = port

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()
        self._sock.close()

    # -- in the front's loop ---------------------------------------------------------------
    async def _serve(self) -> None:
        self._pointed = asyncio.Event()
        if self._target is not None:
            self._pointed.set()
        # TLS is started in `_handle`, so that a failed handshake is seen and said
        self._server = await asyncio.start_server(self._accepted, sock=self._sock)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Called as the connection is made, before anything is read: reading waits for the
        TLS handshake (bytes read before it would never reach it)."""
        writer.transport.pause_reading()
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _point(self, port: int | None) -> None:
        self._target = port
        for pair in list(self._pairs):
            for w in pair:
                w.close()
        self._pairs.clear()
        assert self._pointed is not None
        if port is None:
            self._pointed.clear()
        else:
            self._pointed.set()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._point(None)
        # the connections end with their sockets closed; one still in its handshake is cut
        if self._tasks:
            _, left = await asyncio.wait(set(self._tasks), timeout=2)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def cpu_s(self) -> float:
        """CPU seconds the front's thread has used (its TLS and relaying)."""
        if not self._thread.is_alive():
            return 0.0

        async def now() -> float:
            return time.thread_time()

        return float(asyncio.run_coroutine_threadsafe(now(), self._loop).result(timeout=10))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._pointed is not None
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        try:
            await asyncio.wait_for(writer.start_tls(self._context), HANDSHAKE_S)
        except (OSError, TimeoutError, EOFError) as e:
            self._refuse(peer, e)
            writer.close()
            return
        try:
            await asyncio.wait_for(self._pointed.wait(), WAIT_S)
            target = self._target
            if target is None:
                raise TimeoutError
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.upstream, target), 2.0
            )
        except (OSError, TimeoutError):  # no broker: the client tries again
            writer.close()
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = (writer, up_writer)
        self._pairs.add(pair)
        self.relayed += 1
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            self._pairs.discard(pair)
            for w in pair:
                w.close()

    def _refuse(self, peer: str, why: BaseException) -> None:
        self.refused += 1
        now = time.monotonic()
        last, since = self._said.get(peer, (-SAY_EVERY_S, 0))
        if now - last < SAY_EVERY_S:
            self._said[peer] = (last, since + 1)
            return
        more = f" (and {since} more since the last line)" if since else ""
        what = getattr(why, "reason", None) or type(why).__name__
        self._say(
            f"broker front {self.host}:{self.port} refused a client at {peer}: "
            f"TLS handshake failed ({what}){more}"
        )
        self._said[peer] = (now, 0)
        if len(self._said) > 10_000:  # many addresses: forget the oldest lines
            for key in list(self._said)[:5_000]:
                del self._said[key]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either ends; then close ``writer`` (so the other
    direction ends too)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()
