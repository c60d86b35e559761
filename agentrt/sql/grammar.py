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
from agentrt.sql.schema import Schema, SchemaError, Table, fold_name

ALIASES = ("T1", "T2", "T3")
DEFAULT_MAX_SCOPES = {"sqlite": 64, "duckdb": 48, "postgres": 48}
"""FROM shapes per grammar by default: a strictly typed dialect's scope is about twice the
grammar of a SQLite one, and xgrammar's compile time grows faster than linearly with size."""


@dataclass(frozen=True)
class GrammarOptions:
    """max_scopes: the most FROM-clause shapes (module docstring, "Column-to-table scoping"; None:
    `DEFAULT_MAX_SCOPES` of the dialect);
    max_join_tables: 1 (no joins), 2 or 3; join_on_shared_names: also join tables that share a
    column name; max_set_width: widest set operation / typed subquery list (None: 4 on SQLite, 1
    on PostgreSQL/DuckDB); with_cte: allow the filtered-table WITH form."""

    max_scopes: int | None = None
    max_join_tables: int = 3
    join_on_shared_names: bool = True
    max_set_width: int | None = None
    with_cte: bool = True


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


# ---- symbols ---------------------------------------------------------------------------------


class Lit(str):
    """A literal terminal."""


class Re(str):
    """A regular-expression terminal (Python syntax, as Lark writes /.../)."""


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal: printable ASCII as is, everything else (quote, backslash,
    non-ASCII) as \\uXXXX / \\UXXXXXXXX escapes, which Lark decodes exactly."""
    out = []
    for ch in text:
        o = ord(ch)
        if 0x20 <= o < 0x7F and ch not in '"\\':
            out.append(ch)
        elif o <= 0xFFFF:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


NUM = Re(r"-?(0|[1-9][0-9]{0,14})(\.[0-9]{1,6})?")
NUM_NONZERO = Re(r"-?[1-9][0-9]{0,14}(\.[0-9]{1,6})?")
SMALL_INT = Re(r"[1-9][0-9]{0,2}")
TEXT = Re(r"'([^'\x00-\x1f\x7f]|'')*'")
LIKE_TEXT = Re(r"'([^'\\\x00-\x1f\x7f]|'')*'")
DATE = Re(r"'[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])'")
LIMIT_N = Re(r"(0|[1-9][0-9]{0,5})")

CMP = [" = ", " <> ", " != ", " < ", " > ", " <= ", " >= "]
SETOPS = [" UNION ", " UNION ALL ", " INTERSECT ", " EXCEPT "]
JOINS = [" JOIN ", " INNER JOIN ", " LEFT JOIN "]


class _Rules:
    """Rules as {name: [alternative: [symbol]]}; a symbol is a rule name (str), Lit or Re."""

    def __init__(self):
        self.rules: dict[str, list[list]] = {}

    def add(self, name: str, alts: list[list]) -> str:
        self.rules.setdefault(name, []).extend(alts)
        return name

    def prune(self, start: str) -> None:
        """Drop alternatives that use rules deriving nothing, then rules unreachable from start."""
        productive: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, alts in self.rules.items():
                if name in productive:
                    continue
                if any(all(self._ok(s, productive) for s in alt) for alt in alts):
                    productive.add(name)
                    changed = True
        if start not in productive:
            raise SchemaError("the schema gives no query at all (no table with a usable column)")
        for name in list(self.rules):
            if name not in productive:
                del self.rules[name]
            else:
                self.rules[name] = [a for a in self.rules[name] if all(self._ok(s, productive) for s in a)]
        seen, todo = {start}, [start]
        while todo:
            for alt in self.rules[todo.pop()]:
                for s in alt:
                    if type(s) is str and s not in seen:
                        seen.add(s)
                        todo.append(s)
        for name in list(self.rules):
            if name not in seen:
                del self.rules[name]

    @staticmethod
    def _ok(sym, productive: set[str]) -> bool:
        return type(sym) is not str or sym in productive

    def lark(self) -> str:
        lines = []
        for name, alts in self.rules.items():
            body = " | ".join(" ".join(_sym(s) for s in alt) if alt else '""' for alt in alts)
            lines.append(f"{name}: {body}")
        return "\n".join(lines) + "\n"

    def ebnf(self, start: str) -> str:
        """The same rules as xgrammar EBNF (root rule `root`), literals and regular expressions
        written by agentrt's own converters (grammars/lark_grammar.py, grammars/regex.py)."""
        from agentrt.grammars.lark_grammar import _literal
        from agentrt.grammars.regex import RegexToEBNF

        terms: dict[str, str] = {}

        def sym(x) -> str:
            if isinstance(x, Lit):
                return _literal(str(x))
            if isinstance(x, Re):
                if x not in terms:
                    terms[x] = f"re{len(terms)}"
                return terms[x]
            return x

        lines = [f"root ::= {start}"]
        for name, alts in self.rules.items():
            body = " | ".join("(" + (" ".join(sym(s) for s in alt) if alt else '""') + ")" for alt in alts)
            lines.append(f"{name} ::= {body}")
        for pattern, name in terms.items():
            lines.append(f"{name} ::= {RegexToEBNF(name).convert(str(pattern), False)}")
        return "\n".join(lines) + "\n"


def _sym(s) -> str:
    if isinstance(s, Lit):
        return _lark_string(str(s))
    if isinstance(s, Re):
        return "/" + str(s).replace("/", "\\/") + "/"
    return s


# ---- scopes -----------------------------------------------------------------------------------


def _scopes(schema: Schema, opts: GrammarOptions, dropped: list[str]) -> list[Scope]:
    """The FROM shapes, in priority order, cut at opts.max_scopes (module docstring)."""
    tables = schema.tables
    n = len(tables)
    budget = (
        opts.max_scopes if opts.max_scopes is not None else DEFAULT_MAX_SCOPES[schema.dialect or "sqlite"]
    )
    if budget < 1:
        raise SchemaError("max_scopes must be at least 1")
    if n > budget:
        raise SchemaError(
            f"the schema has {n} tables, more than the grammar's limit of {budget} FROM shapes "
            "(GrammarOptions.max_scopes); give the tables the question needs (Schema.subset)"
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
            for c in sorted(fk_adj[a] | fk_adj[b] | name_adj[a] | name_adj[b]):
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


# ---- the generator ----------------------------------------------------------------------------


def _call(fn: str, *args) -> list:
    seq: list = [Lit(fn + "(")]
    for i, x in enumerate(args):
        if i:
            seq.append(Lit(", "))
        seq.append(x)
    return seq + [Lit(")")]


def _opt(*parts: list) -> list[list]:
    """Every combination of optional parts (each part: a list of symbols, present or absent)."""
    out = [[]]
    for part in parts:
        out = [o + extra for o in out for extra in ([], part)]
    return out


def _seq(items: list, sep: str = ", ") -> list:
    out: list = []
    for i, x in enumerate(items):
        if i:
            out.append(Lit(sep))
        out.append(x)
    return out


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
        self.r = _Rules()
        self.tidx = {id(t): i for i, t in enumerate(schema.tables)}
        self.fold = (lambda s: s) if schema.case_sensitive else fold_name
        self.cte = self._cte_name()
        self.cores: dict[str, list[str]] = defaultdict(list)
        self.blks: dict[str, list[str]] = defaultdict(list)

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
                r.add("inl_" + k, [["lit_" + k], ["lit_" + k, Lit(", "), "inl_" + k]])
        r.add("limit", [[Lit(" LIMIT "), LIMIT_N], [Lit(" LIMIT "), LIMIT_N, Lit(" OFFSET "), LIMIT_N]])
        r.add("dir", [[Lit(" ASC")], [Lit(" DESC")]])
        r.add("setop", [[Lit(s)] for s in SETOPS])
        r.add("cmp", [[Lit(c)] for c in CMP])
        r.add("distinct", [[Lit("DISTINCT ")]])
        r.add("join_kw", [[Lit(j)] for j in JOINS])

    # -- per scope
    def scope(self, si: int, s: Scope) -> None:
        r, P = self.r, f"s{si}_"
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
        self.r.add(key, [[key + "_p"], [key + "_p", Lit(" AND "), key], [key + "_p", Lit(" OR "), key]])
        return key

    def v(self, P: str, m: str, kind: str) -> str:
        return f"{P}v_{m}_{kind}"

    def rhs(self, P: str, m: str, kind: str) -> str:
        return f"{P}r_{m}_{kind}"

    def conditions(self, P: str, m: str) -> None:
        """c (AND/OR of n), n (NOT n | predicate | (c)) and predicates of scope P in mode m
        (p: no aggregates; a: SQLite, aggregates and columns; u: strict, columns only inside
        aggregates). AND/OR precedence is left to the database: the text is the same."""
        r = self.r
        c, n, pr = P + "c_" + m, P + "n_" + m, P + "pr_" + m
        r.add(c, [[n], [n, Lit(" AND "), c], [n, Lit(" OR "), c]])
        r.add(n, [[Lit("NOT "), n], [pr], [Lit("("), c, Lit(")")]])
        if m != "p":  # HAVING: comparisons of aggregates (a smaller set keeps the grammar small)
            preds: list[list] = []
            for kind in self.kinds if m != "u" else self.pure_kinds:
                v, rr = self.v(P, m, kind), self.rhs(P, m, kind)
                preds += [
                    [v, "cmp", rr],
                    [v, Lit(" BETWEEN "), rr, Lit(" AND "), rr],
                    [v, Lit(" IN ("), "inl_" + kind, Lit(")")],
                    [v, Lit(" IN ("), "q1_" + kind, Lit(")")],
                ]
            r.add(pr, preds)
            return
        preds = [[Lit("EXISTS ("), "q_any", Lit(")")], [Lit("EXISTS("), "q_any", Lit(")")]]
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
                    [v, Lit(neg + " IN ("), "q1_" + kind, Lit(")")],
                    [v, Lit(neg + " BETWEEN "), rr, Lit(" AND "), rr],
                ]
                if kind in ("text", "any"):
                    preds.append([v, Lit(neg + " LIKE "), LIKE_TEXT])
        if self.strict and m == "p":
            oc = P + "col_other"
            preds += [[oc, Lit(" IS NULL")], [oc, Lit(" IS NOT NULL")]]
        r.add(pr, preds)

    def values(self, P: str, m: str, kind: str) -> None:
        """v (a value: an atom, or an arithmetic chain headed by an atom), r (v or a literal)
        and a (atoms) of one kind in scope P, mode m."""
        r, d = self.r, self.d
        v, a, rr = self.v(P, m, kind), f"{P}a_{m}_{kind}", self.rhs(P, m, kind)
        vk = lambda k: self.v(P, m, k)
        rk = lambda k: self.rhs(P, m, k)
        atoms: list[list] = []
        if m != "u":
            atoms.append([P + "col_" + kind])
        if m != "p":
            atoms.append([P + "agg_" + kind])
        atoms += [[Lit("("), "q1_" + kind, Lit(")")], [Lit("("), v, Lit(")")]]
        if kind in ("num", "any"):
            atoms += [_call("ABS", vk(kind)), _call("ROUND", vk(kind))]
            if d != "postgres":  # PostgreSQL has round(numeric, int) only, not for double precision
                atoms.append(_call("ROUND", vk(kind), SMALL_INT))
            if m != "u" or not self.strict:
                atoms.append(_call("LENGTH", vk("text" if self.strict else "any")))
            elif "text" in self.pure_kinds:
                atoms.append(_call("LENGTH", vk("text")))
        if kind in ("text", "any"):
            atoms += [_call(fn, vk(kind)) for fn in ("UPPER", "LOWER", "TRIM")]
            atoms += [_call(fn, vk(kind), SMALL_INT, SMALL_INT) for fn in ("SUBSTR", "SUBSTRING")]
        atoms.append(_call("COALESCE", vk(kind), rk(kind) if kind != "date" else vk(kind)))
        if m == "p":  # CASE (a date literal in a THEN branch would be text on PostgreSQL)
            branch = rk(kind) if kind != "date" else vk(kind)
            whens = f"{P}cw_{kind}"
            when = [Lit(" WHEN "), P + "c_p", Lit(" THEN "), branch]
            r.add(whens, [when, when + [whens]])
            atoms += [
                [Lit("CASE"), whens, Lit(" END")],
                [Lit("CASE"), whens, Lit(" ELSE "), branch, Lit(" END")],
            ]
        r.add(a, atoms)
        # arithmetic: a literal never heads a chain or divides (no constant-folding errors at plan time)
        alts = [[a]]
        if kind in ("num", "any", "text"):
            op, lit = "aop_" + kind, "lit_" + kind
            alts += [[a, op, v], [a, op, lit], [a, op, lit, op, v]]
        if kind == "num":
            alts += [[a, Lit(" / "), v], [a, Lit(" / "), NUM_NONZERO]]
        r.add(v, alts)
        r.add(rr, [[v], ["lit_" + kind]])

    def aggregates(self, P: str) -> None:
        """Aggregates of a scope; their arguments are plain values (no nested aggregates)."""
        r = self.r

        def call(fn, arg):
            return [_call(fn, arg), [Lit(fn + "(DISTINCT "), arg, Lit(")")]]

        if not self.strict:
            alts = [[Lit("COUNT(*)")]]
            for fn in ("COUNT", "SUM", "AVG", "MIN", "MAX"):
                alts += call(fn, P + "v_p_any")
            r.add(P + "agg_any", alts)
            return
        alts = [[Lit("COUNT(*)")], _call("COUNT", P + "col_other")]  # no DISTINCT: json has no equality
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
        r = self.r
        it, pv = P + "v_a_any", P + "v_p_any"
        r.add(P + "gl", [[pv], [pv, Lit(", "), P + "gl"]])
        r.add(
            P + "gb",
            [[Lit(" GROUP BY "), P + "gl"], [Lit(" GROUP BY "), P + "gl", Lit(" HAVING "), P + "c_a"]],
        )
        r.add(P + "ol", [[it], [it, "dir"], [it, Lit(", "), P + "ol"], [it, "dir", Lit(", "), P + "ol"]])
        r.add(P + "olp", [[pv], [pv, "dir"], [pv, Lit(", "), P + "olp"], [pv, "dir", Lit(", "), P + "olp"]])
        r.add(P + "tp", [o for o in _opt([Lit(" ORDER BY "), P + "olp"], ["limit"]) if o])
        r.add(P + "ta", [o for o in _opt([Lit(" ORDER BY "), P + "ol"], ["limit"]) if o])
        r.add(P + "items", [[it], [it, Lit(", "), P + "items"]])
        lists = {"any": [[Lit("*")], [P + "items"]]}
        lists.update({f"w{w}": [_seq([it] * w)] for w in range(1, self.width + 1)})
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
        r = self.r
        keyk = [P + "v_p_" + k for k in self.kinds]
        r.add(P + "key", [[x] for x in keyk])
        r.add(P + "it", [[x] for x in keyk] + [[P + "col_other"]])
        r.add(P + "pit", [[P + "v_u_" + k] for k in self.pure_kinds])
        r.add(P + "items", [[P + "it"], [P + "it", Lit(", "), P + "items"]])
        r.add(P + "ditems", [[P + "key"], [P + "key", Lit(", "), P + "ditems"]])
        r.add(P + "pitems", [[P + "pit"], [P + "pit", Lit(", "), P + "pitems"]])
        r.add(
            P + "ol",
            [[P + "key", *dr, *more] for dr in ([], ["dir"]) for more in ([], [Lit(", "), P + "ol"])],
        )
        r.add(
            P + "oa",
            [
                [x, *dr, *more]
                for x in (P + "pit", Lit("1"))
                for dr in ([], ["dir"])
                for more in ([], [Lit(", "), P + "oa"])
            ],
        )
        r.add(P + "gl", [[P + "key"], [P + "key", Lit(", "), P + "gl"]])
        r.add(
            P + "gbx",
            [[Lit(" GROUP BY "), P + "gl"], [Lit(" GROUP BY "), P + "gl", Lit(" HAVING "), P + "c_u"]],
        )
        fw = P + "fw"
        # optional tails as rules of their own (every combination spelled out would triple the size)
        r.add(P + "tp", [o for o in _opt([Lit(" ORDER BY "), P + "ol"], ["limit"]) if o])
        r.add(P + "ta", [o for o in _opt([Lit(" ORDER BY "), P + "oa"], ["limit"]) if o])
        r.add(P + "th", [[Lit(" HAVING "), P + "c_u"], [Lit(" HAVING "), P + "c_u", P + "ta"], [P + "ta"]])
        if "tpos" not in r.rules:
            r.add(
                "tpos",
                [
                    o
                    for o in _opt([Lit(" ORDER BY 1")], ["dir"], ["limit"])
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
            keys = _seq([P + "key"] * g)
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
            plain = _seq([P + "v_p_" + k for k in sig])
            pure = _seq([P + ("v_u_" if k in self.pure_kinds else "v_p_") + k for k in sig])
            if any(k not in self.pure_kinds for k in sig):
                pure = None
            grouped = []
            for g in range(1, len(sig) + 1):
                if all(k in self.pure_kinds for k in sig[g:]):
                    grouped.append(
                        (
                            _seq([P + "v_p_" + k for k in sig[:g]]),
                            [Lit(", ")] * (g < len(sig)) + _seq([P + "v_u_" + k for k in sig[g:]]),
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
        for si, s in enumerate(scopes):
            self.scope(si, s)
        r = self.r
        # a block is "SELECT " then one scope's rest: the scope is chosen after the shared keyword,
        # so a subquery's entry point does not fan out into every scope (compile time)
        alias = Lit(") AS T1") if self.d == "postgres" else Lit(")")
        derived_count = [Lit("COUNT(*) FROM ("), "q_any", alias]
        derived_star = [Lit("* FROM ("), "q_any", alias]
        count_key = "num" if self.strict else "w1"
        for key in ["any", *self.widths]:
            cores = [[c] for c in self.cores.get(key, [])] + ([derived_count] if key == count_key else [])
            r.add("cs_" + key, cores)
            r.add("core_" + key, [[Lit("SELECT "), "cs_" + key]])
            if key == "any" or key == count_key or self.blks.get(key):
                blks = [[b] for b in self.blks.get(key, [])]
                blks += [derived_count] if key == count_key else []
                blks += [derived_count, derived_star] if key == "any" else []
                r.add("bs_" + key, blks)
                r.add("blk_" + key, [[Lit("SELECT "), "bs_" + key]])
            if key == "any":
                continue
            w = self.widths[key]
            if f"ordw{w}" not in r.rules:
                r.add(f"ordw{w}", [[Lit(str(i))] for i in range(1, w + 1)])
                r.add(f"cob{w}", [[Lit(" ORDER BY "), f"ordw{w}"], [Lit(" ORDER BY "), f"ordw{w}", "dir"]])
            chain = f"chain_{key}"
            r.add(chain, [["setop", "core_" + key], ["setop", "core_" + key, chain]])
            r.add(f"cmp_{key}", [["core_" + key, chain, *o] for o in _opt([f"cob{w}"], ["limit"])])
        # width-1 queries for IN (...) and scalar subqueries
        for kind in self.kinds:
            key = kind if self.strict else "w1"
            r.add("q1_" + kind, [["blk_" + key], ["cmp_" + key]])
        r.add("q_any", [["blk_any"]] + [[f"cmp_{k}"] for k in self.widths])
        top: list[list] = [["q_any"]]
        if self.opts.with_cte:
            top += self.ctes(scopes)
        r.add("start", top)
        r.prune("start")
        return r.lark(), r.ebnf("start")

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
                for o in _opt([Lit(" WHERE "), P + "c_p"], [Lit(" ORDER BY "), order], ["limit"])
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
            return any(type(x) is str and reaches(x, seen) for alt in self.r.rules[n] for x in alt)

        def copy(n: str) -> str:
            if n == old:
                return new
            if n not in memo:
                if not reaches(n, set()):
                    memo[n] = n
                else:
                    memo[n] = n + "_c"
                    self.r.rules[n + "_c"] = [
                        [copy(x) if type(x) is str else x for x in alt] for alt in self.r.rules[n]
                    ]
            return memo[n]

        return copy(name)


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
    scopes = _scopes(schema, opts, dropped)
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
