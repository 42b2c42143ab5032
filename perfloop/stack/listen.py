"""The embedded stack beyond loopback (`perfloop up --listen ADDR`): its certificates, its
warehouse password, and the bundle a node gets to reach it.

Made under ``$PERFLOOP_HOME/listen`` at the first start with ``--listen`` and kept:

- ``ca.pem``/``ca.key``: the stack's own certificate authority (ECDSA P-256). It signs the
  server certificate and every client certificate; the broker's fronts and the warehouse
  trust it alone.
- ``server.pem``/``server.key``: the certificate of the broker's fronts and of the warehouse,
  for ``ADDR`` (an IP address or a DNS name; made again when ``ADDR`` changes or it nears its
  end).
- ``stack.pem``/``stack.key``: the client certificate of the stack's own services.
- ``clickhouse.password``: the warehouse's password (random; give `PERFLOOP_CLICKHOUSE_PASSWORD`
  to choose one).
- ``listen.json``: the address and ports, for `issue_client`.

The broker (tansu) speaks plaintext only, so it listens on loopback, and what reaches the
stack's address goes through fronts that end TLS and require a client certificate the stack's
CA signed (`perfloop.stack._tls_front`). The warehouse serves HTTPS itself and asks for the
password on every query (`perfloop.stack.warehouse_server`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import secrets
import shutil
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import SecretStr

from perfloop.exceptions import StackError
from perfloop.listening import ListenFiles, stack_fields
from perfloop.stack.control import _alive, read_state

__all__ = [
    "Listen",
    "client_bundle",
    "is_loopback",
    "listen_settings",
    "mark_running",
    "prepare",
    "server_context",
]

CA_DAYS = 3650
CERT_DAYS = 397
RENEW_DAYS = 30
"""A server or stack certificate this close to its end is made again at the next start."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("10.0.0.5")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def _load_ca(files: ListenFiles) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not files.ca.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("perfloop stack CA"))
            .issuer_name(_name("perfloop stack CA"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(files.ca_key, key)
        files.ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    try:
        cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
        key = serialization.load_pem_private_key(files.ca_key.read_bytes(), None)
    except (OSError, ValueError) as e:
        raise StackError(f"cannot read the stack's CA in {files.dir}: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise StackError(f"{files.ca_key} is not the stack CA's EC key")
    return cert, key


def _issue(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    common: str,
    cert_path: Path,
    key_path: Path,
    *,
    server_names: list[str] | None = None,
) -> None:
    """A certificate the CA signs: for a server (``server_names``: its DNS names and IP
    addresses) or, without them, for a client whose name is ``common``."""
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if server_names is not None:
        sans: list[x509.GeneralName] = []
        for n in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        builder = builder.add_extension(
            x509.SubjectAlternativeName(sans), critical=False
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _usable(path: Path, names: list[str] | None = None) -> bool:
    """Whether the certificate at ``path`` exists, is not near its end and (for a server)
    names every one of ``names``."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return False
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < dt.timedelta(days=RENEW_DAYS):
        return False
    if names is None:
        return True
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    have = {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    have |= set(san.get_values_for_type(x509.DNSName))
    return all(str(ipaddress.ip_address(n)) in have if _is_ip(n) else n in have for n in names)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def prepare(
    home: Path, addr: str, kafka_port: int, clickhouse_port: int, password: str = ""
) -> ListenFiles:
    """Make what is missing or stale of the stack's listen files under ``home/listen``;
    ``password``, where the environment chose one, replaces the warehouse's."""
    files = ListenFiles.of(home)
    files.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = _load_ca(files)
    names = [addr] if addr in ("localhost", "127.0.0.1") else [addr, "localhost", "127.0.0.1"]
    if not _usable(files.server_cert, names):
        _issue(ca, addr, files.server_cert, files.server_key, server_names=names)
    if not _usable(files.stack_cert):
        _issue(ca, "perfloop-stack", files.stack_cert, files.stack_key)
    if password or not files.password.exists():
        fd = os.open(files.password, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password or secrets.token_urlsafe(24))
    info = {"addr": addr, "kafka_port": kafka_port, "clickhouse_port": clickhouse_port}
    with contextlib.suppress(OSError, ValueError):  # the supervisor's pid, where it runs
        old = json.loads(files.info.read_text())
        if old.get("addr") == addr:
            info["supervisor_pid"] = old.get("supervisor_pid")
    files.info.write_text(json.dumps(info))
    return files


def mark_running(files: ListenFiles, pid: int | None) -> None:
    """Write (or, with None, clear) the listening supervisor's pid in ``listen.json``:
    processes on this machine reach the stack with its client settings while it runs
    (`perfloop.listening.reach_listening_stack`)."""
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(files.info.read_text())
        info["supervisor_pid"] = pid
        files.info.write_text(json.dumps(info))


@dataclass(frozen=True)
class Listen:
    """What ``--listen`` changes for the supervisor (nothing, without it)."""

    addr: str | None = None
    files: ListenFiles | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    """The settings it replaces: the address, mutual TLS to the broker with the stack's client
    certificate, HTTPS and the password at the warehouse."""
    env: dict[str, str] = field(default_factory=dict)
    """The same as the environment of the stack's services."""

    def check(self, settings: Any) -> None:
        """One `StackError` line where the embedded broker or warehouse would listen beyond
        loopback without TLS and authentication, or ``--listen`` cannot work."""
        embedded = not settings.external_kafka or not settings.external_clickhouse
        if self.addr is None:
            if embedded and not is_loopback(settings.host):
                raise StackError(
                    f"PERFLOOP_HOST={settings.host} is not a loopback address, and the embedded "
                    "broker and warehouse have no TLS or authentication there: use "
                    f"`perfloop up --listen {settings.host}`"
                )
            return
        if settings.external_kafka or settings.external_clickhouse:
            raise StackError(
                "--listen (PERFLOOP_LISTEN) serves the embedded broker and warehouse; with "
                "PERFLOOP_KAFKA_BOOTSTRAP or PERFLOOP_CLICKHOUSE_URL secure them where they run"
            )

    def running(self, pid: int | None) -> None:
        """The supervisor runs as ``pid`` (None: it stopped): `mark_running`."""
        if self.files is not None:
            mark_running(self.files, pid)

    def context(self) -> ssl.SSLContext | None:
        return None if self.files is None else server_context(self.files)


def listen_settings(settings: Any) -> Listen:
    """`Listen` for the settings' ``listen`` address; its files made where missing."""
    addr = getattr(settings, "listen", None)
    if not addr:
        return Listen()
    if addr in ("0.0.0.0", "::", "*"):
        raise StackError(
            f"--listen {addr}: give the address the other nodes reach this machine at (its "
            "certificate and the broker's metadata name it), not a wildcard"
        )
    running = read_state(settings)
    if running and _alive(running["supervisor_pid"]):  # its files are not to be touched
        raise StackError(
            f"the stack is already up (supervisor pid {running['supervisor_pid']}, home "
            f"{settings.home_dir}); run `perfloop down` first"
        )
    files = prepare(
        settings.home_dir,
        addr,
        settings.kafka_port,
        settings.clickhouse_port,
        settings.clickhouse_password.get_secret_value(),
    )
    fields = stack_fields(files, addr)
    env = {
        f"PERFLOOP_{k.upper()}": v.get_secret_value() if isinstance(v, SecretStr) else str(v)
        for k, v in fields.items()
    }
    return Listen(addr, files, fields, env)


def server_context(files: ListenFiles) -> ssl.SSLContext:
    """The broker fronts' TLS: the server certificate, TLS 1.2 or later, and a client
    certificate the stack's CA signed required of every client."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(files.server_cert), str(files.server_key))
        ctx.load_verify_locations(cafile=str(files.ca))
    except (OSError, ssl.SSLError) as e:
        raise StackError(f"cannot load the stack's TLS files in {files.dir}: {e}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_bundle(home: Path, name: str, out: Path, *, warehouse: bool = False) -> Path:
    """Issue a client certificate ``name`` and write, under ``out``, what a node needs to
    reach the stack: the CA, the certificate and its key, the command keyring and the roster
    (its jobs then take only commands the stack's actuator signed, and sampling changes its
    principals signed) and ``perfloop.env``, the settings to
    source. With ``warehouse`` the env file also holds the warehouse's password (a person's
    machine that queries it); a job's host needs none. Returns the env file's path."""
    if not _NAME.match(name):
        raise StackError(f"client name {name!r}: letters, digits, '.', '_' and '-' only")
    files = ListenFiles.of(home)
    try:
        info = json.loads(files.info.read_text())
    except (OSError, ValueError):
        raise StackError(
            f"no listening stack at {home} (start it with `perfloop up --listen ADDR`)"
        ) from None
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = _load_ca(files)
    cert, key = out / f"{name}.pem", out / f"{name}.key"
    _issue(ca, name, cert, key)
    shutil.copyfile(files.ca, out / "ca.pem")
    addr = info["addr"]
    lines = [
        f"PERFLOOP_KAFKA_BOOTSTRAP={addr}:{info['kafka_port']}",
        "PERFLOOP_KAFKA_SECURITY_PROTOCOL=SSL",
        "PERFLOOP_BROKER_KEEPS_LOG=false",  # the embedded broker restarts empty
        f"PERFLOOP_KAFKA_SSL_CA={(out / 'ca.pem').resolve()}",
        f"PERFLOOP_KAFKA_SSL_CERT={cert.resolve()}",
        f"PERFLOOP_KAFKA_SSL_KEY={key.resolve()}",
    ]
    for name, setting in (("commands.json", "COMMAND_KEYRING"), ("roster.json", "ROSTER")):
        public = home / "keys" / name  # public keys only: what signs commands and settings
        if public.exists():
            shutil.copyfile(public, out / name)
            lines.append(f"PERFLOOP_{setting}={(out / name).resolve()}")
    if warehouse:
        lines += [
            f"PERFLOOP_CLICKHOUSE_URL=https://{addr}:{info['clickhouse_port']}",
            f"PERFLOOP_CLICKHOUSE_CA={(out / 'ca.pem').resolve()}",
            f"PERFLOOP_CLICKHOUSE_PASSWORD={files.password.read_text().strip()}",
        ]
    env = out / "perfloop.env"
    fd = os.open(env, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return env
