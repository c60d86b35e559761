"""The table/column model of a database and its limits; reading no source. The sources are
`agentrt.sql.sources` (JSON `{table: {column: type}}`, and `load_schema` for any source),
`agentrt.sql.ddl` (`CREATE TABLE` text, parsed with sqlglot) and `agentrt.sql.introspect` (a live
database); a column's kind is read by `agentrt.sql.kinds`; the errors are `agentrt.sql.errors`.

Model: `Schema(tables)`, each `Table(name, columns, primary_key, foreign_keys)`, each
`Column(name, type, kind)`. Names are the catalog's own spelling (case kept, unquoted); `type` is
the column's SQL type as declared or reflected ("" when SQLite has none); `kind` is its family,
which decides what the grammar lets a query do with it on a strictly typed database:
"num" (integers, decimals, floats), "text" (char/varchar/text), "bool", "date" (dates and
timestamps) or "other" (time of day, interval, blob, JSON, UUID, enum, arrays, unknown).

Limits (work bounded before it is done, refused with SchemaError naming the limit):
`MAX_TABLES` tables, `MAX_COLUMNS` columns over all tables, `MAX_SCHEMA_BYTES` of JSON text,
`MAX_DDL_BYTES` of CREATE TABLE text (sqlglot parses under the GIL: see there), `MAX_NAME_CHARS`
characters per name, `MAX_TYPE_CHARS` characters per JSON column type. A schema over these limits,
one with no table, a table with no column, duplicate names, a foreign key naming a missing
table/column, text that is neither valid JSON nor parsable DDL: SchemaError (a ValueError via
InvalidRequestError; `param` is None, the API layer names the request field).

Name lookup (`Schema.table`, `Table.column`) is case-insensitive on SQLite and DuckDB (their
identifiers are) and exact on PostgreSQL. CREATE TABLE text names the way the database would:
on PostgreSQL an unquoted name folds to lower case (`CREATE TABLE Users (Name text)` is
users(name)), a quoted one keeps its case (sqlglot's normalize_identifiers in the dialect); JSON
keys are catalog names as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentrt.sql.dialect import dialect_name, quote_ident
from agentrt.sql.errors import SchemaError

TypeKind = Literal["num", "text", "bool", "date", "other"]
KINDS: tuple[str, ...] = ("num", "text", "bool", "date", "other")

MAX_TABLES = 1000
"""The most tables a schema may have."""
MAX_COLUMNS = 10_000
"""The most columns over all tables of a schema."""
MAX_SCHEMA_BYTES = 1 << 20
"""The longest JSON schema text (bytes of UTF-8)."""
MAX_DDL_BYTES = 64 << 10
"""The longest CREATE TABLE text `schema_from_ddl` parses by default (bytes of UTF-8). sqlglot
parses in Python, holding the GIL, so a server's other requests wait while it runs: the cap bounds
that stall (seconds at the cap: docs/benchmarks.md, "SQL bad input"), it does not remove it, which
would need the parse in a killable child process with a deadline, as grammar compiles run
(grammars/compile_child.py). Larger schemas: JSON (`MAX_SCHEMA_BYTES`), or a database the server
was started with."""
MAX_NAME_CHARS = 128
"""The longest table or column name (characters)."""
MAX_TYPE_CHARS = 128
"""The longest column type text of a JSON schema (characters). With `kinds.kind_of_type`'s shape
check this bounds a JSON schema's type parsing (measured: docs/benchmarks.md, "SQL bad input")."""


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def fold_name(name: str) -> str:
    """`name` as SQLite and DuckDB compare identifiers: ASCII letters case-folded, other
    characters as they are (SQLite folds ASCII only; sqlglot normalizes the same way)."""
    return name.translate(_ASCII_LOWER)


@dataclass(frozen=True)
class Column:
    """name: catalog spelling; type: SQL type text ("" if none); kind: type family (module doc)."""

    name: str
    type: str = ""
    kind: TypeKind = "other"


@dataclass(frozen=True)
class ForeignKey:
    """columns of this table referencing ref_columns of ref_table (same length, same order)."""

    columns: tuple[str, ...]
    ref_table: str
    ref_columns: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...] = ()
    foreign_keys: tuple[ForeignKey, ...] = ()
    case_sensitive: bool = field(default=False, compare=False, repr=False)

    def column(self, name: str) -> Column | None:
        """The column called `name` (case-insensitively unless case_sensitive), or None."""
        for c in self.columns:
            if c.name == name or (not self.case_sensitive and fold_name(c.name) == fold_name(name)):
                return c
        return None


@dataclass(frozen=True)
class Schema:
    """tables in catalog order. `dialect` is the database's dialect when known (introspection,
    or given with the DDL), else None."""

    tables: tuple[Table, ...]
    dialect: str | None = None

    def __post_init__(self):
        _check(self)

    @property
    def case_sensitive(self) -> bool:
        return self.dialect == "postgres"

    @property
    def num_columns(self) -> int:
        return sum(len(t.columns) for t in self.tables)

    def table(self, name: str) -> Table | None:
        """The table called `name` (case-insensitively except on PostgreSQL), or None."""
        for t in self.tables:
            if t.name == name or (not self.case_sensitive and fold_name(t.name) == fold_name(name)):
                return t
        return None

    def subset(self, names: list[str]) -> Schema:
        """This schema restricted to the tables `names`, in that order (names matched as
        `table()` does; foreign keys among them kept, those to other tables dropped). Raises
        SchemaError naming an unknown table or one named twice."""
        keep: list[Table] = []
        for n in names:
            t = self.table(n)
            if t is None:
                raise SchemaError(f"no table {n!r} in the schema")
            if any(k is t for k in keep):
                raise SchemaError(f"table {n!r} is named twice")
            keep.append(t)
        kept = {t.name for t in keep}
        return Schema(
            tuple(
                Table(
                    t.name,
                    t.columns,
                    t.primary_key,
                    tuple(fk for fk in t.foreign_keys if fk.ref_table in kept),
                    t.case_sensitive,
                )
                for t in keep
            ),
            self.dialect,
        )

    def with_dialect(self, dialect: str) -> Schema:
        """The same tables read as a `dialect` database (name matching follows the dialect)."""
        dialect = dialect_name(dialect)
        cs = dialect == "postgres"
        return Schema(
            tuple(Table(t.name, t.columns, t.primary_key, t.foreign_keys, cs) for t in self.tables), dialect
        )

    def to_json(self) -> dict[str, dict[str, str]]:
        """{table: {column: type}} (the JSON source format; keys and foreign keys are not kept)."""
        return {t.name: {c.name: c.type for c in t.columns} for t in self.tables}

    def to_ddl(self, dialect: str | None = None) -> str:
        """CREATE TABLE statements (names quoted for `dialect`, default the schema's own or
        SQLite), with primary and foreign keys: the schema text a prompt shows the model."""
        d = dialect_name(dialect or self.dialect or "sqlite")
        out = []
        for t in self.tables:
            lines = [f"  {quote_ident(c.name, d)}{' ' + c.type if c.type else ''}" for c in t.columns]
            if t.primary_key:
                lines.append(f"  PRIMARY KEY ({', '.join(quote_ident(c, d) for c in t.primary_key)})")
            for fk in t.foreign_keys:
                cols = ", ".join(quote_ident(c, d) for c in fk.columns)
                refs = ", ".join(quote_ident(c, d) for c in fk.ref_columns)
                lines.append(f"  FOREIGN KEY ({cols}) REFERENCES {quote_ident(fk.ref_table, d)} ({refs})")
            out.append(f"CREATE TABLE {quote_ident(t.name, d)} (\n" + ",\n".join(lines) + "\n);")
        return "\n".join(out) + "\n"


def _check(schema: Schema) -> None:
    """Raise SchemaError for an empty schema, a limit exceeded, duplicate or empty names, or a key
    naming a column/table that does not exist."""
    if not schema.tables:
        raise SchemaError("the schema has no tables")
    if len(schema.tables) > MAX_TABLES:
        raise SchemaError(f"the schema has {len(schema.tables)} tables, over the limit of {MAX_TABLES}")
    if schema.num_columns > MAX_COLUMNS:
        raise SchemaError(f"the schema has {schema.num_columns} columns, over the limit of {MAX_COLUMNS}")
    cs = schema.dialect == "postgres"

    def key(n: str) -> str:
        return n if cs else fold_name(n)

    seen: set[str] = set()
    for t in schema.tables:
        _check_name(t.name, "table")
        if key(t.name) in seen:
            raise SchemaError(f"table {t.name!r} appears twice in the schema")
        seen.add(key(t.name))
        if not t.columns:
            raise SchemaError(f"table {t.name!r} has no columns")
        cols: set[str] = set()
        for c in t.columns:
            _check_name(c.name, f"column of table {t.name!r}")
            if key(c.name) in cols:
                raise SchemaError(f"column {c.name!r} appears twice in table {t.name!r}")
            cols.add(key(c.name))
            if c.kind not in KINDS:
                raise SchemaError(f"column {t.name}.{c.name} has an unknown type kind {c.kind!r}")
        for k in t.primary_key:
            if key(k) not in cols:
                raise SchemaError(f"primary key of table {t.name!r} names a missing column {k!r}")
    for t in schema.tables:
        for fk in t.foreign_keys:
            ref = schema.table(fk.ref_table)
            if ref is None:
                raise SchemaError(
                    f"foreign key of table {t.name!r} references a missing table {fk.ref_table!r}"
                )
            if len(fk.columns) != len(fk.ref_columns) or not fk.columns:
                raise SchemaError(f"foreign key of table {t.name!r} has mismatched column lists")
            for c in fk.columns:
                if t.column(c) is None:
                    raise SchemaError(f"foreign key of table {t.name!r} names a missing column {c!r}")
            for c in fk.ref_columns:
                if ref.column(c) is None:
                    raise SchemaError(
                        f"foreign key of table {t.name!r} references a missing column {fk.ref_table}.{c}"
                    )


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise SchemaError(f"a {what} has an empty name")
    if len(name) > MAX_NAME_CHARS:
        raise SchemaError(f"{what} name {name[:40]!r}... is longer than {MAX_NAME_CHARS} characters")
    if any(ord(ch) < 0x20 for ch in name) or "\x7f" in name:
        raise SchemaError(f"{what} name {name!r} holds a control character")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise SchemaError(f"{what} name {name!r} is not valid Unicode") from None
