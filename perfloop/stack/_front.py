"""The embedded broker's front: its public address, relayed to the broker process of the moment.

Each broker process the supervisor starts (the first, one after a crash, one after a recycle:
`perfloop.stack._recycle`) listens on a port of its own and advertises that port in its
metadata. Clients bootstrap at the stack's address (``PERFLOOP_KAFKA_PORT``), where this front
relays each connection byte for byte to the broker of the moment, and then reach the broker at
the port its metadata gives, directly. So what a client learned of one broker process (its
address, its topics' ids) never leads it to the next one: the old address refuses, and the
client asks the front for metadata again, which comes from the new broker.

Why: a new broker process is a new cluster whose topics have new ids. A librdkafka client that
reconnected to the old address and fetched before it refreshed its metadata asked the new
broker for topics by ids it does not know; tansu answers an unknown topic with a current
leader (node 0) and a zero topic id, and librdkafka 2.16's handling of that leader hint
(``rd_kafka_metadata_update_op`` looking the topic up by a name it does not have) crashed the
process with SIGSEGV: the sink and the stream worker crashed at recycles in soaks, and a job's
control consumer runs inside the training process.

The front relays only what reaches the stack's address: bootstrap and metadata requests, a few
a minute per client. A connection that arrives while no broker is pointed at (between two
broker processes) waits up to ``WAIT_S`` for the next one instead of being refused.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time

from perfloop.exceptions import StackError

__all__ = ["WAIT_S", "Front", "free_port", "listening_socket"]

WAIT_S = 10.0
"""How long a connection that arrived with no broker to relay to waits for one."""
_CHUNK = 1 << 16


def free_port(host: str, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A port on ``host`` nothing listens on now, not one of ``avoid``."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise StackError(f"no free port on {host} for the broker")


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on ``host:port`` for the broker's clients; one
    `StackError` line if the address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StackError(f"cannot listen on {host}:{port} for the broker: {e.strerror}") from e
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Front:
    """Listens on ``host:port`` and relays each connection to ``host:<the broker's port>``
    (`point_at`), in one thread.

    >>> front = Front("127.0.0.1", 0)
    >>> front.start(); front.point_at(None); front.close()
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self._listener = listening_socket(host, port)
        self.port = int(self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._lock = threading.Lock()
        self._target: int | None = None
        self._pointed = False  # a new target waits to be taken by the relay thread
        self._peers: dict[socket.socket, socket.socket] = {}  # both directions
        self._waiting: list[tuple[socket.socket, float]] = []  # arrived with no target
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perfloop-broker-front", daemon=True)
        self.relayed = 0
        """Connections relayed so far."""

    def start(self) -> None:
        self._thread.start()

    def point_at(self, port: int | None) -> None:
        """Relay new connections to ``port`` (None: hold them until the next broker); the
        connections relayed to the broker before are closed (it is gone)."""
        with self._lock:
            self._target = port
            self._pointed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(5)
        for s in [*self._peers, *(w for w, _ in self._waiting)]:
            s.close()
        self._peers.clear()
        self._waiting.clear()
        self._sel.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    # -- the relay thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            events = self._sel.select(timeout=0.5)
            # The target is taken once a turn, before anything is relayed: a connection made
            # this turn goes to it, and one made to an earlier target is closed first.
            with self._lock:
                pointed, target = self._pointed, self._target
                self._pointed = False
            if pointed:
                self._drop_all()
            for key, _ in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept(target)
                elif sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                elif sock in self._peers:
                    self._relay(sock)
            if target is not None and self._waiting:
                waiting, self._waiting = self._waiting, []
                for client, _ in waiting:
                    self._connect(client, target)
            now = time.monotonic()
            for client, since in [w for w in self._waiting if now - w[1] > WAIT_S]:
                self._waiting.remove((client, since))
                client.close()

    def _accept(self, target: int | None) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:  # nothing after all, or out of descriptors: the client retries
            return
        if target is None:
            self._waiting.append((client, time.monotonic()))
        else:
            self._connect(client, target)

    def _connect(self, client: socket.socket, port: int) -> None:
        try:
            upstream = socket.create_connection((self.host, port), timeout=2.0)
        except OSError:  # the broker went away meanwhile: the client tries again
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(True)
            s.settimeout(5.0)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[client], self._peers[upstream] = upstream, client
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(upstream, selectors.EVENT_READ)
        self.relayed += 1

    def _relay(self, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(_CHUNK)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peers.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            s.close()

    def _drop_all(self) -> None:
        for sock in list(self._peers):
            if sock in self._peers:
                self._drop(sock)
