"""Finite automata over code points for the key and string languages a grammar must enforce
exactly: which property names a `patternProperties` pattern, `propertyNames` or the named
properties cover, their complements (the names `additionalProperties` governs), and a pattern
intersected with a length range.

Textbook constructions (Hopcroft, Motwani & Ullman, "Introduction to Automata Theory", ch. 2-4):
Thompson's NFA from Python's regex AST (`re._parser`), the subset construction run on several NFAs
at once (each DFA state is labelled with the set of components that accept there, which gives
intersections and complements of any of them at no extra cost), Moore's partition refinement, and
the right-linear grammar of a DFA (one EBNF rule per state).

Alphabet. Transitions are code-point ranges. Every automaton here runs over `alphabet(patterns)`:
printable code points without quote, backslash, U+2028/U+2029 and surrogates (no JSON escapes, no
line terminators, on which ECMA-262's `.` and Python's differ), and without the code points on which
the ECMA-262 and Python meanings of a class escape used by the patterns differ (`\\d` is ASCII in
ECMA-262 and Unicode in Python, ...). On that alphabet both dialects give every pattern the same
language, so a complement is exact under either; strings outside the alphabet are never produced
(narrower than the schema, never wider).

Errors: `AutomatonError` (a ValueError) naming the construct that has no automaton here (case
folding, lookaround, backreferences, anchors inside a pattern) or a size past the bounds.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
from dataclasses import dataclass

from agentrt.grammars.regex import (
    _category_ranges,
    _has_anchor,
    _is_one_group,
    _merge,
    _split_top,
    _subtract,
    as_fullmatch,
    esc_char,
)

try:
    import re._constants as sre_c  # Python >= 3.11
    import re._parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as sre_c
    import sre_parse

MAX_NFA_STATES = 20_000
MAX_DFA_STATES = 4_000
_BASE = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x2027), (0x202A, 0xD7FF), (0xE000, 0x10FFFF))
_CATS = (
    sre_c.CATEGORY_DIGIT,
    sre_c.CATEGORY_WORD,
    sre_c.CATEGORY_SPACE,
    sre_c.CATEGORY_NOT_DIGIT,
    sre_c.CATEGORY_NOT_WORD,
    sre_c.CATEGORY_NOT_SPACE,
)


class AutomatonError(ValueError):
    """A regex construct (or a size) this module does not turn into an automaton."""


def _parse(full: str):
    try:
        tree = sre_parse.parse(full)
    except (re.error, OverflowError, RecursionError) as e:
        raise AutomatonError(f"regex {full!r} does not parse ({e})") from None
    if tree.state.flags & re.IGNORECASE:
        raise AutomatonError("case-insensitive matching is not supported")
    return tree


def _categories(items, found: set) -> None:
    for op, av in items:
        if op is sre_c.IN:
            found.update(a for o, a in av if o is sre_c.CATEGORY)
        elif op is sre_c.BRANCH:
            for b in av[1]:
                _categories(b, found)
        elif op is sre_c.SUBPATTERN:
            _categories(av[3], found)
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
            _categories(av[2], found)
        elif op is sre_c.CATEGORY:
            found.add(av)


@functools.cache
def alphabet(fulls: tuple[str, ...] = ()) -> tuple[tuple[int, int], ...]:
    """The code points strings may use when they must match (or not match) the whole-string
    regexes `fulls`: `_BASE` less the code points where a class escape they use means different
    things in ECMA-262 and Python."""
    cats: set = set()
    for full in fulls:
        _categories(list(_parse(full)), cats)
    out = list(_BASE)
    for cat in cats & set(_CATS):
        ambiguous = _subtract(_category_ranges(cat, True), _category_ranges(cat, False))
        out = _subtract(out, ambiguous)
    return tuple(_merge(out))


def _intersect(a, b):
    """Intersection of two sorted lists of disjoint ranges, in linear time."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class _NFA:
    """Thompson NFA: `eps[s]` epsilon successors, `edges[s]` (ranges, target)."""

    def __init__(self, sigma):
        self.sigma = list(sigma)
        self.sigma_t = tuple(self.sigma)
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[tuple, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise AutomatonError(f"the automaton would exceed {MAX_NFA_STATES} states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def chars(self, a: int, ranges, b: int) -> None:
        ranges = self.sigma_t if ranges is self.sigma else tuple(_intersect(_merge(ranges), self.sigma))
        if ranges:
            self.edges[a].append((ranges, b))

    def literal(self, text: str, a: int) -> int:
        for ch in text:
            b = self.state()
            self.chars(a, [(ord(ch), ord(ch))], b)
            a = b
        return a

    def regex(self, full: str, a: int) -> int:
        """States for whole-string regex `full` from `a`; returns the end state."""
        return self.seq(list(_parse(full)), a)

    def seq(self, items, a: int) -> int:
        for op, av in items:
            a = self.node(op, av, a)
        return a

    def node(self, op, av, a: int) -> int:
        if op is sre_c.LITERAL:
            b = self.state()
            self.chars(a, [(av, av)], b)
            return b
        if op is sre_c.NOT_LITERAL:
            b = self.state()
            self.chars(a, _subtract([(0, 0x10FFFF)], [(av, av)]), b)
            return b
        if op is sre_c.ANY:
            b = self.state()
            self.chars(a, [(0, 0x09), (0x0B, 0x10FFFF)], b)
            return b
        if op is sre_c.IN:
            b = self.state()
            self.chars(a, _class_ranges(av), b)
            return b
        if op is sre_c.BRANCH:
            end = self.state()
            for branch in av[1]:
                start = self.state()
                self.eps[a].append(start)
                self.eps[self.seq(list(branch), start)].append(end)
            return end
        if op is sre_c.SUBPATTERN:
            _group, add_flags, _del, sub = av
            if add_flags & re.IGNORECASE:
                raise AutomatonError("case-insensitive matching is not supported")
            return self.seq(list(sub), a)
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):  # a language ignores laziness
            lo, hi, sub = av
            for _ in range(lo):
                a = self.seq(list(sub), a)
            if hi is sre_c.MAXREPEAT:
                loop = self.state()
                self.eps[a].append(loop)
                self.eps[self.seq(list(sub), loop)].append(loop)
                return loop
            end = self.state()
            self.eps[a].append(end)
            for _ in range(hi - lo):
                a = self.seq(list(sub), a)
                self.eps[a].append(end)
            return end
        raise AutomatonError(f"regex construct {op} (anchors inside, lookaround, backreferences)")


def _class_ranges(items) -> list:
    negate, ranges = False, []
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            ranges.append((av, av))
        elif op is sre_c.RANGE:
            ranges.append(av)
        elif op is sre_c.CATEGORY and av in _CATS:
            ranges += _category_ranges(av, False)  # the alphabet lacks where meanings differ
        else:
            raise AutomatonError(f"class item {op}")
    ranges = _merge(ranges)
    return _subtract([(0, 0x10FFFF)], ranges) if negate else ranges


@dataclass
class DFA:
    """A complete DFA over its alphabet, split into character classes: `classes[c]` the code-point
    ranges of class c; state 0 starts; `trans[s][c]` the successor of s on class c; `labels[s]` the
    frozenset of component ids accepting in s."""

    classes: list[list[tuple[int, int]]]
    trans: list[list[int]]
    labels: list[frozenset]


def build(components, sigma) -> DFA:
    """`_build` cached (the normalizer checks what nodes.py later emits, often many times over
    through `$ref` and `allOf`); the DFA returned is shared: do not change it."""
    for kind, arg in components:
        if kind == "length" and max(arg[0], arg[1] or 0) >= MAX_DFA_STATES:
            raise AutomatonError(f"a length bound of {MAX_DFA_STATES} or more is too large for an automaton")
    key = tuple((kind, tuple(arg) if isinstance(arg, list) else arg) for kind, arg in components)
    return _build(key, tuple(sigma))


@functools.lru_cache(maxsize=256)
def _build(components, sigma) -> DFA:
    """The product DFA of `components` over alphabet `sigma`, one run for all. A component is
    ("regex", whole-string regex), ("search", ECMA-262 search pattern: JSON Schema's `pattern`
    semantics), ("words", list of strings) or ("length", (lo, hi)) with hi
    None for unbounded; its id is its index. Raises AutomatonError past MAX_DFA_STATES."""
    nfa = _NFA(sigma)
    start = nfa.state()
    finals: dict[int, int] = {}
    absorbing: dict[int, tuple[int, int]] = {}  # absorbing final state -> its component's states
    for cid, (kind, arg) in enumerate(components):
        s = nfa.state()
        first = s
        nfa.eps[start].append(s)
        if kind == "search":
            done = nfa.state()  # every continuation of a match is a match
            nfa.chars(done, nfa.sigma, done)
            finals[done] = cid
            loop = nfa.state()  # unanchored start: any prefix
            nfa.chars(loop, nfa.sigma, loop)
            nfa.eps[s].append(loop)
            for head, core, tail in _search_parts(arg):
                end = nfa.regex(core, s if head else loop)
                if tail:
                    finals[end] = cid
                else:
                    nfa.eps[end].append(done)
            absorbing[done] = (first, len(nfa.eps))
        elif kind == "regex":
            finals[nfa.regex(arg, s)] = cid
        elif kind == "words":
            for w in arg:
                finals[nfa.literal(w, s)] = cid
        else:
            lo, hi = arg
            for _ in range(lo):
                t = nfa.state()
                nfa.chars(s, nfa.sigma, t)
                s = t
            if hi is None:
                nfa.chars(s, nfa.sigma, s)
                finals[s] = cid
            else:
                end = nfa.state()
                finals[end] = cid
                nfa.eps[s].append(end)
                for _ in range(hi - lo):
                    t = nfa.state()
                    nfa.chars(s, nfa.sigma, t)
                    nfa.eps[t].append(end)
                    s = t
    return _determinize(nfa, start, finals, absorbing)


def _search_parts(pattern: str) -> list[tuple[bool, str, bool]]:
    """An ECMA-262 search pattern as top-level alternatives (anchored at the start?, core, anchored
    at the end?); AutomatonError when an anchor sits anywhere else."""
    body = pattern
    while _is_one_group(body):
        body = body[body.index(":") + 1 if body.startswith("(?:") else 1 : -1]
    out = []
    for alt in _split_top(body, "|"):
        while _is_one_group(alt):
            alt = alt[alt.index(":") + 1 if alt.startswith("(?:") else 1 : -1]
        head = alt.startswith("^")
        tail = alt.endswith("$") and not alt.endswith("\\$")
        core = alt[1 if head else 0 : len(alt) - (1 if tail else 0)]
        if _has_anchor(core):
            raise AutomatonError("anchors (^, $) inside the pattern are not supported")
        out.append((head, core, tail))
    return out


def _closure(nfa: _NFA, states) -> frozenset:
    seen, todo = set(states), list(states)
    while todo:
        for t in nfa.eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)


def _collapse(states: frozenset, absorbing: dict) -> frozenset:
    """A component that reached its absorbing final state needs none of its other states."""
    for done, (lo, hi) in absorbing.items():
        if done in states:
            states = frozenset(x for x in states if not lo <= x < hi or x == done)
    return states


def _classes(nfa: _NFA) -> tuple[list[list[tuple[int, int]]], dict]:
    """Split the alphabet into classes no edge tells apart; map each edge's ranges to the bit mask
    of its classes."""
    sets = list(dict.fromkeys(rs for row in nfa.edges for rs, _t in row))
    cuts = sorted(
        {x for lo, hi in nfa.sigma for x in (lo, hi + 1)}
        | {x for rs in sets for lo, hi in rs for x in (lo, hi + 1)}
    )
    sig_lo = [lo for lo, _ in nfa.sigma]

    def inside(x: int) -> bool:  # cuts include the alphabet's bounds: a piece is wholly in or out
        k = bisect.bisect_right(sig_lo, x) - 1
        return k >= 0 and nfa.sigma[k][1] >= x

    pieces = [(lo, hi - 1) for lo, hi in itertools.pairwise(cuts) if inside(lo)]
    starts = [lo for lo, _ in pieces]
    member = [0] * len(pieces)  # bit i: piece lies in sets[i]

    for i, rs in enumerate(sets):
        for lo, hi in rs:
            j = bisect.bisect_left(starts, lo)
            while j < len(pieces) and pieces[j][1] <= hi:
                member[j] |= 1 << i
                j += 1
    by_sig: dict[int, int] = {}
    classes: list[list[tuple[int, int]]] = []
    piece_class = []
    for (lo, hi), sig in zip(pieces, member):
        if sig not in by_sig:
            by_sig[sig] = len(classes)
            classes.append([])
        c = by_sig[sig]
        piece_class.append(c)
        if classes[c] and classes[c][-1][1] + 1 == lo:
            classes[c][-1] = (classes[c][-1][0], hi)
        else:
            classes[c].append((lo, hi))
    masks = {}
    for i, rs in enumerate(sets):
        m = 0
        for pc, sig in zip(piece_class, member):
            if sig >> i & 1:
                m |= 1 << pc
        masks[rs] = m
    return classes, masks


def _determinize(nfa: _NFA, start: int, finals: dict[int, int], absorbing: dict) -> DFA:
    classes, masks = _classes(nfa)
    edges = [[(masks[rs], t) for rs, t in row] for row in nfa.edges]
    closure_cache: dict[frozenset, frozenset] = {}

    def close(states: frozenset) -> frozenset:
        got = closure_cache.get(states)
        if got is None:
            got = closure_cache[states] = _collapse(_closure(nfa, states), absorbing)
        return got

    first = close(frozenset([start]))
    index = {first: 0}
    order = [first]
    trans, labels = [], []
    i = 0
    while i < len(order):
        cur = order[i]
        i += 1
        labels.append(frozenset(finals[s] for s in cur if s in finals))
        out = [(m, t) for s in cur for m, t in edges[s]]
        row = []
        for c in range(len(classes)):
            bit = 1 << c
            target = close(frozenset(t for m, t in out if m & bit))
            j = index.get(target)
            if j is None:
                if len(order) >= MAX_DFA_STATES:
                    raise AutomatonError(f"the automaton would exceed {MAX_DFA_STATES} states")
                j = index[target] = len(order)
                order.append(target)
            row.append(j)
        trans.append(row)
    return DFA(classes, trans, labels)


def minimize(dfa: DFA, output) -> tuple[DFA, list]:
    """Moore's refinement of `dfa` where states are equivalent only with equal `output(label)`.
    Returns the minimal DFA (start 0) and the output of each of its states."""
    outs = [output(lab) for lab in dfa.labels]
    keys = {o: i for i, o in enumerate(dict.fromkeys(outs))}
    cls = [keys[o] for o in outs]
    while True:
        ids: dict = {}
        new = [
            ids.setdefault((cls[s], tuple(cls[t] for t in row)), len(ids)) for s, row in enumerate(dfa.trans)
        ]
        if len(ids) == len(set(cls)):
            break
        cls = new
    remap = {cls[0]: 0}
    for c in cls:
        remap.setdefault(c, len(remap))
    trans: list = [None] * len(remap)
    out_of: list = [None] * len(remap)
    for s, row in enumerate(dfa.trans):
        c = remap[cls[s]]
        if trans[c] is None:
            trans[c] = [remap[cls[t]] for t in row]
            out_of[c] = outs[s]
    return DFA(dfa.classes, trans, [frozenset()] * len(trans)), out_of


def live_states(dfa: DFA, accepting: list[bool]) -> list[bool]:
    """States from which an accepting state can be reached."""
    back: list[list[int]] = [[] for _ in dfa.trans]
    for s, row in enumerate(dfa.trans):
        for t in set(row):
            back[t].append(s)
    live = list(accepting)
    todo = [s for s, a in enumerate(accepting) if a]
    while todo:
        for p in back[todo.pop()]:
            if not live[p]:
                live[p] = True
                todo.append(p)
    return live


def accepts(dfa: DFA, text: str) -> int | None:
    """The state `dfa` reaches on `text`, None when a character is outside its alphabet."""
    s = 0
    for ch in text:
        cp = ord(ch)
        for c, rs in enumerate(dfa.classes):
            if any(lo <= cp <= hi for lo, hi in rs):
                s = dfa.trans[s][c]
                break
        else:
            return None
    return s


def ranges_ebnf(ranges) -> str:
    """An EBNF character class for code-point `ranges`."""
    body = "".join(
        esc_char(lo, True) if lo == hi else f"{esc_char(lo, True)}-{esc_char(hi, True)}" for lo, hi in ranges
    )
    return f"[{body}]"


def dfa_ebnf(dfa: DFA, finals: list, name: str) -> tuple[list[str], bool]:
    """Right-linear EBNF of `dfa`: rule `{name}_{s}` for each live state s, whose alternatives are
    one character class per successor and `finals[s]` (an EBNF expression that ends the string
    there, or None). Dead states are left out, so no prefix leads nowhere. Returns the rule lines
    and whether the start state is live (False: the language is empty)."""
    live = live_states(dfa, [f is not None for f in finals])
    lines = []
    for s, row in enumerate(dfa.trans):
        if not live[s]:
            continue
        by_target: dict[int, list] = {}
        for c, t in enumerate(row):
            if live[t]:
                by_target.setdefault(t, []).extend(dfa.classes[c])
        alts = [f"({finals[s]})"] if finals[s] is not None else []
        alts += [f"({ranges_ebnf(_merge(rs))} {name}_{t})" for t, rs in by_target.items()]
        lines.append(f"{name}_{s} ::= " + " | ".join(alts))
    return lines, live[0]


def search_regex(pattern: str) -> str:
    """The whole-string regex for an ECMA-262 search for `pattern` (raises AutomatonError when it
    has anchors inside)."""
    full = as_fullmatch(pattern)
    if full is None:
        raise AutomatonError("anchors (^, $) inside the pattern are not supported")
    return full
