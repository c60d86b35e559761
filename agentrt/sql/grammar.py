"""Schema-aware SQL grammars: every sentence is one read-only query that names only the
schema's tables and columns, in the dialect's spelling, and that the database accepts
(tests/sql check this with EXPLAIN on random walks through the compiled grammar and on random
sentences of its rules, for SQLite, DuckDB and PostgreSQL).

`sql_grammar(schema, dialect, options)` returns an SQLGrammar holding the same rules twice: as a
Lark grammar (start rule `start`; agentrt compiles it through grammars/lark_grammar.py, the
`ConstraintSpec.lark` path) and as xgrammar EBNF (root rule `root`, `ConstraintSpec.grammar`).
`SQLGrammar.spec()` gives the EBNF spec: same language (tested), but it skips Lark's own
analysis of the grammar, which costs more than xgrammar's compile on these grammars (measured:
concert_singer, 32 FROM shapes: 1.3 s through EBNF, 5.4 s through Lark).

## The subset

`[WITH cte AS (SELECT * FROM t [WHERE ...] [ORDER BY ...] [LIMIT n]) ]query`, a query being a
SELECT block or a set operation (UNION [ALL] / INTERSECT / EXCEPT) of blocks. A block:
`SELECT [DISTINCT] items FROM from [WHERE cond] [GROUP BY ... [HAVING cond]] [ORDER BY ...]
[LIMIT n [OFFSET m]]`; `from` is one table (`t`, `t AS T1`), a join of two or three tables
(`t AS T1 [INNER |LEFT ]JOIN u AS T2 ON T1.a = T2.b [AND|OR ...] ...`), or a derived table
(`SELECT COUNT(*) | * FROM (query)`); the block after `WITH` reads `FROM cte AS T1` with t's
columns. Values: columns (bare, `table.column` in an unaliased single-table block, `T1.column`
with aliases T1..T3 numbered in FROM order), literals (numbers, 'strings', and on
PostgreSQL/DuckDB TRUE/FALSE and 'YYYY-MM-DD' dates), arithmetic (+ - * /, || for text),
COUNT(*) / COUNT|SUM|AVG|MIN|MAX([DISTINCT] x), ABS, ROUND, LENGTH, UPPER, LOWER, TRIM, SUBSTR,
COALESCE, CASE WHEN ... THEN ... [ELSE ...] END (over plain values), scalar subqueries.
Conditions: comparisons (= <> != < > <= >=), [NOT] IN (literals | subquery), [NOT] BETWEEN,
[NOT] LIKE, IS [NOT] NULL, EXISTS (subquery), AND / OR / NOT, parentheses; HAVING conditions
compare aggregates (comparisons, BETWEEN, IN). Spelling: keywords upper-case, single spaces,
`, ` between items, so the model's choices are few; sqlglot's own output for these constructs
is accepted too (`NOT x IN (...)`, `<>`, `EXISTS(...)`, `SUBSTRING`), which is how
`validate.normalize` writes known-good queries in the grammar's spelling.

Not in the subset: correlated subqueries (a subquery sees only its own FROM), window
functions, CAST, output aliases (`AS name`), `T1.*`, RIGHT/FULL/CROSS/NATURAL joins, USING,
joins of four or more tables, recursive CTEs, CTEs other than the filtered-table form above.

## Bounded length

Every repetition has a bound (`GrammarOptions`), so the language is finite and a model that
starts repeating itself is led back to the end of the query. Measured before the bounds: the
135M default model wrote `SELECT Theme, Theme, Theme, ...` and `SUBSTRING(SUBSTRING(...` until
max_tokens cut the query (6 of 8 Spider trial queries). Bounds (defaults): select items (6),
conditions joined by AND/OR in a WHERE, HAVING, ON or parenthesised group (3; a group holds
[NOT] predicates, so parentheses do not nest), GROUP BY / ORDER BY keys (3), IN-list literals
(8), WHEN branches (3), terms of an arithmetic chain (3), blocks of a set operation (3), string
literals (`rules.MAX_TEXT_CHARS`, 64 characters) and numbers (15 digits, 6 decimals). Calls
nest one level: a call's argument is an arithmetic chain of columns, aggregates and scalar
subqueries (`ROUND(AVG(x), 2)`, `ABS(a - b)`, not `UPPER(TRIM(x))`), and a CASE branch's
condition and values are built from those too. Subqueries nest `max_subquery_depth` deep
(default 1: a subquery holds no subquery); each level is another copy of the scope rules, over
the first `max_subquery_scopes` scopes (default 16), which bounds the cost. All 50 Spider gold
queries of the sample are inside these bounds (tests/sql). The bound on a sentence's length
(`Rules.max_bytes`) is finite but multiplicative (about 10^15 bytes on a Spider database), so it
is no max_tokens to give. What ends every query within max_tokens is `max_tokens_policy:
"close"` (grammars/length_policy.py; the default of the `sql` constraint and of LLM.sql): its
closing-path search gave up on the unbounded grammar (past its limit of bitmask fills) and
finds a path on this one (measured: docs/benchmarks.md, Spider). The bounds cost compile time:
larger caps compile slower (measured on concert_singer, same run: the caps above 7.3 s, caps
8/4/4/16/4/4 11.2 s, on a loaded 2-core box), hence these defaults.

## Column-to-table scoping (enforced, not measured)

The grammar is split into *scopes*: a scope is one FROM clause shape (a table, a table with
alias T1, or a join sequence with aliases T1..Tk). The model commits to a scope right after
`SELECT `, and inside that block every column reference is one of the scope's columns: bare
names only where they are unambiguous (present in exactly one table of the scope), qualified
names only with the scope's own prefixes. So a column of a table not in the FROM clause, an
ambiguous bare column, or an alias that was not declared cannot be written. Expression rules are
generated once per scope (per mode, and on strict dialects per type family), so the grammar
grows linearly with the number of scopes; a subquery chooses its own scope (not correlated).

Which scopes exist, in this order, until `GrammarOptions.max_scopes` (default
`DEFAULT_MAX_SCOPES`: 64 on SQLite, 48 on DuckDB/PostgreSQL):
1. every table, unaliased (a schema with more tables than `max_scopes` is refused with a
   SchemaError naming `Schema.subset` as the way out);
2. ordered pairs of tables linked by a foreign key (either direction);
3. ordered pairs sharing a key-like column name (a primary key of either, or a name ending in
   id/code/_no; `join_on_shared_names`: Spider and many real schemas declare few foreign keys);
4. triples `a, b, c` linked by two foreign keys (c may repeat a table: `Highschooler, Friend,
   Highschooler`);
5. every table as `t AS T1` (also what the WITH form needs);
6. triples with one foreign-key link, then pairs sharing another column name, then triples
   linked by names only, those with the most key-like shared names first.
`SQLGrammar.dropped` says what the budget left out. A join's ON clause compares qualified
columns of one type family of the tables joined so far (`=`, joined by AND/OR).

## What else the grammar enforces (so that the database accepts every query)

- Aggregates: none in WHERE, ON, GROUP BY or inside another aggregate; HAVING only after GROUP
  BY; on SQLite, aggregates in ORDER BY only after GROUP BY (SQLite reports "misuse of
  aggregate" otherwise); ORDER BY of a set operation only by result position (1..width).
- Widths: `IN (subquery)` and scalar subqueries have exactly one result column; both sides of a
  set operation have the same number of columns (widths 1..`max_set_width`: default 4 on SQLite,
  1 on PostgreSQL/DuckDB, where the columns are type-checked too).
- PostgreSQL and DuckDB are strictly typed and strict about grouping, so there (and only there):
  values carry a type family (num, text, bool, date; "other" columns such as blobs, JSON, UUID
  can only be selected, counted or tested for NULL), comparisons, IN, BETWEEN, CASE branches,
  COALESCE and set-operation columns stay within one family, SUM/AVG take numbers, LIKE text,
  MIN/MAX numbers, text or dates; a grouped block puts its grouping expressions first and groups
  by position (`SELECT T1.name, COUNT(*) FROM ... GROUP BY 1`), its other items and HAVING/ORDER
  BY use columns only inside aggregates; with DISTINCT, ORDER BY is by position and "other"
  columns are left out (json has no equality); a literal never heads an arithmetic chain or
  divides (no constant-folding error at plan time, no division by a literal zero). A derived
  table gets the alias PostgreSQL 15 requires.
- SQLite is dynamically typed and lenient about grouping: one value family, and the gold-query
  style `SELECT T1.name ... GROUP BY T1.id` is kept.
- Identifiers are quoted by `dialect.quote_ident`; string literals by `dialect.quote_string`
  (no control characters; no backslash in LIKE patterns). No `;`, no statement but a query.

Known gap: PostgreSQL matches a bare ORDER BY name against output column names first, so a
column named like a function (`upper`) ordered bare while two select items are that function
is "ambiguous" there; not prevented.

## Size

Every scope costs its own expression rules (about 30 rules, 5 KB of EBNF on SQLite; twice that
on strict dialects), so the grammar is linear in the number of scopes and, through the column
lists shared per table, in the number of columns; xgrammar's compile time grows faster than
linearly with grammar size (measured on 2 CPU cores: 64 SQLite scopes about 3.5 s, 128 about
9 s), hence the budget. `SQLGrammar.stats` gives scopes, rules and bytes.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from agentrt.sql.dialect import dialect_name, quote_ident, strict_types
from agentrt.sql.rules import (
    CMP,
    DATE,
    JOINS,
    LIKE_TEXT,
    LIMIT_N,
    NUM,
    NUM_NONZERO,
    SETOPS,
    SMALL_INT,
    TEXT,
    Lit,
    Rep,
    Rules,
    fn_call,
    joined,
    optional,
)
from agentrt.sql.schema import Schema, SchemaError, Table, fold_name
from agentrt.sql.scopes import Scope, scopes_of

DEFAULT_MAX_SCOPES = {"sqlite": 64, "duckdb": 48, "postgres": 48}
"""FROM shapes per grammar by default: a strictly typed dialect's scope is about twice the
grammar of a SQLite one, and xgrammar's compile time grows faster than linearly with size."""


@dataclass(frozen=True)
class GrammarOptions:
    """max_scopes: the most FROM-clause shapes (module docstring, "Column-to-table scoping"; None:
    `DEFAULT_MAX_SCOPES` of the dialect);
    max_join_tables: 1 (no joins), 2 or 3; join_on_shared_names: also join tables that share a
    column name; max_set_width: widest set operation / typed subquery list (None: 4 on SQLite, 1
    on PostgreSQL/DuckDB); with_cte: allow the filtered-table WITH form.

    Length bounds (module docstring, "Bounded length"): max_items select items; max_conditions
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


@dataclass
class SQLGrammar:
    """lark: the grammar text (start rule `start`); ebnf: the same rules as xgrammar EBNF (root
    rule `root`), which skips Lark's own analysis of the grammar (most of the compile time of a
    large schema); scopes: the FROM shapes it allows; dropped: what GrammarOptions left out, one
    line each; stats: rules, scopes, bytes; rules: the rule table (below)."""

    lark: str
    ebnf: str
    dialect: str
    schema: Schema
    scopes: list[Scope]
    dropped: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    rules: dict = field(default_factory=dict, repr=False)
    """The rule table both texts are written from: {name: [alternative: [symbol]]}, a symbol
    being a rule name (str), a `Lit` or a `Re` (tests sample sentences from it)."""

    def spec(self, lark: bool = False):
        """The ConstraintSpec for agentrt's grammar backend: kind "grammar" (the EBNF), or with
        lark=True kind "lark" (the same language through grammars/lark_grammar.py)."""
        from agentrt.grammars.spec import ConstraintSpec

        return ConstraintSpec.lark(self.lark) if lark else ConstraintSpec.grammar(self.ebnf)


# ---- the generator ----------------------------------------------------------------------------


class _Gen:
    """Builds the rules (see the module docstring). Rule names: `sN_...` belong to scope N,
    `tcI_kind` list the columns of table I, the rest are shared."""

    def __init__(self, schema: Schema, dialect: str, opts: GrammarOptions):
        self.schema, self.d, self.opts = schema, dialect, opts
        self.strict = strict_types(dialect)
        self.kinds = ("num", "text", "bool", "date") if self.strict else ("any",)
        # kinds a pure (aggregate) value may have on strict dialects: no boolean aggregates
        self.pure_kinds = ("num", "text", "date")
        self.modes = ("p", "u") if self.strict else ("p", "a")
        self.width = opts.max_set_width if opts.max_set_width is not None else (1 if self.strict else 4)
        if self.strict:
            self.sigs = [
                sig for w in range(1, self.width + 1) for sig in itertools.product(self.kinds, repeat=w)
            ]
            self.widths = {"__".join(sig): len(sig) for sig in self.sigs}
        else:
            self.sigs = []
            self.widths = {f"w{w}": w for w in range(1, self.width + 1)}
        self.r = Rules()
        self.tidx = {id(t): i for i, t in enumerate(schema.tables)}
        self.fold = (lambda s: s) if schema.case_sensitive else fold_name
        self.cte = self._cte_name()
        self.cores: dict[str, list[str]] = defaultdict(list)
        self.blks: dict[str, list[str]] = defaultdict(list)
        self.depth = opts.max_subquery_depth
        self.level = self.depth  # the level being built (module docstring, "Bounded length")

    def sp(self, si: int) -> str:
        """The rule-name prefix of scope `si` at the current level."""
        return f"s{si}_" if self.level == self.depth else f"s{si}l{self.level}_"

    def qn(self, name: str) -> str:
        """A query rule's name (`q_any`, `q1_num`, `blk_any`, ...) at the current level."""
        return name if self.level == self.depth else f"l{self.level}{name}"

    def sub(self, name: str) -> str | None:
        """A query rule's name one level down (a subquery), None at level 0 (no subqueries)."""
        return f"l{self.level - 1}{name}" if self.level > 0 else None

    def q(self, name: str) -> Lit:
        return Lit(quote_ident(name, self.d))

    def kind(self, col) -> str:
        return col.kind if self.strict else "any"

    def _cte_name(self) -> str:
        names = {self.fold(t.name) for t in self.schema.tables}
        name, i = "cte", 1
        while self.fold(name) in names:
            name, i = f"cte{i}", i + 1
        return name

    def table_cols(self, t: Table, kind: str) -> str:
        """Rule: the quoted names of t's columns of `kind` (shared by every scope)."""
        name = f"tc{self.tidx[id(t)]}_{kind}"
        if name not in self.r.rules:
            self.r.add(name, [[self.q(c.name)] for c in t.columns if self.kind(c) == kind])
        return name

    # -- shared rules
    def shared(self) -> None:
        r = self.r
        if self.strict:
            r.add("lit_num", [[NUM]])
            r.add("lit_text", [[TEXT]])
            r.add("lit_bool", [[Lit("TRUE")], [Lit("FALSE")]])
            r.add("lit_date", [[DATE]])
            r.add("aop_num", [[Lit(o)] for o in (" + ", " - ", " * ")])
            r.add("aop_text", [[Lit(" || ")]])
        else:
            r.add("lit_any", [[NUM], [TEXT]])
            r.add("aop_any", [[Lit(o)] for o in (" + ", " - ", " * ", " / ", " || ")])
        for k in self.kinds:
            if k != "bool":
                r.bounded("inl_" + k, "lit_" + k, [", "], self.opts.max_in_list)
        r.add("limit", [[Lit(" LIMIT "), LIMIT_N], [Lit(" LIMIT "), LIMIT_N, Lit(" OFFSET "), LIMIT_N]])
        r.add("dir", [[Lit(" ASC")], [Lit(" DESC")]])
        r.add("setop", [[Lit(s)] for s in SETOPS])
        r.add("cmp", [[Lit(c)] for c in CMP])
        r.add("distinct", [[Lit("DISTINCT ")]])
        r.add("join_kw", [[Lit(j)] for j in JOINS])

    # -- per scope
    def scope(self, si: int, s: Scope) -> None:
        r, P = self.r, self.sp(si)
        single = len(s.bindings) == 1
        counts: dict[str, int] = defaultdict(int)
        for b in s.bindings:
            for c in b.table.columns:
                counts[self.fold(c.name)] += 1
        for kind in self.kinds + (("other",) if self.strict else ()):
            alts = []
            for b in s.bindings:
                tc = self.table_cols(b.table, kind)
                prefix = b.alias if b.alias else quote_ident(b.table.name, self.d)
                alts.append([Lit(prefix + "."), tc])
                mine = [c for c in b.table.columns if self.kind(c) == kind]
                if single or all(counts[self.fold(c.name)] == 1 for c in mine):
                    alts.append([tc])
                else:  # bare names: only those in exactly one table of the scope
                    alts += [[self.q(c.name)] for c in mine if counts[self.fold(c.name)] == 1]
            r.add(P + "col_" + kind, alts)
        frm: list = []
        for k, b in enumerate(s.bindings):
            frm += [self.q(b.table.name)] + ([Lit(" AS " + b.alias)] if b.alias else [])
            if k:
                frm[-2:-2] = ["join_kw"]
                frm += [Lit(" ON "), self.on_rule(s, k)]
        r.add(P + "from", [frm])
        r.add(P + "fw", [[Lit(" FROM "), P + "from"], [Lit(" FROM "), P + "from", Lit(" WHERE "), P + "c_p"]])
        self.when_conditions(P)
        for m in self.modes:
            self.conditions(P, m)
            for kind in self.kinds if m != "u" else self.pure_kinds:
                self.values(P, m, kind)
        self.aggregates(P)
        if self.strict:
            self.strict_blocks(P)
        else:
            self.sqlite_blocks(P)

    def on_rule(self, s: Scope, k: int) -> str:
        """Rule: the ON condition joining binding k (k >= 1) to bindings 0..k-1: equalities of
        qualified columns of one kind, joined by AND / OR."""
        key = "on_" + "_".join(str(self.tidx[id(b.table)]) for b in s.bindings[: k + 1])
        if key in self.r.rules:
            return key
        preds = []
        for kind in self.kinds:
            qc = f"{key}_{kind}"
            self.r.add(
                qc, [[Lit(b.alias + "."), self.table_cols(b.table, kind)] for b in s.bindings[: k + 1]]
            )
            preds.append([qc, Lit(" = "), qc])
        self.r.add(key + "_p", preds)
        return self.r.bounded(key, key + "_p", [" AND ", " OR "], self.opts.max_conditions)

    def v(self, P: str, m: str, kind: str) -> str:
        return f"{P}v_{m}_{kind}"

    def rhs(self, P: str, m: str, kind: str) -> str:
        return f"{P}r_{m}_{kind}"

    def conditions(self, P: str, m: str) -> None:
        """c (1..max_conditions of n joined by AND/OR), n ([NOT] predicate, or [NOT] a
        parenthesised group of [NOT] predicates) and predicates of scope P in mode m (p: no
        aggregates; a: SQLite, aggregates and columns; u: strict, columns only inside
        aggregates). AND/OR precedence is left to the database: the text is the same."""
        r, k = self.r, self.opts.max_conditions
        c, n, pr = P + "c_" + m, P + "n_" + m, P + "pr_" + m
        g, gn = P + "g_" + m, P + "gn_" + m
        r.bounded(c, n, [" AND ", " OR "], k)
        r.add(n, [[Lit("NOT "), pr], [pr], [Lit("("), g, Lit(")")], [Lit("NOT ("), g, Lit(")")]])
        r.add(gn, [[Lit("NOT "), pr], [pr]])
        r.bounded(g, gn, [" AND ", " OR "], k)
        q_any = self.sub("q_any")
        q1 = lambda kind: self.sub("q1_" + kind)
        if m != "p":  # HAVING: comparisons of aggregates (a smaller set keeps the grammar small)
            preds: list[list] = []
            for kind in self.kinds if m != "u" else self.pure_kinds:
                v, rr = self.v(P, m, kind), self.rhs(P, m, kind)
                preds += [
                    [v, "cmp", rr],
                    [v, Lit(" BETWEEN "), rr, Lit(" AND "), rr],
                    [v, Lit(" IN ("), "inl_" + kind, Lit(")")],
                ]
                if q_any:
                    preds.append([v, Lit(" IN ("), q1(kind), Lit(")")])
            r.add(pr, preds)
            return
        preds = [[Lit("EXISTS ("), q_any, Lit(")")], [Lit("EXISTS("), q_any, Lit(")")]] if q_any else []
        for kind in self.kinds:
            v, rr = self.v(P, m, kind), self.rhs(P, m, kind)
            preds += [[v, Lit(" IS NULL")], [v, Lit(" IS NOT NULL")]]
            if kind == "bool":
                preds += [[v], [v, Lit(" = "), rr], [v, Lit(" <> "), rr]]
                continue
            preds.append([v, "cmp", rr])
            for neg in ("", " NOT"):
                preds += [
                    [v, Lit(neg + " IN ("), "inl_" + kind, Lit(")")],
                    [v, Lit(neg + " BETWEEN "), rr, Lit(" AND "), rr],
                ]
                if q_any:
                    preds.append([v, Lit(neg + " IN ("), q1(kind), Lit(")")])
                if kind in ("text", "any"):
                    preds.append([v, Lit(neg + " LIKE "), LIKE_TEXT])
        if self.strict and m == "p":
            oc = P + "col_other"
            preds += [[oc, Lit(" IS NULL")], [oc, Lit(" IS NOT NULL")]]
        r.add(pr, preds)

    def when_conditions(self, P: str) -> str:
        """Rule: the condition of a CASE WHEN branch in scope P: 1..2 predicates over values
        without calls or CASE (`w`), joined by AND/OR."""
        r, pw = self.r, P + "pw"
        preds: list[list] = []
        for kind in self.kinds:
            w, rw = f"{P}w_p_{kind}", f"{P}rw_p_{kind}"
            preds += [[w, Lit(" IS NULL")], [w, Lit(" IS NOT NULL")]]
            if kind == "bool":
                preds.append([w])
                continue
            preds += [[w, "cmp", rw], [w, Lit(" IN ("), "inl_" + kind, Lit(")")]]
            if kind in ("text", "any"):
                preds.append([w, Lit(" LIKE "), LIKE_TEXT])
        r.add(pw, preds)
        return r.bounded(P + "cw", pw, [" AND ", " OR "], 2)

    def values(self, P: str, m: str, kind: str) -> None:
        """Values of one kind in scope P, mode m, two levels deep so that the grammar stays
        finite: b (a column, an aggregate, a scalar subquery), w (an arithmetic chain of b: the
        argument of a call), a (b, a call of w, (w), CASE over w), v (an arithmetic chain of a)
        and r (v or a literal); chains have at most max_terms terms, and a literal never heads a
        chain or divides (no constant-folding errors at plan time)."""
        r, d = self.r, self.d
        v, a, rr = self.v(P, m, kind), f"{P}a_{m}_{kind}", self.rhs(P, m, kind)
        b, w, rw = f"{P}b_{m}_{kind}", f"{P}w_{m}_{kind}", f"{P}rw_{m}_{kind}"
        wk = lambda k: f"{P}w_{m}_{k}"
        rwk = lambda k: f"{P}rw_{m}_{k}" if k != "date" else wk(k)
        base: list[list] = []
        if m != "u":
            base.append([P + "col_" + kind])
        if m != "p":
            base.append([P + "agg_" + kind])
        q1 = self.sub("q1_" + kind)
        if q1:
            base.append([Lit("("), q1, Lit(")")])
        r.add(b, base)
        atoms: list[list] = [[b], [Lit("("), w, Lit(")")]]
        if kind in ("num", "any"):
            atoms += [fn_call("ABS", wk(kind)), fn_call("ROUND", wk(kind))]
            if d != "postgres":  # PostgreSQL has round(numeric, int) only, not for double precision
                atoms.append(fn_call("ROUND", wk(kind), SMALL_INT))
            if m != "u" or not self.strict:
                atoms.append(fn_call("LENGTH", wk("text" if self.strict else "any")))
            elif "text" in self.pure_kinds:
                atoms.append(fn_call("LENGTH", wk("text")))
        if kind in ("text", "any"):
            atoms += [fn_call(fn, wk(kind)) for fn in ("UPPER", "LOWER", "TRIM")]
            atoms += [fn_call(fn, wk(kind), SMALL_INT, SMALL_INT) for fn in ("SUBSTR", "SUBSTRING")]
        atoms.append(fn_call("COALESCE", wk(kind), rwk(kind)))
        if m == "p":  # CASE (a date literal in a THEN branch would be text on PostgreSQL)
            whens = f"{P}cw_{kind}"
            r.add(whens + "_1", [[Lit(" WHEN "), P + "cw", Lit(" THEN "), rwk(kind)]])
            r.bounded(whens, whens + "_1", [""], self.opts.max_whens)
            atoms += [
                [Lit("CASE"), whens, Lit(" END")],
                [Lit("CASE"), whens, Lit(" ELSE "), rwk(kind), Lit(" END")],
            ]
        r.add(a, atoms)
        hi = self.opts.max_terms - 1
        for chain, head in ((v, a), (w, b)):
            tail = []
            if kind in ("num", "any", "text"):
                op, lit = "aop_" + kind, "lit_" + kind
                tail += [[op, head], [op, lit]]
            if kind == "num":
                tail += [[Lit(" / "), head], [Lit(" / "), NUM_NONZERO]]
            if tail and hi > 0:
                r.add(chain + "_t", tail)
                r.add(chain, [[head, Rep(chain + "_t", 0, hi)]])
            else:
                r.add(chain, [[head]])
        r.add(rr, [[v], ["lit_" + kind]])
        r.add(rw, [[w], ["lit_" + kind]])

    def aggregates(self, P: str) -> None:
        """Aggregates of a scope; their arguments are plain values (no nested aggregates)."""
        r = self.r

        def call(fn, arg):
            return [fn_call(fn, arg), [Lit(fn + "(DISTINCT "), arg, Lit(")")]]

        if not self.strict:
            alts = [[Lit("COUNT(*)")]]
            for fn in ("COUNT", "SUM", "AVG", "MIN", "MAX"):
                alts += call(fn, P + "v_p_any")
            r.add(P + "agg_any", alts)
            return
        alts = [[Lit("COUNT(*)")], fn_call("COUNT", P + "col_other")]  # no DISTINCT: json has no equality
        for k in self.kinds:
            alts += call("COUNT", P + "v_p_" + k)
        for fn in ("SUM", "AVG", "MIN", "MAX"):
            alts += call(fn, P + "v_p_num")
        r.add(P + "agg_num", alts)
        for k in ("text", "date"):
            r.add(P + "agg_" + k, call("MIN", P + "v_p_" + k) + call("MAX", P + "v_p_" + k))

    # -- blocks: core (a set-operation member: no ORDER BY / LIMIT) and blk (a whole block),
    #    both without their leading "SELECT ", which the shared rules write once
    def sqlite_blocks(self, P: str) -> None:
        """SQLite blocks: items may mix columns and aggregates; ORDER BY may use aggregates only
        after GROUP BY (SQLite: "misuse of aggregate" in ORDER BY of a query it does not
        already treat as aggregated)."""
        r, keys = self.r, self.opts.max_keys
        it, pv = P + "v_a_any", P + "v_p_any"
        r.bounded(P + "gl", pv, [", "], keys)
        r.add(
            P + "gb",
            [[Lit(" GROUP BY "), P + "gl"], [Lit(" GROUP BY "), P + "gl", Lit(" HAVING "), P + "c_a"]],
        )
        r.add(P + "oi", [[it], [it, "dir"]])
        r.bounded(P + "ol", P + "oi", [", "], keys)
        r.add(P + "oip", [[pv], [pv, "dir"]])
        r.bounded(P + "olp", P + "oip", [", "], keys)
        r.add(P + "tp", [o for o in optional([Lit(" ORDER BY "), P + "olp"], ["limit"]) if o])
        r.add(P + "ta", [o for o in optional([Lit(" ORDER BY "), P + "ol"], ["limit"]) if o])
        r.bounded(P + "items", it, [", "], self.opts.max_items)
        lists = {"any": [[Lit("*")], [P + "items"]]}
        lists.update({f"w{w}": [joined([it] * w)] for w in range(1, self.width + 1)})
        for key, items in lists.items():
            heads = [[*pre, *li, P + "fw"] for li in items for pre in ([], ["distinct"])]
            core = f"{P}core_{key}"
            r.add(core, [h + gb for h in heads for gb in ([], [P + "gb"])])
            self.cores[key].append(core)
            if key in ("any", "w1"):
                blk = f"{P}blk_{key}"
                r.add(blk, [h + t for h in heads for t in ([], [P + "tp"], [P + "gb"], [P + "gb", P + "ta"])])
                self.blks[key].append(blk)

    def strict_blocks(self, P: str) -> None:
        """Blocks of a strictly typed, strictly grouped dialect: plain (no aggregates), DISTINCT
        (ORDER BY position only), aggregate-only, or grouped by position (keys first)."""
        r, keys, n = self.r, self.opts.max_keys, self.opts.max_items
        keyk = [P + "v_p_" + k for k in self.kinds]
        r.add(P + "key", [[x] for x in keyk])
        r.add(P + "it", [[x] for x in keyk] + [[P + "col_other"]])
        r.add(P + "pit", [[P + "v_u_" + k] for k in self.pure_kinds])
        r.bounded(P + "items", P + "it", [", "], n)
        r.bounded(P + "ditems", P + "key", [", "], n)
        r.bounded(P + "pitems", P + "pit", [", "], n)
        r.add(P + "oi", [[P + "key", *dr] for dr in ([], ["dir"])])
        r.bounded(P + "ol", P + "oi", [", "], keys)
        r.add(P + "oai", [[x, *dr] for x in (P + "pit", Lit("1")) for dr in ([], ["dir"])])
        r.bounded(P + "oa", P + "oai", [", "], keys)
        r.bounded(P + "gl", P + "key", [", "], keys)
        r.add(
            P + "gbx",
            [[Lit(" GROUP BY "), P + "gl"], [Lit(" GROUP BY "), P + "gl", Lit(" HAVING "), P + "c_u"]],
        )
        fw = P + "fw"
        # optional tails as rules of their own (every combination spelled out would triple the size)
        r.add(P + "tp", [o for o in optional([Lit(" ORDER BY "), P + "ol"], ["limit"]) if o])
        r.add(P + "ta", [o for o in optional([Lit(" ORDER BY "), P + "oa"], ["limit"]) if o])
        r.add(P + "th", [[Lit(" HAVING "), P + "c_u"], [Lit(" HAVING "), P + "c_u", P + "ta"], [P + "ta"]])
        if "tpos" not in r.rules:
            r.add(
                "tpos",
                [
                    o
                    for o in optional([Lit(" ORDER BY 1")], ["dir"], ["limit"])
                    if o and o != ["dir"] and o != ["dir", "limit"]
                ],
            )

        def kinds_of_block(plain, distinct, pure, grouped):
            """(core alternatives, blk alternatives). grouped: [(keys, rest, g)]."""
            core = [[*plain, fw], ["distinct", *distinct, fw]]
            blk = [
                [*plain, fw],
                [*plain, fw, P + "tp"],
                ["distinct", *distinct, fw],
                ["distinct", *distinct, fw, "tpos"],
            ]
            if pure:
                core += [[*pure, fw], [*pure, fw, P + "gbx"]]
                blk += [
                    [*pure, fw],
                    [*pure, fw, P + "ta"],
                    [*pure, fw, P + "gbx"],
                    [*pure, fw, P + "gbx", P + "ta"],
                ]
            for keys, rest, g in grouped:
                gbp = Lit(" GROUP BY " + ", ".join(str(i) for i in range(1, g + 1)))
                core += [[*keys, *rest, fw, gbp], [*keys, *rest, fw, gbp, Lit(" HAVING "), P + "c_u"]]
                blk += [[*keys, *rest, fw, gbp], [*keys, *rest, fw, gbp, P + "th"]]
            return core, blk

        grouped = []
        for g in (1, 2, 3):
            keys = joined([P + "key"] * g)
            grouped += [(keys, [], g), (keys, [Lit(", "), P + "pitems"], g)]
        core, blk = kinds_of_block([P + "items"] + [], [P + "ditems"], [P + "pitems"], grouped)
        core.append([Lit("*"), fw])
        blk += [[Lit("*"), fw], [Lit("*"), fw, P + "tp"]]
        r.add(P + "core_any", core)
        r.add(P + "blk_any", blk)
        self.cores["any"].append(P + "core_any")
        self.blks["any"].append(P + "blk_any")
        for sig in self.sigs:
            key = "__".join(sig)
            plain = joined([P + "v_p_" + k for k in sig])
            pure = joined([P + ("v_u_" if k in self.pure_kinds else "v_p_") + k for k in sig])
            if any(k not in self.pure_kinds for k in sig):
                pure = None
            grouped = []
            for g in range(1, len(sig) + 1):
                if all(k in self.pure_kinds for k in sig[g:]):
                    grouped.append(
                        (
                            joined([P + "v_p_" + k for k in sig[:g]]),
                            [Lit(", ")] * (g < len(sig)) + joined([P + "v_u_" + k for k in sig[g:]]),
                            g,
                        )
                    )
            core, blk = kinds_of_block(plain, plain, pure, grouped)
            r.add(f"{P}core_{key}", core)
            r.add(f"{P}blk_{key}", blk)
            self.cores[key].append(f"{P}core_{key}")
            self.blks[key].append(f"{P}blk_{key}")

    # -- queries
    def build(self, scopes: list[Scope]) -> tuple[str, str]:
        self.shared()
        # level 0 first: its queries are the subqueries of level 1, and so on up to the top
        for level in range(self.depth + 1):
            self.level = level
            self.cores, self.blks = defaultdict(list), defaultdict(list)
            inner = scopes[: self.opts.max_subquery_scopes] if level < self.depth else scopes
            for si, s in enumerate(inner):
                self.scope(si, s)
            self.queries()
        r = self.r
        top: list[list] = [["q_any"]]
        if self.opts.with_cte:
            top += self.ctes(scopes)
        r.add("start", top)
        r.prune("start")
        return r.lark(), r.ebnf("start")

    def queries(self) -> None:
        """The query rules of the current level: blocks of every scope, set operations (at most
        max_set_members blocks), derived tables, width-1 queries (IN, scalar subqueries)."""
        r, qn = self.r, self.qn
        # a block is "SELECT " then one scope's rest: the scope is chosen after the shared keyword,
        # so a subquery's entry point does not fan out into every scope (compile time)
        alias = Lit(") AS T1") if self.d == "postgres" else Lit(")")
        sub_any = self.sub("q_any")
        derived_count = [[Lit("COUNT(*) FROM ("), sub_any, alias]] if sub_any else []
        derived_star = [[Lit("* FROM ("), sub_any, alias]] if sub_any else []
        count_key = "num" if self.strict else "w1"
        for key in ["any", *self.widths]:
            cores = [[c] for c in self.cores.get(key, [])] + (derived_count if key == count_key else [])
            r.add(qn("cs_" + key), cores)
            r.add(qn("core_" + key), [[Lit("SELECT "), qn("cs_" + key)]])
            if key == "any" or key == count_key or self.blks.get(key):
                blks = [[b] for b in self.blks.get(key, [])]
                blks += derived_count if key == count_key else []
                blks += derived_count + derived_star if key == "any" else []
                r.add(qn("bs_" + key), blks)
                r.add(qn("blk_" + key), [[Lit("SELECT "), qn("bs_" + key)]])
            if key == "any" or self.opts.max_set_members < 2:
                continue
            w = self.widths[key]
            if f"ordw{w}" not in r.rules:
                r.add(f"ordw{w}", [[Lit(str(i))] for i in range(1, w + 1)])
                r.add(f"cob{w}", [[Lit(" ORDER BY "), f"ordw{w}"], [Lit(" ORDER BY "), f"ordw{w}", "dir"]])
            member = r.add(qn(f"member_{key}"), [["setop", qn("core_" + key)]])
            chain = [qn("core_" + key), Rep(member, 1, self.opts.max_set_members - 1)]
            r.add(qn(f"cmp_{key}"), [[*chain, *o] for o in optional([f"cob{w}"], ["limit"])])
        # width-1 queries for IN (...) and scalar subqueries
        for kind in self.kinds:
            key = kind if self.strict else "w1"
            r.add(qn("q1_" + kind), [[qn("blk_" + key)], [qn("cmp_" + key)]])
        r.add(qn("q_any"), [[qn("blk_any")]] + [[qn(f"cmp_{k}")] for k in self.widths])

    def ctes(self, scopes: list[Scope]) -> list[list]:
        """WITH cte AS (SELECT * FROM t [WHERE ...] [ORDER BY ...] [LIMIT n]) then a block over
        `cte AS T1`: the rules of the scope `t AS T1` with the FROM clause replaced."""
        r, alts = self.r, []
        plain = {
            s.bindings[0].table.name: i
            for i, s in enumerate(scopes)
            if len(s.bindings) == 1 and not s.bindings[0].alias
        }
        aliased = {
            s.bindings[0].table.name: i
            for i, s in enumerate(scopes)
            if len(s.bindings) == 1 and s.bindings[0].alias
        }
        cte = quote_ident(self.cte, self.d)
        for name, si in plain.items():
            ai = aliased.get(name)
            if ai is None:
                continue
            P, A = f"s{si}_", f"s{ai}_"
            head = [Lit(f"WITH {cte} AS (SELECT * FROM "), P + "from"]
            order = P + ("ol" if self.strict else "olp")  # plain ORDER BY: no aggregates
            body = [
                head + o + [Lit(") ")]
                for o in optional([Lit(" WHERE "), P + "c_p"], [Lit(" ORDER BY "), order], ["limit"])
            ]
            r.add(f"cteh{si}", body)
            fw = f"{A}fwc"
            r.add(fw, [[Lit(f" FROM {cte} AS T1")], [Lit(f" FROM {cte} AS T1 WHERE "), A + "c_p"]])
            alts.append([f"cteh{si}", Lit("SELECT "), self._clone(A + "blk_any", A + "fw", fw)])
        return alts

    def _clone(self, name: str, old: str, new: str) -> str:
        """A copy of rule `name`, and of the rules of its scope under it that reach `old`, with
        `old` replaced by `new`; rules that do not reach `old` are shared, not copied."""
        prefix = name.split("_")[0] + "_"
        memo: dict[str, str] = {}

        def reaches(n: str, seen: set) -> bool:
            if n == old:
                return True
            if n in seen or not n.startswith(prefix) or n not in self.r.rules:
                return False
            seen.add(n)
            return any(
                reaches(x.rule if type(x) is Rep else x, seen)
                for alt in self.r.rules[n]
                for x in alt
                if type(x) in (str, Rep)
            )

        def copy(n: str) -> str:
            if n == old:
                return new
            if n not in memo:
                if not reaches(n, set()):
                    memo[n] = n
                else:
                    memo[n] = n + "_c"
                    self.r.rules[n + "_c"] = [[_copied(x, copy) for x in alt] for alt in self.r.rules[n]]
            return memo[n]

        return copy(name)


def _copied(sym, copy):
    """`sym` with its rule name (a rule, or a Rep's rule) replaced by copy(name)."""
    if type(sym) is Rep:
        return Rep(copy(sym.rule), sym.lo, sym.hi)
    return copy(sym) if type(sym) is str else sym


def sql_grammar(
    schema: Schema, dialect: str | None = None, options: GrammarOptions | None = None
) -> SQLGrammar:
    """The schema-aware grammar of `schema` in `dialect` (default: the schema's own, else
    SQLite). Raises SchemaError when the schema has more tables than options.max_scopes or the
    options are invalid."""
    opts = options or GrammarOptions()
    d = dialect_name(dialect or schema.dialect or "sqlite")
    if schema.dialect != d:
        schema = schema.with_dialect(d)
    if opts.max_join_tables not in (1, 2, 3):
        raise SchemaError("max_join_tables must be 1, 2 or 3")
    if opts.max_set_width is not None and not 1 <= opts.max_set_width <= 8:
        raise SchemaError("max_set_width must be between 1 and 8")
    dropped: list[str] = []
    budget = opts.max_scopes if opts.max_scopes is not None else DEFAULT_MAX_SCOPES[d]
    if budget < 1:
        raise SchemaError("max_scopes must be at least 1")
    scopes = scopes_of(schema, opts, budget, dropped)
    gen = _Gen(schema, d, opts)
    lark, ebnf = gen.build(scopes)
    stats = {
        "scopes": len(scopes),
        "join_scopes": sum(len(s.bindings) > 1 for s in scopes),
        "rules": len(gen.r.rules),
        "bytes": len(ebnf.encode()),
        "tables": len(schema.tables),
        "columns": schema.num_columns,
    }
    return SQLGrammar(lark, ebnf, d, schema, scopes, dropped, stats, gen.r.rules)
