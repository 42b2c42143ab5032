"""What a failed warehouse query says: a missing table or database names it and the command
that creates it; anything else is the server's own line without the client's wrapping."""

from __future__ import annotations

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from perfloop.warehouse.access import query_error

WRAP = "Received ClickHouse exception, code: {code}, server response: {said} (for url http://h:1)"


def failed(code: int | None, said: str) -> DatabaseError:
    e = DatabaseError(WRAP.format(code=code, said=said))
    e.code = code  # as clickhouse-connect sets it from the response
    return e


@pytest.mark.parametrize(
    ("said", "table"),
    [
        ("Code: 60. DB::Exception: Unknown table expression identifier 'audit'. In scope "
         "SELECT * FROM audit. (UNKNOWN_TABLE) (version 26.9.2.1)", "audit"),
        ("Code: 60. DB::Exception: Table perfloop.config_changes does not exist. "
         "(UNKNOWN_TABLE) (version 24.3.1.1)", "config_changes"),
        ("Code: 60. DB::Exception: Table `perfloop`.`steps` doesn't exist. (UNKNOWN_TABLE)",
         "steps"),
    ],
)  # fmt: skip
def test_a_missing_table_is_named_with_the_command_that_creates_it(said: str, table: str) -> None:
    assert query_error(failed(60, said)) == (
        f"the warehouse has no {table} table yet; run `perfloop migrate`"
    )


def test_a_missing_table_is_found_by_its_text_when_the_code_is_absent() -> None:
    e = DatabaseError("Code: 60. DB::Exception: Table perfloop.audit does not exist.")
    assert query_error(e) == "the warehouse has no audit table yet; run `perfloop migrate`"


def test_a_missing_database_says_to_migrate() -> None:
    said = "Code: 81. DB::Exception: Database perfloop does not exist. (UNKNOWN_DATABASE)"
    assert "no perfloop database yet; run `perfloop migrate`" in query_error(failed(81, said))


def test_any_other_refusal_is_the_servers_line() -> None:
    said = (
        "Code: 62. DB::Exception: Syntax error: failed at position 1 ('SELEC'). (SYNTAX_ERROR) "
        "(version 26.9.2.1)"
    )
    line = query_error(failed(62, said))
    assert line == (
        "Code: 62. DB::Exception: Syntax error: failed at position 1 ('SELEC'). (SYNTAX_ERROR)"
    )
    assert "\n" not in line and "Received" not in line


def test_an_unrecognised_message_is_kept_whole_on_one_line() -> None:
    assert query_error(DatabaseError("connection\nreset")) == "connection reset"
