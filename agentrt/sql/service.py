"""SQL generation as the runtime serves it: the databases a server knows by name, the schema-aware
constraint of a request (cached per schema), the prompt, and the check of a generated query.

The constraint (`{"sql": {...}}` on chat and completions, `LLM.sql`, `agentrt sql`) is the grammar
of agentrt/sql/grammar.py (its EBNF form: the same language as its Lark text, without Lark's own
analysis of the grammar) compiled through the ordinary grammar path: read-only queries
that name only the schema's tables and columns, in its dialect. A request names a database the
server was started with (`--database NAME=URL`) or carries the schema itself (DDL text or JSON);
it never carries a connection URL, so a client cannot make the server connect anywhere.

The prompt (`sql_messages`): a system message with the dialect, the schema as CREATE TABLE
statements (keys included) and the instruction to answer with one read-only query only; the
question is the user message.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from agentrt.grammars.spec import ConstraintSpec
from agentrt.sql.ddl import schema_from_ddl
from agentrt.sql.dialect import dialect_name
from agentrt.sql.errors import SchemaError
from agentrt.sql.grammar import sql_grammar
from agentrt.sql.schema import Schema
from agentrt.sql.sources import schema_from_json

SQL_SYSTEM_PROMPT = (
    "You write {dialect} queries. The database has these tables:\n\n{ddl}\n"
    "Answer the user's question with one read-only SQL query (a SELECT) over these tables, "
    "and nothing else."
)
"""The system prompt of a SQL request: {dialect} (SQLite, DuckDB or PostgreSQL) and {ddl} (the
schema as CREATE TABLE statements, Schema.to_ddl)."""

DIALECT_TITLES = {"sqlite": "SQLite", "duckdb": "DuckDB", "postgres": "PostgreSQL"}
GRAMMAR_CACHE_SIZE = 32
"""Schemas whose grammar text is kept (the compiled grammar is cached by the grammar backend)."""


def sql_messages(question: str, schema: Schema, dialect: str | None = None) -> list[dict]:
    """The chat messages of a SQL question: the system prompt (SQL_SYSTEM_PROMPT) and the question."""
    d = dialect_name(dialect or schema.dialect or "sqlite")
    system = SQL_SYSTEM_PROMPT.format(dialect=DIALECT_TITLES[d], ddl=schema.to_ddl(d))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def sql_constraint(schema: Schema, dialect: str | None = None) -> ConstraintSpec:
    """The schema-aware grammar of `schema` in `dialect` (default the schema's own, else SQLite) as
    a ConstraintSpec (EBNF). Raises SchemaError when the schema is too large for the grammar
    (agentrt/sql/grammar.py: GrammarOptions.max_scopes)."""
    return sql_grammar(schema, dialect).spec()


def schema_from_request(source: str | dict, dialect: str | None = None) -> Schema:
    """A schema a request carries: CREATE TABLE text or JSON {table: {column: type}} (a dict or its
    text). Raises SchemaError for anything else, a database URL included (requests never make the
    server connect to an address they choose; name a database the server was started with)."""
    if isinstance(source, dict):
        return schema_from_json(source, dialect)
    if not isinstance(source, str) or not source.strip():
        raise SchemaError("the schema is empty: give CREATE TABLE statements or {table: {column: type}}")
    text = source.strip()
    if text.startswith("{"):
        return schema_from_json(text, dialect)
    if "://" in text.split("\n", 1)[0] and not text.upper().startswith("CREATE"):
        raise SchemaError(
            "a request cannot carry a database URL: give the schema (CREATE TABLE text or JSON), or "
            "name a database the server was started with (--database NAME=URL)"
        )
    return schema_from_ddl(text, dialect or "sqlite")


@dataclass(frozen=True)
class Database:
    """A named database: its read-only SQLAlchemy engine, its dialect and its introspected schema."""

    name: str
    engine: object
    dialect: str
    schema: Schema


def table_limit_warning(db: Database) -> str | None:
    """The line `agentrt serve` prints for a named database with more tables than the grammar's
    default limit (grammar.DEFAULT_MAX_SCOPES for its dialect): every request naming it must
    then choose its tables (`"tables"`). None when it is within the limit."""
    from agentrt.sql.grammar import DEFAULT_MAX_SCOPES

    limit = DEFAULT_MAX_SCOPES[db.dialect]
    if len(db.schema.tables) <= limit:
        return None
    return (
        f"agentrt: warning: database {db.name}: {len(db.schema.tables)} tables, more than the grammar's "
        f'limit of {limit}: each request must name the tables it needs, {{"sql": {{"database": '
        f'"{db.name}", "tables": ["...", "..."]}}}}'
    )


def parse_database_args(specs: list[str] | None) -> dict[str, str]:
    """NAME=URL pairs (`--database`, repeatable) -> {name: url}. Raises ValueError naming a bad or
    repeated one."""
    out: dict[str, str] = {}
    for spec in specs or []:
        name, sep, url = spec.partition("=")
        name = name.strip()
        if not sep or not name or not url.strip():
            raise ValueError(f"--database must be NAME=URL (e.g. shop=sqlite:///shop.db), got {spec!r}")
        if name in out:
            raise ValueError(f"--database {name!r} given twice")
        out[name] = url.strip()
    return out


class SQLDatabases:
    """The databases a server constrains queries to, by name. Each is opened read-only and
    introspected by `load` (at start) and again by `get(..., refresh=True)` (a request asking for it:
    the schema changed). Thread-safe."""

    def __init__(self, urls: Mapping[str, str] | None = None):
        self._urls = dict(urls or {})
        self._dbs: dict[str, Database] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._urls)

    @property
    def names(self) -> list[str]:
        return list(self._urls)

    def load(self) -> None:
        """Open and introspect every database. Raises SchemaError (DatabaseUnreachableError when
        one cannot be read) naming the database."""
        for name in self._urls:
            self._open(name)

    def get(self, name: str, refresh: bool = False) -> Database:
        """The database called `name`, introspected again when `refresh`. Raises SchemaError naming
        an unknown name (and the names there are), or one that can no longer be read."""
        if name not in self._urls:
            known = ", ".join(self._urls) or "none (start the server with --database NAME=URL)"
            raise SchemaError(f"unknown database {name!r}; this server has: {known}")
        with self._lock:
            db = self._dbs.get(name)
        return self._open(name) if db is None or refresh else db

    def _open(self, name: str) -> Database:
        from agentrt.sql.introspect import dialect_of, introspect, open_database

        try:
            engine = open_database(self._urls[name])
            schema = introspect(engine)
        except SchemaError as e:
            raise type(e)(f"database {name!r}: {e.message}") from None
        db = Database(name, engine, dialect_of(engine), schema)
        with self._lock:
            old = self._dbs.get(name)
            self._dbs[name] = db
        if old is not None and old.engine is not engine:
            old.engine.dispose()
        return db
