"""Schema-aware SQL generation: the model can only write read-only SQL that names the tables and
columns a database has, in its dialect.

Modules:
- errors.py: SchemaError and DatabaseUnreachableError.
- schema.py: the table/column model (Schema, Table, Column, ForeignKey) and its limits.
- sources.py: a schema from any source (`load_schema`) and from JSON `{table: {column: type}}`
  (`schema_from_json`).
- kinds.py: a column's type family (num, text, bool, date, other) from its type as each source
  spells it.
- ddl.py: the model read from CREATE TABLE text (sqlglot, names as the dialect makes them).
- introspect.py: the model of a live database through SQLAlchemy's inspector (SQLite, DuckDB via
  duckdb-engine, PostgreSQL via psycopg 3); read-only engines (`open_database`).
- dialect.py: dialect names, identifier quoting, string literals, the reserved words.
- grammar.py: the grammar generator (`sql_grammar` -> SQLGrammar with Lark and EBNF texts and
  a ConstraintSpec) and its queries; grammar_select.py: a scope's FROM clause and SELECT blocks;
  grammar_expr.py: values, conditions, aggregates. The language (the subset, the scoping, the
  size bounds): docs/sql-grammar.md.
- validate.py: `validate` (parse, read-only, schema, database EXPLAIN; never raises for a bad
  query), `execute` (read-only, row limit, timeout) and `normalize` (a query in the grammar's
  spelling).
- service.py: the runtime's side (named databases, a request's schema, the constraint, the prompt).

Typical use:

    schema = load_schema("sqlite:///shop.db")            # or DDL text, or {table: {column: type}}
    grammar = sql_grammar(schema)                          # SQLGrammar; grammar.spec() for the engine
    prompt = schema.to_ddl()                               # the schema the model is shown
    check = validate(sql_text, schema, engine=open_database("sqlite:///shop.db"))
    rows = execute(sql_text, open_database("sqlite:///shop.db"), schema, max_rows=100)

Requires the `sql` extra: sqlalchemy (<= 2.0.44 for DuckDB reflection, see introspect.py),
sqlglot, duckdb + duckdb-engine, psycopg[binary].
"""

from agentrt.sql.ddl import schema_from_ddl
from agentrt.sql.dialect import DIALECTS, dialect_name, quote_ident, quote_string
from agentrt.sql.errors import DatabaseUnreachableError, SchemaError
from agentrt.sql.grammar import GrammarOptions, SQLGrammar, sql_grammar
from agentrt.sql.introspect import introspect, open_database
from agentrt.sql.schema import Column, ForeignKey, Schema, Table
from agentrt.sql.sources import load_schema, schema_from_json
from agentrt.sql.validate import (
    DatabaseConnectionError,
    QueryError,
    QueryResult,
    QueryTimeoutError,
    Validation,
    execute,
    normalize,
    validate,
)

__all__ = [
    "DIALECTS",
    "Column",
    "DatabaseConnectionError",
    "DatabaseUnreachableError",
    "ForeignKey",
    "GrammarOptions",
    "QueryError",
    "QueryResult",
    "QueryTimeoutError",
    "SQLGrammar",
    "Schema",
    "SchemaError",
    "Table",
    "Validation",
    "dialect_name",
    "execute",
    "introspect",
    "load_schema",
    "normalize",
    "open_database",
    "quote_ident",
    "quote_string",
    "schema_from_ddl",
    "schema_from_json",
    "sql_grammar",
    "validate",
]
