"""The embedded stack beyond loopback (`perfloop up --listen`): its certificates and password
(`perfloop.stack.listen`), its TLS fronts (`perfloop.stack._tls_front`), a node's bundle, and
the settings a process on the stack's machine reaches it with (`perfloop.listening`)."""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from perfloop.exceptions import StackError
from perfloop.listening import ListenFiles, reach_listening_stack
from perfloop.settings import StackSettings
from perfloop.stack._tls_front import TlsFront
from perfloop.stack.listen import client_bundle, listen_settings, prepare, server_context
from tests.helpers import Echo, clean_env  # noqa: F401 (fixture)
from tests.tls import make_pki

pytestmark = pytest.mark.usefixtures("clean_env")


def _sans(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(
        san.get_values_for_type(x509.DNSName)
    )


def test_the_files_are_made_once_and_kept(tmp_path: Path) -> None:
    files = prepare(tmp_path, "10.1.2.3", 19092, 18123)
    assert _sans(files.server_cert) == {"10.1.2.3", "127.0.0.1", "localhost"}
    for secret in (files.ca_key, files.server_key, files.stack_key, files.password):
        assert secret.stat().st_mode & 0o077 == 0, f"{secret.name} is readable by others"
    before = {p.name: p.read_bytes() for p in files.dir.iterdir() if p.name != "listen.json"}
    prepare(tmp_path, "10.1.2.3", 19092, 18123)
    after = {p.name: p.read_bytes() for p in files.dir.iterdir() if p.name != "listen.json"}
    assert after == before


def test_another_address_gets_a_new_server_certificate_from_the_same_ca(tmp_path: Path) -> None:
    files = prepare(tmp_path, "10.1.2.3", 19092, 18123)
    ca, password = files.ca.read_bytes(), files.password.read_text()
    prepare(tmp_path, "node7.example", 19092, 18123)
    assert "node7.example" in _sans(files.server_cert)
    assert files.ca.read_bytes() == ca and files.password.read_text() == password


def test_a_chosen_password_replaces_the_made_one(tmp_path: Path) -> None:
    files = prepare(tmp_path, "10.1.2.3", 19092, 18123)
    assert len(files.password.read_text()) >= 24
    prepare(tmp_path, "10.1.2.3", 19092, 18123, password="chosen")
    assert files.password.read_text() == "chosen"


def test_listen_settings_give_the_services_tls_and_the_password(tmp_path: Path) -> None:
    s = StackSettings(home=tmp_path, listen="10.1.2.3")
    listen = listen_settings(s)
    out = s.model_copy(update=listen.fields)
    assert out.kafka_bootstrap == "10.1.2.3:19092"
    assert out.clickhouse_url == "https://10.1.2.3:18123"
    assert out.kafka_security_protocol == "SSL" and out.kafka_ssl_cert is not None
    assert listen.env["PERFLOOP_CLICKHOUSE_PASSWORD"] == out.clickhouse_password.get_secret_value()
    assert listen.env["PERFLOOP_KAFKA_SSL_KEY"] == str(tmp_path / "listen" / "stack.key")


def test_a_running_stacks_files_are_left_alone(tmp_path: Path) -> None:
    files = prepare(tmp_path, "10.1.2.3", 19092, 18123)
    before = {p.name: p.read_bytes() for p in files.dir.iterdir()}
    (tmp_path / "stack.json").write_text(json.dumps({"supervisor_pid": os.getpid()}))
    with pytest.raises(StackError, match="already up"):
        listen_settings(StackSettings(home=tmp_path, listen="10.9.9.9"))
    assert {p.name: p.read_bytes() for p in files.dir.iterdir()} == before


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_address_is_refused(tmp_path: Path, wildcard: str) -> None:
    with pytest.raises(StackError, match="not a wildcard"):
        listen_settings(StackSettings(home=tmp_path, listen=wildcard))


def test_an_embedded_stack_beyond_loopback_without_listen_is_refused(tmp_path: Path) -> None:
    s = StackSettings(home=tmp_path, host="10.1.2.3")
    with pytest.raises(StackError, match=r"perfloop up --listen 10\.1\.2\.3"):
        listen_settings(s).check(s)
    listen_settings(StackSettings(home=tmp_path)).check(StackSettings(home=tmp_path))
    remote = StackSettings(
        home=tmp_path,
        host="10.1.2.3",
        kafka_bootstrap_override="kafka:9092",
        clickhouse_url_override="https://ch:8443",
    )
    listen_settings(remote).check(remote)  # nothing embedded listens: nothing to refuse


def test_listen_with_an_external_broker_is_refused(tmp_path: Path) -> None:
    s = StackSettings(home=tmp_path, listen="10.1.2.3", kafka_bootstrap_override="kafka:9092")
    with pytest.raises(StackError, match="serves the embedded broker and warehouse"):
        listen_settings(s).check(s)


def test_a_node_bundle_holds_a_client_certificate_and_no_password_by_default(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    files = prepare(home, "10.1.2.3", 19092, 18123)
    (home / "keys").mkdir()
    (home / "keys" / "commands.json").write_text('{"keys": []}')
    (home / "keys" / "roster.json").write_text('{"principals": []}')
    env = client_bundle(home, "node-1", tmp_path / "node-1")
    lines = dict(line.split("=", 1) for line in env.read_text().splitlines())
    assert lines["PERFLOOP_KAFKA_BOOTSTRAP"] == "10.1.2.3:19092"
    assert lines["PERFLOOP_KAFKA_SECURITY_PROTOCOL"] == "SSL"
    assert lines["PERFLOOP_BROKER_KEEPS_LOG"] == "false"  # its clients know it restarts empty
    assert Path(lines["PERFLOOP_COMMAND_KEYRING"]).read_text() == '{"keys": []}'
    assert Path(lines["PERFLOOP_ROSTER"]).read_text() == '{"principals": []}'
    assert not any(k.startswith("PERFLOOP_CLICKHOUSE") for k in lines)
    cert = x509.load_pem_x509_certificate(Path(lines["PERFLOOP_KAFKA_SSL_CERT"]).read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.rfc4514_string() == "CN=node-1"
    assert env.stat().st_mode & 0o077 == 0
    with_password = client_bundle(home, "laptop", tmp_path / "laptop", warehouse=True)
    assert files.password.read_text() in with_password.read_text()


def test_a_bundle_without_a_listening_stack_or_with_a_bad_name_is_one_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(StackError, match="perfloop up --listen ADDR"):
        client_bundle(tmp_path, "node-1", tmp_path / "out")
    prepare(tmp_path, "10.1.2.3", 19092, 18123)
    with pytest.raises(StackError, match="letters, digits"):
        client_bundle(tmp_path, "../etc", tmp_path / "out")


def test_a_process_of_the_stacks_machine_reaches_it_only_while_it_runs(tmp_path: Path) -> None:
    files = prepare(tmp_path, "10.1.2.3", 29092, 28123)
    plain = StackSettings(home=tmp_path)
    assert reach_listening_stack(plain) is plain  # no supervisor recorded
    info = json.loads(files.info.read_text())
    files.info.write_text(json.dumps(info | {"supervisor_pid": os.getpid()}))
    reached = reach_listening_stack(plain)
    assert reached.kafka_bootstrap == "10.1.2.3:29092" and reached.kafka_ssl_cert is not None
    assert reached.clickhouse_url == "https://10.1.2.3:28123"
    own = StackSettings(home=tmp_path, kafka_security_protocol="SASL_SSL",
                        kafka_sasl_username="u", kafka_sasl_password="p")  # fmt: skip
    assert reach_listening_stack(own) is own  # settings of its own come first
    files.info.write_text(json.dumps(info | {"supervisor_pid": _dead_pid()}))
    assert reach_listening_stack(plain) is plain


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# -- the TLS fronts --------------------------------------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> ListenFiles:
    return prepare(tmp_path, "127.0.0.1", 19092, 18123)


@pytest.fixture
def front(pki: ListenFiles) -> Iterator[TlsFront]:
    f = TlsFront("127.0.0.1", 0, server_context(pki))
    f.start()
    yield f
    f.close()


def _client(
    pki: ListenFiles, cert: Path | None, key: Path | None, ca: Path | None = None
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca or pki.ca))
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _ask(port: int, ctx: ssl.SSLContext, what: bytes) -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as c,
    ):
        c.sendall(what)
        return c.recv(1 << 16)


def test_a_client_with_the_stacks_certificate_is_relayed_in_the_clear(
    pki: ListenFiles, front: TlsFront
) -> None:
    a = Echo(b"a")
    front.point_at(a.port)
    ctx = _client(pki, pki.stack_cert, pki.stack_key)
    assert _ask(front.port, ctx, b"hello") == b"a:hello"
    # 300 kB with no "a" or ":" in it: what comes back, less the echo's prefixes, is it
    big = bytes(b for b in os.urandom(400_000) if b not in b"a:")[:300_000]
    with (
        socket.create_connection(("127.0.0.1", front.port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as c,
    ):
        c.sendall(big)
        got = b""
        while len(got.replace(b"a:", b"")) < len(big) and (chunk := c.recv(1 << 16)):
            got += chunk
    assert got.replace(b"a:", b"") == big
    assert front.relayed == 2
    a.close()


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_a_client_without_a_certificate_the_stack_signed_reaches_nothing(
    tmp_path: Path, pki: ListenFiles, front: TlsFront, who: str
) -> None:
    a = Echo(b"a")
    front.point_at(a.port)
    if who == "no certificate":
        ctx = _client(pki, None, None)
    else:
        other = make_pki(tmp_path / "other", "intruder")
        ctx = _client(pki, other.cert, other.key)
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        reply = _ask(front.port, ctx, b"hello")
        if not reply:  # TLS 1.3: the refusal can come after the client's handshake ends
            raise ConnectionError("closed")
    assert front.relayed == 0
    a.close()


def test_a_plaintext_client_reaches_nothing_and_refusals_are_said_once_a_minute(
    front: TlsFront, caplog: pytest.LogCaptureFixture
) -> None:
    a = Echo(b"a")
    front.point_at(a.port)
    caplog.set_level(logging.WARNING, logger="perfloop.stack.supervisor")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", front.port), timeout=5) as c:
            c.sendall(b"\x00\x00\x00\x10plaintext kafka")
            c.settimeout(5)
            assert not c.recv(1 << 16).startswith(b"a:")
    deadline = time.monotonic() + 5
    while front.refused < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (front.relayed, front.refused) == (0, 3)
    lines = [r.getMessage() for r in caplog.records if "refused a client" in r.getMessage()]
    assert len(lines) == 1, lines  # the next two within the minute: counted, not said
    assert f"broker front 127.0.0.1:{front.port} refused a client at 127.0.0.1" in lines[0]
    assert "TLS handshake failed" in lines[0]
    a.close()


def test_pointing_elsewhere_closes_the_relayed_connections_and_waits_between(
    pki: ListenFiles, front: TlsFront
) -> None:
    a, b = Echo(b"a"), Echo(b"b")
    front.point_at(a.port)
    ctx = _client(pki, pki.stack_cert, pki.stack_key)
    with (
        socket.create_connection(("127.0.0.1", front.port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as c,
    ):
        c.sendall(b"1")
        assert c.recv(64) == b"a:1"
        front.point_at(None)
        assert c.recv(64) == b""  # closed: its broker is gone
    front.point_at(b.port)
    assert _ask(front.port, ctx, b"2") == b"b:2"
    a.close()
    b.close()


def test_a_taken_address_is_one_line(pki: ListenFiles, front: TlsFront) -> None:
    with pytest.raises(StackError, match=r"cannot listen on 127\.0\.0\.1"):
        TlsFront("127.0.0.1", front.port, server_context(pki))
