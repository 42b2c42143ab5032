"""Warehouse access: clickhouse-connect clients, applying the migrations, and reading what
landed (`query`: one query on a client of its own, its failure one line that says what to
do)."""

from __future__ import annotations

import datetime
import logging
import re
import time
from typing import Any
from urllib.parse import urlparse

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError
from clickhouse_connect.driver.query import QueryResult

from perfloop.exceptions import WarehouseError
from perfloop.settings import BaseServiceSettings
from perfloop.warehouse.migrations import MIGRATIONS, Migration

__all__ = ["client", "migrate", "query", "query_error", "unix_ns", "wait_settled"]

log = logging.getLogger(__name__)

UNKNOWN_SETTING = 115
UNKNOWN_TABLE = 60
UNKNOWN_DATABASE = 81

_MIGRATIONS_TABLE = """CREATE TABLE IF NOT EXISTS schema_migrations (
    version UInt32,
    name String,
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ReplacingMergeTree ORDER BY version"""


def client(
    settings: BaseServiceSettings, *, database: str | None = None, timeout_s: float = 30.0
) -> Client:
    """A clickhouse-connect client for the configured warehouse (one per thread).

    What it sends is compressed (lz4) for an external ClickHouse only: the embedded warehouse
    is on loopback, where compressing cost the sink and the server CPU for nothing.

    Raises `WarehouseError` with one line if the warehouse cannot be reached.
    """
    url = urlparse(settings.clickhouse_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise WarehouseError(
            f"PERFLOOP_CLICKHOUSE_URL={settings.clickhouse_url!r} is not an http(s) URL"
        )
    user = url.username or settings.clickhouse_user
    tls: dict[str, Any] = {}
    if url.scheme == "https" and settings.clickhouse_ca is not None:
        tls["ca_cert"] = str(settings.clickhouse_ca)
    try:
        return clickhouse_connect.get_client(
            host=url.hostname,
            port=url.port or (8443 if url.scheme == "https" else 8123),
            secure=url.scheme == "https",
            username=user,
            password=url.password or settings.clickhouse_password.get_secret_value(),
            database=settings.clickhouse_database if database is None else database,
            connect_timeout=min(timeout_s, 5.0),
            send_receive_timeout=timeout_s,
            autogenerate_session_id=False,
            compress=settings.external_clickhouse,
            **tls,
        )
    except ClickHouseError as e:
        raise WarehouseError(
            f"ClickHouse at {settings.clickhouse_url} is unreachable or refused: "
            f"{_reason(e, user=user, ca=settings.clickhouse_ca)}"
        ) from e


def _reason(e: Exception, *, user: str = "", ca: object = None) -> str:
    """What went wrong, in a few words, and which setting to look at.

    >>> failed = "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed (_"
    >>> print(_reason(Exception(failed)))  # doctest: +NORMALIZE_WHITESPACE
    its TLS certificate is not trusted (certificate verify failed: self-signed;
    PERFLOOP_CLICKHOUSE_CA names the CA to trust)
    >>> refused = Exception("Code: 516. DB::Exception: ann: Authentication failed")
    >>> print(_reason(refused, user="ann"))  # doctest: +NORMALIZE_WHITESPACE
    user 'ann' was refused: wrong password, or no such user (PERFLOOP_CLICKHOUSE_USER,
    PERFLOOP_CLICKHOUSE_PASSWORD)
    """
    text = " ".join(str(e).split())
    cert = re.search(r"certificate verify failed: ([^(']+)", text)
    if cert or "CERTIFICATE_VERIFY_FAILED" in text:
        why = f"certificate verify failed: {cert.group(1).strip()}" if cert else "not verified"
        fix = (
            f"PERFLOOP_CLICKHOUSE_CA={ca}" if ca else "PERFLOOP_CLICKHOUSE_CA names the CA to trust"
        )
        return f"its TLS certificate is not trusted ({why}; {fix})"
    if "Code: 516." in text or "AUTHENTICATION_FAILED" in text:
        return (
            f"user {user!r} was refused: wrong password, or no such user "
            "(PERFLOOP_CLICKHOUSE_USER, PERFLOOP_CLICKHOUSE_PASSWORD)"
        )
    if "SSLError" in text or "WRONG_VERSION_NUMBER" in text:
        ssl_why = re.search(r"\[SSL: ([A-Z_]+)\]", text)
        return f"TLS failed ({ssl_why.group(1) if ssl_why else 'SSL error'}): is it HTTPS?"
    errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", text)
    if errno:
        return errno.group(1).strip()
    if "Remote end closed connection without response" in text:
        return "it closed the connection without an answer (an HTTPS server asked over HTTP?)"
    return text[:200] or type(e).__name__


class _DropDriverNoise(logging.Filter):
    """clickhouse-connect logs "Unexpected Http Driver Exception" before raising the error
    that `client` turns into one line: the line says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Unexpected Http Driver Exception"


logging.getLogger("clickhouse_connect.driver._backend.http_sync").addFilter(_DropDriverNoise())


def query(
    settings: BaseServiceSettings,
    sql: str,
    parameters: dict[str, Any] | None = None,
    *,
    timeout_s: float = 30.0,
) -> QueryResult:
    """Run one query on a client of its own (closed after it) and return its result.

    Raises `WarehouseError` with one line: the warehouse unreachable (`client`), a table or
    the database not created yet ("… run `perfloop migrate`"), or what the server refused.
    """
    ch = client(settings, timeout_s=timeout_s)
    try:
        return ch.query(sql, parameters=parameters or {})
    except ClickHouseError as e:
        raise WarehouseError(query_error(e)) from e
    finally:
        ch.close()


_MISSING_TABLE = re.compile(
    r"Unknown table expression identifier '([^']+)'|Table ([\w.`]+) does(?:n't| not) exist"
)
_SERVER_SAID = re.compile(
    r"(Code: \d+\. DB::Exception: .*?)(?: \(version [^)]*\))?(?: \(for url [^)]*\))?$"
)


def query_error(e: ClickHouseError) -> str:
    """One line for a failed query: what is missing and how to create it, or what the server
    said (without the client's wrapping)."""
    text = " ".join(str(e).split())
    code = getattr(e, "code", None)
    missing = _MISSING_TABLE.search(text)
    if code == UNKNOWN_TABLE or missing:
        name = next((g for g in missing.groups() if g), "") if missing else ""
        table = name.replace("`", "").rpartition(".")[2] or "queried"
        return f"the warehouse has no {table} table yet; run `perfloop migrate`"
    if code == UNKNOWN_DATABASE:
        return "the warehouse has no perfloop database yet; run `perfloop migrate`"
    said = _SERVER_SAID.search(text)
    return (said.group(1) if said else text)[:500]


def migrate(
    settings: BaseServiceSettings, migrations: tuple[Migration, ...] = MIGRATIONS
) -> list[int]:
    """Create the database and apply pending ``migrations`` (`MIGRATIONS`) in order; return
    the versions applied."""
    db = settings.clickhouse_database
    admin = client(settings, database="")
    try:
        admin.command(f"CREATE DATABASE IF NOT EXISTS `{db}`")
    except ClickHouseError as e:
        raise WarehouseError(f"cannot create database {db}: {e}") from e
    finally:
        admin.close()
    ch = client(settings)
    applied: list[int] = []
    try:
        ch.command(_MIGRATIONS_TABLE)
        done = {r[0] for r in ch.query("SELECT version FROM schema_migrations").result_rows}
        for m in migrations:
            if m.version in done:
                continue
            for stmt in m.statements:
                try:
                    ch.command(stmt)
                except ClickHouseError as e:
                    if not (m.tuning and getattr(e, "code", None) == UNKNOWN_SETTING):
                        raise
                    log.warning(
                        "migration %d: this server skips %s (%s)", m.version, stmt, _reason(e)
                    )
            ch.insert("schema_migrations", [[m.version, m.name]], column_names=["version", "name"])
            applied.append(m.version)
    except ClickHouseError as e:
        raise WarehouseError(f"migration failed: {_reason(e)}") from e
    finally:
        ch.close()
    return applied


def unix_ns(ts: datetime.datetime) -> int:
    """Unix nanoseconds of a timestamp read from the warehouse (a naive one is UTC; the
    client gives microseconds)."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=datetime.UTC)
    return int(ts.timestamp() * 1_000_000) * 1000


def wait_settled(
    ch: Client,
    sql: str,
    parameters: dict[str, Any],
    *,
    quiet_s: float,
    timeout_s: float,
    poll_s: float = 0.5,
) -> Any:
    """Run ``sql`` (one value, e.g. a count of a job's rows) until it is non-zero and has not
    changed for ``quiet_s`` (more than a sink flush: every row sent has landed), or until
    ``timeout_s``; return its last value.

    The sink inserts telemetry every ``flush_interval_s`` (5 s), so a job's last rows land up
    to that long after it ended: a reader that wants them all waits for the count to settle.
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    since = time.monotonic()
    while True:
        value = ch.query(sql, parameters=parameters).result_rows[0][0]
        now = time.monotonic()
        if value != last:
            last, since = value, now
        elif value and now - since >= quiet_s:
            return value
        if now >= deadline:
            return value
        time.sleep(poll_s)
