"""The table/column model from its three sources (a live database through SQLAlchemy's inspector,
CREATE TABLE text, JSON), their agreement, and clear errors for bad input. Model-free."""

from __future__ import annotations

import json
import sqlite3

import pytest

from agentrt.sql import (
    DatabaseUnreachableError,
    SchemaError,
    introspect,
    load_schema,
    open_database,
    schema_from_ddl,
    schema_from_json,
)
from agentrt.sql.schema import MAX_COLUMNS, MAX_TABLES
from tests.support.sql.awkward import ddl, expected_model, make_awkward, model

PORTABLE_DDL = """
CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name VARCHAR(30), born DATE, net_worth REAL,
                     active BOOLEAN, signed TIMESTAMP, photo BLOB);
CREATE TABLE song (song_id INTEGER, singer_id INTEGER REFERENCES singer (singer_id), title TEXT,
                   sales NUMERIC(10, 2), PRIMARY KEY (song_id));
"""


@pytest.mark.parametrize("dialect", ["sqlite", "duckdb"])
def test_introspection_reads_awkward_names_types_and_keys(dialect, tmp_path):
    engine = make_awkward(dialect, tmp_path)
    schema = introspect(engine)
    assert schema.dialect == dialect
    assert model(schema, keys=False) == expected_model()
    if dialect == "sqlite":  # duckdb-engine 0.17 reports no primary keys (introspect.py docstring)
        assert [t.primary_key for t in schema.tables] == [("id",)] * 3


def test_sqlite_and_duckdb_introspection_give_the_same_model(tmp_path):
    import sqlalchemy as sa

    models = []
    for url in (f"sqlite:///{tmp_path / 'a.sqlite'}", f"duckdb:///{tmp_path / 'a.duckdb'}"):
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            for statement in PORTABLE_DDL.split(";"):
                if statement.strip():
                    conn.exec_driver_sql(statement)
        models.append(model(introspect(engine), keys=False))
        engine.dispose()
    assert models[0] == models[1]
    kinds = {c: k for c, k in models[0][0][1]}
    assert kinds == {"singer_id": "num", "name": "text", "born": "date", "net_worth": "num", "active": "bool",
                     "signed": "date", "photo": "other"}  # fmt: skip
    assert models[0][1][3] == [(("singer_id",), "singer", ("singer_id",))]


@pytest.mark.parametrize("dialect", ["sqlite", "duckdb", "postgres"])
def test_ddl_text_gives_the_introspectedmodel(dialect, tmp_path):
    """sqlglot's reading of CREATE TABLE text agrees with the database's own catalog."""
    parsed = schema_from_ddl(ddl(dialect), dialect)
    assert model(parsed, keys=False) == expected_model()
    assert [t.primary_key for t in parsed.tables] == [("id",)] * 3
    if dialect == "sqlite":
        assert model(parsed) == model(introspect(make_awkward("sqlite", tmp_path)))
    portable = schema_from_ddl(PORTABLE_DDL, dialect)
    assert portable.table("song").foreign_keys[0].ref_table == "singer"
    assert portable.table("SONG") is not None if dialect != "postgres" else portable.table("SONG") is None


def test_spider_databases_introspect(spider_dir):
    """Every Spider database reads, with its (SQLite-lenient) foreign keys kept only when they
    resolve to real columns."""
    for path in sorted(spider_dir.glob("*.sqlite")):
        schema = introspect(f"sqlite:///{path}")
        assert schema.tables, path
        for t in schema.tables:
            for fk in t.foreign_keys:
                ref = schema.table(fk.ref_table)
                assert ref is not None and all(ref.column(c) for c in fk.ref_columns), (path, fk)


def test_json_schema_and_its_round_trip():
    schema = schema_from_json(
        '{"Order Items": {"id": "INTEGER", "Name": "VARCHAR(20)", "when": "DATE", "blob": "", "ok": "BOOLEAN"}}'
    )
    t = schema.table("order items")
    assert [(c.name, c.kind) for c in t.columns] == [
        ("id", "num"), ("Name", "text"), ("when", "date"), ("blob", "other"), ("ok", "bool"),
    ]  # fmt: skip
    again = schema_from_json(schema.to_json())
    assert model(again) == model(schema)
    assert load_schema({"t": {"a": "int"}}).table("t").column("A").kind == "num"
    assert load_schema(json.dumps({"t": {"a": "int"}})).table("t") is not None
    ddl_again = schema_from_ddl(schema.to_ddl("sqlite"), "sqlite")
    assert model(ddl_again) == model(schema)


def test_to_ddl_quotes_and_keys_round_trip(tmp_path):
    original = schema_from_ddl(ddl("sqlite"), "sqlite")
    for dialect in ("sqlite", "duckdb", "postgres"):
        assert model(schema_from_ddl(original.to_ddl(dialect), dialect)) == model(original)
    text = original.to_ddl("postgres")
    assert 'CREATE TABLE "Clients"' in text and '"quote""d"' in text and 'FOREIGN KEY ("order")' in text


@pytest.mark.parametrize(
    "text,match",
    [
        ("CREATE TABLE (", "does not parse"),
        ("SELECT 1; INSERT INTO t VALUES (1)", "no CREATE TABLE"),
        ("", "no CREATE TABLE"),
        ("CREATE TABLE t (a INT, a TEXT)", "appears twice"),
        ("CREATE TABLE t (a INT); CREATE TABLE T (b INT)", "appears twice"),
        ("CREATE TABLE t (a INT REFERENCES missing (x))", "missing table"),
        ("CREATE TABLE t (a INT, PRIMARY KEY (b))", "missing column"),
    ],
)
def test_bad_ddl_is_a_clear_error(text, match):
    with pytest.raises(SchemaError, match=match):
        schema_from_ddl(text, "sqlite")


@pytest.mark.parametrize(
    "value,match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be an object"),
        ({}, "no tables"),
        ({"t": {}}, "no columns"),
        ({"t": ["a"]}, "expected an object"),
        ({"t": {"a": 5}}, "type must be a string"),
        ({"t": {"a\nb": "int"}}, "control character"),
        ({"t" * 200: {"a": "int"}}, "longer than"),
    ],
)
def test_bad_json_is_a_clear_error(value, match):
    with pytest.raises(SchemaError, match=match):
        schema_from_json(value)


def test_limits_are_refused_before_the_work():
    with pytest.raises(SchemaError, match=f"over the limit of {MAX_TABLES}"):
        schema_from_json({f"t{i}": {"a": "int"} for i in range(MAX_TABLES + 1)})
    with pytest.raises(SchemaError, match=f"more than {MAX_COLUMNS} columns"):
        schema_from_json(
            {f"t{i}": {f"c{j}": "int" for j in range(100)} for i in range(MAX_COLUMNS // 100 + 1)}
        )
    with pytest.raises(SchemaError, match="unsupported SQL dialect"):
        schema_from_json({"t": {"a": "int"}}, "mysql")


def test_unreachable_and_empty_databases_are_clear_errors(tmp_path):
    missing = tmp_path / "missing.sqlite"
    with pytest.raises(DatabaseUnreachableError, match="no SQLite database file at .*never created"):
        introspect(f"sqlite:///{missing}")
    assert not missing.exists()  # opened read-only: never created
    with pytest.raises(DatabaseUnreachableError):
        introspect(f"duckdb:///{tmp_path / 'missing.duckdb'}")
    assert not (tmp_path / "missing.duckdb").exists()


def test_unreachable_postgres_hides_the_password():
    from agentrt.testing import free_port

    with pytest.raises(DatabaseUnreachableError) as e:
        introspect(f"postgresql://someone:s3cret@127.0.0.1:{free_port()}/db")
    assert "s3cret" not in str(e.value) and "cannot read the database" in str(e.value)


def test_empty_database_and_bad_urls(tmp_path):
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(empty).close()
    with pytest.raises(SchemaError, match="has no tables"):
        introspect(f"sqlite:///{empty}")
    with pytest.raises(SchemaError, match="unsupported database"):
        open_database("mysql://x@localhost/db")
    with pytest.raises(SchemaError, match="not a database URL"):
        open_database("::::")


def test_open_database_cannot_write(tmp_path):
    path = tmp_path / "w.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (a INTEGER)")
    conn.commit()
    conn.close()
    engine = open_database(f"sqlite:///{path}")
    import sqlalchemy as sa

    with engine.connect() as c:
        assert c.exec_driver_sql("SELECT COUNT(*) FROM t").scalar() == 0
        with pytest.raises(sa.exc.OperationalError, match="readonly|read-only"):
            c.exec_driver_sql("INSERT INTO t VALUES (1)")
    engine.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///file:{path}?mode=rwc&uri=true",
        "sqlite:///file:{path}?mode=rw",
        "sqlite:///file://{path}?uri=true",
        "sqlite:///file://localhost{path}?mode=memory&uri=true",
    ],
)
def test_sqlite_file_uri_is_opened_read_only_and_never_created(tmp_path, url):
    """A URL that is itself an SQLite file: URI gets what a path gets: the file must exist and its
    `mode` becomes ro (the check found `mode=rwc` creating a new empty file)."""
    import sqlalchemy as sa

    missing = tmp_path / "created.sqlite"
    with pytest.raises(DatabaseUnreachableError, match="no SQLite database file"):
        open_database(url.format(path=missing))
    assert not missing.exists()
    path = tmp_path / "there.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (a INTEGER)")
    engine = open_database(url.format(path=path))
    assert dict(engine.url.query)["mode"] == "ro"
    assert [t.name for t in introspect(engine).tables] == ["t"]
    with engine.connect() as c, pytest.raises(sa.exc.OperationalError, match="readonly|read-only"):
        c.exec_driver_sql("INSERT INTO t VALUES (1)")
    engine.dispose()
    with pytest.raises(SchemaError, match="not a local file"):
        open_database(f"sqlite:///file://otherhost{path}?uri=true")


def test_subset_keeps_keys_inside_it():
    schema = schema_from_ddl(ddl("sqlite"), "sqlite")
    sub = schema.subset(["Order Items", "clients"])
    assert [t.name for t in sub.tables] == ["Order Items", "Clients"]
    assert sub.table("Order Items").foreign_keys
    only = schema.subset(["日本"])
    assert only.table("日本").foreign_keys == ()
    with pytest.raises(SchemaError, match="no table"):
        schema.subset(["nope"])
    with pytest.raises(SchemaError, match="named twice"):
        schema.subset(["clients", "Clients"])


@pytest.mark.parametrize("dialect", ["sqlite", "duckdb"])
def test_views_are_read_as_tables(dialect, tmp_path):
    import sqlalchemy as sa

    url = {"sqlite": f"sqlite:///{tmp_path / 'v.sqlite'}", "duckdb": f"duckdb:///{tmp_path / 'v.duckdb'}"}[
        dialect
    ]
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (a INTEGER, b TEXT)")
        conn.exec_driver_sql("CREATE VIEW v AS SELECT a, b AS bb FROM t")
    schema = introspect(engine)
    assert [(t.name, [c.name for c in t.columns]) for t in schema.tables] == [
        ("t", ["a", "b"]),
        ("v", ["a", "bb"]),
    ]
    assert [t.name for t in introspect(engine, include_views=False).tables] == ["t"]
    engine.dispose()
