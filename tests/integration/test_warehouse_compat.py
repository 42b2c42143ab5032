"""The embedded warehouse speaks ClickHouse HTTP well enough for clickhouse-connect and curl."""

from __future__ import annotations

import datetime as dt
import gzip
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import clickhouse_connect
import numpy as np
import pyarrow as pa
import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from perfloop.exceptions import WarehouseError
from perfloop.settings import BaseServiceSettings, WarehouseServerSettings
from perfloop.stack.warehouse_server import WarehouseServer
from perfloop.warehouse import client as perfloop_client

pytestmark = pytest.mark.integration

N = 100_000
BODY_LIMIT = 32 << 20  # bytes; the 100k-row insert fits, the over-limit test does not
T0 = 1_700_000_000_123_456_789  # ns since the epoch, with all nine fractional digits


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarehouseServer]:
    data_dir: Path = tmp_path_factory.mktemp("warehouse")
    srv = WarehouseServer(
        WarehouseServerSettings(
            clickhouse_port=_free_port(), data_dir=data_dir, max_body_bytes=BODY_LIMIT
        )
    )
    srv.start()
    boot = clickhouse_connect.get_client(host="127.0.0.1", port=srv.settings.clickhouse_port)
    boot.command("CREATE DATABASE IF NOT EXISTS perfloop")
    boot.close()
    yield srv
    srv.stop()


def _client(server: WarehouseServer, **kwargs: object) -> Client:
    return clickhouse_connect.get_client(
        host="127.0.0.1", port=server.settings.clickhouse_port, database="perfloop", **kwargs
    )


@pytest.fixture(scope="module")
def client(server: WarehouseServer) -> Iterator[Client]:
    c = _client(server)
    yield c
    c.close()


def _http(
    server: WarehouseServer, query: str | None = None, body: bytes | None = None, **params: str
):
    """A raw request as curl would send it; returns (status, headers, body)."""
    if query is not None:
        params["query"] = query
    url = f"{server.url}/?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _columns() -> list[list[object]]:
    return [
        [T0 + i for i in range(N)],
        [f"host-{i % 7}" for i in range(N)],
        [None if i % 5 == 0 else i * 0.25 for i in range(N)],
        [[float(i), -1.5] for i in range(N)],
        [{"sm": float(i), "mem": 0.5} for i in range(N)],
    ]


def test_columnar_insert_round_trips_exactly(client: Client) -> None:
    client.command(
        "CREATE TABLE samples (ts DateTime64(9), host LowCardinality(String),"
        " power_w Nullable(Float64), clocks Array(Float32), util Map(String, Float64))"
        " ENGINE = MergeTree ORDER BY ts"
    )
    cols = _columns()
    names = ["ts", "host", "power_w", "clocks", "util"]
    summary = client.insert("samples", cols, column_names=names, column_oriented=True)
    assert summary.written_rows == N

    got = client.query(
        "SELECT toUnixTimestamp64Nano(ts), host, power_w, clocks, util FROM samples ORDER BY ts"
    )
    assert got.result_columns == cols
    ts = client.query_np("SELECT ts FROM samples ORDER BY ts")[:, 0]
    assert ts.astype("datetime64[ns]").astype(np.int64).tolist() == cols[0]


def test_parameterised_select(client: Client) -> None:
    query = "SELECT count() FROM samples WHERE host = {h:String} AND ts >= {t:DateTime64(9)}"
    start = dt.datetime.fromtimestamp((T0 + 50_000) // 10**9, dt.UTC)
    result = client.query(query, parameters={"h": "host-3", "t": start})
    expected = sum(1 for i in range(N) if i % 7 == 3 and T0 + i >= (T0 + 50_000) // 10**9 * 10**9)
    assert result.result_rows == [(expected,)]
    arrays = client.query(
        "SELECT {a:Array(String)}, {s:String}", parameters={"a": ["it's", "b"], "s": "tab\tq"}
    )
    assert arrays.result_rows == [(["it's", "b"], "tab\tq")]


def test_command_and_dataframes(client: Client) -> None:
    assert client.command("SELECT count() FROM samples") == N
    client.command("CREATE TABLE IF NOT EXISTS scratch (a UInt8) ENGINE = Memory")
    assert client.command("EXISTS TABLE scratch") == 1
    client.command("DROP TABLE scratch")
    arr = client.query_np("SELECT number, number * 2 FROM numbers(3)")
    assert arr.tolist() == [[0, 0], [1, 2], [2, 4]]
    try:
        import pandas  # noqa: F401
    except ImportError:
        pytest.skip("pandas is not installed; query_df not checked")
    df = client.query_df("SELECT host, count() AS n FROM samples GROUP BY host ORDER BY host")
    assert df["n"].sum() == N and list(df["host"])[:2] == ["host-0", "host-1"]


@pytest.mark.parametrize("compress", [False, "gzip", "zstd", "lz4"])
def test_insert_with_each_compression(server: WarehouseServer, compress: object) -> None:
    with _client(server, compress=compress) as c:
        table = f"comp_{compress}"
        c.command(f"CREATE TABLE {table} (a UInt64, s String) ENGINE = MergeTree ORDER BY a")
        c.insert(table, [[1, 2, 3], ["x", "y", "z"]], column_names=["a", "s"], column_oriented=True)
        assert c.query(f"SELECT sum(a), groupArray(s) FROM {table}").result_rows == [
            (6, ["x", "y", "z"])
        ]


def test_concurrent_clients_insert(server: WarehouseServer, client: Client) -> None:
    client.command(
        "CREATE TABLE conc (worker UInt8, i UInt32) ENGINE = MergeTree ORDER BY (worker, i)"
    )
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            with _client(server) as c:
                for batch in range(10):
                    rows = list(range(batch * 1000, (batch + 1) * 1000))
                    c.insert(
                        "conc",
                        [[worker] * 1000, rows],
                        column_names=["worker", "i"],
                        column_oriented=True,
                    )
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.command("SELECT count() FROM conc") == 20_000


def test_a_long_query_does_not_hold_up_others(server: WarehouseServer, client: Client) -> None:
    """Requests run on a pool of sessions: one still running does not block the next."""
    assert server.settings.sessions >= 2
    done = threading.Event()

    def long() -> None:
        with _client(server) as c:
            c.query("SELECT sleepEachRow(0.5) FROM numbers(4) SETTINGS max_block_size = 1")
        done.set()

    worker = threading.Thread(target=long)
    worker.start()
    seen = 0
    while not done.is_set() and not seen:  # on one session this waits for it to end
        seen = client.command(
            "SELECT count() FROM system.processes WHERE query LIKE '%sleepEachRow(0.5)%' "
            "AND query NOT LIKE '%system.processes%'"
        )
    running_alongside = not done.is_set()
    worker.join()
    assert seen == 1 and running_alongside


def test_errors_are_clickhouse_errors(server: WarehouseServer, client: Client) -> None:
    with pytest.raises(DatabaseError, match=r"Code: 62\. DB::Exception: Syntax error") as syntax:
        client.query("SELEC 1")
    assert "SYNTAX_ERROR" in str(syntax.value)
    with pytest.raises(DatabaseError, match=r"Code: 60\..*nope"):
        client.query("SELECT * FROM nope")
    status, headers, body = _http(server, "SELECT * FROM nope")
    assert status == 404 and headers["X-ClickHouse-Exception-Code"] == "60"
    assert body.startswith(b"Code: 60. DB::Exception: ") and b"(version " in body


def test_curl_style_http(server: WarehouseServer) -> None:
    with urllib.request.urlopen(f"{server.url}/ping", timeout=5) as resp:
        assert resp.read() == b"Ok.\n"
    status, headers, body = _http(server, "SELECT 1")
    assert (status, body) == (200, b"1\n")
    assert (
        headers["X-ClickHouse-Format"] == "TabSeparated"
        and headers["X-ClickHouse-Timezone"] == "UTC"
    )
    assert headers["X-ClickHouse-Query-Id"] and "read_rows" in headers["X-ClickHouse-Summary"]
    _, headers, body = _http(server, "SELECT 1 AS x FORMAT JSONEachRow")
    assert body == b'{"x":1}\n' and headers["X-ClickHouse-Format"] == "JSONEachRow"
    _, _, body = _http(server, "SELECT {n:UInt8} + 1", param_n="41", default_format="CSV")
    assert body == b"42\n"
    _, _, body = _http(server, body=b"SELECT currentDatabase()", database="perfloop")
    assert body == b"perfloop\n"
    status, _, _ = _http(
        server, "INSERT INTO perfloop.conc FORMAT CSV", body=gzip.compress(b"9,1\n")
    )
    assert status == 500  # gzip bytes without Content-Encoding are garbage CSV
    status, headers, _ = _http(server, body=b"INSERT INTO perfloop.conc FORMAT CSV\n9,1\n9,2\n")
    assert status == 200 and '"written_rows":"2"' in headers["X-ClickHouse-Summary"]


def test_gzip_body_over_raw_http(server: WarehouseServer) -> None:
    query = urllib.parse.urlencode({"query": "INSERT INTO perfloop.conc FORMAT TSV"})
    req = urllib.request.Request(
        f"{server.url}/?{query}",
        data=gzip.compress(b"8\t1\n8\t2\n8\t3\n"),
        headers={"Content-Encoding": "gzip"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    assert _http(server, "SELECT count() FROM perfloop.conc WHERE worker = 8")[2] == b"3\n"


def test_garbage_insert_fails_and_server_keeps_serving(
    server: WarehouseServer, client: Client
) -> None:
    before = client.command("SELECT count() FROM samples")
    status, headers, body = _http(
        server, "INSERT INTO perfloop.samples FORMAT Native", body=b"\xff\x00garbage" * 100
    )
    assert status >= 400 and headers["X-ClickHouse-Exception-Code"] and body.startswith(b"Code: ")
    with pytest.raises(DatabaseError):
        client.raw_insert("samples", ["ts"], insert_block=b"\x01\x02\x03", fmt="RowBinary")
    assert client.command("SELECT count() FROM samples") == before
    assert _http(server, "SELECT 2")[2] == b"2\n"


def test_body_over_limit_is_a_clear_error(server: WarehouseServer, client: Client) -> None:
    client.command("CREATE TABLE big (a UInt32, b UInt32) ENGINE = MergeTree ORDER BY a")
    status, headers, body = _http(
        server, "INSERT INTO perfloop.big FORMAT CSV", body=b"1,1\n" * (BODY_LIMIT // 4 + 1)
    )
    assert status == 413 and headers["X-ClickHouse-Exception-Code"] == "307"
    assert f"max_body_bytes={BODY_LIMIT}".encode() in body
    assert client.command("SELECT count() FROM perfloop.big") == 0, "nothing inserted"
    assert _http(server, "SELECT 3")[2] == b"3\n"


def test_insert_deduplication_token(client: Client) -> None:
    client.command(
        "CREATE TABLE dedup (a UInt32) ENGINE = MergeTree ORDER BY a"
        " SETTINGS non_replicated_deduplication_window = 100"
    )
    for _ in range(2):
        client.insert(
            "dedup",
            [[1, 2, 3]],
            column_names=["a"],
            column_oriented=True,
            settings={"insert_deduplication_token": "abc"},
        )
    client.insert(
        "dedup",
        [[1, 2, 3]],
        column_names=["a"],
        column_oriented=True,
        settings={"insert_deduplication_token": "xyz"},
    )
    assert client.command("SELECT count() FROM dedup") == 6


def test_port_in_use_is_a_warehouse_error(server: WarehouseServer, tmp_path: Path) -> None:
    other = WarehouseServer(server.settings.model_copy(update={"data_dir": tmp_path}))
    with pytest.raises(WarehouseError, match="in use"):
        other.start()


def test_clickhouse_compressed_framing(server: WarehouseServer) -> None:
    import lz4.block

    raw = b"7\t1\n7\t2\n"
    packed = lz4.block.compress(raw, store_size=False)
    header = (
        bytes([0x82]) + (9 + len(packed)).to_bytes(4, "little") + len(raw).to_bytes(4, "little")
    )
    body = b"\0" * 16 + header + packed  # checksum is not verified by the embedded server
    status, _, _ = _http(server, "INSERT INTO perfloop.conc FORMAT TSV", body=body, decompress="1")
    assert status == 200
    assert _http(server, "SELECT count() FROM perfloop.conc WHERE worker = 7")[2] == b"2\n"


def test_perfloop_client_compresses_only_for_an_external_warehouse(
    server: WarehouseServer,
) -> None:
    # The embedded warehouse is on loopback: lz4 there only cost CPU on both sides. The same
    # server named as an external ClickHouse gets compressed inserts, and both land.
    port = server.settings.clickhouse_port
    embedded = BaseServiceSettings(clickhouse_port=port)
    external = BaseServiceSettings(clickhouse_url_override=f"http://127.0.0.1:{port}")
    for settings, compression in ((embedded, None), (external, "lz4")):
        c = perfloop_client(settings)
        try:
            assert c.write_compression == compression
            table = f"perfloop_client_{compression}"
            c.command(f"CREATE TABLE IF NOT EXISTS {table} (x Int64) ENGINE = MergeTree ORDER BY x")
            c.insert_arrow(table, pa.table({"x": pa.array(np.arange(1000))}))
            c.insert(table, [[-1], [-2]], column_names=["x"])
            assert c.query(f"SELECT count(), sum(x) FROM {table}").result_rows == [
                (1002, 499500 - 3)
            ]
        finally:
            c.close()


# -- Native at a client's protocol revision (clickhouse-go, Grafana's plugin) ------------------

_TYPES = """SELECT number AS n, toString(number) AS s, toLowCardinality(toString(number % 3)) AS lc,
 if(number % 2 = 0, NULL, number * 1.5) AS nf, range(number % 4) AS arr,
 arrayMap(x -> toLowCardinality(toString(x)), range(number % 3)) AS alc,
 map('a', number, 'b', number + 1) AS m, (number, toString(number)) AS t,
 CAST((number, 'x') AS Tuple(a UInt64, b String)) AS nt,
 toDateTime64('2026-01-01 00:00:00', 9, 'UTC') + number AS dt, toDecimal64(number, 4) AS d,
 toFixedString('ab', 2) AS fs, toUUID('00000000-0000-0000-0000-000000000001') AS u,
 CAST(if(number % 2 = 0, NULL, 'q') AS LowCardinality(Nullable(String))) AS lcn,
 NULL AS nothing, [[1, 2], [3]] AS nested, CAST('a' AS Enum8('a' = 1, 'b' = 2)) AS e,
 toIPv4('1.2.3.4') AS ip, true AS b, toDate('2026-01-02') AS dd, [] AS empty,
 (1.5, 2.5)::Point AS pt
FROM numbers({rows:UInt32})"""


def _driver_rows(data: bytes, revision: int) -> list[tuple[object, ...]]:
    """Every row of a Native answer as clickhouse-driver (the native-protocol client, an
    independent reader of the format) reads it from a server at ``revision``."""
    from clickhouse_driver.bufferedreader import BufferedReader
    from clickhouse_driver.connection import ServerInfo
    from clickhouse_driver.context import Context
    from clickhouse_driver.streams.native import BlockInputStream

    class _Bytes(BufferedReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.at = 0
            super().__init__(1 << 16)

        def read_into_buffer(self) -> None:
            chunk = data[self.at : self.at + len(self.buffer)]
            if not chunk:
                raise EOFError
            self.at += len(chunk)
            self.buffer[: len(chunk)] = chunk
            self.current_buffer_size = len(chunk)

    ctx = Context()
    ctx.server_info = ServerInfo("perfloop", 1, 1, 1, revision, "UTC", "perfloop", revision)
    ctx.settings = {}
    ctx.client_settings = {"use_numpy": False, "strings_as_bytes": False,
                           "strings_encoding": "utf-8"}  # fmt: skip
    reader, rows = _Bytes(), []
    stream = BlockInputStream(reader, ctx)
    while reader.at < len(data) or reader.position < reader.current_buffer_size:
        rows += stream.read().get_rows()
    return rows


@pytest.mark.parametrize("rows", [0, 1, 7, 70_000])  # 70k: several blocks
def test_native_at_a_clients_protocol_revision(server: WarehouseServer, rows: int) -> None:
    """As clickhouse-go asks (``default_format=Native&client_protocol_version=54460``): each
    block with its info header, each column with its serialization byte, every type a
    dashboard meets, read back by clickhouse-driver at that revision as the same rows it reads
    from the plain (revision 0) answer."""
    pytest.importorskip("clickhouse_driver", reason="clickhouse-driver (dev extra) reads Native")
    status, _, plain = _http(server, _TYPES, default_format="Native", param_rows=str(rows))
    assert status == 200
    want = _driver_rows(plain, 0) if plain else []
    assert len(want) == rows
    for revision in (54405, 54454, 54460):
        status, headers, body = _http(server, _TYPES, default_format="Native",
                                      param_rows=str(rows),
                                      client_protocol_version=str(revision))  # fmt: skip
        assert status == 200 and headers["X-ClickHouse-Format"] == "Native"
        if rows:
            assert body.startswith(b"\x01\x00\x02\xff\xff\xff\xff\x00")  # the block info
        assert (_driver_rows(body, revision) if body else []) == want, revision


def test_native_at_a_revision_refuses_what_it_cannot_walk_in_one_line(
    server: WarehouseServer,
) -> None:
    sql = "SELECT uniqState(number) AS u FROM numbers(3)"
    status, _, body = _http(server, sql, default_format="Native", client_protocol_version="54460")
    assert status == 501 and body.count(b"\n") <= 1
    assert b"cannot send AggregateFunction(uniq, UInt64) columns in Native format" in body
    assert _http(server, sql, default_format="Native")[0] == 200  # revision 0: as chDB writes
    status, _, body = _http(server, "SELECT 1", default_format="Native",
                            client_protocol_version="new")  # fmt: skip
    assert status == 400 and b"client_protocol_version must be a number" in body


def test_clickhouse_connect_reads_at_its_protocol_revision(server: WarehouseServer) -> None:
    """clickhouse-connect's probe finds the block info a server writes and reads every answer
    at revision 54405 since, LowCardinality columns included."""
    c = _client(server)
    try:
        assert c.protocol_version == 54405
        got = c.query("SELECT toLowCardinality(toString(number % 3)) AS l, number FROM numbers(5)")
        assert got.result_rows == [(str(i % 3), i) for i in range(5)]
    finally:
        c.close()
