"""The expression rules of the schema-aware SQL grammar (docs/sql-grammar.md): `ExprGen` holds
the generator's state (schema, dialect, options, the rule table, the subquery level being built)
and writes, per scope, the values (columns, literals, arithmetic chains, calls, CASE, scalar
subqueries), the WHERE/HAVING/ON/CASE conditions and the aggregates; the shared rules (literals,
operators, LIMIT) once. agentrt.sql.grammar_select builds a scope's SELECT blocks on it and
agentrt.sql.grammar the queries and the entry point `sql_grammar`."""

from __future__ import annotations

import itertools
from collections import defaultdict

from agentrt.sql.dialect import quote_ident, strict_types
from agentrt.sql.grammar_options import GrammarOptions
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
)
from agentrt.sql.schema import Schema, Table, fold_name
from agentrt.sql.scopes import Scope


class ExprGen:
    """The rules of a grammar being built (docs/sql-grammar.md). Rule names: `sN_...` belong to
    scope N, `tcI_kind` list the columns of table I, the rest are shared."""

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
        self.level = self.depth  # the level being built (docs/sql-grammar.md, "Bounded length")

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
