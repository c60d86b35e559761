"""Checking and running generated SQL: `validate` (never raises for a bad query), `execute`
(read-only, row limit, timeout) and `normalize` (a query rewritten in the spelling of
agentrt.sql.grammar, used to check that the grammar accepts known-good queries).

validate(query, schema, dialect, engine=None) runs, in order, stopping at the first failure
(`Validation.stage` names it):
1. "parse": sqlglot parses exactly one statement in the dialect;
2. "read_only": the statement is a query (SELECT, set operation, WITH ... SELECT) with nothing
   that writes or changes the session anywhere inside it: no INSERT/UPDATE/DELETE/MERGE/COPY,
   DDL, PRAGMA, ATTACH/DETACH, SET, SELECT ... INTO, FOR UPDATE, and no statement sqlglot could
   only read as an opaque command;
3. "schema": every table is one of the schema's (or a CTE of the query) and every column
   resolves against the tables in its scope (sqlglot's qualify with the schema; SQLite and
   DuckDB names match case-insensitively, PostgreSQL's unquoted names fold to lower case);
4. "database" (with a SQLAlchemy engine): the database plans it, `EXPLAIN <query>`, in a
   read-only way (SQLite: PRAGMA query_only on that connection; PostgreSQL: a READ ONLY
   transaction with statement_timeout; DuckDB: a transaction rolled back), within `timeout_s`.
   A database that cannot be reached, or whose connection breaks during the check (SQLAlchemy's
   `dialect.is_disconnect` decides), is no verdict on the query: stage "connection",
   `checked_database` False.

execute(query, engine, max_rows, timeout_s) validates steps 1-3 against the engine's own schema
(given or introspected), then runs the query with the same read-only guards and a time limit
(SQLite: a progress handler that aborts the statement; DuckDB: `interrupt()` from a timer;
PostgreSQL: `statement_timeout`), and fetches at most max_rows rows (`QueryResult.truncated`
says more were there). A failure raises QueryError (a ValueError) with the stage and the
database's message; a timeout raises QueryTimeoutError; a database that cannot be reached or
drops the connection raises DatabaseConnectionError (stage "connection").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agentrt.errors import InvalidRequestError
from agentrt.sql.dialect import dialect_name, needs_quotes
from agentrt.sql.errors import SchemaError
from agentrt.sql.schema import Schema, fold_name

DEFAULT_TIMEOUT_S = 10.0
"""Seconds a query (or its EXPLAIN) may run."""
DEFAULT_MAX_ROWS = 1000
"""Rows `execute` returns at most."""


@dataclass(frozen=True)
class Validation:
    """ok: the query passed every stage run; error: why not (None when ok); stage: the stage
    that failed ("parse" | "read_only" | "schema" | "database"), or "connection" when the
    database could not be asked (unreachable, connection lost: no verdict on the query), None
    when ok; checked_database: whether the database itself answered on the query."""

    ok: bool
    error: str | None = None
    stage: str | None = None
    checked_database: bool = False


@dataclass
class QueryResult:
    """columns: result column names; rows: at most max_rows tuples of Python values;
    truncated: the query had more rows; elapsed_s: wall time of the execution and fetch."""

    columns: list[str]
    rows: list[tuple]
    truncated: bool = False
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def jsonable(self) -> dict[str, Any]:
        """{"columns", "rows", "truncated"} with values JSON can carry (other types as str)."""

        def conv(x):
            if x is None or isinstance(x, (bool, int, float, str)):
                return x
            if isinstance(x, (bytes, bytearray, memoryview)):
                return bytes(x).hex()
            return str(x)

        return {
            "columns": self.columns,
            "rows": [[conv(x) for x in r] for r in self.rows],
            "truncated": self.truncated,
        }


class QueryError(InvalidRequestError):
    """A query failed validation or execution. `stage`: as in Validation."""

    def __init__(self, message: str, stage: str | None = None):
        super().__init__(message)
        self.stage = stage


class QueryTimeoutError(QueryError):
    """The query ran past its time limit and was stopped."""


class DatabaseConnectionError(QueryError):
    """The database could not be connected to, or the connection broke while the query ran: no
    verdict on the query (stage "connection")."""

    def __init__(self, message: str):
        super().__init__(message, "connection")


def _sqlglot():
    import sqlglot

    logging.getLogger("sqlglot").setLevel(logging.ERROR)  # its "falling back to Command" warnings
    return sqlglot


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else type(e).__name__


def _parse(query: str, dialect: str):
    """(tree, None) or (None, Validation) for a failure of stage 1 or 2."""
    sqlglot = _sqlglot()
    from sqlglot.errors import SqlglotError

    if not isinstance(query, str) or not query.strip():
        return None, Validation(False, "the query is empty", "parse")
    try:
        trees = [t for t in sqlglot.parse(query, read=dialect) if t is not None]
    except SqlglotError as e:
        return None, Validation(False, f"the query does not parse as {dialect}: {_first_line(e)}", "parse")
    except RecursionError:
        return None, Validation(False, "the query is nested too deeply to parse", "parse")
    if len(trees) != 1:
        return None, Validation(False, f"expected one statement, got {len(trees)}", "parse")
    problem = read_only_problem(trees[0])
    if problem:
        return None, Validation(False, problem, "read_only")
    return trees[0], None


def read_only_problem(tree) -> str | None:
    """Why the parsed statement `tree` is not a read-only query, or None when it is."""
    from sqlglot import exp

    if (
        not isinstance(tree, (exp.Query, exp.Subquery))
        or isinstance(tree, exp.Subquery)
        and not isinstance(tree.unnest(), exp.Query)
    ):
        return f"not a query: {type(tree).__name__.upper()} statements are not allowed"
    banned = (
        exp.DML,
        exp.DDL,
        exp.Command,
        exp.Pragma,
        exp.Attach,
        exp.Detach,
        exp.Set,
        exp.Into,
        exp.Lock,
        exp.Copy,
        exp.Drop,
        exp.Alter,
        exp.Transaction,
        exp.Commit,
        exp.Rollback,
        exp.Use,
        exp.TruncateTable,
    )
    for node in tree.walk():
        if isinstance(node, banned):
            what = {exp.Into: "SELECT ... INTO", exp.Lock: "FOR UPDATE/SHARE"}.get(
                type(node), type(node).__name__.upper()
            )
            return f"{what} is not allowed: only read-only queries run"
    return None


def _mapping(schema: Schema) -> dict:
    """sqlglot's schema mapping: names as the dialect's normalization leaves them (lower case on
    the case-insensitive dialects, exact on PostgreSQL, whose quoted names keep their case)."""
    fold = (lambda s: s) if schema.case_sensitive else fold_name
    return {fold(t.name): {fold(c.name): "TEXT" for c in t.columns} for t in schema.tables}


def schema_problem(tree, schema: Schema, dialect: str) -> str | None:
    """Why the parsed query names something the schema lacks (table, column, ambiguous or
    unresolvable reference), or None."""
    from sqlglot import exp
    from sqlglot.errors import SqlglotError
    from sqlglot.optimizer.qualify import qualify
    from sqlglot.schema import MappingSchema

    ctes = {fold_name(c.alias_or_name) for c in tree.find_all(exp.CTE)}
    for t in tree.find_all(exp.Table):
        if not isinstance(t.this, exp.Identifier):
            return f"table expression {t.sql(dialect)!r} is not a table of the schema"
        if fold_name(t.name) in ctes and not t.args.get("db"):
            continue
        if t.args.get("db") or t.args.get("catalog"):
            return f"table {t.sql(dialect)!r} is qualified with a schema/database: not in the schema"
        # PostgreSQL folds an unquoted name to lower case; the others compare case-insensitively
        found = schema.table(fold_name(t.name) if schema.case_sensitive and not t.this.quoted else t.name)
        if found is None:
            return f"no such table: {t.name}"
    tree = tree.copy()
    # qualify aliases an unaliased table by its name folded to lower case, after which a
    # column qualified by the quoted mixed-case name ("Clients".id on PostgreSQL) no longer
    # resolves (sqlglot 30): alias each such table by its own name, which changes nothing
    for t in tree.find_all(exp.Table):
        if not t.alias and isinstance(t.this, exp.Identifier):
            t.set("alias", exp.TableAlias(this=t.this.copy()))
    try:
        qualify(
            tree,
            schema=MappingSchema(_mapping(schema), dialect=dialect, normalize=False),
            dialect=dialect,
            validate_qualify_columns=True,
            quote_identifiers=False,
            identify=False,
        )
    except (SqlglotError, KeyError, ValueError) as e:
        return f"{_first_line(e)}"
    except RecursionError:
        return "the query is nested too deeply to check"
    except Exception:  # noqa: BLE001 (a fault of sqlglot's optimizer itself: an AssertionError on some
        # positional GROUP BY over a scalar subquery; validate never raises): names only
        return _names_exist(tree, schema)
    return None


def _names_exist(tree, schema: Schema) -> str | None:
    """The weaker check: every column name is a column of some table of the schema."""
    from sqlglot import exp

    for col in tree.find_all(exp.Column):
        name = col.name
        if schema.case_sensitive and not col.this.quoted:
            name = fold_name(name)
        if not any(t.column(name) is not None for t in schema.tables):
            return f"no such column: {col.sql()}"
    return None


def validate(
    query: str,
    schema: Schema | None = None,
    dialect: str | None = None,
    engine=None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Validation:
    """Check `query` (module docstring). `schema`: the tables it may name (introspected from
    `engine` when None); `dialect`: default the schema's, else the engine's, else SQLite.
    Never raises for a bad query; raises SchemaError only when neither a schema nor a readable
    engine is given."""
    if schema is None:
        if engine is None:
            raise SchemaError("validate needs a schema or an engine")
        from agentrt.sql.introspect import introspect

        schema = introspect(engine)
    if dialect is None:
        if schema.dialect:
            dialect = schema.dialect
        elif engine is not None:
            from agentrt.sql.introspect import dialect_of

            dialect = dialect_of(engine)
    d = dialect_name(dialect or "sqlite")
    if schema.dialect != d:
        schema = schema.with_dialect(d)
    tree, failure = _parse(query, d)
    if failure:
        return failure
    problem = schema_problem(tree, schema, d)
    if problem:
        return Validation(False, problem, "schema")
    if engine is None:
        return Validation(True)
    try:
        _run(engine, "EXPLAIN " + query, timeout_s, max_rows=None)
    except DatabaseConnectionError as e:
        return Validation(False, e.message, "connection", False)
    except QueryError as e:
        return Validation(False, e.message, "database", True)
    return Validation(True, checked_database=True)


def execute(
    query: str,
    engine,
    schema: Schema | None = None,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> QueryResult:
    """Run a read-only query on `engine` (module docstring) and return at most `max_rows` rows.
    Raises QueryError (stage "parse" | "read_only" | "schema" | "database"), QueryTimeoutError,
    DatabaseConnectionError (stage "connection"); SchemaError/DatabaseUnreachableError when the
    database cannot be read for its schema."""
    from agentrt.sql.introspect import dialect_of, introspect

    if max_rows < 0:
        raise QueryError("max_rows must be >= 0")
    d = dialect_of(engine)
    schema = (schema or introspect(engine)).with_dialect(d)
    tree, failure = _parse(query, d)
    if failure:
        raise QueryError(failure.error, failure.stage)
    problem = schema_problem(tree, schema, d)
    if problem:
        raise QueryError(problem, "schema")
    return _run(engine, query, timeout_s, max_rows)


def _run(engine, sql: str, timeout_s: float, max_rows: int | None) -> QueryResult:
    """Run `sql` (already checked) on a pooled connection of `engine` with the read-only guards
    and the time limit of its dialect; the transaction is always rolled back. max_rows None:
    fetch nothing (EXPLAIN)."""
    import sqlalchemy as sa

    from agentrt.sql.introspect import describe, dialect_of

    d = dialect_of(engine)
    t0 = time.monotonic()
    timed_out = threading.Event()
    try:
        conn_cm = engine.connect()
    except Exception as e:  # noqa: BLE001 (the pool connects here: an unreachable database; duckdb's
        # own IOException is not wrapped by SQLAlchemy)
        raise DatabaseConnectionError(
            f"cannot connect to {describe(engine)}: {_first_line(getattr(e, 'orig', None) or e)}"
        ) from None
    with conn_cm as conn:
        try:
            raw = conn.connection.dbapi_connection
        except sa.exc.SQLAlchemyError as e:
            raise DatabaseConnectionError(
                f"cannot connect to {describe(engine)}: {_first_line(getattr(e, 'orig', None) or e)}"
            ) from None
        guards = _Guards()
        try:
            cur = raw.cursor()
            _guard(d, raw, cur, guards, timeout_s, t0 + timeout_s, timed_out)
            cur.execute(sql)
            columns, rows, truncated = _fetch(cur, max_rows)
            return QueryResult(columns, rows, truncated, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 (each driver has its own error classes)
            raise _driver_error(engine, e, raw, timed_out.is_set(), timeout_s) from None
        finally:
            _unguard(d, raw, conn, guards)


@dataclass
class _Guards:
    """What the read-only guards of one query changed, for `_unguard` to undo (filled in as each is
    set, so a guard that fails half-way is undone as far as it went)."""

    timer: threading.Timer | None = None  # duckdb's time limit
    restore: Any = None  # SQLite's query_only before the query
    explicit: bool = False  # a transaction we began ourselves (an autocommit connection)


def _guard(d: str, raw, cur, guards: _Guards, timeout_s: float, deadline: float, timed_out) -> None:
    """Makes the transaction of dialect `d` read-only and limits it to timeout_s seconds (deadline:
    time.monotonic() value): SQLite query_only + a progress handler, Postgres a read-only transaction
    + statement_timeout, duckdb a transaction + a timer that interrupts it; `timed_out` is set when
    a limit stops the query."""
    if d == "sqlite":
        guards.restore = cur.execute("PRAGMA query_only").fetchone()[0]
        cur.execute("PRAGMA query_only = ON")

        def progress():
            if time.monotonic() > deadline:
                timed_out.set()
                return 1
            return 0

        raw.set_progress_handler(progress, 1000)
    elif d == "postgres":
        guards.explicit = bool(getattr(raw, "autocommit", False))
        cur.execute("BEGIN READ ONLY" if guards.explicit else "SET TRANSACTION READ ONLY")
        cur.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout_s * 1000))}")
    elif d == "duckdb":
        cur.execute("BEGIN TRANSACTION")

        def stop():
            timed_out.set()
            raw.interrupt()

        guards.timer = threading.Timer(timeout_s, stop)
        guards.timer.daemon = True
        guards.timer.start()


def _fetch(cur, max_rows: int | None) -> tuple[list[str], list[tuple], bool]:
    """(column names, at most max_rows rows, whether more were there) of an executed cursor;
    nothing when max_rows is None or the statement returns no rows."""
    rows: list[tuple] = []
    truncated = False
    columns: list[str] = []
    if max_rows is not None and cur.description is not None:
        columns = [c[0] for c in cur.description]
        got = cur.fetchmany(max_rows + 1) if max_rows else []
        truncated = len(got) > max_rows
        rows = [tuple(r) for r in got[:max_rows]]
    return columns, rows, truncated


def _driver_error(engine, e: Exception, raw, timed_out: bool, timeout_s: float) -> Exception:
    """The typed error of a driver's exception: QueryTimeoutError past the limit,
    DatabaseConnectionError when the connection is gone, else QueryError (stage "database")."""
    from agentrt.sql.introspect import describe

    if timed_out or _is_timeout(e):
        return QueryTimeoutError(f"the query ran past its {timeout_s:g} s limit and was stopped", "database")
    if _is_disconnect(engine, e, raw):
        return DatabaseConnectionError(f"lost the connection to {describe(engine)}: {_first_line(e)}")
    return QueryError(f"the database refused the query: {_first_line(e)}", "database")


def _unguard(d: str, raw, conn, guards: _Guards) -> None:
    """Stops the timer and undoes the guards: SQLite's handler and query_only, else a rollback;
    a connection that fails it is invalidated (dropped from the pool)."""
    if guards.timer is not None:
        guards.timer.cancel()
    try:
        if d == "sqlite":
            raw.set_progress_handler(None, 0)
            if guards.restore is not None:
                raw.cursor().execute(f"PRAGMA query_only = {int(guards.restore)}")
        else:
            if guards.explicit:
                raw.cursor().execute("ROLLBACK")
            else:
                raw.rollback()
    except Exception:  # noqa: BLE001 (a broken connection: dropped from the pool)
        conn.invalidate()


def _is_disconnect(engine, e: BaseException, raw) -> bool:
    """The driver error `e` means the connection is gone (SQLAlchemy's per-dialect
    `is_disconnect`: psycopg's "server closed the connection unexpectedly", a closed SQLite
    handle), not that the database refused the query."""
    try:
        gone = engine.dialect.is_disconnect(e, raw, None)
    except Exception:  # noqa: BLE001 (a dialect that cannot tell: read the connection itself)
        gone = False
    return bool(gone or getattr(raw, "broken", False) is True or getattr(raw, "closed", False) is True)


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "statement timeout" in text or "canceling statement" in text or "interrupted" in text


# ---- normalize: a query in the grammar's spelling -------------------------------------------


def normalize(query: str, schema: Schema, dialect: str | None = None) -> str:
    """`query` rewritten in agentrt.sql.grammar's spelling (what its grammar accepts for the
    same query): sqlglot's output for the dialect, with table and column names in the catalog's
    spelling and quoted by dialect.quote_ident, table aliases renumbered T1, T2, ... in FROM
    order within each SELECT, and (SQLite) double-quoted names that are no column read as the
    string literals SQLite reads them as. Raises QueryError when the query does not parse or
    names what the schema lacks."""
    sqlglot = _sqlglot()
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    d = dialect_name(dialect or schema.dialect or "sqlite")
    schema = schema.with_dialect(d)
    try:
        tree = sqlglot.parse_one(query, read=d)
    except SqlglotError as e:
        raise QueryError(f"the query does not parse as {d}: {_first_line(e)}", "parse") from None
    for select in list(tree.find_all(exp.Select)):
        _normalize_select(select, schema, d)
    for t in tree.find_all(exp.Table):
        found = schema.table(t.name)
        if found is not None:
            t.set("this", exp.Identifier(this=found.name, quoted=needs_quotes(found.name, d)))
    return tree.sql(dialect=d)


def _own_nodes(select, cls):
    """Nodes of type cls inside `select` but not inside a nested SELECT/set operation."""
    from sqlglot import exp

    out = []
    stack = [select]
    while stack:
        node = stack.pop()
        for child in node.iter_expressions():
            if isinstance(child, (exp.Select, exp.SetOperation)) or (
                isinstance(child, exp.Subquery) and child is not select
            ):
                continue
            if isinstance(child, cls):
                out.append(child)
            stack.append(child)
    return out


def _normalize_select(select, schema: Schema, d: str) -> None:
    from sqlglot import exp

    sources = []  # (old alias lower or table name lower, Table)
    froms = []
    if select.args.get("from_") is not None or select.args.get("from") is not None:
        f = select.args.get("from_") or select.args.get("from")
        froms.append(f.this)
    for j in select.args.get("joins") or []:
        froms.append(j.this)
    tables = [x for x in froms if isinstance(x, exp.Table)]
    rename: dict[str, str] = {}
    aliased = len(froms) > 1 or any(x.alias for x in tables)
    for k, t in enumerate(froms):
        if not isinstance(t, exp.Table):
            continue
        found = schema.table(t.name)
        old = fold_name(t.alias or t.name)
        if aliased:
            new = f"T{k + 1}"
            rename[old] = new
            t.set("alias", exp.TableAlias(this=exp.Identifier(this=new, quoted=False)))
        sources.append((rename.get(old, old), found))
    for col in _own_nodes(select, exp.Column):
        qual = col.table
        target = None
        if qual:
            key = fold_name(qual)
            new = rename.get(key, key)
            for name, table in sources:
                if table is not None and fold_name(name) == fold_name(new):
                    target = table
            if target is not None:
                col.set(
                    "table",
                    exp.Identifier(this=rename.get(key, target.name if not aliased else new), quoted=False),
                )
                if not aliased:
                    col.set("table", exp.Identifier(this=target.name, quoted=needs_quotes(target.name, d)))
        else:
            hits = [t for _, t in sources if t is not None and t.column(col.name) is not None]
            target = hits[0] if len(hits) == 1 else None
        found = target.column(col.name) if target is not None else None
        if found is not None:
            col.set("this", exp.Identifier(this=found.name, quoted=needs_quotes(found.name, d)))
        elif d == "sqlite" and not qual and col.this.quoted:
            col.replace(exp.Literal.string(col.name))  # SQLite reads an unknown "name" as a string
