"""Validation (parse, read-only, schema, EXPLAIN; never raises for a bad query), read-only
execution with a row limit and a timeout, and normalization to the grammar's spelling, on
SQLite and DuckDB. Model-free."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa

from agentrt.sql import QueryError, QueryTimeoutError, execute, introspect, normalize, open_database, validate
from agentrt.sql.validate import DatabaseConnectionError, _is_disconnect, _run
from tests.support.sql.awkward import ENDLESS, make_awkward


@pytest.fixture(params=["sqlite", "duckdb"])
def db(request, tmp_path):
    """(engine, schema) of the awkward database with three rows in "Order Items"."""
    engine = make_awkward(request.param, tmp_path)
    with engine.begin() as conn:
        conn.exec_driver_sql('INSERT INTO "Clients" (id, "Name") VALUES (1, \'Ada\')')
        for i in range(3):
            conn.exec_driver_sql(
                f'INSERT INTO "Order Items" (id, client_id, "select") VALUES ({i}, 1, \'s{i}\')'
            )
    yield engine, introspect(engine)
    engine.dispose()


@pytest.mark.parametrize(
    "query,stage,match",
    [
        ("", "parse", "empty"),
        ("SELEC id FROM Clients", "parse", "does not parse|expected one statement|not a query"),
        ("SELECT id FROM Clients; SELECT 1", "parse", "one statement"),
        ("DELETE FROM Clients", "read_only", "not a query"),
        ("DROP TABLE Clients", "read_only", "not a query"),
        ("PRAGMA query_only = OFF", "read_only", "not a query"),
        ("ATTACH DATABASE 'x.db' AS x", "read_only", "not a query"),
        ("WITH d AS (DELETE FROM Clients RETURNING *) SELECT * FROM d", "read_only", "DELETE"),
        ("SELECT * INTO copy FROM Clients", "read_only", "INTO"),
        ("SELECT id FROM Nope", "schema", "no such table"),
        ("SELECT nope FROM Clients", "schema", "nope"),
        ("SELECT T2.id FROM Clients AS T1", "schema", "T2|could not be resolved"),
        (
            'SELECT id FROM Clients AS T1 JOIN "Order Items" AS T2 ON T1.id = T2.client_id',
            "schema",
            "ambiguous|could not",
        ),
        ("SELECT * FROM read_csv('/etc/passwd')", "schema", "not a table"),
    ],
)
def test_bad_queries_are_reported_not_raised(db, query, stage, match):
    engine, schema = db
    result = validate(query, schema, engine=engine)
    assert not result.ok and result.stage == stage, result
    assert __import__("re").search(match, result.error), result.error


def test_the_database_is_asked(db):
    engine, schema = db
    good = validate('SELECT "select", COUNT(*) FROM "Order Items" GROUP BY "select"', schema, engine=engine)
    assert good.ok and good.checked_database
    # sqlglot accepts it and every name exists; only the database knows the function is unknown
    bad = validate('SELECT no_such_function("select") FROM "Order Items"', schema, engine=engine)
    assert not bad.ok and bad.stage == "database" and bad.checked_database, bad
    offline = validate('SELECT "select" FROM "Order Items"', schema)
    assert offline.ok and not offline.checked_database
    assert validate(None, schema).stage == "parse"


def test_an_unreachable_database_is_no_verdict_on_the_query(tmp_path):
    """A database that went away after the engine was opened: stage "connection", not checked by
    the database (the check found an outage reported as stage "database", checked_database true)."""
    engine = make_awkward("sqlite", tmp_path)
    schema = introspect(engine)
    path = tmp_path / "gone.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript('CREATE TABLE "Clients" (id INTEGER)')
    gone = open_database(f"sqlite:///{path}")
    assert validate("SELECT id FROM Clients", schema, engine=gone).checked_database
    gone.dispose()  # the pooled connection would still read the unlinked file
    path.unlink()
    result = validate("SELECT id FROM Clients", schema, engine=gone)
    assert not result.ok and result.stage == "connection" and not result.checked_database, result
    assert "cannot connect" in result.error
    with pytest.raises(DatabaseConnectionError, match="cannot connect") as e:
        execute("SELECT id FROM Clients", gone, schema)
    assert e.value.stage == "connection"


def test_a_broken_connection_is_told_from_a_refused_query():
    """SQLAlchemy's dialect decides what a lost connection looks like (psycopg's "server closed the
    connection unexpectedly" in tests/sql/test_sql_postgres.py; a closed SQLite handle here)."""
    engine = sa.create_engine("sqlite://")
    raw = sqlite3.connect(":memory:")
    raw.close()
    with pytest.raises(sqlite3.ProgrammingError) as closed:
        raw.execute("SELECT 1")
    assert _is_disconnect(engine, closed.value, raw)
    assert not _is_disconnect(
        engine, sqlite3.OperationalError("no such table: x"), sqlite3.connect(":memory:")
    )


def test_strict_types_are_the_databases_verdict(tmp_path):
    """DuckDB refuses SUM over text when it binds the query: EXPLAIN reports it (SQLite would
    return 0)."""
    engine = make_awkward("duckdb", tmp_path)
    schema = introspect(engine)
    result = validate('SELECT SUM("select") FROM "Order Items"', schema, engine=engine)
    assert not result.ok and result.stage == "database", result


def test_execute_returns_rows_with_a_limit(db):
    engine, schema = db
    res = execute('SELECT "select" FROM "Order Items" ORDER BY id', engine, schema, max_rows=2)
    assert res.columns == ["select"] and res.rows == [("s0",), ("s1",)] and res.truncated
    res = execute('SELECT "select" FROM "Order Items" ORDER BY id', engine, schema, max_rows=10)
    assert [r[0] for r in res.rows] == ["s0", "s1", "s2"] and not res.truncated
    assert res.jsonable() == {"columns": ["select"], "rows": [["s0"], ["s1"], ["s2"]], "truncated": False}
    with pytest.raises(QueryError, match="no such table") as e:
        execute("SELECT * FROM nope", engine, schema)
    assert e.value.stage == "schema"


def test_execute_refuses_writes_and_the_database_guards_too(db):
    engine, schema = db
    for q in ['DELETE FROM "Order Items"', "UPDATE Clients SET \"Name\" = 'x'", "DROP TABLE Clients"]:
        with pytest.raises(QueryError) as e:
            execute(q, engine, schema)
        assert e.value.stage == "read_only"
    # below the static check, the connection itself refuses (SQLite) or rolls back (DuckDB)
    try:
        _run(engine, 'DELETE FROM "Order Items"', timeout_s=5, max_rows=0)
    except QueryError as e:
        assert e.stage == "database"
    with engine.connect() as conn:
        assert conn.exec_driver_sql('SELECT COUNT(*) FROM "Order Items"').scalar() == 3


def test_execute_stops_at_the_timeout(db):
    engine, schema = db
    with pytest.raises(QueryTimeoutError, match="limit"):
        execute(ENDLESS, engine, schema, timeout_s=0.5)
    # the connection is usable afterwards
    assert execute("SELECT COUNT(*) FROM Clients", engine, schema).rows == [(1,)]


def test_sqlite_file_is_opened_read_only_for_execution(tmp_path):
    path = tmp_path / "x.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (a INTEGER)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.commit()
    conn.close()
    engine = open_database(f"sqlite:///{path}")
    assert execute("SELECT a FROM t", engine).rows == [(1,)]
    with pytest.raises(QueryError, match="readonly|read-only"):
        _run(engine, "INSERT INTO t VALUES (2)", timeout_s=5, max_rows=0)
    with engine.connect() as c, pytest.raises(sa.exc.OperationalError):
        c.exec_driver_sql("INSERT INTO t VALUES (2)")
    engine.dispose()


def test_normalize_writes_the_grammars_spelling(tmp_path):
    engine = make_awkward("sqlite", tmp_path)
    schema = introspect(engine)
    assert normalize(
        'select "SELECT", name from clients c join "order items" o on c.ID = o.CLIENT_ID', schema
    ) == ('SELECT "select", Name FROM Clients AS T1 JOIN "Order Items" AS T2 ON T1.id = T2.client_id')
    assert (
        normalize('SELECT id FROM clients WHERE name = "Ada"', schema)
        == "SELECT id FROM Clients WHERE Name = 'Ada'"
    )
    assert normalize(
        'SELECT "Ünïcode" FROM "日本" WHERE x IN (SELECT t.id FROM clients AS t)', schema
    ).endswith("IN (SELECT T1.id FROM Clients AS T1)")
    with pytest.raises(QueryError, match="does not parse"):
        normalize("SELECT FROM WHERE (", schema)
