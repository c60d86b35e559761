"""SQL dialects: names, identifier quoting, literals and the grammar's keyword spelling.

Three dialects, named as sqlglot names them: "sqlite", "duckdb", "postgres" ("postgresql", the
SQLAlchemy name, is accepted for "postgres"). `dialect_name()` maps any accepted spelling to one of
them and raises SchemaError naming the accepted ones otherwise.

Identifier quoting (`quote_ident`): an identifier is written bare when it is a plain ASCII word
(`[A-Za-z_][A-Za-z0-9_]*`; on PostgreSQL lower-case only, `[a-z_][a-z0-9_]*`, because PostgreSQL
folds unquoted names to lower case) and not in `RESERVED`; otherwise it is double-quoted with
embedded double quotes doubled (SQL standard, and the rule of all three dialects). Spaces, mixed
case on PostgreSQL, non-ASCII letters and reserved words are therefore always quoted; quoting is
exact on all three (a quoted name is the catalog name itself).

`RESERVED` was measured, not copied from a manual: every keyword of SQLite's keyword list, of
PostgreSQL 15's `pg_get_keywords()` and of DuckDB's `duckdb_keywords()` (555 words) was used as a
bare column and table name in the positions the grammar writes names (select list, qualified
`T1.x`, WHERE, GROUP BY, ORDER BY, inside COUNT/MAX, IN (subquery), FROM, JOIN ... ON) on SQLite
3.40, DuckDB 2.0 and PostgreSQL 15, and parsed with sqlglot 30 in each dialect; a word is reserved
when any database refused a query, returned something other than the column (`current_date`,
`user`), or sqlglot did not read it as a column/table. The union over the three dialects is used
for all of them (quoting a word that needs no quotes is still exact SQL).
tests/sql/test_sql_grammar.py (test_awkward_identifiers_are_quoted_and_run: SQLite, DuckDB) and
tests/sql/test_sql_postgres.py (test_postgres_grammar_queries_plan) re-check the reserved words
of their test database on the live databases.

String literals are single-quoted with embedded quotes doubled ('it''s'), no backslash escapes
(PostgreSQL with standard_conforming_strings, the default since 9.1); the grammar excludes control
characters from string literals.
"""

from __future__ import annotations

import re

from agentrt.sql.errors import SchemaError

DIALECTS = ("sqlite", "duckdb", "postgres")
_ALIASES = {"sqlite": "sqlite", "duckdb": "duckdb", "postgres": "postgres", "postgresql": "postgres"}

RESERVED = frozenset(
    [
        "add",
        "all",
        "alter",
        "analyse",
        "analyze",
        "and",
        "anti",
        "any",
        "array",
        "as",
        "asc",
        "asof",
        "asymmetric",
        "at",
        "authorization",
        "autoincrement",
        "between",
        "binary",
        "both",
        "by",
        "case",
        "cast",
        "check",
        "collate",
        "collation",
        "column",
        "commit",
        "concurrently",
        "constraint",
        "create",
        "cross",
        "cube",
        "current_catalog",
        "current_date",
        "current_role",
        "current_schema",
        "current_time",
        "current_timestamp",
        "current_user",
        "default",
        "deferrable",
        "delete",
        "desc",
        "describe",
        "distinct",
        "do",
        "drop",
        "else",
        "end",
        "escape",
        "except",
        "exists",
        "false",
        "fetch",
        "for",
        "force",
        "foreign",
        "freeze",
        "from",
        "full",
        "glob",
        "grant",
        "group",
        "having",
        "if",
        "ilike",
        "in",
        "index",
        "initially",
        "inner",
        "insert",
        "install",
        "intersect",
        "into",
        "is",
        "isnull",
        "join",
        "lambda",
        "lateral",
        "leading",
        "left",
        "like",
        "limit",
        "localtime",
        "localtimestamp",
        "lock",
        "map",
        "natural",
        "not",
        "nothing",
        "notnull",
        "null",
        "offset",
        "on",
        "only",
        "or",
        "order",
        "outer",
        "overlaps",
        "pivot",
        "pivot_longer",
        "pivot_wider",
        "placing",
        "positional",
        "primary",
        "qualify",
        "raise",
        "references",
        "regexp",
        "returning",
        "revoke",
        "right",
        "rollback",
        "rollup",
        "select",
        "semi",
        "session_user",
        "set",
        "show",
        "similar",
        "some",
        "summarize",
        "symmetric",
        "table",
        "tablesample",
        "then",
        "to",
        "trailing",
        "transaction",
        "true",
        "union",
        "unique",
        "unpack",
        "unpivot",
        "update",
        "user",
        "using",
        "values",
        "variadic",
        "verbose",
        "when",
        "where",
        "window",
        "with",
    ]
)
"""Words always quoted as identifiers (lower case; see the module docstring for how they were
measured)."""

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PLAIN_PG = re.compile(r"[a-z_][a-z0-9_]*\Z")


def dialect_name(dialect: str) -> str:
    """The canonical name ("sqlite" | "duckdb" | "postgres") of `dialect` (case-insensitive; the
    SQLAlchemy name "postgresql" too). Raises SchemaError naming the supported dialects."""
    name = _ALIASES.get(str(dialect).lower()) if isinstance(dialect, str) else None
    if name is None:
        raise SchemaError(f"unsupported SQL dialect {dialect!r}: expected one of {', '.join(DIALECTS)}")
    return name


def needs_quotes(name: str, dialect: str) -> bool:
    """Whether identifier `name` must be double-quoted in `dialect` (module docstring)."""
    plain = _PLAIN_PG if dialect == "postgres" else _PLAIN
    return not plain.match(name) or name.lower() in RESERVED


def quote_ident(name: str, dialect: str) -> str:
    """`name` as the grammar writes it in `dialect`: bare, or double-quoted with `"` doubled."""
    if needs_quotes(name, dialect):
        return '"' + name.replace('"', '""') + '"'
    return name


def quote_string(text: str) -> str:
    """`text` as a single-quoted SQL string literal ('' for an embedded quote)."""
    return "'" + text.replace("'", "''") + "'"


def strict_types(dialect: str) -> bool:
    """True where comparing or combining values of different type families is an error the
    database reports at planning time (PostgreSQL, DuckDB); SQLite converts instead."""
    return dialect in ("duckdb", "postgres")
