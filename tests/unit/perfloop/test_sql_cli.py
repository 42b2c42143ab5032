"""`perfloop sql`'s statement handling: where a script splits, which statements answer with
rows, and which ask for the server's own output format."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from perfloop.cli.query import explicit_format, returns_rows, split_statements

# a statement's pieces: plain words, quoted strings and comments that may hold ';'
_word = st.sampled_from(["SELECT", "x", "1", "FROM", "t", "(", ")", ",", "count()"])
_quoted = st.text(alphabet="ab;'\\ -", max_size=6).map(
    lambda s: "'" + s.replace("\\", "\\\\").replace("'", "''") + "'"
)
_comment = st.text(alphabet="ab; ", max_size=6).map(lambda s: f"/* {s} */")
_statement = st.lists(st.one_of(_word, _quoted, _comment), min_size=1, max_size=8).map(
    lambda parts: "SELECT " + " ".join(parts)
)


@given(st.lists(_statement, min_size=1, max_size=5))
def test_a_script_splits_into_its_statements_whatever_their_strings_and_comments_hold(
    statements: list[str],
) -> None:
    assert split_statements(" ;\n ".join(statements) + ";") == statements


def test_line_comments_and_quoted_names_hide_their_semicolons() -> None:
    script = 'SELECT `a;b` FROM t -- not; here\n; SELECT "c;d" # nor; here\n;;'
    assert split_statements(script) == [
        "SELECT `a;b` FROM t -- not; here",
        'SELECT "c;d" # nor; here',
    ]


def test_rows_or_a_command() -> None:
    for q in ("select 1", "WITH 1 AS x SELECT x", "SHOW TABLES", "DESC t", "EXPLAIN SELECT 1",
              "EXISTS TABLE t", "(SELECT 1)", "-- why\nSELECT 1"):  # fmt: skip
        assert returns_rows(q), q
    for q in ("CREATE TABLE t (x Int8) ENGINE = Memory", "INSERT INTO t VALUES (1)",
              "DROP TABLE t", "OPTIMIZE TABLE t FINAL", "SYSTEM FLUSH LOGS", ""):  # fmt: skip
        assert not returns_rows(q), q


def test_the_format_a_statement_asks_for() -> None:
    assert explicit_format("SELECT 1 format TabSeparatedWithNames") == "TabSeparatedWithNames"
    assert explicit_format("SELECT 1 SETTINGS max_threads = 1 FORMAT CSV  ") == "CSV"
    assert explicit_format("SELECT 'x FORMAT CSV'") is None
    assert explicit_format("SELECT formatDateTime(now(), '%F')") is None
    assert explicit_format("SELECT 1 /* FORMAT JSON */") is None
