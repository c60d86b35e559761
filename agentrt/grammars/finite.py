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
    is ("ref", name) | ("term", productive: bool) | ("alt", ...) | ("opt", item) | ("rep1", item)."""
    rules: dict[str, tuple] = {}
    for line in ebnf.splitlines():
        if line.strip():
            name, body = _Line(line).rule()
            rules[name] = body
    return rules


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
            node = ("term", True)
        elif kind == "cls":
            node = ("term", not _class_is_empty(text))
        elif kind == "look":
            self.expr()
            self.close()
            return ("term", True)  # a lookahead constrains, it does not produce
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
            return ("rep1", node)
        if kind == "count":
            self.pos += 1
            lo = int(text[1:].split(",")[0])
            return ("rep1", node) if lo > 0 else ("opt", node)
        return node

    def close(self):
        if self.peek()[1] != ")":
            raise _Unparsed(self.line)
        self.pos += 1


def unproductive_rules(ebnf: str, root: str = "root") -> list[str] | None:
    """Rules reachable from `root` that derive no finite string, in reachability order ([] when the
    grammar is fine). None when `ebnf` is not in the printed form this module reads (the caller
    then cannot tell and should not refuse)."""
    try:
        rules = _parse(ebnf)
    except _Unparsed:
        return None
    if root not in rules:
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


def check_finite(ebnf: str, root: str = "root") -> None:
    """Raise ConstraintError when some rule reachable from `root` in `ebnf` (xgrammar's printed form)
    can never finish: a recursion with no way out, or an empty character class."""
    bad = unproductive_rules(ebnf, root)
    if bad:
        names = ", ".join(f"'{n}'" for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConstraintError(
            f"the constraint admits no finite output: rule {names} can never finish "
            "(a recursion with no way out, such as a required property that contains "
            "its own object, or an empty character class)"
        )
