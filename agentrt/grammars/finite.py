"""Refuse grammars that admit no finite output.

A rule such as ``root ::= "a" root`` (or a JSON Schema object whose required property `$ref`s the
object itself, or an empty character class) compiles in xgrammar, but no output ever satisfies it:
generation runs to max_tokens, and xgrammar's jump-forward search over the forced text "aaaa..."
never ends. The check is the textbook productive-symbol fixpoint for context-free grammars
(Hopcroft & Ullman, "useless symbols"): a rule is productive when one of its alternatives consists
only of terminals and productive rules. Every rule reachable from the root must be productive;
otherwise a prefix can lead the matcher into a rule it can never leave.

The input is xgrammar's printed EBNF (``str(xgr.Grammar)``), which is regular: one rule per line,
``name ::= body`` with an optional lookahead ``(= ...)`` that does not affect productivity.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from agentrt.errors import ConstraintError

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<define>::=)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<look>\(=)
  | (?P<count>\{\s*\d+\s*,\s*-?\d+\s*\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  | (?P<punct>[()|*+?])
""",
    re.VERBOSE | re.DOTALL,
)

_SIMPLE_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "b": 8, "a": 7, "e": 27, "0": 0}
_MAX_CODEPOINT = 0x10FFFF


class _Unparsed(Exception):
    pass


def _class_is_empty(text: str) -> bool:
    """True when the character class `text` ("[...]" in xgrammar's printed syntax) matches no
    character: ``[]``, or a negated class whose ranges cover every code point."""
    body, negated = text[1:-1], False
    if body.startswith("^"):
        body, negated = body[1:], True
    chars, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            e = body[i + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(e)
            if width and re.fullmatch(r"[0-9a-fA-F]+", body[i + 2 : i + 2 + width] or "-"):
                chars.append(int(body[i + 2 : i + 2 + width], 16))
                i += 2 + width
                continue
            chars.append(_SIMPLE_ESCAPES.get(e, ord(e)))
            i += 2
            continue
        chars.append(-1 if c == "-" else ord(c))  # -1: a range dash (an escaped dash is a char)
        i += 1
    ranges, j = [], 0
    while j < len(chars):
        if j + 2 < len(chars) and chars[j + 1] == -1 and chars[j] >= 0 and chars[j + 2] >= 0:
            ranges.append((chars[j], chars[j + 2]))
            j += 3
        else:
            c = ord("-") if chars[j] == -1 else chars[j]
            ranges.append((c, c))
            j += 1
    if not negated:
        return not ranges
    covered = 0
    for lo, hi in sorted(ranges):
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > _MAX_CODEPOINT


def _parse(ebnf: str) -> dict[str, tuple]:
    """{rule name: body} where a body is ("alt", [seq, ...]), a seq is a list of items and an item
    is ("ref", name) | ("term", productive: bool, chars) | ("alt", ...) | ("opt", item) |
    ("rep1", item, min count). `chars`: at least the characters a terminal matches (a string's
    printed length, 1 for a class, 0 for a lookahead)."""
    rules: dict[str, tuple] = {}
    for line in ebnf.splitlines():
        if line.strip():
            name, body = _Line(line).rule()
            rules[name] = body
    return rules


def _rules_with_root(ebnf: str, root: str, rules: dict | None) -> dict[str, tuple] | None:
    """`rules` (or `ebnf` parsed), or None when `ebnf` is not in the printed form or lacks `root`."""
    if rules is None:
        try:
            rules = _parse(ebnf)
        except _Unparsed:
            return None
    return rules if root in rules else None


class _Line:
    """Recursive-descent parser of one printed rule: name ::= alternatives [lookahead]."""

    def __init__(self, line: str):
        self.line, self.toks, self.pos = line, [], 0
        at = 0
        while at < len(line):
            m = _TOKEN.match(line, at)
            if m is None:
                raise _Unparsed(line)
            if m.lastgroup != "ws":
                self.toks.append((m.lastgroup, m.group()))
            at = m.end()

    def rule(self) -> tuple[str, tuple]:
        if len(self.toks) < 3 or self.toks[0][0] != "name" or self.toks[1][0] != "define":
            raise _Unparsed(self.line)
        self.pos = 2
        body = self.expr()
        if self.pos != len(self.toks):
            raise _Unparsed(self.line)
        return self.toks[0][1], body

    def peek(self):
        return self.toks[self.pos] if self.pos < len(self.toks) else (None, None)

    def expr(self):
        alts = [self.seq()]
        while self.peek()[1] == "|":
            self.pos += 1
            alts.append(self.seq())
        return ("alt", alts)

    def seq(self):
        items = []
        while True:
            kind, text = self.peek()
            if kind is None or text in ("|", ")"):
                return items
            items.append(self.item())

    def item(self):
        kind, text = self.peek()
        self.pos += 1
        if kind == "name":
            node = ("ref", text)
        elif kind == "string":
            node = ("term", True, len(text) - 2)
        elif kind == "cls":
            node = ("term", not _class_is_empty(text), 1)
        elif kind == "look":
            self.expr()
            self.close()
            return ("term", True, 0)  # a lookahead constrains, it does not produce
        elif text == "(":
            node = self.expr()
            self.close()
        else:
            raise _Unparsed(self.line)
        kind, text = self.peek()
        if text in ("*", "?"):
            self.pos += 1
            return ("opt", node)
        if text == "+":
            self.pos += 1
            return ("rep1", node, 1)
        if kind == "count":
            self.pos += 1
            lo = int(text[1:].split(",")[0])
            return ("rep1", node, lo) if lo > 0 else ("opt", node)
        return node

    def close(self):
        if self.peek()[1] != ")":
            raise _Unparsed(self.line)
        self.pos += 1


def unproductive_rules(ebnf: str, root: str = "root", rules: dict | None = None) -> list[str] | None:
    """Rules reachable from `root` that derive no finite string, in reachability order ([] when the
    grammar is fine). None when `ebnf` is not in the printed form this module reads (the caller
    then cannot tell and should not refuse). `rules`: `ebnf` already parsed."""
    rules = _rules_with_root(ebnf, root, rules)
    if rules is None:
        return None
    productive: set[str] = set()

    def prod(node) -> bool:
        kind = node[0]
        if kind == "term":
            return node[1]
        if kind == "ref":
            return node[1] in productive
        if kind == "opt":
            return True
        if kind == "rep1":
            return prod(node[1])
        return any(all(prod(i) for i in s) for s in node[1])

    users: dict[str, set[str]] = {}
    for name, body in rules.items():
        for ref in _refs(body):
            users.setdefault(ref, set()).add(name)
    work = list(rules)
    while work:  # a rule is re-examined only when one of the rules it uses became productive
        name = work.pop()
        if name not in productive and prod(rules[name]):
            productive.add(name)
            work.extend(users.get(name, ()))
    order, seen, stack = [], {root}, [root]
    while stack:
        name = stack.pop()
        order.append(name)
        for ref in _refs(rules.get(name, ("alt", []))):
            if ref not in seen and ref in rules:
                seen.add(ref)
                stack.append(ref)
    return [n for n in order if n not in productive]


def _refs(node):
    kind = node[0]
    if kind == "ref":
        yield node[1]
    elif kind in ("opt", "rep1"):
        yield from _refs(node[1])
    elif kind == "alt":
        for s in node[1]:
            for i in s:
                yield from _refs(i)


def check_finite(ebnf: str, root: str = "root") -> ForcedBound | None:
    """Raise ConstraintError when some rule reachable from `root` in `ebnf` (xgrammar's printed form)
    can never finish: a recursion with no way out, or an empty character class. Returns the
    grammar's `forced_text_bound` (None: not readable), from the same parse."""
    try:
        rules = _parse(ebnf)
    except _Unparsed:
        return None
    bad = unproductive_rules(ebnf, root, rules)
    if bad:
        names = ", ".join(f"'{n}'" for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConstraintError(
            f"the constraint admits no finite output: rule {names} can never finish "
            "(a recursion with no way out, such as a required property that contains "
            "its own object, or an empty character class)"
        )
    return forced_text_bound(ebnf, root, rules)


_SAT = 1 << 62  # saturating arithmetic: a bound this large means "no useful bound"


class ForcedBound(NamedTuple):
    """An upper bound on the text a grammar can force at once (what xgrammar's
    `find_jump_forward_string` materialises, one character at a time): at most
    `fixed + per_output_char * n` characters after `n` output characters. `per_output_char` is 0
    for a grammar without recursion."""

    fixed: int
    per_output_char: int

    def at(self, num_output_chars: int) -> int:
        return min(_SAT, self.fixed + self.per_output_char * num_output_chars)


def forced_text_bound(ebnf: str, root: str = "root", rules: dict | None = None) -> ForcedBound | None:
    """Bound the forced text of `ebnf` (xgrammar's printed form); None when it cannot be read.

    Forced text is a prefix of every way to finish, so it is at most the shortest completion of
    the matcher's stack: the sum, over the stack's frames, of the shortest text that finishes
    each frame's alternative (its `rest`). Without recursion a stack is a path of rule references
    and the longest such sum is a longest-path computation over that acyclic graph. With recursion
    the stack grows with the output: each accepted character pushes at most one frame per rule or
    group, so depth <= frames * (chars + 2) and the bound is max rest * that depth (loose, but
    small for JSON-like grammars whose recursion is followed by one closing character).
    Counted repetitions (`x{n, m}`), long literals and rules that double each other are what make
    it large: `"a"{2000000000,2147483647}` is bounded by 2e9, and the caller then does not let
    xgrammar materialise the text. `rules`: `ebnf` already parsed."""
    rules = _rules_with_root(ebnf, root, rules)
    if rules is None:
        return None
    minlen = {name: _SAT for name in rules}

    def mlen(node) -> int:
        kind = node[0]
        if kind == "term":
            return node[2]
        if kind == "ref":
            return minlen.get(node[1], _SAT)
        if kind == "opt":
            return 0
        if kind == "rep1":
            return min(_SAT, node[2] * mlen(node[1]))
        return min((min(_SAT, sum(mlen(i) for i in s)) for s in node[1]), default=_SAT)

    for _ in range(len(rules) + 1):  # shortest derivations: a fixpoint from above
        changed = False
        for name, body in rules.items():
            m = mlen(body)
            if m < minlen[name]:
                minlen[name], changed = m, True
        if not changed:
            break

    def rest(node, inner_ref) -> int:
        """The longest 'shortest text to finish `node`' over positions inside it; `inner_ref`
        gives a referenced rule's contribution (its own rest, or 0 when it is its own frame)."""
        kind = node[0]
        if kind == "term":
            return node[2]
        if kind == "ref":
            return inner_ref(node[1])
        if kind == "opt":
            return rest(node[1], inner_ref)
        if kind == "rep1":
            return min(_SAT, rest(node[1], inner_ref) + (node[2] - 1) * mlen(node[1]))
        best = 0
        for s in node[1]:
            after = 0
            for item in reversed(s):
                best = max(best, min(_SAT, rest(item, inner_ref) + after))
                after = min(_SAT, after + mlen(item))
        return best

    reachable, cyclic = _reach_and_cycles(rules, root)
    fixed: dict[str, int] = {}  # longest path over non-recursive rules (recursive ones weigh 0)
    for name in reversed(_topological(rules, reachable)):
        fixed[name] = rest(rules[name], lambda n: 0 if n in cyclic else fixed.get(n, _SAT))
    if not cyclic:
        return ForcedBound(fixed[root], 0)
    local = max(rest(rules[n], lambda _n: 0) for n in cyclic)
    num_frames = sum(1 + _count_groups(rules[n]) for n in cyclic)
    top = max(fixed.values(), default=0)
    per_char = min(_SAT, local * num_frames)
    return ForcedBound(min(_SAT, top + 2 * per_char), per_char)


def _reach_and_cycles(rules: dict[str, tuple], root: str) -> tuple[set[str], set[str]]:
    """Rules reachable from `root`, and those of them on a cycle (Tarjan's strongly connected
    components, iterative)."""
    graph = {n: [r for r in _refs(body) if r in rules] for n, body in rules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cyclic: set[str] = set()
    work = [(root, 0)]
    while work:
        node, i = work.pop()
        if i == 0:
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)
        succ = graph[node]
        if i < len(succ):
            work.append((node, i + 1))
            nxt = succ[i]
            if nxt not in index:
                work.append((nxt, 0))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
            continue
        if low[node] == index[node]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == node:
                    break
            if len(comp) > 1 or node in graph[node]:
                cyclic.update(comp)
        if work:
            parent = work[-1][0]
            low[parent] = min(low[parent], low[node])
    return set(index), cyclic


def _topological(rules: dict[str, tuple], names: set[str]) -> list[str]:
    """`names` ordered so that a rule comes before the rules it references (cycles broken
    anywhere: callers treat recursive rules separately)."""
    order, seen = [], set()
    for start in sorted(names):
        if start in seen:
            continue
        seen.add(start)
        work = [(start, iter(_refs(rules[start])))]
        while work:
            name, it = work[-1]
            for ref in it:
                if ref in names and ref not in seen:
                    seen.add(ref)
                    work.append((ref, iter(_refs(rules[ref]))))
                    break
            else:
                work.pop()
                order.append(name)
    return order[::-1]


def _count_groups(node) -> int:
    kind = node[0]
    if kind in ("opt", "rep1"):
        return 1 + _count_groups(node[1])
    if kind == "alt":
        return 1 + sum(_count_groups(i) for s in node[1] for i in s)
    return 0
