"""The SELECT blocks of the schema-aware SQL grammar (docs/sql-grammar.md): `SelectGen` adds to
`ExprGen` a scope's FROM clause (with its ON conditions and the optional WHERE) and its blocks,
`core` (a set-operation member: no ORDER BY / LIMIT) and `blk` (a whole block), as SQLite's
lenient grouping or PostgreSQL's and DuckDB's strict typing and grouping allow them.
agentrt.sql.grammar joins the blocks into queries."""

from __future__ import annotations

from collections import defaultdict

from agentrt.sql.dialect import quote_ident
from agentrt.sql.grammar_expr import ExprGen
from agentrt.sql.rules import Lit, joined, optional
from agentrt.sql.scopes import Scope


class SelectGen(ExprGen):
    """ExprGen with a scope's FROM clause and SELECT blocks."""

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
        self._strict_lists(P)
        self._strict_any_block(P)
        for sig in self.sigs:
            self._strict_sig_block(P, sig)

    def _strict_lists(self, P: str) -> None:
        """The item, ORDER BY and GROUP BY lists and the optional tails the strict blocks share."""
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

    def _strict_kinds_of_block(self, P: str, plain, distinct, pure, grouped):
        """(core alternatives, blk alternatives) of one select list: plain, DISTINCT (ORDER BY position
        only), aggregate-only (pure, or None) and grouped by position; grouped: [(keys, rest, g)]."""
        fw = P + "fw"
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

    def _strict_any_block(self, P: str) -> None:
        """The core and block rules of the untyped select lists (key "any"): items, `*`, grouped by
        the first 1-3 items."""
        r, fw = self.r, P + "fw"
        grouped = []
        for g in (1, 2, 3):
            keys = joined([P + "key"] * g)
            grouped += [(keys, [], g), (keys, [Lit(", "), P + "pitems"], g)]
        core, blk = self._strict_kinds_of_block(
            P, [P + "items"] + [], [P + "ditems"], [P + "pitems"], grouped
        )
        core.append([Lit("*"), fw])
        blk += [[Lit("*"), fw], [Lit("*"), fw, P + "tp"]]
        r.add(P + "core_any", core)
        r.add(P + "blk_any", blk)
        self.cores["any"].append(P + "core_any")
        self.blks["any"].append(P + "blk_any")

    def _strict_sig_block(self, P: str, sig) -> None:
        """The core and block rules of one typed signature (its columns' kinds, in order)."""
        r = self.r
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
        core, blk = self._strict_kinds_of_block(P, plain, plain, pure, grouped)
        r.add(f"{P}core_{key}", core)
        r.add(f"{P}blk_{key}", blk)
        self.cores[key].append(f"{P}core_{key}")
        self.blks[key].append(f"{P}blk_{key}")
