"""`agentrt sql`: a question over a database -> one read-only query (schema-aware grammar), printed,
and with --execute its rows. The subcommand's parser and its run, over the SDK's `LLM.sql` (the
command sits above agentrt/sql/, which never imports the SDK)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def add_sql_parser(sub, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `sql` subcommand (with the engine flags) to the `agentrt` subparsers `sub`."""
    q = sub.add_parser("sql", help="write a SQL query for a question over a database (schema-aware grammar)")
    add_engine_args(q)
    q.add_argument("question", help="the question, in words")
    q.add_argument(
        "--database", required=True, help="sqlite:///PATH, duckdb:///PATH or postgresql://... (read-only)"
    )
    q.add_argument(
        "--tables",
        default=None,
        metavar="A,B",
        help="only these tables (a database over the grammar's limit)",
    )
    q.add_argument("--execute", action="store_true", help="run the query (read-only) and print the rows")
    q.add_argument(
        "--max-rows",
        type=_int_at_least(0),
        default=20,
        help="rows printed with --execute (default %(default)s)",
    )
    q.add_argument(
        "--max-tokens", type=_int_at_least(1), default=256, help="query tokens at most (default %(default)s)"
    )
    # one job, not a server: its compile need not yield to other requests, and may take longer
    q.set_defaults(compile_nice=0, compile_timeout=120.0)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum (else argparse's usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def sql_command(config, args: argparse.Namespace) -> int:
    """`agentrt sql`: print the query (and its rows with --execute). Exit 0 when the query passed
    its checks (and ran), 1 when it did not (the reason on stderr), 2 on bad arguments or a
    database that cannot be read."""
    from agentrt.sdk import LLM
    from agentrt.sql.errors import SchemaError
    from agentrt.sql.sources import load_schema

    tables = [t.strip() for t in args.tables.split(",") if t.strip()] if args.tables is not None else None
    try:  # the database (reachable, its tables) before the model loads: a bad URL fails in seconds
        schema = load_schema(args.database)
        if tables is not None:
            schema.subset(tables)
        llm = LLM.from_config(config)
        result = llm.sql(
            args.question,
            args.database,
            tables=tables,
            execute=args.execute,
            max_rows=args.max_rows,
            max_tokens=args.max_tokens,
        )
    except (ValueError, SchemaError) as e:
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2
    print(result.query)
    if not result.valid:
        print(f"agentrt: the query failed its check ({result.stage}): {result.error}", file=sys.stderr)
        return 1
    if result.rows is not None:
        print("\t".join(result.rows.columns))
        for row in result.rows.rows:
            print("\t".join("NULL" if v is None else str(v) for v in row))
        if result.rows.truncated:
            print(f"... (more rows; --max-rows {args.max_rows})")
    return 0
