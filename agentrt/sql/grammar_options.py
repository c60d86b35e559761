"""The options of a schema-aware SQL grammar (agentrt.sql.grammar): its size and length bounds,
read by the generator's modules (grammar, grammar_expr, grammar_select)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_SCOPES = {"sqlite": 64, "duckdb": 48, "postgres": 48}
"""FROM shapes per grammar by default: a strictly typed dialect's scope is about twice the
grammar of a SQLite one, and xgrammar's compile time grows faster than linearly with size."""


@dataclass(frozen=True)
class GrammarOptions:
    """max_scopes: the most FROM-clause shapes (docs/sql-grammar.md, "Column-to-table scoping";
    None: `DEFAULT_MAX_SCOPES` of the dialect);
    max_join_tables: 1 (no joins), 2 or 3; join_on_shared_names: also join tables that share a
    column name; max_set_width: widest set operation / typed subquery list (None: 4 on SQLite, 1
    on PostgreSQL/DuckDB); with_cte: allow the filtered-table WITH form.

    Length bounds (docs/sql-grammar.md, "Bounded length"): max_items select items; max_conditions
    conditions joined by AND/OR in one WHERE, HAVING, ON or parenthesised group; max_keys GROUP BY
    and ORDER BY keys; max_in_list literals in an IN list; max_whens WHEN branches; max_terms
    terms of an arithmetic chain; max_set_members blocks in a set operation;
    max_subquery_depth subqueries inside subqueries (0: no subqueries; each level adds a copy of
    the scope rules, so the grammar grows linearly with it); max_subquery_scopes: the FROM shapes
    a subquery may use (the first of the top level's, in its order: single tables, then joins
    along foreign keys)."""

    max_scopes: int | None = None
    max_join_tables: int = 3
    join_on_shared_names: bool = True
    max_set_width: int | None = None
    with_cte: bool = True
    max_items: int = 6
    max_conditions: int = 3
    max_keys: int = 3
    max_in_list: int = 8
    max_whens: int = 3
    max_terms: int = 3
    max_set_members: int = 3
    max_subquery_depth: int = 1
    max_subquery_scopes: int = 16
