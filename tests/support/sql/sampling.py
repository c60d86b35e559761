"""Random sentences of a schema-aware SQL grammar, sampled from its rule table
(`SQLGrammar.rules`): alternatives uniformly at random up to a depth, then along the shortest
derivations, so every sample ends. Regular-expression terminals get random text of their
language (written for the handful of expressions agentrt.sql.grammar uses)."""

from __future__ import annotations

import random

from agentrt.sql import rules as g

_TEXT_CHARS = "abcXYZ 019_%'.-" + "éü日本" + '"\\'


def _regex_sample(pattern: str, rng: random.Random) -> str:
    if pattern == g.NUM:
        whole = str(rng.choice([0, 1, 7, 42, 1950, 2014, 300000, rng.randrange(10**15)]))
        frac = rng.choice(["", "", "." + str(rng.randrange(10**6)).zfill(rng.randint(1, 6))[:6]])
        return rng.choice(["", "", "-"]) + whole + frac
    if pattern == g.NUM_NONZERO:
        return rng.choice(["", "-"]) + str(rng.randrange(1, 10**6)) + rng.choice(["", ".5"])
    if pattern == g.SMALL_INT:
        return str(rng.randrange(1, 1000))
    if pattern == g.LIMIT_N:
        return str(rng.choice([0, 1, 3, 10, rng.randrange(10**6)]))
    if pattern == g.DATE:
        return f"'{rng.randint(1000, 2999)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}'"
    if pattern in (g.TEXT, g.LIKE_TEXT):
        chars = _TEXT_CHARS if pattern == g.TEXT else _TEXT_CHARS.replace("\\", "")
        body = "".join(rng.choice(chars) for _ in range(rng.randint(0, 8)))
        return "'" + body.replace("'", "''") + "'"
    raise AssertionError(f"no sampler for regex {pattern!r}")


def _cost(sym, best: dict) -> float:
    if type(sym) is g.Rep:
        return sym.lo * best[sym.rule] if sym.lo else 0
    return best[sym] if type(sym) is str else 1


def _min_lengths(rules: dict) -> dict[str, int]:
    """Symbols in the shortest derivation of each rule (a fixpoint)."""
    inf = float("inf")
    best = {name: inf for name in rules}
    changed = True
    while changed:
        changed = False
        for name, alts in rules.items():
            for alt in alts:
                n = sum(_cost(s, best) for s in alt)
                if n < best[name]:
                    best[name] = n
                    changed = True
    return best


def sample(grammar, rng: random.Random, max_depth: int = 6) -> str:
    """One random sentence of `grammar` (an SQLGrammar)."""
    rules = grammar.rules
    best = getattr(grammar, "_min_lengths", None)
    if best is None:
        best = _min_lengths(rules)
        grammar._min_lengths = best
    out: list[str] = []
    stack: list[tuple[object, int]] = [("start", 0)]
    while stack:
        sym, depth = stack.pop()
        if isinstance(sym, g.Lit):
            out.append(str(sym))
            continue
        if isinstance(sym, g.Re):
            out.append(_regex_sample(str(sym), rng))
            continue
        if isinstance(sym, g.Rep):
            count = sym.lo if depth >= max_depth else rng.randint(sym.lo, sym.hi)
            stack += [(sym.rule, depth + 1)] * count
            continue
        alts = rules[sym]
        if depth >= max_depth:
            cost = [sum(_cost(s, best) for s in a) for a in alts]
            alt = alts[cost.index(min(cost))]
        else:
            alt = rng.choice(alts)
        for s in reversed(alt):
            stack.append((s, depth + 1))
    return "".join(out)
