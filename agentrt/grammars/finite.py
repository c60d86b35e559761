"""Refuse grammars that admit no finite output, and bound the text a grammar can force.

A rule such as ``root ::= "a" root`` (or a JSON Schema object whose required property `$ref`s the
object itself, or an empty character class) compiles in xgrammar, but no output ever satisfies it:
generation runs to max_tokens, and xgrammar's jump-forward search over the forced text "aaaa..."
never ends. The check is the textbook productive-symbol computation for context-free grammars
(Hopcroft & Ullman, "useless symbols"): a rule is productive when one of its alternatives consists
only of terminals and productive rules. Every rule reachable from the root must be productive;
otherwise a prefix can lead the matcher into a rule it can never leave.

The input is xgrammar's printed EBNF (``str(xgr.Grammar)``), which is regular: one rule per line,
``name ::= body`` with an optional lookahead ``(= ...)`` that does not affect productivity.

Cost: linear in the grammar's size, apart from a heap (n log n) for the shortest derivations. Each
line is parsed token by token (shift-reduce, no recursion) into a flat table of nodes
(alternations, sequences, repetitions, terminals, rule references); productivity is the worklist
form of the fixpoint, each sequence counting down its items not yet known productive, so every node
and reference is handled once; shortest derivation lengths are Knuth's generalisation of
Dijkstra's algorithm to grammars ("A generalization of Dijkstra's algorithm", Information
Processing Letters 6(1), 1977); reachability is one depth-first search and recursion among rules
Tarjan's strongly connected components, both iterative (a chain of 20,000 rules is no deeper for
Python than one rule). Only `rest` recurses, over the groups nested inside one rule (xgrammar
caps that nesting). The former fixpoints re-read a rule whenever one of its references changed
and swept all rules once per level of a chain: quadratic. Measured with `bench/finite_check.py`
(2-core box under a load of ~5, before -> after): a chain of 1,000 rules 17.8 s -> 0.13 s, 4,000
rules 301 s -> 0.55 s, 20,000 rules -> 3.5 s; xgrammar's grammar of an object with N required
string properties (2 rules per property), where the former passes happened to converge at once:
N = 1,000 0.55 -> 0.36 s, 4,000 2.6 -> 1.9 s, 20,000 (3.4 MB of EBNF) 16.3 -> 9.7 s. The check
runs in the compile child, under the compile deadline (grammars/compile_child.py).
"""

from __future__ import annotations

import heapq
import re
from typing import NamedTuple

from agentrt.errors import ConstraintError

_TOKEN = re.compile(  # one token and the whitespace before it
    r"""\s*(?:
    (?P<define>::=)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<look>\(=)
  | (?P<count>\{\s*\d+\s*,\s*-?\d+\s*\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  | (?P<punct>[()|*+?])
)""",
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


_SAT = 1 << 62  # saturating arithmetic: a bound this large means "no useful bound"

# node kinds of _Graph
_TERM, _REF, _OPT, _REP, _ALT, _SEQ = range(6)


class _Graph:
    """Parsed printed rules as one flat table of nodes (`_parse`; no tree, no recursion).

    Per node id: `kind` (_TERM: a string, class or lookahead; _REF: a rule reference; _OPT: `x?`,
    `x*` or `x{0, n}`; _REP: `x+` or `x{n, m}` with n > 0; _ALT: a rule's body or a parenthesised
    group; _SEQ: one alternative of an _ALT), `parent` (-1 for a rule's body), `kids` (ids in
    order), `arg` (a _TERM's minimum length in characters: a string's printed length, 1 for a
    class, 0 for a lookahead; a _REP's minimum count; a _REF's rule name). `dead`: the _TERM
    nodes that match nothing (an empty character class). `body[name]`: the rule's _ALT node;
    `span[name]`: the ids of its nodes; `refs[name]`: the defined rules its body references, in
    order of appearance (duplicates kept); `users[name]`: the _REF nodes that name rule `name`.
    A lookahead's contents do not count (it constrains, it does not produce)."""

    def __init__(self):
        self.kind: list[int] = []
        self.parent: list[int] = []
        self.kids: list[list[int]] = []
        self.arg: list = []
        self.dead: set[int] = set()
        self.body: dict[str, int] = {}
        self.span: dict[str, range] = {}
        self.refs: dict[str, list[str]] = {}
        self.users: dict[str, list[int]] = {}
        self._owner: dict[int, str] = {}  # a rule's body node -> the rule's name
        self._empty: dict[str, bool] = {}  # character class -> matches nothing (classes repeat)

    def _node(self, kind: int, parent: int, arg=None, leaf: bool = False) -> int:
        i = len(self.kind)
        self.kind.append(kind)
        self.parent.append(parent)
        self.kids.append(() if leaf else [])
        self.arg.append(arg)
        if parent >= 0:
            self.kids[parent].append(i)
        return i

    def owner(self, i: int) -> str | None:
        """The rule whose body is node `i` (None for a body a later rule of that name replaced)."""
        name = self._owner.get(i)
        return name if name is not None and self.body[name] == i else None

    def add_rule(self, line: str) -> None:
        """Parse one printed rule, ``name ::= alternatives``, into nodes, one token at a time
        (shift-reduce over a stack of open groups). Raises _Unparsed when it is not in that form."""
        toks, at = [], 0
        for m in _TOKEN.finditer(line):
            if m.start() != at:
                raise _Unparsed(line)
            at = m.end()
            toks.append((m.lastgroup, m.group(m.lastgroup)))
        if (at != len(line) and not line[at:].isspace()) or len(toks) < 3:
            raise _Unparsed(line)
        if toks[0][0] != "name" or toks[1][0] != "define":
            raise _Unparsed(line)
        name, first = toks[0][1], len(self.kind)
        node = self._node
        body = node(_ALT, -1)
        refs: list[str] = []
        # open groups: [group node, its current alternative] ([-1, -1] inside a lookahead)
        groups = [[body, node(_SEQ, body)]]
        looks = []  # depths in `groups` where lookaheads opened
        last = None  # the item a postfix applies to (None: no postfix may follow here)
        for kind, text in toks[2:]:
            seq = groups[-1][1]
            post, last = last, None
            if kind == "name":
                if seq >= 0:
                    last = node(_REF, seq, text, True)
                    refs.append(text)
                    self.users.setdefault(text, []).append(last)
                else:
                    last = -1
            elif kind == "string":
                last = node(_TERM, seq, len(text) - 2, True) if seq >= 0 else -1
            elif kind == "cls":
                last = node(_TERM, seq, 1, True) if seq >= 0 else -1
                if last >= 0:
                    empty = self._empty.get(text)
                    if empty is None:
                        empty = self._empty[text] = _class_is_empty(text)
                    if empty:
                        self.dead.add(last)
            elif text == "(":
                group = node(_ALT, seq) if seq >= 0 else -1
                groups.append([group, node(_SEQ, group) if group >= 0 else -1])
            elif kind == "look":
                looks.append(len(groups))
                groups.append([-1, -1])
            elif text == "|":
                group = groups[-1][0]
                groups[-1][1] = node(_SEQ, group) if group >= 0 else -1
            elif text == ")":
                if len(groups) == 1:
                    raise _Unparsed(line)
                group = groups.pop()[0]
                if looks and looks[-1] == len(groups):  # a lookahead ends: it matches "" here
                    looks.pop()
                    if groups[-1][1] >= 0:
                        node(_TERM, groups[-1][1], 0, True)
                else:
                    last = group
            elif post is not None and (kind == "count" or text in ("*", "?", "+")):
                lo = 1 if text == "+" else int(text[1:].split(",")[0]) if kind == "count" else 0
                if post >= 0:  # wrap the item: parent -> _OPT/_REP -> item
                    up = self.parent[post]
                    wrap = len(self.kind)
                    self.kind.append(_REP if lo > 0 else _OPT)
                    self.parent.append(up)
                    self.kids.append([post])
                    self.arg.append(lo if lo > 0 else None)
                    self.kids[up][-1] = wrap
                    self.parent[post] = wrap
            else:
                raise _Unparsed(line)
        if len(groups) != 1:
            raise _Unparsed(line)
        self.body[name] = body
        self._owner[body] = name
        self.span[name] = range(first, len(self.kind))
        self.refs[name] = refs

    def finish(self) -> _Graph:
        """Drop references to rules that are not defined (after the last add_rule)."""
        for name, refs in self.refs.items():
            if any(r not in self.body for r in refs):
                self.refs[name] = [r for r in refs if r in self.body]
        return self

    def productive(self) -> set[str]:
        """Names of the rules that derive some finite string: the least fixpoint, as a worklist.
        A node is settled once (when it is first known productive); a sequence counts down its
        items not yet productive, so each node and each reference is handled once."""
        kind, parent, kids = self.kind, self.parent, self.kids
        pending = [len(k) for k in kids]  # (read for sequences only)
        done = bytearray(len(kind))
        work = [
            i
            for i, k in enumerate(kind)
            if (k == _TERM and i not in self.dead) or k == _OPT or (k == _SEQ and not kids[i])
        ]
        names: set[str] = set()
        while work:
            i = work.pop()
            if done[i]:
                continue
            done[i] = 1
            up = parent[i]
            if up < 0:  # a rule's body: the rule is productive, and so is every reference to it
                name = self.owner(i)
                if name is not None:
                    names.add(name)
                    work.extend(self.users.get(name, ()))
            elif kind[up] == _SEQ:
                pending[up] -= 1
                if pending[up] == 0:
                    work.append(up)
            elif kind[up] != _OPT:  # (an optional part is productive already)
                work.append(up)
        return names

    def min_lengths(self) -> list[int]:
        """Per node, the fewest characters it derives (_SAT: none, or at least _SAT): Knuth's
        generalisation of Dijkstra's algorithm. Every node but an alternation is a superior
        function of its parts (a sum, a count times its part), final once its parts are; an
        alternation is a minimum, final when it is the smallest tentative value on the heap."""
        kind, parent, kids, arg = self.kind, self.parent, self.kids, self.arg
        n = len(kind)
        value = [_SAT] * n
        pending = [len(k) for k in kids]
        final = bytearray(n)
        ready: list[int] = []  # final, not yet propagated
        for i, k in enumerate(kind):
            if k == _TERM or k == _OPT or (k == _SEQ and not kids[i]):
                value[i] = arg[i] if k == _TERM else 0
                final[i] = 1
                ready.append(i)
        heap: list[tuple[int, int]] = []
        while True:
            while ready:
                i = ready.pop()
                v, up = value[i], parent[i]
                if up < 0:  # a rule's body: its references now have their value
                    for r in self.users.get(self.owner(i), ()):
                        value[r], final[r] = v, 1
                        ready.append(r)
                    continue
                ku = kind[up]
                if ku == _ALT:
                    if not final[up] and v < value[up]:
                        value[up] = v
                        heapq.heappush(heap, (v, up))
                elif ku == _SEQ:
                    pending[up] -= 1
                    if pending[up] == 0:
                        value[up] = min(_SAT, sum(value[c] for c in kids[up]))
                        final[up] = 1
                        ready.append(up)
                elif ku == _REP:
                    value[up] = min(_SAT, arg[up] * v)
                    final[up] = 1
                    ready.append(up)
                # (an optional part: 0, final from the start)
            while heap and final[heap[0][1]]:
                heapq.heappop(heap)
            if not heap:
                return value
            _, i = heapq.heappop(heap)
            final[i] = 1
            ready.append(i)

    def rest(self, i: int, inner_ref, mlen: list[int]) -> int:
        """The longest 'shortest text to finish node `i`' over positions inside it; `inner_ref`
        gives a referenced rule's contribution (its own rest, or 0 when it is its own frame);
        `mlen`: min_lengths(). Recursive in the nesting of groups within one rule only."""
        k = self.kind[i]
        if k == _TERM:
            return self.arg[i]
        if k == _REF:
            return inner_ref(self.arg[i])
        if k == _OPT:
            return self.rest(self.kids[i][0], inner_ref, mlen)
        if k == _REP:
            part = self.kids[i][0]
            return min(_SAT, self.rest(part, inner_ref, mlen) + (self.arg[i] - 1) * mlen[part])
        best = 0  # _ALT (a _SEQ is only ever an alternative's child)
        for s in self.kids[i]:
            after = 0
            for item in reversed(self.kids[s]):
                best = max(best, min(_SAT, self.rest(item, inner_ref, mlen) + after))
                after = min(_SAT, after + mlen[item])
        return best

    def num_groups(self, name: str) -> int:
        """Alternations (its body included), optional parts and repetitions in rule `name`."""
        kind = self.kind
        return sum(1 for i in self.span[name] if kind[i] in (_ALT, _OPT, _REP))

    def reach_order(self, root: str) -> list[str]:
        """Rules reachable from `root` in depth-first order (a stack; references pushed in order)."""
        order, seen, stack = [], {root}, [root]
        while stack:
            name = stack.pop()
            order.append(name)
            for ref in self.refs.get(name, ()):
                if ref not in seen:
                    seen.add(ref)
                    stack.append(ref)
        return order

    def components(self, root: str) -> tuple[list[str], set[str]]:
        """Rules reachable from `root`, each after every rule it references outside its own
        strongly connected component (Tarjan's algorithm, iterative: components come out in
        reverse topological order), and those of them on a cycle."""
        graph = self.refs
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        on_stack: set[str] = set()
        stack: list[str] = []
        order: list[str] = []
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
                order.extend(comp)
                if len(comp) > 1 or node in succ:
                    cyclic.update(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
        return order, cyclic


def _parse(ebnf: str) -> _Graph:
    """The rules of `ebnf` (xgrammar's printed form, one rule per line). Raises _Unparsed."""
    graph = _Graph()
    for line in ebnf.splitlines():
        if line.strip():
            graph.add_rule(line)
    return graph.finish()


def _graph_with_root(ebnf: str, root: str, rules: _Graph | None) -> _Graph | None:
    """`rules` (or `ebnf` parsed), or None when `ebnf` is not in the printed form or lacks `root`."""
    if rules is None:
        try:
            rules = _parse(ebnf)
        except _Unparsed:
            return None
    return rules if root in rules.body else None


def unproductive_rules(ebnf: str, root: str = "root", rules: _Graph | None = None) -> list[str] | None:
    """Rules reachable from `root` that derive no finite string, in reachability order ([] when the
    grammar is fine). None when `ebnf` is not in the printed form this module reads (the caller
    then cannot tell and should not refuse). `rules`: `ebnf` already parsed. Linear in the
    grammar's size."""
    graph = _graph_with_root(ebnf, root, rules)
    return None if graph is None else _unproductive(graph, root)


def _unproductive(graph: _Graph, root: str) -> list[str]:
    productive = graph.productive()
    return [n for n in graph.reach_order(root) if n not in productive]


def check_finite(ebnf: str, root: str = "root") -> ForcedBound | None:
    """Raise ConstraintError when some rule reachable from `root` in `ebnf` (xgrammar's printed form)
    can never finish: a recursion with no way out, or an empty character class. Returns the
    grammar's `forced_text_bound` (None: not readable), from the same parse. Linear in the size of
    `ebnf` (n log n for the shortest derivations)."""
    graph = _graph_with_root(ebnf, root, None)
    if graph is None:
        return None
    bad = _unproductive(graph, root)
    if bad:
        names = ", ".join(f"'{n}'" for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConstraintError(
            f"the constraint admits no finite output: rule {names} can never finish "
            "(a recursion with no way out, such as a required property that contains "
            "its own object, or an empty character class)"
        )
    return _forced_bound(graph, root)


class ForcedBound(NamedTuple):
    """An upper bound on the text a grammar can force at once (what xgrammar's
    `find_jump_forward_string` materialises, one character at a time): at most
    `fixed + per_output_char * n` characters after `n` output characters. `per_output_char` is 0
    for a grammar without recursion."""

    fixed: int
    per_output_char: int

    def at(self, num_output_chars: int) -> int:
        return min(_SAT, self.fixed + self.per_output_char * num_output_chars)


def forced_text_bound(ebnf: str, root: str = "root", rules: _Graph | None = None) -> ForcedBound | None:
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
    xgrammar materialise the text. `rules`: `ebnf` already parsed. Cost: n log n in the grammar's
    size (module docstring)."""
    graph = _graph_with_root(ebnf, root, rules)
    return None if graph is None else _forced_bound(graph, root)


def _forced_bound(graph: _Graph, root: str) -> ForcedBound:
    mlen = graph.min_lengths()
    order, cyclic = graph.components(root)
    fixed: dict[str, int] = {}  # longest path over non-recursive rules (recursive ones weigh 0)

    def inner(name: str) -> int:
        return 0 if name in cyclic else fixed.get(name, _SAT)

    for name in order:  # (a rule's references outside its component come before it)
        fixed[name] = graph.rest(graph.body[name], inner, mlen)
    if not cyclic:
        return ForcedBound(fixed[root], 0)
    local = max(graph.rest(graph.body[n], lambda _n: 0, mlen) for n in cyclic)
    num_frames = sum(1 + graph.num_groups(n) for n in cyclic)
    top = max(fixed.values(), default=0)
    per_char = min(_SAT, local * num_frames)
    return ForcedBound(min(_SAT, top + 2 * per_char), per_char)
