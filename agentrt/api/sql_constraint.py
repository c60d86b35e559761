"""The `sql` constraint of a chat or completions request (agentrt/sql/): resolve the request's
field into a grammar, a schema and (for a named database) its engine, and check the finished
queries of a response. No HTTP framework here; serving.py calls these around a generation."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NamedTuple

from agentrt.api.errors import APIError
from agentrt.api.protocol import SQLConstraint
from agentrt.grammars.spec import ConstraintSpec
from agentrt.sql.dialect import dialect_name
from agentrt.sql.service import SQLDatabases

if TYPE_CHECKING:
    from agentrt.api.generation import ServingResult


class SQLTarget(NamedTuple):
    """A request's `sql` constraint resolved: the grammar, the schema, the dialect, and the named
    database's SQLAlchemy engine (None for a schema the request carried)."""

    spec: ConstraintSpec
    schema: Any
    dialect: str
    engine: Any


async def sql_target(databases: SQLDatabases | None, sql: SQLConstraint) -> SQLTarget:
    """The schema, dialect, database (when named) and grammar of a request's `sql` field, from the
    server's `databases`, restricted to `sql.tables` when given; the schema work runs off the event
    loop. Raises APIError (400) naming the field: both or neither of schema and database, an
    unknown database, a schema that is empty, unparsable or too large, a dialect that disagrees
    with the named database's, a table `tables` names that the schema lacks; 503 (the server's
    side, retryable) when a named database asked to `refresh` cannot be reached."""
    from agentrt.sql.errors import DatabaseUnreachableError, SchemaError
    from agentrt.sql.service import schema_from_request, sql_constraint

    if (sql.schema_ is None) == (sql.database is None):
        raise APIError("sql: give exactly one of schema and database", param="sql")
    param = "sql.database" if sql.database is not None else "sql.schema"
    try:
        if sql.database is not None:
            db = await asyncio.to_thread((databases or SQLDatabases()).get, sql.database, sql.refresh)
            if sql.dialect is not None and dialect_name(sql.dialect) != db.dialect:
                raise SchemaError(f"database {db.name!r} is {db.dialect}, not {sql.dialect}")
            schema, dialect, engine = db.schema, db.dialect, db.engine
        else:
            dialect = dialect_name(sql.dialect or "sqlite")
            schema = await asyncio.to_thread(schema_from_request, sql.schema_, dialect)
            engine = None
        if sql.tables is not None:
            try:
                schema = schema.subset(sql.tables)
            except SchemaError as e:
                raise APIError(f"sql.tables: {e.message}", param="sql.tables") from None
        spec = await asyncio.to_thread(sql_constraint, schema, dialect)
    except DatabaseUnreachableError as e:
        raise APIError(f"{param}: {e.message}", status=503, type_="server_error") from None
    except SchemaError as e:
        raise APIError(f"{param}: {e.message}", param=param) from None
    return SQLTarget(spec, schema, dialect, engine)


async def sql_databases_listing(databases: SQLDatabases | None) -> dict:
    """GET /v1/sql/databases: the databases the server was started with (`--database NAME=URL`),
    each with what a client needs to build the prompt `LLM.sql` and `agentrt sql` use: `name`,
    `dialect`, `num_tables`, `num_columns`, `tables` (names), `max_tables` (the grammar's limit:
    over it, a request must choose `sql.tables`), `ddl` (Schema.to_ddl in the dialect) and
    `system_prompt` (agentrt/sql/service.py's SQL_SYSTEM_PROMPT filled in). Never the URL."""
    from agentrt.sql.grammar import DEFAULT_MAX_SCOPES
    from agentrt.sql.service import sql_messages

    def listing() -> list[dict]:
        out = []
        for name in databases.names if databases else []:
            db = databases.get(name)
            out.append(
                {
                    "name": name,
                    "dialect": db.dialect,
                    "num_tables": len(db.schema.tables),
                    "num_columns": db.schema.num_columns,
                    "tables": [t.name for t in db.schema.tables],
                    "max_tables": DEFAULT_MAX_SCOPES[db.dialect],
                    "ddl": db.schema.to_ddl(db.dialect),
                    "system_prompt": sql_messages("", db.schema, db.dialect)[0]["content"],
                }
            )
        return out

    return {"object": "list", "data": await asyncio.to_thread(listing)}


async def add_sql_checks(result: ServingResult, target: SQLTarget | None) -> ServingResult:
    """With a `sql` constraint, each choice of a complete chat/completions body gets a `sql_check`
    ({valid, error, stage, checked_database}: sqlglot in the dialect, the names in the schema, and
    EXPLAIN on a named database; agentrt/sql/validate.py). A choice that did not end (finish_reason
    "length") is invalid with stage "length", even when its text happens to parse: the grammar
    may have continued it (`LIMIT 10` cut from `LIMIT 100`). Streams are not checked."""
    if target is None or result.body is None:
        return result
    from agentrt.sql.validate import validate

    for choice in result.body["choices"]:
        if choice.get("finish_reason") != "stop":
            choice["sql_check"] = {
                "valid": False,
                "error": f"the query did not end within max_tokens (finish_reason "
                f"{choice.get('finish_reason')!r}): it may be cut short",
                "stage": "length",
                "checked_database": False,
            }
            continue
        query = choice["message"]["content"] if "message" in choice else choice["text"]
        v = await asyncio.to_thread(validate, query or "", target.schema, target.dialect, target.engine)
        choice["sql_check"] = {
            "valid": v.ok,
            "error": v.error,
            "stage": v.stage,
            "checked_database": v.checked_database,
        }
    return result
