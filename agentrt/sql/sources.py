"""Loading a Schema from a source: `schema_from_json` (`{table: {column: type}}`, a dict or its
JSON text) and `load_schema`, which takes any source (a database URL or SQLAlchemy engine,
introspected by agentrt.sql.introspect; CREATE TABLE text, parsed by agentrt.sql.ddl; JSON; a
Schema) and hands it to the module that reads it. Errors: SchemaError (agentrt.sql.errors) naming
the problem, DatabaseUnreachableError for a database that cannot be read."""

from __future__ import annotations

import json

from agentrt.sql.ddl import schema_from_ddl
from agentrt.sql.dialect import dialect_name
from agentrt.sql.errors import SchemaError
from agentrt.sql.introspect import introspect
from agentrt.sql.kinds import kind_of_type
from agentrt.sql.schema import (
    MAX_COLUMNS,
    MAX_SCHEMA_BYTES,
    MAX_TABLES,
    MAX_TYPE_CHARS,
    Column,
    Schema,
    Table,
)


def schema_from_json(obj, dialect: str | None = None) -> Schema:
    """A Schema from `{table: {column: type}}` (a dict, or its JSON text). Types are SQL type
    names ("INTEGER", "VARCHAR(20)", "" for none), their kinds read with sqlglot in `dialect`
    (default SQLite). Raises SchemaError naming the problem."""
    d = dialect_name(dialect) if dialect is not None else None
    if isinstance(obj, (str, bytes)):
        if len(obj) > MAX_SCHEMA_BYTES:
            raise SchemaError(f"the schema text is {len(obj)} bytes, over the limit of {MAX_SCHEMA_BYTES}")
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            raise SchemaError(f"the schema is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SchemaError(
            f"a JSON schema must be an object {{table: {{column: type}}}}, got {type(obj).__name__}"
        )
    if len(obj) > MAX_TABLES:
        raise SchemaError(f"the schema has {len(obj)} tables, over the limit of {MAX_TABLES}")
    tables = []
    total = 0
    for name, cols in obj.items():
        if not isinstance(cols, dict):
            raise SchemaError(
                f"table {name!r}: expected an object {{column: type}}, got {type(cols).__name__}"
            )
        total += len(cols)
        if total > MAX_COLUMNS:
            raise SchemaError(f"the schema has more than {MAX_COLUMNS} columns (the limit)")
        columns = []
        for cname, ctype in cols.items():
            if ctype is None:
                ctype = ""
            if not isinstance(ctype, str):
                raise SchemaError(
                    f"column {name}.{cname}: the type must be a string, got {type(ctype).__name__}"
                )
            if len(ctype) > MAX_TYPE_CHARS:
                raise SchemaError(
                    f"column {name}.{cname}: the type is {len(ctype)} characters, over the limit of "
                    f"{MAX_TYPE_CHARS}"
                )
            columns.append(Column(cname, ctype.strip(), kind_of_type(ctype, d or "sqlite")))
        tables.append(Table(name, tuple(columns), case_sensitive=d == "postgres"))
    return Schema(tuple(tables), d)


def load_schema(source, dialect: str | None = None) -> Schema:
    """A Schema from any source: a SQLAlchemy Engine/Connection or database URL string
    (`sqlite:///x.db`, `duckdb:///x.duckdb`, `postgresql+psycopg://...`; introspected), a dict
    `{table: {column: type}}`, JSON text of one, or CREATE TABLE text. `dialect` is the dialect
    of DDL/JSON text (default SQLite), and must agree with a database's own when both are given.
    Raises SchemaError (DatabaseUnreachableError for a database that cannot be read)."""
    if isinstance(source, Schema):
        return source if dialect is None else source.with_dialect(dialect)
    if isinstance(source, dict):
        return schema_from_json(source, dialect)
    if isinstance(source, str):
        text = source.strip()
        if text.startswith("{"):
            return schema_from_json(text, dialect)
        if "://" in text.split("\n", 1)[0] and not text.upper().startswith("CREATE"):
            s = introspect(text)
            if dialect is not None and dialect_name(dialect) != s.dialect:
                raise SchemaError(f"the database is {s.dialect}, not {dialect}")
            return s
        return schema_from_ddl(text, dialect or "sqlite")
    try:
        import sqlalchemy
    except ImportError:  # pragma: no cover - sqlalchemy is a dependency of the sql extra
        sqlalchemy = None
    if sqlalchemy is not None and isinstance(
        source, (sqlalchemy.engine.Engine, sqlalchemy.engine.Connection)
    ):
        return introspect(source)
    raise SchemaError(
        "a schema must be a database URL or SQLAlchemy engine, CREATE TABLE text, or JSON "
        f"{{table: {{column: type}}}}; got {type(source).__name__}"
    )
