"""The finite-output check and forced-text bound (grammars/finite.py), model-free: verdicts on
grammars of 20,000 rules and alternatives (the shapes that made the former fixpoints quadratic),
productivity against the textbook definition on random grammars, and bounds pinned to the values
the former implementation gave."""

from __future__ import annotations

import random
import sys

import pytest
import xgrammar as xgr

from agentrt.errors import ConstraintError
from agentrt.grammars.finite import (
    _OPT,
    _REF,
    _REP,
    _TERM,
    ForcedBound,
    _parse,
    check_finite,
    forced_text_bound,
    unproductive_rules,
)

N = 20_000


def _printed(ebnf: str) -> str:
    return str(xgr.Grammar.from_ebnf(ebnf))


def _chain(n: int, end: str) -> str:
    """root ::= r0, ri ::= "x" ri+1, r(n-1) ::= `end`."""
    return (
        "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(n - 1)) + f"r{n - 1} ::= {end}\n"
    )


def test_a_chain_of_20000_rules_is_finite_and_bounded_by_its_length():
    # (each rule's shortest derivation waits for the next one's: a pass-by-pass fixpoint needs
    # 20,000 passes over 20,000 rules; and the chain is deeper than Python's recursion limit)
    assert N > sys.getrecursionlimit()
    assert check_finite(_printed(_chain(N, '"z"'))) == ForcedBound(N, 0)


def test_a_chain_of_20000_rules_with_no_way_out_is_refused_naming_its_rules():
    printed = _printed(_chain(N, '"y" r0'))  # the last rule leads back to the first: never ends
    assert unproductive_rules(printed) == ["root"] + [f"r{i}" for i in range(N)]
    with pytest.raises(ConstraintError, match="no finite output: rule 'root', 'r0', 'r1' and 19998 more"):
        check_finite(printed)


def test_a_cycle_of_20000_rules_with_a_way_out_is_bounded_per_output_character():
    # one strongly connected component of 20,000 rules: r(N-1) ::= "y" r0 | "z". local rest:
    # "y" + the shortest r0 (N characters) = N + 1; frames: 4 per rule in xgrammar's printed form
    # (the rule and its two nested groups `((...))`), 5 for the one with two alternatives
    bound = check_finite(_printed(_chain(N, '"y" r0 | "z"')))
    per_char = (N + 1) * (4 * N + 1)
    assert bound == ForcedBound((N + 1) + 2 * per_char, per_char)


def test_a_sequence_of_20000_rule_references_in_reverse_order():
    # root uses r19999 ... r0 in that order: re-examining root whenever one of them became
    # productive read its whole body each time
    refs = " ".join(f"r{i}" for i in reversed(range(N)))
    rules = "".join(f'r{i} ::= "a{i % 10}"\n' for i in range(N))
    assert check_finite(_printed(f"root ::= {refs}\n{rules}")) == ForcedBound(2 * N, 0)
    # one rule without a way out among them: only it (reachable, unproductive) and root are named
    bad = rules.replace('r777 ::= "a7"', 'r777 ::= "a" r777')
    assert unproductive_rules(_printed(f"root ::= {refs}\n{bad}")) == ["root", "r777"]


def test_20000_alternatives_in_one_rule():
    alts = " | ".join(f'"k{i}" v{i % 7}' for i in range(N))
    values = "".join(f'v{j} ::= "{"w" * (j + 1)}"\n' for j in range(7))
    assert check_finite(_printed(f"root ::= {alts}\n{values}")) == ForcedBound(len(f"k{N - 1}") + 7, 0)
    empty = values.replace('v6 ::= "wwwwwww"', "v6 ::= [^\\x00-\\U0010FFFF]")  # no character at all
    assert unproductive_rules(_printed(f"root ::= {alts}\n{empty}")) == ["v6"]


# bounds the former implementation (quadratic fixpoints) gave, in xgrammar's printed form
PINNED = [
    ('root ::= (("ab" "c"))', (3, 0)),
    ('root ::= (("(" root ")") | ("x"))', (33, 15)),
    ('root ::= (("a"{2000000000, 2147483647}))', (2_000_000_000, 0)),
    (
        'root ::= ((a b{2, 5} "." c?))\na ::= (("aa") | ("a" a))\nb ::= (([0-9] "-"))\nc ::= (("c" c) | (""))',
        (65, 30),
    ),
    ('root ::= (("{" pair ("," pair)* "}"))\npair ::= (("k" ":" val))\nval ::= (("1") | (root))', (155, 75)),
    ('root ::= ((x y))\nx ::= (("a" y) | ("b"))\ny ::= (("c" x "d") | ("e"))', (63, 30)),
    ('root ::= ((s))\ns ::= (("q" t))\nt ::= (("r" [a-z]+ "s"))', (4, 0)),
    ('root ::= (("a" (=("b"))) | (undefined))', (1 << 62, 0)),  # an undefined rule: no useful bound
    ('root ::= (("[" item{3, 3} "]"))\nitem ::= (("ab") | ("c" item))', (38, 15)),
    ('root ::= ((("a" | "bb")+ "c"))', (3, 0)),
]


@pytest.mark.parametrize("printed,expected", PINNED)
def test_bounds_are_those_of_the_former_implementation(printed, expected):
    assert forced_text_bound(printed) == expected
    assert check_finite(printed) == expected


def _productive_by_definition(ebnf: str) -> set[str]:
    """The least set P of rules with: a rule is in P when one of its alternatives has only
    productive items (a terminal that matches something, an optional part, a repetition of a
    productive item, a group with a productive alternative, a rule in P). Full passes over the
    node table until nothing changes, each node evaluated from scratch."""
    g = _parse(ebnf)

    def prod(i, p) -> bool:
        kind = g.kind[i]
        if kind == _TERM:
            return i not in g.dead
        if kind == _REF:
            return g.arg[i] in p
        if kind == _OPT:
            return True
        if kind == _REP:
            return prod(g.kids[i][0], p)
        return any(all(prod(j, p) for j in g.kids[s]) for s in g.kids[i])  # _ALT of _SEQs

    p: set[str] = set()
    while True:
        more = {name for name, body in g.body.items() if prod(body, p)}
        if more == p:
            return p
        p = more


def _random_grammar(rng: random.Random) -> str:
    names = ["root"] + [f"r{i}" for i in range(1, rng.randint(1, 7))]

    def item(depth):
        c = rng.random()
        if c < 0.35:
            return rng.choice(names)
        if c < 0.6:
            return '"' + "x" * rng.randint(0, 3) + '"'
        if c < 0.7:
            return rng.choice(["[a-z]", "[^\\x00-\\U0010FFFF]"])
        if depth > 2:
            return '"y"'
        return "(" + alt(depth + 1) + ")" + rng.choice(["", "*", "+", "?", "{2,5}", "{0,3}"])

    def alt(depth):
        return " | ".join(
            " ".join(item(depth) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))
        )

    return "".join(f"{name} ::= {alt(0)}\n" for name in names)


def _reachable(ebnf: str, root: str) -> set[str]:
    g = _parse(ebnf)
    seen, todo = {root}, [root]
    while todo:
        name = todo.pop()
        for i in g.span[name]:
            ref = g.arg[i] if g.kind[i] == _REF else None
            if ref in g.body and ref not in seen and g.parent[i] >= 0:
                seen.add(ref)
                todo.append(ref)
    return seen


def test_productivity_matches_the_definition_on_random_grammars():
    rng = random.Random(7)
    checked = refused = 0
    for _ in range(400):
        try:
            printed = _printed(_random_grammar(rng))
        except RuntimeError:  # (xgrammar refused it)
            continue
        expected = _reachable(printed, "root") - _productive_by_definition(printed)
        bad = unproductive_rules(printed)
        assert sorted(bad) == sorted(expected) and len(bad) == len(set(bad))
        if bad:
            with pytest.raises(ConstraintError, match="no finite output"):
                check_finite(printed)
            refused += 1
        else:
            assert check_finite(printed) is not None
        checked += 1
    assert checked > 300 and 0 < refused < checked  # (both verdicts exercised)
