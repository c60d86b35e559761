"""FROM-clause shapes (*scopes*) of a schema-aware SQL grammar, in priority order (the order and
the budget are explained in docs/sql-grammar.md, "Column-to-table scoping")."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

from agentrt.sql.errors import SchemaError
from agentrt.sql.schema import Schema, Table, fold_name

ALIASES = ("T1", "T2", "T3")


@dataclass(frozen=True)
class Binding:
    table: Table
    alias: str | None  # None: the table is written bare and qualifies its columns by its name


@dataclass(frozen=True)
class Scope:
    """One FROM clause shape: its tables with their aliases, in FROM order."""

    bindings: tuple[Binding, ...]

    def describe(self) -> str:
        return ", ".join(b.table.name + (f" AS {b.alias}" if b.alias else "") for b in self.bindings)


def scopes_of(schema: Schema, opts, budget: int, dropped: list[str]) -> list[Scope]:
    """The FROM shapes of `schema`, in priority order, cut at `budget` (what the cut leaves out
    is appended to `dropped`). opts: the GrammarOptions (max_join_tables, join_on_shared_names).
    Raises SchemaError when the schema has more tables than `budget`."""
    tables = schema.tables
    n = len(tables)
    if n > budget:
        raise SchemaError(
            f"the schema has {n} tables, more than the grammar's limit of {budget} FROM shapes "
            "(GrammarOptions.max_scopes); give the tables the question needs (the sql constraint's "
            '"tables": [...], LLM.sql(tables=...), agentrt sql --tables, or Schema.subset)'
        )
    idx = {id(t): i for i, t in enumerate(tables)}
    fk_adj: dict[int, set[int]] = defaultdict(set)
    for t in tables:
        for fk in t.foreign_keys:
            a, b = idx[id(t)], idx[id(schema.table(fk.ref_table))]
            fk_adj[a].add(b)
            fk_adj[b].add(a)
    name_adj: dict[int, set[int]] = defaultdict(set)
    score: dict[tuple[int, int], int] = {}
    if opts.join_on_shared_names:
        fold = (lambda s: s) if schema.case_sensitive else fold_name
        cols = [{fold(c.name) for c in t.columns} for t in tables]
        pks = [{fold(c) for c in t.primary_key} for t in tables]
        for a, b in itertools.combinations(range(n), 2):
            shared = cols[a] & cols[b]
            if shared and b not in fk_adj[a]:
                name_adj[a].add(b)
                name_adj[b].add(a)
                # a shared key column is a likelier join than a shared "name" or "key" column
                score[a, b] = score[b, a] = max(
                    2 if c in pks[a] or c in pks[b] else 1 if c.endswith(("id", "code", "_no")) else 0
                    for c in shared
                )
    joins = opts.max_join_tables >= 2
    fk_pairs = [(a, b) for a in range(n) for b in sorted(fk_adj[a])] if joins else []
    name_pairs = [(a, b) for a in range(n) for b in sorted(name_adj[a])] if joins else []
    name_pairs.sort(key=lambda p: -score[p])  # stable: table order within a score
    triples: list[list[tuple[int, int, int]]] = [[], [], []]  # by foreign-key links: 2, 1, 0
    if opts.max_join_tables >= 3:
        for a, b in fk_pairs + name_pairs:
            # a third table, not one of the two again (a self-join chain ranked as two foreign-key
            # links pushed Student-Has_Pet-Pets out of a subquery's first scopes: Spider pets_1)
            for c in sorted((fk_adj[a] | fk_adj[b] | name_adj[a] | name_adj[b]) - {a, b}):
                links = (b in fk_adj[a]) + (c in fk_adj[a] or c in fk_adj[b])
                names = score.get((a, b), 0) + max(score.get((a, c), 0), score.get((b, c), 0))
                triples[2 - links].append((-names, len(triples[2 - links]), (a, b, c)))
        triples = [[t for _, _, t in sorted(group)] for group in triples]
    scopes = [Scope((Binding(t, None),)) for t in tables]
    pair = lambda ps: [[(i, "T1"), (j, "T2")] for i, j in ps]
    triple = lambda ts: [list(zip(t, ALIASES)) for t in ts]
    keyed = [p for p in name_pairs if score[p] > 0]
    for what, seqs in (
        ("joins of two tables linked by a foreign key", pair(fk_pairs)),
        ("joins of two tables sharing a key column name", pair(keyed)),
        ("joins of three tables linked by foreign keys", triple(triples[0])),
        ("single tables with an alias (`t AS T1`)", [[(i, "T1")] for i in range(n)]),
        ("joins of three tables with one foreign-key link", triple(triples[1])),
        ("joins of two tables sharing another column name", pair([p for p in name_pairs if score[p] == 0])),
        ("joins of three tables sharing column names", triple(triples[2])),
    ):
        room = max(budget - len(scopes), 0)
        if len(seqs) > room:
            dropped.append(f"{what}: {len(seqs) - room} of {len(seqs)} left out by max_scopes={budget}")
            seqs = seqs[:room]
        for seq in seqs:
            scopes.append(Scope(tuple(Binding(tables[i], alias) for i, alias in seq)))
    return scopes
