"""ClickHouse HTTP wire details for the embedded warehouse server: status codes, error text,
content types, request-body decompression and ClickHouse's compressed-block framing."""

from __future__ import annotations

import base64
import binascii
import hmac
import re
import socket
import zlib
from collections.abc import Callable, Mapping
from typing import Any

CHUNK = 1 << 20
DISPLAY_NAME = socket.gethostname()

# URL parameters that belong to the HTTP layer, never forwarded to the engine as settings.
# readonly is here because a session that once set it cannot unset it.
HTTP_ONLY = frozenset(
    {
        "query", "database", "default_format", "query_id", "session_id", "session_timeout",
        "session_check", "compress", "decompress", "user", "password", "quota_key",
        "buffer_size", "wait_end_of_query", "client_protocol_version", "role", "stacktrace",
        "enable_http_compression", "http_zlib_compression_level", "send_progress_in_http_headers",
        "http_headers_progress_interval_ms", "cancel_http_readonly_queries_on_client_close",
        "add_http_cors_header", "http_wait_end_of_query", "http_response_buffer_size",
        "readonly", "async_insert", "wait_for_async_insert", "async_insert_deduplicate",
    }
)  # fmt: skip

# ClickHouse's HTTP status for an exception code (HTTPHandler::exceptionCodeToHTTPStatus).
STATUS_BY_CODE = {
    **dict.fromkeys((6, 25, 26, 27, 38, 41, 72, 376, 15, 44, 53, 62, 117, 321, 167, 168, 169), 400),
    **dict.fromkeys((60, 46, 47, 50, 56, 81, 115, 63, 73, 336, 124, 511), 404),
    516: 401,
    307: 413,
    48: 501,
    209: 503,
}
NAMES = {
    36: "BAD_ARGUMENTS",
    48: "NOT_IMPLEMENTED",
    62: "SYNTAX_ERROR",
    73: "UNKNOWN_FORMAT",
    271: "CANNOT_DECOMPRESS",
    516: "AUTHENTICATION_FAILED",
    307: "TOO_MANY_BYTES",
    1001: "STD_EXCEPTION",
}
CODE_RE = re.compile(r"Code: (\d+)\. DB::Exception: ")
LEADING_COMMENTS = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.S)
INSERT_FORMAT = re.compile(r"\A(INSERT\s+INTO\s.*?)\bFORMAT\s+([A-Za-z0-9_]+)", re.S | re.I)
TRAILING_FORMAT = re.compile(r"\bFORMAT\s+([A-Za-z0-9_]+)(?:\s+SETTINGS\b[^;]*)?\s*;?\s*\Z", re.I)
STATEMENT = re.compile(r"\A([A-Za-z]+)(?:\s+([A-Za-z]+))?")
PYTHON_ONLY_FORMATS = frozenset({"dataframe", "df", "arrowtable", "debug"})


class DBException(Exception):
    """An error to send back the ClickHouse way."""

    def __init__(self, code: int, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status or STATUS_BY_CODE.get(code, 500)

    @classmethod
    def of(cls, code: int, text: str, status: int | None = None) -> DBException:
        """Our own error, worded as the engine words its own."""
        name = NAMES.get(code, "UNKNOWN_EXCEPTION")
        return cls(code, f"Code: {code}. DB::Exception: {text}. ({name})", status)

    @classmethod
    def wrap(cls, exc: BaseException) -> DBException:
        """An engine error; chDB's text already holds ``Code: N. DB::Exception: ...``."""
        text = str(exc)
        match = CODE_RE.search(text)
        if match is None:
            return cls.of(1001, text.strip().rstrip(".") or type(exc).__name__)
        return cls(int(match.group(1)), text[match.start() :].strip())


def content_type(fmt: str) -> str:
    lower = fmt.lower()
    if lower.startswith(("tabseparated", "tsv")):
        return "text/tab-separated-values; charset=UTF-8"
    if lower.startswith("csv"):
        return "text/csv; charset=UTF-8; header=absent"
    if lower.startswith("json"):
        return "application/json; charset=UTF-8"
    if lower.startswith(("pretty", "vertical", "markdown", "values", "xml", "template")):
        return "text/plain; charset=UTF-8"
    return "application/octet-stream"


class Decoder:
    """Incremental decompressor for concatenated frames (gzip members, lz4/zstd frames)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._obj = factory()

    def feed(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self._obj.decompress(data))
            if not self._obj.eof:
                break
            data = self._obj.unused_data
            self._obj = self._factory()
        return b"".join(out)


def body_decoder(encoding: str) -> Decoder | None:
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return None
    if enc in ("gzip", "x-gzip"):
        return Decoder(lambda: zlib.decompressobj(wbits=31))
    if enc == "deflate":
        return Decoder(lambda: zlib.decompressobj(wbits=15))
    if enc == "lz4":
        import lz4.frame

        return Decoder(lz4.frame.LZ4FrameDecompressor)
    if enc == "zstd":
        from backports import zstd

        return Decoder(zstd.ZstdDecompressor)
    raise DBException.of(
        36, f"Unknown Content-Encoding {encoding!r}; valid: gzip, deflate, lz4, zstd"
    )


def unframe(data: bytes) -> bytes:
    """Decode ClickHouse's native compression framing (``decompress=1``); checksums unchecked."""
    out, pos = [], 0
    while pos < len(data):
        if len(data) - pos < 25:
            raise DBException.of(271, "Truncated compressed block")
        method = data[pos + 16]
        size = int.from_bytes(data[pos + 17 : pos + 21], "little")
        raw_size = int.from_bytes(data[pos + 21 : pos + 25], "little")
        payload = data[pos + 25 : pos + 16 + size]
        if method == 0x02:
            out.append(payload)
        elif method == 0x82:
            import lz4.block

            out.append(lz4.block.decompress(payload, uncompressed_size=raw_size))
        elif method == 0x90:
            from backports import zstd

            out.append(zstd.decompress(payload))
        else:
            raise DBException.of(271, f"Unknown compression method 0x{method:02x}")
        pos += 16 + size
    return b"".join(out)


def leading_keywords(sql: str) -> tuple[str, str]:
    rest = sql[LEADING_COMMENTS.match(sql).end() :]  # type: ignore[union-attr]
    match = STATEMENT.match(rest)
    if match is None:
        return "", ""
    return match.group(1).upper(), (match.group(2) or "").upper()


def credentials(headers: Mapping[str, str], params: Mapping[str, str]) -> tuple[str, str]:
    """The user and password a request gives, the ways ClickHouse takes them: HTTP Basic
    authentication, the ``X-ClickHouse-User``/``-Key`` headers, or the ``user``/``password``
    URL parameters (none: ``default`` with no password).

    >>> credentials({"Authorization": "Basic " + base64.b64encode(b"ann:p:w").decode()}, {})
    ('ann', 'p:w')
    >>> credentials({"X-ClickHouse-User": "bob", "X-ClickHouse-Key": "k"}, {})
    ('bob', 'k')
    >>> credentials({}, {"user": "cy"}), credentials({}, {})
    (('cy', ''), ('default', ''))
    >>> credentials({"Authorization": "Basic !!"}, {})
    ('', '')
    """
    auth = headers.get("Authorization") or ""
    if auth[:6].lower() == "basic ":
        try:
            user, _, password = base64.b64decode(auth[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return "", ""  # refused below: no user is called ""
        return user, password
    if headers.get("X-ClickHouse-User") is not None:
        return headers["X-ClickHouse-User"], headers.get("X-ClickHouse-Key") or ""
    return params.get("user") or "default", params.get("password") or ""


def check_credentials(given: tuple[str, str], wanted: tuple[str, str]) -> None:
    """Raise ClickHouse's AUTHENTICATION_FAILED unless ``given`` is ``wanted`` (compared in
    constant time).

    >>> check_credentials(("default", "s3"), ("default", "s3"))
    >>> try:
    ...     check_credentials(("default", "no"), ("default", "s3"))
    ... except DBException as e:
    ...     print(e.code, e.status, str(e).split("DB::Exception: ")[1][:30])
    516 401 default: Authentication failed
    """
    user_ok = hmac.compare_digest(given[0].encode(), wanted[0].encode())
    password_ok = hmac.compare_digest(given[1].encode(), wanted[1].encode())
    if not (user_ok and password_ok):
        raise DBException.of(
            516,
            f"{given[0]}: Authentication failed: password is incorrect, or there is no user "
            "with such name",
        )
