"""CREATE TABLE text as a Schema (agentrt.sql.schema), parsed with sqlglot in the database's
dialect: `schema_from_ddl`. The text is bounded first (`schema.MAX_DDL_BYTES`: sqlglot parses in
Python, holding the GIL); names come out as the database would make them (PostgreSQL folds
unquoted names to lower case); a CREATE TABLE that cannot be read is an error naming it, never
skipped.
"""

from __future__ import annotations

import re

from agentrt.sql.dialect import dialect_name
from agentrt.sql.errors import SchemaError
from agentrt.sql.kinds import kind_of_datatype
from agentrt.sql.schema import MAX_DDL_BYTES, MAX_TABLES, Column, ForeignKey, Schema, Table, fold_name


def schema_from_ddl(text: str, dialect: str = "sqlite", *, max_bytes: int = MAX_DDL_BYTES) -> Schema:
    """A Schema from `CREATE TABLE` statements in `dialect` (parsed with sqlglot): columns and
    their types (SQLite's typeless columns too), column- and table-level PRIMARY KEY and FOREIGN
    KEY/REFERENCES; other table constraints (UNIQUE, CHECK) are read past. Names as the database
    makes them: PostgreSQL folds unquoted names to lower case (sqlglot's normalize_identifiers),
    so `a int, A int` is a duplicate there. SQLite's table options `WITHOUT ROWID` and `STRICT`
    (which sqlglot cannot parse after the column list) are read past: they change neither names
    nor types. Other statements (INSERT, CREATE INDEX/VIEW, PRAGMA, ...) are skipped.
    Raises SchemaError when the text is over `max_bytes` (default MAX_DDL_BYTES; parse times at
    the cap: docs/benchmarks.md), does not parse, holds a CREATE TABLE that sqlglot cannot read
    as one (named, e.g. PostgreSQL's `CREATE TABLE t OF type`) or without a column list (`AS
    SELECT`, `CREATE VIRTUAL TABLE`: the module decides its columns), holds no CREATE TABLE, or
    breaks a limit."""
    from sqlglot import exp

    d = dialect_name(dialect)
    tables = []
    for st in _parse_statements(text, d, max_bytes):
        if not isinstance(st, exp.Create) or str(st.args.get("kind", "")).upper() != "TABLE":
            continue
        tables.append(_table_of(st, d))
        if len(tables) > MAX_TABLES:
            raise SchemaError(f"the DDL creates more than {MAX_TABLES} tables (the limit)")
    if not tables:
        raise SchemaError("the DDL holds no CREATE TABLE statement")
    tables = _resolve_fk_columns(tables)
    return Schema(tuple(tables), d)


def _parse_statements(text: str, d: str, max_bytes: int) -> list:
    """The sqlglot statements of `text` in dialect d (CREATE TABLEs with SQLite's table options read
    again without them). Raises SchemaError when text is not a string, is over max_bytes, does not
    parse or nests too deeply."""
    import sqlglot
    from sqlglot.errors import SqlglotError

    if not isinstance(text, str):
        raise SchemaError(f"DDL must be a string, got {type(text).__name__}")
    size = len(text.encode(errors="surrogatepass"))
    if size > max_bytes:
        raise SchemaError(
            f"the DDL is {size} bytes, over the limit of {max_bytes} bytes of CREATE TABLE text "
            "(MAX_DDL_BYTES); give a larger schema as JSON {table: {column: type}} or name a database "
            "the server was started with"
        )
    try:
        statements = sqlglot.parse(text, read=d)
        return [_reparse_create_table(st, d) for st in statements if st is not None]
    except SqlglotError as e:
        raise SchemaError(f"the DDL does not parse as {d}: {_first_line(e)}") from None
    except RecursionError:
        raise SchemaError("the DDL is nested too deeply to parse") from None


def _table_of(st, d: str) -> Table:
    """The Table of one CREATE TABLE statement (sqlglot exp.Create) in dialect d: its columns,
    primary key and foreign keys (foreign key columns not yet resolved). Raises SchemaError for a
    CREATE TABLE without a column list (AS SELECT, CREATE VIRTUAL TABLE)."""
    from sqlglot import exp
    from sqlglot.optimizer.normalize_identifiers import normalize_identifiers

    target = st.this
    if not isinstance(target, exp.Schema) or not isinstance(target.this, exp.Table):
        what = "CREATE VIRTUAL TABLE" if _is_virtual(st) else "CREATE TABLE without a column list"
        raise SchemaError(
            f"{what} is not supported in DDL: {st.sql(d)[:80]!r}; give its columns as a CREATE "
            "TABLE or JSON, or name a database the server was started with (introspected)"
        )
    if d == "postgres":  # unquoted names fold to lower case, as PostgreSQL does
        target = normalize_identifiers(target.copy(), dialect=d)
    columns, pk, fks = [], [], []
    for item in target.expressions:
        if isinstance(item, exp.ColumnDef):
            columns.append(_column(item, d, pk, fks))
        elif isinstance(item, exp.Identifier):  # SQLite: a column declared without a type
            columns.append(Column(item.name, "", "other"))
        elif isinstance(item, exp.PrimaryKey):
            pk.extend(_names(item.expressions))
        elif isinstance(item, exp.ForeignKey):
            fks.append(_reference(item.args["reference"], tuple(_names(item.expressions))))
        elif isinstance(item, exp.Constraint):
            for sub in item.expressions:
                if isinstance(sub, exp.PrimaryKey):
                    pk.extend(_names(sub.expressions))
                elif isinstance(sub, exp.ForeignKey):
                    fks.append(_reference(sub.args["reference"], tuple(_names(sub.expressions))))
    cs = d == "postgres"
    return Table(target.this.name, tuple(columns), tuple(pk), tuple(f for f in fks if f is not None), cs)


def _column(item, d: str, pk: list, fks: list) -> Column:
    """The Column of one column definition (sqlglot exp.ColumnDef); its PRIMARY KEY and REFERENCES
    constraints are appended to pk and fks."""
    from sqlglot import exp

    kind = item.args.get("kind")
    # the dialect's spelling, except SQLite's (it writes affinities: BOOLEAN -> INTEGER)
    type_text = "" if kind is None else kind.sql() if d == "sqlite" else kind.sql(d)
    for cons in item.args.get("constraints") or []:
        ck = cons.args.get("kind")
        if isinstance(ck, exp.PrimaryKeyColumnConstraint):
            pk.append(item.name)
        elif isinstance(ck, exp.Reference):
            fks.append(_reference(ck, (item.name,)))
    return Column(item.name, type_text, kind_of_datatype(kind) if kind is not None else "other")


_CREATE_TABLE = re.compile(
    r"\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:(?:GLOBAL|LOCAL)\s+)?(?:TEMP\s+|TEMPORARY\s+|UNLOGGED\s+)?"
    r"(?:VIRTUAL\s+)?TABLE\b",
    re.IGNORECASE,
)
_SQLITE_TABLE_OPTIONS = re.compile(
    r"\)\s*(?:WITHOUT\s+ROWID|STRICT)(?:\s*,\s*(?:WITHOUT\s+ROWID|STRICT))*\s*;?\s*\Z", re.IGNORECASE
)


def _reparse_create_table(st, d: str):
    """`st` as parsed, except a CREATE TABLE that sqlglot could only read as an opaque command
    (exp.Command): on SQLite, with its trailing table options (WITHOUT ROWID, STRICT) taken off
    and parsed again; otherwise SchemaError naming the statement (never skipped: its table would
    be missing from the schema without a word)."""
    import sqlglot
    from sqlglot import exp

    if not isinstance(st, exp.Command) or str(st.this).upper() != "CREATE":
        return st
    statement = f"CREATE{st.args.get('expression') or ''}"
    if not _CREATE_TABLE.match(statement):
        return st  # CREATE INDEX/TRIGGER/...: skipped like the parsed ones
    if d == "sqlite" and _SQLITE_TABLE_OPTIONS.search(statement):
        again = sqlglot.parse(_SQLITE_TABLE_OPTIONS.sub(")", statement), read=d)
        if len(again) == 1 and isinstance(again[0], exp.Create) and isinstance(again[0].this, exp.Schema):
            return again[0]
    short = " ".join(statement.split())
    raise SchemaError(
        f"a CREATE TABLE statement could not be read as {d} DDL: {short[:100]!r}"
        + ("..." if len(short) > 100 else "")
    )


def _is_virtual(st) -> bool:
    from sqlglot import exp

    return st.find(exp.VirtualProperty) is not None


def _names(items) -> list[str]:
    from sqlglot import exp

    out = []
    for x in items:
        if isinstance(x, exp.Ordered):
            x = x.this
        out.append(x.name)
    return out


def _reference(ref, columns: tuple[str, ...]) -> ForeignKey | None:
    """A ForeignKey from sqlglot's Reference (`REFERENCES t(c, ...)`); ref_columns () when the
    DDL names none (the referenced table's primary key, filled in by _resolve_fk_columns)."""
    from sqlglot import exp

    target = ref.this
    if isinstance(target, exp.Schema):
        return ForeignKey(columns, target.this.name, tuple(_names(target.expressions)))
    if isinstance(target, exp.Table):
        return ForeignKey(columns, target.name, ())
    return None


def _resolve_fk_columns(tables: list[Table]) -> list[Table]:
    """Fill the referenced columns of `REFERENCES t` (no column list: t's primary key)."""
    by_name = {fold_name(t.name): t for t in tables}
    out = []
    for t in tables:
        fks = []
        for fk in t.foreign_keys:
            if not fk.ref_columns:
                ref = by_name.get(fold_name(fk.ref_table))
                if ref is None or len(ref.primary_key) != len(fk.columns):
                    raise SchemaError(
                        f"foreign key of table {t.name!r} references {fk.ref_table!r} without naming "
                        "columns, and that table has no matching primary key"
                    )
                fk = ForeignKey(fk.columns, fk.ref_table, ref.primary_key)
            fks.append(fk)
        out.append(Table(t.name, t.columns, t.primary_key, tuple(fks), t.case_sensitive))
    return out


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
