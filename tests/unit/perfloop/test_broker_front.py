"""The broker's front (`perfloop.stack._front`): what reaches the stack's address is relayed to
the broker process of the moment, and nothing relayed to one process ever reaches the next."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from perfloop.exceptions import StackError
from perfloop.stack._front import Front, free_port
from tests.helpers import Echo


def ask(port: int, what: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(what)
        return c.recv(1 << 16)


@pytest.fixture
def front() -> Iterator[Front]:
    f = Front("127.0.0.1", 0)
    f.start()
    yield f
    f.close()


def test_a_connection_is_relayed_byte_for_byte_to_the_broker_pointed_at(front: Front) -> None:
    a = Echo(b"a")
    front.point_at(a.port)
    assert ask(front.port, b"hello") == b"a:hello"
    big = bytes(range(256)) * 200  # more than one read
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as c:
        c.sendall(big)
        got = b""
        while len(got) < len(big) + 2:
            got += c.recv(1 << 16)
    assert got.startswith(b"a:") and got.replace(b"a:", b"") == big
    a.close()


def test_after_the_broker_is_replaced_only_the_new_one_answers(front: Front) -> None:
    a, b = Echo(b"a"), Echo(b"b")
    front.point_at(a.port)
    old = socket.create_connection(("127.0.0.1", front.port), timeout=5)
    old.sendall(b"x")
    assert old.recv(100) == b"a:x"
    front.point_at(b.port)  # a recycle: what was relayed to the old broker is closed
    assert old.recv(100) == b""
    old.close()
    assert ask(front.port, b"y") == b"b:y"
    a.close()
    b.close()


def test_a_connection_made_between_two_brokers_waits_for_the_next(front: Front) -> None:
    front.point_at(None)
    c = socket.create_connection(("127.0.0.1", front.port), timeout=5)
    c.sendall(b"early")
    b = Echo(b"b")
    threading.Timer(0.3, front.point_at, args=(b.port,)).start()
    assert c.recv(100) == b"b:early"  # held, not refused, and relayed once it could be
    c.close()
    b.close()


def test_a_broker_that_refuses_closes_the_connection_and_the_front_goes_on(front: Front) -> None:
    front.point_at(free_port("127.0.0.1"))  # nothing listens there
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as c:
        assert c.recv(100) == b""
    a = Echo(b"a")
    front.point_at(a.port)
    assert ask(front.port, b"z") == b"a:z"
    a.close()


def test_a_taken_address_is_one_line() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(StackError, match=r"cannot listen on 127\.0\.0\.1:\d+ for the broker"):
            Front("127.0.0.1", s.getsockname()[1])


def test_free_port_avoids_the_ports_given() -> None:
    first = free_port("127.0.0.1")
    assert free_port("127.0.0.1", avoid={first}) != first
