"""A live database's tables, columns (with types), primary and foreign keys, read through
SQLAlchemy's inspector (`sqlalchemy.inspect`), never through catalog queries of our own:
SQLite (the standard library driver), DuckDB (`duckdb-engine`) and PostgreSQL (psycopg 3, URL
`postgresql+psycopg://...`).

`open_database(url)` opens an engine that cannot write where the driver allows it:
- SQLite: the file is opened read-only (`file:PATH?mode=ro&uri=true`; a missing file is an error,
  never created; a URL that is itself a `file:` URI, `sqlite:///file:PATH?mode=rwc&uri=true`,
  gets the same: its `mode` is replaced by `ro`) and every connection runs `PRAGMA query_only = ON`;
- DuckDB: `read_only=True` (an in-memory database cannot be opened read-only: it has nothing
  to protect);
- PostgreSQL: every transaction is READ ONLY (`default_transaction_read_only=on`) with
  `connect_timeout` seconds to connect.
`introspect(source)` reads the default schema (PostgreSQL `search_path`, DuckDB `main`): its tables
and, with include_views, its views (columns only). Work is bounded: the table count is read first
and refused above `schema.MAX_TABLES`, columns above `schema.MAX_COLUMNS`.

Known gaps of the drivers (not worked around: that would need catalog queries):
- duckdb-engine 0.17 reports no primary keys (its pg_catalog emulation has no index data), so a
  DuckDB Schema has empty `primary_key`s; columns, types and foreign keys are read.
- duckdb-engine 0.17 cannot reflect at all under SQLAlchemy >= 2.0.45 (SQLAlchemy's PostgreSQL
  reflection queries `pg_collation` and casts to REGCLASS, which DuckDB lacks: duckdb_engine
  issues #1379/#1391, fix pending in PR #1393); with such a SQLAlchemy a DuckDB database is
  refused with a SchemaError naming the versions. SQLAlchemy 2.0.44 is the last that works.

Errors: DatabaseUnreachableError (a SchemaError) when the database cannot be opened or its
catalog read (the message has the driver's reason and the URL without its password);
SchemaError for an unsupported dialect, a missing driver, an empty database or a limit.
"""

from __future__ import annotations

import os

from agentrt.sql.dialect import dialect_name
from agentrt.sql.errors import DatabaseUnreachableError, SchemaError
from agentrt.sql.kinds import kind_of_sqlalchemy_type
from agentrt.sql.schema import MAX_COLUMNS, MAX_TABLES, Column, ForeignKey, Schema, Table, fold_name

CONNECT_TIMEOUT_S = 10
"""Seconds a PostgreSQL connection attempt may take (psycopg `connect_timeout`)."""


def open_database(url: str, read_only: bool = True):
    """A SQLAlchemy Engine for `url` (sqlite:///PATH, duckdb:///PATH, postgresql+psycopg://...;
    "postgresql://" is read as psycopg 3), read-only as the module docstring says unless
    read_only is False. Nothing is connected yet. Raises SchemaError for a URL that is not one
    of these or whose driver is not installed, DatabaseUnreachableError for a read-only SQLite
    file that does not exist."""
    import sqlalchemy as sa
    from sqlalchemy import event

    try:
        u = sa.engine.make_url(url)
    except sa.exc.ArgumentError as e:
        raise SchemaError(f"not a database URL: {e}") from None
    backend = u.get_backend_name()
    kwargs: dict = {}
    if backend == "sqlite":
        db = u.database or ""
        if read_only and db and db != ":memory:":
            # a path, or a file: URI (`sqlite:///file:PATH?mode=rwc&uri=true`) whose mode is
            # overridden: both open the existing file read-only, never create one
            path = _sqlite_uri_path(db) if db.startswith("file:") else db
            if not os.path.isfile(path):
                raise DatabaseUnreachableError(
                    f"no SQLite database file at {path!r} (a read-only database is never created)"
                )
            uri = db if db.startswith("file:") else f"file:{db}"
            u = u.set(database=uri, query={**u.query, "mode": "ro", "uri": "true"})
    elif backend == "duckdb":
        if read_only and u.database not in (None, "", ":memory:"):
            kwargs["connect_args"] = {"read_only": True}
    elif backend == "postgresql":
        if u.drivername == "postgresql":
            u = u.set(drivername="postgresql+psycopg")
        args = {"connect_timeout": CONNECT_TIMEOUT_S}
        if read_only:
            args["options"] = "-c default_transaction_read_only=on"
        kwargs["connect_args"] = args
        kwargs["pool_pre_ping"] = True  # a server restarted since: reconnect, not a failed query
    else:
        raise SchemaError(f"unsupported database {backend!r}: expected sqlite, duckdb or postgresql")
    try:
        engine = sa.create_engine(u, **kwargs)
    except (sa.exc.NoSuchModuleError, ImportError, ModuleNotFoundError) as e:
        raise SchemaError(
            f"no driver for {u.drivername!r} ({e}); install agentrt's `sql` extra "
            "(sqlalchemy, duckdb-engine, psycopg[binary])"
        ) from None
    if backend == "sqlite" and read_only:

        @event.listens_for(engine, "connect")
        def _query_only(dbapi_conn, _record):  # pragma: no branch - runs per connection
            dbapi_conn.execute("PRAGMA query_only = ON")

    return engine


def _sqlite_uri_path(uri: str) -> str:
    """The file path of an SQLite `file:` URI (https://sqlite.org/uri.html): `file:PATH`,
    `file:///PATH` or `file://localhost/PATH`, percent-decoded, without its query."""
    from urllib.parse import unquote

    rest = uri[len("file:") :].split("?", 1)[0].split("#", 1)[0]
    if rest.startswith("//"):
        authority, _, path = rest[2:].partition("/")
        if authority not in ("", "localhost"):
            raise SchemaError(f"an SQLite file: URI with the host {authority!r} is not a local file")
        rest = "/" + path
    return unquote(rest)


def dialect_of(engine) -> str:
    """The dialect name ("sqlite" | "duckdb" | "postgres") of a SQLAlchemy Engine/Connection."""
    return dialect_name(engine.dialect.name)


def describe(engine) -> str:
    """The engine's URL without its password, for messages."""
    try:
        return engine.url.render_as_string(hide_password=True)
    except AttributeError:  # a Connection
        return engine.engine.url.render_as_string(hide_password=True)


def introspect(source, *, include_views: bool = True) -> Schema:
    """The Schema of a live database. `source`: a URL (opened with open_database, read-only,
    and disposed of after) or a SQLAlchemy Engine/Connection. Raises DatabaseUnreachableError
    when it cannot be opened or read, SchemaError when it has no tables or breaks a limit."""
    import sqlalchemy as sa

    own = isinstance(source, str)
    engine = open_database(source) if own else source
    dialect = dialect_of(engine)
    where = describe(engine)
    try:
        if isinstance(engine, sa.engine.Connection):
            return _read(engine, dialect, include_views, where)
        with engine.connect() as conn:
            return _read(conn, dialect, include_views, where)
    except SchemaError:
        raise
    except sa.exc.SQLAlchemyError as e:
        orig = getattr(e, "orig", None) or e
        text = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        if dialect == "duckdb" and ("pg_collation" in text or "REGCLASS" in text):
            raise SchemaError(
                f"duckdb-engine cannot reflect {where} under SQLAlchemy {sa.__version__} "
                "(duckdb_engine issue #1391; use SQLAlchemy <= 2.0.44): " + text
            ) from None
        raise DatabaseUnreachableError(f"cannot read the database {where}: {text}") from None
    except Exception as e:  # noqa: BLE001 (driver errors SQLAlchemy does not wrap: duckdb's IOException)
        raise DatabaseUnreachableError(f"cannot read the database {where}: {type(e).__name__}: {e}") from None
    finally:
        if own:
            engine.dispose()


def _read(conn, dialect: str, include_views: bool, where: str) -> Schema:
    import sqlalchemy as sa

    ins = sa.inspect(conn)
    names = list(ins.get_table_names())
    views = []
    if include_views:
        try:
            views = [v for v in ins.get_view_names() if v not in names]
        except NotImplementedError:  # pragma: no cover - every supported dialect has views
            views = []
    if not names and not views:
        raise SchemaError(f"the database {where} has no tables")
    if len(names) + len(views) > MAX_TABLES:
        raise SchemaError(
            f"the database {where} has {len(names) + len(views)} tables and views, over the limit of {MAX_TABLES}"
        )
    tables = []
    total = 0
    for name in names + views:
        cols = ins.get_columns(name)
        total += len(cols)
        if total > MAX_COLUMNS:
            raise SchemaError(f"the database {where} has more than {MAX_COLUMNS} columns (the limit)")
        columns = tuple(
            Column(c["name"], _type_text(c["type"], conn), kind_of_sqlalchemy_type(c["type"])) for c in cols
        )
        pk: tuple[str, ...] = ()
        fks: list[ForeignKey] = []
        if name not in views:
            pk = tuple((ins.get_pk_constraint(name) or {}).get("constrained_columns") or ())
            for fk in ins.get_foreign_keys(name):
                if fk.get("referred_schema") not in (None, ins.default_schema_name):
                    continue  # a table of another schema: not in this model
                fks.append(
                    ForeignKey(
                        tuple(fk["constrained_columns"]), fk["referred_table"], tuple(fk["referred_columns"])
                    )
                )
        tables.append(Table(name, columns, pk, tuple(fks), dialect == "postgres"))
    # SQLite accepts foreign keys to tables/columns that do not exist (Spider has some), and
    # matches names case-insensitively: keep the keys that resolve, in the catalog's spelling
    return Schema(tuple(_resolve_fks(t, tables, dialect) for t in tables), dialect)


def _resolve_fks(table: Table, tables: list[Table], dialect: str) -> Table:
    cs = dialect == "postgres"
    keep = []
    for fk in table.foreign_keys:
        ref = next(
            (
                t
                for t in tables
                if t.name == fk.ref_table or (not cs and fold_name(t.name) == fold_name(fk.ref_table))
            ),
            None,
        )
        if ref is None or not fk.columns or len(fk.columns) != len(fk.ref_columns):
            continue
        cols = [table.column(c) for c in fk.columns]
        refs = [ref.column(c) for c in fk.ref_columns]
        if all(cols) and all(refs):
            keep.append(ForeignKey(tuple(c.name for c in cols), ref.name, tuple(c.name for c in refs)))
    return Table(table.name, table.columns, table.primary_key, tuple(keep), table.case_sensitive)


def _type_text(t, conn) -> str:
    """A reflected type as SQL text in the connection's dialect ("" for SQLite's no-type)."""
    from sqlalchemy import exc
    from sqlalchemy import types as st

    if isinstance(t, st.NullType):
        return ""
    try:
        return t.compile(dialect=conn.dialect)
    except exc.CompileError:  # a type the dialect cannot render (a reflection placeholder)
        return str(t)
