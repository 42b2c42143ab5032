"""The embedded warehouse server: chDB served over the ClickHouse HTTP interface.

A chDB data directory can be opened by one process only, so this server owns it and every
other perfloop process talks to it the way it would talk to a real ClickHouse server:
``clickhouse_connect.get_client(host=..., port=...)`` or ``curl``. A pool of chDB sessions
on the one data directory serves the requests, up to ``sessions`` at once (each has its own
database in use and settings), so a long insert does not hold up a small one.

What the HTTP layer supports: ``GET /ping``; ``GET|POST /`` with the query in the ``query``
parameter and/or the body (multipart form fields too); ``database`` /
``X-ClickHouse-Database``; ``param_<name>`` bound by the engine; ``default_format`` and
``FORMAT x``; query settings as URL parameters (applied with ``SET`` for the one request;
HTTP-only and unknown names are ignored); ``INSERT ... FORMAT x`` with the data in the body,
plain or ``Content-Encoding`` gzip / deflate / lz4 / zstd, or ClickHouse ``decompress=1``
framing (lz4, zstd, none); a Native answer at the ``client_protocol_version`` the client
sends (`perfloop.stack._native`). Responses are never compressed. Errors come back as ClickHouse
sends them: status, ``X-ClickHouse-Exception-Code`` and ``Code: N. DB::Exception: ...``.

Security: with ``clickhouse_password`` set, every request but ``/ping`` must give the user and
password (``clickhouse_user``) as ClickHouse takes them (HTTP Basic authentication, the
``X-ClickHouse-User``/``-Key`` headers or the ``user``/``password`` parameters), or is refused
with AUTHENTICATION_FAILED (516). With ``clickhouse_tls_cert`` and ``clickhouse_tls_key`` it
serves HTTPS only (TLS 1.2 or later; each connection's handshake in the thread serving it, so
a client that stalls holds up no one else).

Example (``python -m perfloop.stack.warehouse_server`` runs the same from the environment):

>>> from perfloop.settings import WarehouseServerSettings
>>> server = WarehouseServer(WarehouseServerSettings(clickhouse_port=18123))  # doctest: +SKIP
>>> server.run()  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import email.policy
import errno
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from perfloop.exceptions import WarehouseError
from perfloop.settings import WarehouseServerSettings
from perfloop.stack._clickhouse_http import (
    CHUNK,
    DISPLAY_NAME,
    HTTP_ONLY,
    INSERT_FORMAT,
    LEADING_COMMENTS,
    PYTHON_ONLY_FORMATS,
    TRAILING_FORMAT,
    DBException,
    body_decoder,
    check_credentials,
    content_type,
    credentials,
    leading_keywords,
    unframe,
)
from perfloop.stack._native import NativeError, at_revision
from perfloop.stack._tls_server import handshake, server_context

__all__ = ["WarehouseServer", "main"]

log = logging.getLogger(__name__)

DRAIN_FACTOR = 4  # an over-limit body up to this multiple of the limit is read, then refused


class _Session:
    """One chDB session and its per-request state (database in use, settings applied)."""

    def __init__(self, data_dir: Path, known: frozenset[str] | None = None) -> None:
        from chdb import session as chdb_session

        self.chdb = chdb_session.Session(str(data_dir))
        self.known = (
            known
            if known is not None
            else frozenset(self.tsv("SELECT name FROM system.settings").splitlines()) - HTTP_ONLY
        )
        self.database: str | None = None
        self.applied: dict[str, str] = {}

    def tsv(self, sql: str) -> str:
        return bytes(self.chdb.query(sql, "TabSeparatedRaw").bytes()).decode().strip()

    def use(self, database: str, sql: str) -> None:
        if database == self.database:
            return
        try:
            self.chdb.query(f"USE `{database.replace('`', '``')}`", "TSV")
        except Exception as e:
            err = DBException.wrap(e)
            if err.code != 81 or leading_keywords(sql) != ("CREATE", "DATABASE"):
                raise err from e
            database = "default"  # bootstrap: a client bound to a database creates it
            self.chdb.query("USE default", "TSV")
        self.database = database

    def apply(self, settings: dict[str, str]) -> None:
        wanted = {k: v for k, v in settings.items() if k in self.known}
        changes = [f"{k} = DEFAULT" for k in self.applied if k not in wanted]
        for key, value in wanted.items():
            if self.applied.get(key) != value:
                quoted = value.replace("\\", "\\\\").replace("'", "\\'")
                changes.append(f"{key} = '{quoted}'")
        if not changes:
            return
        try:
            self.chdb.query("SET " + ", ".join(changes), "TSV")
        except Exception as e:
            for key in {*self.applied, *wanted}:
                try:
                    self.chdb.query(f"SET {key} = DEFAULT", "TSV")
                except Exception:
                    log.warning("cannot reset setting %s", key)
            self.applied = {}
            raise DBException.wrap(e) from e
        self.applied = wanted


class _Engine:
    """A pool of chDB sessions on one data directory: each request takes a free session for
    its whole run, so up to ``sessions`` requests run at once (an insert into the raw tables
    does not hold up a small one, nor a query), and more wait for a session to come free."""

    def __init__(self, data_dir: Path, sessions: int = 1) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            first = _Session(data_dir)
            self.version = first.tsv("SELECT version()")
            pool = [first] + [_Session(data_dir, first.known) for _ in range(sessions - 1)]
        except Exception as e:
            raise WarehouseError(f"cannot open the warehouse at {data_dir}: {e}") from e
        self._all = pool
        self._free: queue.LifoQueue[_Session] = queue.LifoQueue()
        for session in pool:
            self._free.put(session)

    @contextlib.contextmanager
    def _session(self) -> Iterator[_Session]:
        session = self._free.get()
        try:
            yield session
        finally:
            self._free.put(session)

    def close(self) -> None:
        for _ in self._all:  # each once it is free
            self._free.get().chdb.close()

    def query(
        self, sql: str, fmt: str, params: dict[str, str], database: str, settings: dict[str, str]
    ) -> tuple[bytes, dict[str, int]]:
        """Run one statement; return its output and summary counters."""
        with self._session() as session:
            session.use(database, sql)
            session.apply(settings)
            try:
                result = session.chdb.query(sql, fmt, params=params or None)
            except Exception as e:
                raise DBException.wrap(e) from e
            finally:
                if leading_keywords(sql)[0] == "USE":
                    session.database = None
            if not hasattr(result, "bytes"):
                raise DBException.of(73, f"Format {fmt} is not an HTTP output format")
            body = bytes(result.bytes() or b"")
            stats = {
                "read_rows": result.rows_read(),
                "read_bytes": result.bytes_read(),
                "written_rows": result.rows_written(),
                "written_bytes": result.bytes_written(),
                "elapsed_ns": int(result.elapsed() * 1e9),
            }
            return body, stats

    def insert(
        self, head: str, fmt: str, chunks: Sequence[bytes], database: str, settings: dict[str, str]
    ) -> dict[str, int]:
        """Stream already-read data chunks into ``head`` (an INSERT without FORMAT)."""
        with self._session() as session:
            session.use(database, head)
            session.apply(settings)
            try:
                inserter = session.chdb.send_insert(head, fmt)
            except Exception as e:
                raise DBException.wrap(e) from e
            try:
                for chunk in chunks:
                    if chunk:
                        inserter.append(chunk)
                result = inserter.finish()
            except Exception as e:
                try:
                    inserter.cancel()
                except Exception:
                    log.debug("cancel after a failed insert failed", exc_info=True)
                raise DBException.wrap(e) from e
            return {
                "written_rows": result.rows_written,
                "written_bytes": result.bytes_written,
                "elapsed_ns": int(result.elapsed * 1e9),
            }


def _native_at(revision: str, body: bytes) -> bytes:
    """chDB's Native ``body`` as a server writes it for a client that sent
    ``client_protocol_version`` (`perfloop.stack._native`); one error line when it cannot be."""
    if not revision:
        return body
    try:
        rev = int(revision)
    except ValueError:
        raise DBException.of(
            36, f"client_protocol_version must be a number, not {revision[:40]!r}", 400
        ) from None
    try:
        return at_revision(body, rev)
    except NativeError as e:
        raise DBException.of(48, str(e)) from None


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request against the shared engine."""

    protocol_version = "HTTP/1.1"
    server_version = "perfloop-chserver"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        query_id = ""
        try:
            url = urlsplit(self.path)
            params = dict(parse_qsl(url.query, keep_blank_values=True))
            query_id = params.get("query_id") or str(uuid.uuid4())
            if url.path.rstrip("/") in ("/ping", ""):
                if url.path.rstrip("/") == "/ping" or ("query" not in params and self._no_body()):
                    self._drain()
                    self._reply(200, b"Ok.\n", {"Content-Type": "text/html; charset=UTF-8"})
                    return
            else:
                self._drain()
                raise DBException.of(36, f"No handler for path {url.path!r}; valid: /, /ping", 404)
            wanted = self.server.credentials
            if wanted is not None:
                try:
                    check_credentials(credentials(self.headers, params), wanted)
                except DBException:
                    self._drain()
                    raise
            self._execute(params, query_id)
        except DBException as e:
            self._error(e, query_id)
        except Exception as e:  # a bad request must never kill the server
            log.exception("unexpected error serving %s", self.path)
            self._error(DBException.of(1001, f"{type(e).__name__}: {e}"), query_id)

    def _no_body(self) -> bool:
        return not self.headers.get("Transfer-Encoding") and not int(
            self.headers.get("Content-Length") or 0
        )

    def _drain(self) -> None:
        for _ in self._read_body():
            pass

    def _read_body(self) -> Iterator[bytes]:
        """The raw request body in pieces, chunked or not; over the limit is an error."""
        limit = self.server.max_body_bytes
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            total = 0
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024).strip():
                        pass  # trailers
                    return
                total += size
                if total > limit:
                    self.close_connection = True
                    raise self._too_big(limit)
                yield self.rfile.read(size)
                self.rfile.readline(1024)
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            # Read a moderately oversized body before answering, so that a client that sends
            # it whole still gets the error instead of a broken pipe; a huge one is cut off.
            if length <= DRAIN_FACTOR * limit:
                while length > 0 and (piece := self.rfile.read(min(CHUNK, length))):
                    length -= len(piece)
            self.close_connection = True
            raise self._too_big(limit)
        while length > 0:
            piece = self.rfile.read(min(CHUNK, length))
            if not piece:
                self.close_connection = True
                return
            length -= len(piece)
            yield piece

    @staticmethod
    def _too_big(limit: int) -> DBException:
        return DBException.of(
            307,
            f"Request body is larger than max_body_bytes={limit};"
            " raise PERFLOOP_MAX_BODY_BYTES or send smaller batches",
        )

    def _body(self, params: dict[str, str]) -> list[bytes]:
        """The decoded body as chunks (Content-Encoding, then ``decompress=1`` framing)."""
        decoder = body_decoder(self.headers.get("Content-Encoding", ""))
        limit, total, chunks = self.server.max_body_bytes, 0, []
        try:
            for piece in self._read_body():
                data = decoder.feed(piece) if decoder else piece
                total += len(data)
                if total > limit:
                    self.close_connection = True
                    raise self._too_big(limit)
                chunks.append(data)
        except DBException:
            raise
        except Exception as e:
            self.close_connection = True
            raise DBException.of(271, f"Cannot decode the request body: {e}") from e
        if params.get("decompress") == "1":
            chunks = [unframe(b"".join(chunks))]
        return chunks

    def _form_fields(self, body: bytes) -> dict[str, str]:
        ctype = self.headers.get("Content-Type", "")
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + body
        )
        fields = {}
        for part in message.iter_parts():  # type: ignore[attr-defined]
            if part.get_filename():
                raise DBException.of(48, "External data (file form fields) is not supported")
            name = part.get_param("name", header="content-disposition")
            fields[str(name)] = bytes(part.get_payload(decode=True) or b"").decode()
        return fields

    def _execute(self, params: dict[str, str], query_id: str) -> None:
        chunks = self._body(params)
        if self.headers.get("Content-Type", "").startswith("multipart/form-data"):
            params.update(self._form_fields(b"".join(chunks)))
            chunks = []
        database = params.get("database") or self.headers.get("X-ClickHouse-Database") or "default"
        default_fmt = (
            params.get("default_format")
            or self.headers.get("X-ClickHouse-Format")
            or "TabSeparated"
        )
        binds = {k[6:]: v for k, v in params.items() if k.startswith("param_")}
        settings = {k: v for k, v in params.items() if not k.startswith("param_")}
        sql, data = self._split(params.get("query", ""), chunks)
        if not sql.strip():
            raise DBException.of(62, "Empty query", 400)
        engine = self.server.engine
        insert = INSERT_FORMAT.match(sql[LEADING_COMMENTS.match(sql).end() :])  # type: ignore[union-attr]
        if insert is not None:
            head, fmt = insert.group(1).strip(), insert.group(2)
            stats = engine.insert(head, fmt, data, database, settings)
            self._reply(200, b"", {"X-ClickHouse-Query-Id": query_id}, stats)
            return
        trailing = TRAILING_FORMAT.search(sql)
        fmt = trailing.group(1) if trailing else default_fmt
        if fmt.lower() in PYTHON_ONLY_FORMATS or default_fmt.lower() in PYTHON_ONLY_FORMATS:
            raise DBException.of(73, f"Unknown output format {fmt}")
        body, stats = engine.query(sql, default_fmt, binds, database, settings)
        if fmt.lower() == "native":
            body = _native_at(params.get("client_protocol_version", ""), body)
        headers = {
            "X-ClickHouse-Query-Id": query_id,
            "X-ClickHouse-Format": fmt,
            "Content-Type": content_type(fmt),
        }
        self._reply(200, body, headers, stats)

    @staticmethod
    def _split(param_sql: str, chunks: list[bytes]) -> tuple[str, list[bytes]]:
        """The statement text and, for ``INSERT ... FORMAT x``, the data chunks after it."""
        if param_sql:
            head = param_sql[LEADING_COMMENTS.match(param_sql).end() :]  # type: ignore[union-attr]
            if INSERT_FORMAT.match(head) or not any(chunks):
                return param_sql, chunks
            return param_sql + " " + b"".join(chunks).decode("utf-8", "replace"), []
        body = b"".join(chunks)
        text = body[: 1 << 16].decode("latin-1")
        start = LEADING_COMMENTS.match(text).end()  # type: ignore[union-attr]
        insert = INSERT_FORMAT.match(text[start:])
        if insert is None:
            return body.decode("utf-8", "replace"), []
        pos = start + insert.end()
        while pos < len(body) and body[pos] in b" \t\r":
            pos += 1
        if pos < len(body) and body[pos] == 0x0A:
            pos += 1
        return body[:pos].decode("utf-8", "replace"), [body[pos:]]

    def _reply(
        self, status: int, body: bytes, headers: dict[str, str], stats: dict[str, int] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("X-ClickHouse-Server-Display-Name", DISPLAY_NAME)
        self.send_header("X-ClickHouse-Timezone", "UTC")
        for key, value in headers.items():
            self.send_header(key, value)
        if stats is not None:
            summary = {
                "read_rows": 0,
                "read_bytes": 0,
                "written_rows": 0,
                "written_bytes": 0,
                "total_rows_to_read": 0,
            }
            summary.update(stats)
            summary.setdefault("result_rows", 0)
            summary.setdefault("result_bytes", len(body))
            self.send_header(
                "X-ClickHouse-Summary",
                json.dumps({k: str(v) for k, v in summary.items()}, separators=(",", ":")),
            )
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, err: DBException, query_id: str) -> None:
        text = str(err)
        if "(version " not in text:
            text = f"{text} (version {self.server.engine.version})"
        headers = {
            "X-ClickHouse-Exception-Code": str(err.code),
            "X-ClickHouse-Query-Id": query_id,
            "Content-Type": "text/plain; charset=UTF-8",
        }
        try:
            self._reply(err.status, (text + "\n").encode(), headers)
        except OSError:
            self.close_connection = True


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    engine: _Engine
    max_body_bytes: int
    credentials: tuple[str, str] | None = None  # (user, password) every query must give

    def finish_request(self, request: Any, client_address: Any) -> None:
        if handshake(request, client_address):  # in the connection's own thread
            super().finish_request(request, client_address)


class WarehouseServer:
    """chDB on ``data_dir`` served over ClickHouse HTTP on ``host:clickhouse_port``."""

    def __init__(self, settings: WarehouseServerSettings) -> None:
        self.settings = settings
        self.data_dir = settings.data_dir or settings.home_dir / "warehouse"
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        """The ClickHouse HTTP address this server answers on."""
        scheme = "https" if self.settings.clickhouse_tls_cert else "http"
        return f"{scheme}://{self.settings.host}:{self.settings.clickhouse_port}"

    def start(self) -> None:
        """Bind the port, open the data directory and serve in a background thread."""
        if self._httpd is not None:
            return
        address = (self.settings.host, self.settings.clickhouse_port)
        try:
            httpd = _HTTPServer(address, _Handler, bind_and_activate=True)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise WarehouseError(
                    f"port {address[1]} on {address[0]} is in use;"
                    " stop the other server or set PERFLOOP_CLICKHOUSE_PORT"
                ) from e
            raise WarehouseError(f"cannot bind {address[0]}:{address[1]}: {e.strerror}") from e
        try:
            if self.settings.clickhouse_tls_cert:
                httpd.socket = server_context(
                    self.settings.clickhouse_tls_cert, self.settings.clickhouse_tls_key
                ).wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
            password = self.settings.clickhouse_password.get_secret_value()
            if password:
                httpd.credentials = (self.settings.clickhouse_user, password)
            httpd.engine = _Engine(self.data_dir, self.settings.sessions)
        except BaseException:
            httpd.server_close()
            raise
        httpd.max_body_bytes = self.settings.max_body_bytes
        self._httpd = httpd
        self._stopped.clear()
        self._thread = threading.Thread(
            target=httpd.serve_forever, name="perfloop-chserver", daemon=True
        )
        self._thread.start()
        log.info("warehouse serving %s from %s", self.url, self.data_dir)

    def stop(self) -> None:
        """Stop serving and close the data directory; safe to call twice."""
        httpd, self._httpd = self._httpd, None
        self._stopped.set()
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        httpd.engine.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        log.info("warehouse stopped")

    def run(self) -> None:
        """Start, then block until ``stop()``, SIGTERM or SIGINT."""
        self.start()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stopped.set())
        try:
            while not self._stopped.wait(0.5):
                pass
        finally:
            self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m perfloop.stack.warehouse_server [--host H] [--port P] [--data-dir D]``; the
    rest from the environment."""
    parser = argparse.ArgumentParser(
        prog="python -m perfloop.stack.warehouse_server", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", help="address to bind (PERFLOOP_HOST)")
    parser.add_argument("--port", type=int, help="port to bind (PERFLOOP_CLICKHOUSE_PORT)")
    parser.add_argument("--data-dir", type=Path, help="chDB data directory (PERFLOOP_DATA_DIR)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {
        k: v
        for k, v in (
            ("host", args.host),
            ("clickhouse_port", args.port),
            ("data_dir", args.data_dir),
        )
        if v
    }
    settings = WarehouseServerSettings().model_copy(update=overrides)
    started = time.monotonic()
    try:
        WarehouseServer(settings).run()
    except WarehouseError as e:
        print(f"perfloop.stack.warehouse_server: {e}", file=sys.stderr)
        return 2
    log.debug("served for %.0f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
