"""Schema-aware SQL grammars: every sentence is one read-only query that names only the
schema's tables and columns, in the dialect's spelling, and that the database accepts
(tests/sql check this with EXPLAIN on random walks through the compiled grammar and on random
sentences of its rules, for SQLite, DuckDB and PostgreSQL).

`sql_grammar(schema, dialect, options)` returns an SQLGrammar holding the same rules twice: as a
Lark grammar (start rule `start`; agentrt compiles it through grammars/lark_grammar.py, the
`ConstraintSpec.lark` path) and as xgrammar EBNF (root rule `root`, `ConstraintSpec.grammar`).
`SQLGrammar.spec()` gives the EBNF spec: same language (tested), but it skips Lark's own
analysis of the grammar, which costs more than xgrammar's compile on these grammars (measured:
docs/benchmarks.md, "SQL generation on Spider"). Raises SchemaError for a schema over the
options' limits or invalid options.

The language (the subset, its length bounds, column-to-table scoping, what else it enforces so
that the database accepts every query, its size) is described in docs/sql-grammar.md. This
module holds the options, the result, the queries (set operations, derived tables, subquery
levels, the WITH form) and the entry point; a scope's values and conditions are written by
agentrt.sql.grammar_expr, its FROM clause and SELECT blocks by agentrt.sql.grammar_select.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from agentrt.sql.dialect import dialect_name, quote_ident
from agentrt.sql.errors import SchemaError
from agentrt.sql.grammar_options import DEFAULT_MAX_SCOPES, GrammarOptions
from agentrt.sql.grammar_select import SelectGen
from agentrt.sql.rules import Lit, Rep, optional
from agentrt.sql.schema import Schema
from agentrt.sql.scopes import Scope, scopes_of


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


class _Gen(SelectGen):
    """SelectGen with the queries of every subquery level and the WITH form: `build` writes the
    whole grammar."""

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
