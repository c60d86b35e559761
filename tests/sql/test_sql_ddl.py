"""CREATE TABLE text as the database reads it (agentrt/sql/ddl.py): a size cap before sqlglot runs,
PostgreSQL's folding of unquoted names, SQLite's table options, and CREATE TABLE statements that
cannot be read refused by name, never skipped. Also the bounded reading of JSON column types.
Model-free."""

from __future__ import annotations

import sqlite3

import pytest

from agentrt.sql import SchemaError, introspect, schema_from_ddl, schema_from_json, sql_grammar
from agentrt.sql.kinds import kind_of_type
from agentrt.sql.schema import MAX_DDL_BYTES, MAX_TYPE_CHARS


def _tables(schema) -> list[tuple[str, list[str]]]:
    return [(t.name, [c.name for c in t.columns]) for t in schema.tables]


def test_ddl_over_the_cap_is_refused_before_parsing():
    # the pathological shape of the check: one DEFAULT expression of many terms (1 MiB took 40 s)
    ddl = "CREATE TABLE t (a int DEFAULT (" + "1+" * (MAX_DDL_BYTES // 2) + "1))"
    with pytest.raises(SchemaError, match=f"over the limit of {MAX_DDL_BYTES} bytes.*MAX_DDL_BYTES"):
        schema_from_ddl(ddl, "sqlite")
    # at the cap it parses (the measured worst case of the docstring), and the cap can be raised
    at_cap = "CREATE TABLE t (a int DEFAULT (" + "1+" * ((MAX_DDL_BYTES - 40) // 2) + "1))"
    assert len(at_cap.encode()) <= MAX_DDL_BYTES
    assert _tables(schema_from_ddl(at_cap, "sqlite")) == [("t", ["a"])]
    assert _tables(schema_from_ddl(ddl, "sqlite", max_bytes=len(ddl))) == [("t", ["a"])]


def test_json_types_are_bounded_and_never_parsed_when_not_type_shaped():
    long_type = "DECIMAL(" + "1+" * MAX_TYPE_CHARS + "1)"
    with pytest.raises(SchemaError, match=f"over the limit of {MAX_TYPE_CHARS}"):
        schema_from_json({"t": {"a": long_type}})
    # not shaped like a type name: "other" without sqlglot; the kinds of real types are unchanged
    assert kind_of_type("DECIMAL(1+1+1)") == "other"
    assert kind_of_type("'; DROP TABLE x; --") == "other"
    cases = {
        "VARCHAR(20)": "text",
        "numeric(10, 2)": "num",
        "DOUBLE PRECISION": "num",
        "timestamp(3) with time zone": "date",
        "boolean": "bool",
        "int[]": "other",
        "money": "other",
        "": "other",
    }
    for text, kind in cases.items():
        assert kind_of_type(text, "postgres") == kind, text


def test_postgres_ddl_folds_unquoted_names_like_the_database():
    ddl = (
        'CREATE TABLE Users (Id int PRIMARY KEY, Name text, "Mixed" int);\n'
        "CREATE TABLE Orders (Uid int REFERENCES USERS (ID), Total numeric);"
    )
    schema = schema_from_ddl(ddl, "postgres")
    assert _tables(schema) == [("users", ["id", "name", "Mixed"]), ("orders", ["uid", "total"])]
    assert schema.table("users").primary_key == ("id",)
    assert schema.table("orders").foreign_keys[0].ref_table == "users"
    assert schema.table("Users") is None  # PostgreSQL names are exact: the quoted "Users" does not exist
    # the grammar writes the folded names bare and the quoted one quoted
    text = sql_grammar(schema).ebnf
    assert '"\\"Mixed\\""' in text and '\\"Users\\"' not in text and '"\\"Name\\""' not in text
    # SQLite and DuckDB compare names case-insensitively: the DDL's spelling is kept
    for dialect in ("sqlite", "duckdb"):
        assert _tables(schema_from_ddl("CREATE TABLE Users (Name text)", dialect)) == [("Users", ["Name"])]


@pytest.mark.parametrize(
    "dialect,ddl,refused",
    [
        ("postgres", "CREATE TABLE t (a int, A int)", True),  # both are column a
        ("postgres", 'CREATE TABLE t ("A" int, a int)', False),  # "A" and a
        ("postgres", 'CREATE TABLE t ("a" int, A int)', True),
        ("postgres", "CREATE TABLE T (a int); CREATE TABLE t (b int)", True),
        ("sqlite", "CREATE TABLE t (a int, A int)", True),
        # DuckDB: quoted names compare case-insensitively too
        ("duckdb", 'CREATE TABLE t ("A" int, a int)', True),
    ],
)
def test_duplicate_names_follow_the_dialects_case_rules(dialect, ddl, refused):
    if refused:
        with pytest.raises(SchemaError, match="appears twice"):
            schema_from_ddl(ddl, dialect)
    else:
        assert len(schema_from_ddl(ddl, dialect).tables[0].columns) == 2


def test_sqlite_table_options_are_read_past_and_match_the_database(tmp_path):
    ddl = (
        "CREATE TABLE t (a INTEGER PRIMARY KEY, b TEXT) WITHOUT ROWID;\n"
        "CREATE TABLE u (c INTEGER, d TEXT) STRICT;\n"
        "CREATE TEMP TABLE IF NOT EXISTS v (e INTEGER PRIMARY KEY, f INT REFERENCES t (a)) STRICT, WITHOUT ROWID;\n"
        "create table w (g int primary key) without rowid"
    )
    schema = schema_from_ddl(ddl, "sqlite")
    assert _tables(schema) == [("t", ["a", "b"]), ("u", ["c", "d"]), ("v", ["e", "f"]), ("w", ["g"])]
    assert schema.table("v").foreign_keys[0].ref_table == "t"
    path = tmp_path / "opts.sqlite"
    with sqlite3.connect(path) as db:  # the same statements on SQLite itself (TEMP aside)
        db.executescript(ddl.replace("TEMP ", ""))
    live = introspect(f"sqlite:///{path}")
    assert _tables(live) == _tables(schema)


@pytest.mark.parametrize(
    "dialect,statement,match",
    [
        (
            "sqlite",
            "CREATE VIRTUAL TABLE docs USING fts5(title, body)",
            "CREATE VIRTUAL TABLE is not supported",
        ),
        ("sqlite", "CREATE TABLE x (a int) WITHOUT ROWID, FOO", "could not be read as sqlite DDL"),
        ("postgres", "CREATE TABLE x OF some_type", "could not be read as postgres DDL: 'CREATE TABLE x OF"),
        ("postgres", "CREATE TEMP TABLE x (a int) ON COMMIT DROP", "ON COMMIT DROP"),
        ("sqlite", "CREATE TABLE x AS SELECT 1 AS a", "without a column list"),
    ],
)
def test_create_table_that_cannot_be_read_is_refused_by_name(dialect, statement, match):
    # beside a good table: the bad one used to vanish from the schema without a word
    with pytest.raises(SchemaError, match=match):
        schema_from_ddl(f"CREATE TABLE ok (a int);\n{statement};", dialect)


def test_other_statements_are_still_skipped():
    ddl = "CREATE TABLE t (a int); CREATE INDEX i ON t (a) WHERE a > 1; PRAGMA foo = 1; INSERT INTO t VALUES (1)"
    assert _tables(schema_from_ddl(ddl, "sqlite")) == [("t", ["a"])]
