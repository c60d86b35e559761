"""A small database with awkward identifiers (spaces, reserved words, mixed case, non-ASCII, an
embedded double quote, a backslash, a name that tries to end its quotes and drop a table) and every type
family, as DDL for SQLite, DuckDB and PostgreSQL."""

from __future__ import annotations

_SQL_TYPES = {
    "int": "INTEGER",
    "real": "REAL",
    "num": "NUMERIC(10,2)",
    "vc": "VARCHAR(40)",
    "text": "TEXT",
    "date": "DATE",
    "ts": "TIMESTAMP",
    "bool": "BOOLEAN",
    "blob": "BLOB",
}
_TYPES = {"sqlite": _SQL_TYPES, "duckdb": _SQL_TYPES, "postgres": {**_SQL_TYPES, "blob": "BYTEA"}}

# (table, [(column, type key)], primary key, [(column, referenced table, referenced column)])
TABLES = [
    (
        "Clients",
        [
            ("id", "int"),
            ("Name", "vc"),
            ("user", "text"),
            ("created at", "ts"),
            ("photo", "blob"),
            ("back\\slash", "text"),
        ],
        "id",
        [],
    ),
    (
        "Order Items",
        [
            ("id", "int"),
            ("client_id", "int"),
            ("select", "vc"),
            ("Unit Price", "real"),
            ("MixedCase", "int"),
            ("naïve café", "text"),
            ("from", "date"),
            ("group", "bool"),
            ('quote"d', "num"),
            ("t1", "int"),
        ],
        "id",
        [("client_id", "Clients", "id")],
    ),
    (
        "日本",
        [
            ("id", "int"),
            ("Ünïcode", "text"),
            ("order", "int"),
            ("where", "date"),
            ('x"; DROP TABLE "Clients"; --', "text"),
        ],
        "id",
        [("order", "Order Items", "id")],
    ),
]


def q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def statements(dialect: str) -> list[str]:
    """One CREATE TABLE statement per table for `dialect` (every name quoted)."""
    types = _TYPES[dialect]
    out = []
    for name, cols, pk, fks in TABLES:
        lines = [f"{q(c)} {types[t]}" for c, t in cols]
        lines.append(f"PRIMARY KEY ({q(pk)})")
        lines += [f"FOREIGN KEY ({q(c)}) REFERENCES {q(t)} ({q(rc)})" for c, t, rc in fks]
        out.append(f"CREATE TABLE {q(name)} (" + ", ".join(lines) + ")")
    return out


def ddl(dialect: str) -> str:
    """The statements as one DDL text."""
    return ";\n".join(statements(dialect)) + ";\n"


ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
"""A query that never ends (for timeouts); its only table is its own CTE."""

_KINDS = {"int": "num", "real": "num", "num": "num", "vc": "text", "text": "text", "date": "date", "ts": "date",
          "bool": "bool", "blob": "other"}  # fmt: skip


def model(schema, keys: bool = True) -> list:
    """What two sources of a schema must agree on: tables, columns with kinds, foreign keys (and
    primary keys where the source reports them)."""
    return [
        (
            t.name,
            [(c.name, c.kind) for c in t.columns],
            t.primary_key if keys else None,
            sorted((fk.columns, fk.ref_table, fk.ref_columns) for fk in t.foreign_keys),
        )
        for t in schema.tables
    ]


def expected_model() -> list:
    """model(schema, keys=False) of the awkward database."""
    return [
        (name, [(c, _KINDS[t]) for c, t in cols], None, sorted(((c,), rt, (rc,)) for c, rt, rc in fks))
        for name, cols, _pk, fks in TABLES
    ]


def make_awkward(dialect: str, path):
    """A SQLAlchemy engine on a new awkward-identifier database (tests/support/sql/awkward.py) of
    `dialect` ("sqlite" | "duckdb") in directory `path`."""
    import sqlalchemy as sa

    url = {
        "sqlite": f"sqlite:///{path / 'awkward.sqlite'}",
        "duckdb": f"duckdb:///{path / 'awkward.duckdb'}",
    }[dialect]
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for statement in statements(dialect):
            conn.exec_driver_sql(statement)
    return engine
